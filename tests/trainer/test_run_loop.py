"""SIGKILL at many points of a run, then the same command again: the run folder ends as an uninterrupted run's.

One run folder is killed over and over, each time at a later point (after a step is logged
before any checkpoint exists, half-way through a line of samples.jsonl, while a checkpoint
is being written, between publishing a checkpoint and removing older ones), each rerun
resuming where the last kill left it. At the end ``metrics.jsonl``, ``samples.jsonl`` and the
final weights must equal those of a run that was never interrupted. A run whose data runs out
inside a step, run again once finished, logs nothing twice.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from reinforge.config.schema import RunConfig
from reinforge.tracking import Tracker
from reinforge.trainer.run_loop import DataExhausted, StepSkipped, TrainingRun

sys.path.insert(0, str(Path(__file__).parents[1]))
import forked_python  # noqa: E402

# Runs ``reinforge train`` with one kill point armed: the process SIGKILLs itself there.
DRIVER = r'''
import os, signal, sys
from reinforge.cli import main
from reinforge.tracking import Tracker
from reinforge.tracking import jsonl
from reinforge.trainer import checkpoint

where, at = sys.argv[1].split(":")
at = int(at)

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if where == "logged":  # the step's metrics are in metrics.jsonl, nothing after
    log = Tracker.log
    def logged(self, metrics, step):
        log(self, metrics, step)
        if step == at:
            die()
    Tracker.log = logged
elif where == "samples":  # half of a samples.jsonl line written
    log_samples = jsonl.JsonlBackend.log_samples
    def half_written(self, step_, rows):
        if step_ != at:
            return log_samples(self, step_, rows)
        with open(self.samples_path, "a") as handle:
            handle.write('{"step": %d, "prom' % step_)
            handle.flush()
            os.fsync(handle.fileno())
        die()
    jsonl.JsonlBackend.log_samples = half_written
elif where == "sealing":  # every file of the checkpoint written, its manifest not yet
    seal = checkpoint.seal
    def sealing(folder, step_):
        if step_ == at:
            die()
        return seal(folder, step_)
    checkpoint.seal = sealing
elif where == "published":  # the checkpoint and latest are in place, older checkpoints not yet removed
    remove_old = checkpoint.CheckpointManager.remove_old
    def published(self):
        if self.step_folders()[0].name == f"step_{at:06d}":
            die()
        remove_old(self)
    checkpoint.CheckpointManager.remove_old = published
sys.exit(main(["train", *sys.argv[2:]]))
'''

KILL_POINTS = ["logged:1", "sealing:2", "logged:3", "samples:3", "sealing:4", "published:4"]
UNCOMPARED = ("timing_s/", "perf/", "rollout/tokens_per_s")


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def comparable(records: list[dict]) -> list[dict]:
    return [{key: value for key, value in record.items() if not key.startswith(UNCOMPARED)} for record in records]


def final_weights(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    folder = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return {name: torch.load(folder / name, weights_only=True)["model"]
            for name in ("actor_state.pt", "critic_state.pt")}


@pytest.mark.slow
def test_kills_at_many_points_leave_the_run_folder_of_an_uninterrupted_run(rl_args, arithmetic_data_dir, tmp_path):
    common = {"trainer.total_steps": 4, "trainer.save_every": 2, "trainer.keep_last": 1,
              "data.val_files": f"[{arithmetic_data_dir / 'test.parquet'}]", "trainer.test_every": 3,
              "trainer.val_before_train": True, "actor.mini_batch_size": 2, "actor.shuffle": True,
              "algorithm.adv_estimator": "gae", "actor.use_kl_loss": True, "algorithm.use_kl_in_reward": True,
              "algorithm.kl_ctrl.type": "adaptive", "trainer.num_logged_samples": 2}
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"

    def train(run_dir: Path, kill_at: str = "none:0") -> subprocess.CompletedProcess:
        # each run a fork of one preloaded interpreter (forked_python): one hash seed for all of them
        return forked_python.run(["-c", DRIVER, kill_at, *rl_args(run_dir, **common)], timeout=300)

    finished = train(reference_dir)
    assert finished.returncode == 0, finished.stderr[-3000:]
    for kill_at in KILL_POINTS:
        killed = train(killed_dir, kill_at)
        assert killed.returncode == -9, f"{kill_at}: {killed.stderr[-3000:]}"
    finished = train(killed_dir)
    assert finished.returncode == 0, finished.stderr[-3000:]

    assert comparable(rows(killed_dir / "metrics.jsonl")) == comparable(rows(reference_dir / "metrics.jsonl"))
    assert rows(killed_dir / "samples.jsonl") == rows(reference_dir / "samples.jsonl")
    assert [row["step"] for row in rows(killed_dir / "samples.jsonl")] == [1, 1, 2, 2, 3, 3, 4, 4]
    expected, actual = final_weights(reference_dir), final_weights(killed_dir)
    for name, state in expected.items():
        assert state.keys() == actual[name].keys()
        assert all(torch.equal(state[key], actual[name][key]) for key in state), name
    assert sorted(path.name for path in (killed_dir / "checkpoints").iterdir()) == ["latest", "step_000004"]
    assert not (killed_dir / ".lock").exists()


@dataclass
class RunSettings:
    trainer: RunConfig = field(default_factory=RunConfig)


class NumberedBatches:
    """``num_batches`` batches, numbered from 1; the next one past them raises ``DataExhausted``."""

    def __init__(self, num_batches: int):
        self.num_batches, self.drawn, self.epoch = num_batches, 0, 0

    def next_batch(self) -> int:
        if self.drawn == self.num_batches:
            raise DataExhausted(f"the {self.num_batches} batches are used up")
        self.drawn += 1
        return self.drawn

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]


class TwoBatchesAStep(TrainingRun):
    """A run whose every step draws two batches, as dynamic sampling may; its "weight" sums the batches trained."""

    def __init__(self, run_dir: Path, num_batches: int, save_every: int):
        self.config = RunSettings(RunConfig(output_dir=str(run_dir), save_every=save_every, keep_last=1,
                                            loggers=["jsonl"]))
        self.run_dir = run_dir
        self.open_run_folder("auto", keep_last=1, refused=())
        self.train_loader = NumberedBatches(num_batches)
        self.tracker = Tracker(run_dir, ["jsonl"])
        self.step, self.total_steps, self.weight = 0, num_batches, 0

    def train_step(self, batch: int) -> dict[str, float]:
        self.weight += batch + self.train_loader.next_batch()
        return {"weight": float(self.weight)}

    def validate(self) -> dict[str, float]:
        return {"val/weight": float(self.weight)}

    def data_used_up(self) -> str | None:
        loader = self.train_loader
        return "the batches are used up" if loader.drawn == loader.num_batches else None

    def write_checkpoint(self, folder: Path) -> None:
        pass

    def checkpoint_extras(self) -> dict:
        return {"weight": self.weight}

    def load_checkpoint_state(self, folder: Path, state: dict) -> None:
        self.weight = state["weight"]

    def fit(self) -> dict[str, float]:
        try:
            self.resume()
            return self.run_steps(self.train_loader.next_batch, test_every=0,
                                  save_every=self.config.trainer.save_every, validate_first=False)
        finally:
            self.tracker.close()
            self.release_run_folder()


@pytest.mark.parametrize("save_every", [1, 0])
def test_a_finished_run_whose_data_ran_out_inside_a_step_logs_nothing_again_when_run_again(tmp_path, save_every):
    """Five batches, two a step: step 3 finds one and is dropped, step 2 is the final one. With save_every=1 its
    checkpoint holds the loader before the dropped step, so a rerun draws it again and ends the same way."""
    first = TwoBatchesAStep(tmp_path, num_batches=5, save_every=save_every).fit()
    logged = (tmp_path / "metrics.jsonl").read_text()
    assert [json.loads(line)["step"] for line in logged.splitlines()] == [1, 2, 2]
    assert first["weight"] == first["val/weight"] == 1 + 2 + 3 + 4
    for _ in range(2):
        again = TwoBatchesAStep(tmp_path, num_batches=5, save_every=save_every).fit()
        assert (tmp_path / "metrics.jsonl").read_text() == logged
        assert again == first


class SkipsStepTwoOnce(TwoBatchesAStep):
    """Two steps of one batch each; step 2's first attempt is skipped (its tools' service down)."""

    def __init__(self, run_dir: Path):
        super().__init__(run_dir, num_batches=2, save_every=1)
        self.skipped = False

    def train_step(self, batch: int) -> dict[str, float]:
        if batch == 2 and not self.skipped:
            self.skipped = True
            raise StepSkipped("every tool call failed", {"agent/tool_errors": 8.0})
        self.weight += batch
        return {"weight": float(self.weight)}

    def data_used_up(self) -> str | None:
        return None


def test_a_finished_run_run_again_reports_the_trained_step_not_its_skipped_attempt(tmp_path):
    first = SkipsStepTwoOnce(tmp_path).fit()
    assert [json.loads(line).get("training/skipped_step") for line in
            (tmp_path / "metrics.jsonl").read_text().splitlines()] == [None, 1.0, None]
    again = SkipsStepTwoOnce(tmp_path).fit()  # resumed at its final step: nothing to train
    assert again == first and "agent/tool_errors" not in again
