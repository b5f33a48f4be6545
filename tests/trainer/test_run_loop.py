"""SIGKILL at many points of a run, then the same command again: the run folder ends as an uninterrupted run's.

One run folder is killed over and over, each time at a later point (after a step is logged
before any checkpoint exists, half-way through a line of samples.jsonl, while a checkpoint
is being written, between publishing a checkpoint and removing older ones), each rerun
resuming where the last kill left it. At the end ``metrics.jsonl``, ``samples.jsonl`` and the
final weights must equal those of a run that was never interrupted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
