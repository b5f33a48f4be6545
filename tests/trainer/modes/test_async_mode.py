"""trainer.mode=async end to end on the tiny model: at max_staleness=0 it is the sync trainer, partial rollouts
train with the loglinear proximal policy, a killed run resumes without losing or repeating an admitted prompt
group, and with trainer.async_deterministic the same seed gives the same run however the threads interleave."""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from reinforge.cli import main
from reinforge.config import config_to_dict
from reinforge.config.schema import Config
from reinforge.protocol import Batch
from reinforge.rollout.base import SamplingParams
from reinforge.trainer.modes.async_mode import AsyncMode
from reinforge.trainer.modes.partial import run_segment
from reinforge.trainer.modes.trainer_calls import TrainerCalls
from reinforge.trainer.rl_trainer import resume_refuses
from reinforge.trainer.run_folder import check_resumed_settings

from ..test_rl_trainer import base_args, read_metrics, sigkill_at_step, train_in_a_process

NOT_COMPARED = ("timing_s/", "perf/", "rollout/tokens_per_s", "async/")
ROLLOUT_VS_TRAINER = ("training/rollout_probs_diff", "training/rollout_log_probs_diff",
                      "training/rollout_actor_probs_pearson_corr")
"""The rollout copy runs transformers' attention, the training model the packed varlen path: ~1e-10 apart, and
a correlation of such probabilities within float32 rounding of 1 (0.99999994 against 1.0 with transformers 5.24)."""


def run(model: Path, data: Path, run_dir: Path, **overrides: object) -> list[dict]:
    settings = {"reward.num_workers": 0, "trainer.total_steps": 3, "actor.use_kl_loss": True, **overrides}
    assert main(["train", *base_args(model, data, run_dir, **settings)]) == 0
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def sync_metrics(tiny_model_dir, arithmetic_data_dir, tmp_path_factory) -> list[dict]:
    return run(tiny_model_dir, arithmetic_data_dir, tmp_path_factory.mktemp("sync") / "run")


@pytest.mark.parametrize("separate_rollout", [False, True])
def test_async_with_max_staleness_0_and_sync_every_update_gives_the_sync_trainers_metrics(
        tiny_model_dir, arithmetic_data_dir, tmp_path, sync_metrics, separate_rollout):
    sync = sync_metrics
    asynchronous = run(tiny_model_dir, arithmetic_data_dir, tmp_path / "async", **{
        "trainer.mode": "async", "trainer.max_staleness": 0, "trainer.trigger_sync_steps": 1,
        "rollout.segment_tokens": 4, "trainer.separate_rollout": separate_rollout})
    assert len(sync) == len(asynchronous) == 3
    for want, got in zip(sync, asynchronous, strict=True):
        compared = {key for key in want if not key.startswith(NOT_COMPARED)}
        assert compared <= set(got)
        for key in compared:
            if key.startswith(ROLLOUT_VS_TRAINER):
                assert got[key] == pytest.approx(want[key], abs=1e-7), key
            else:
                assert got[key] == want[key], key
        assert got["async/staleness_max"] == 0.0 and "rollout_corr/kl" not in got


def test_async_with_partial_rollouts_and_the_loglinear_proximal_policy(tiny_model_dir, arithmetic_data_dir, tmp_path):
    run_dir = tmp_path / "run"
    rows = run(tiny_model_dir, arithmetic_data_dir, run_dir, **{
        "trainer.mode": "async", "trainer.max_staleness": 1, "rollout.segment_tokens": 2,
        "trainer.proximal": "loglinear", "trainer.total_steps": 5, "trainer.separate_rollout": True,
        "rollout.name": "native"})
    assert len(rows) == 5 and max(row["async/staleness_max"] for row in rows) >= 1.0
    for row in rows:
        assert row["actor/num_skipped_steps"] == 0  # a non-finite gradient would be skipped and counted here
        assert 0 <= row["async/trainer_idle_fraction"] <= 1 and 0 <= row["async/rollouter_idle_fraction"] <= 1
        assert "timing_s/old_log_prob" not in row  # loglinear needs no extra forward
        assert row["timing_s/gen"] >= 0 and row["rollout/tokens_per_s"] >= 0  # the rollouter's, since the last step
    assert sum(row["async/rollout_tokens"] for row in rows) > 0 and max(row["rollout/tokens_per_s"] for row in rows) > 0
    # the engine's own counts over the segments between steps: every token the rollouter kept was generated once
    generated = sum(row.get("rollout/num_generated_tokens", 0.0) for row in rows)
    assert generated >= sum(row["async/rollout_tokens"] for row in rows) > 0
    for row in rows:
        if row.get("rollout/num_decode_steps"):
            assert row["rollout/decode_batch_mean"] == row["rollout/num_decode_rows"] / row["rollout/num_decode_steps"]
            assert 0 < row["rollout/kv_blocks_used_peak"] <= row["rollout/kv_blocks_total"]
    records = [json.loads(line) for line in (run_dir / "async_groups.jsonl").read_text().splitlines()]
    positions = [position for record in records for position in record["positions"]]
    assert [record["step"] for record in records] == [1, 2, 3, 4, 5]
    assert len(positions) == len(set(positions)) == 5 * 4


@pytest.mark.slow
def test_a_killed_async_run_resumes_without_losing_or_repeating_an_admitted_group(
        tiny_model_dir, arithmetic_data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = base_args(tiny_model_dir, arithmetic_data_dir, run_dir, **{
        "reward.num_workers": 0, "trainer.mode": "async", "trainer.max_staleness": 1, "rollout.segment_tokens": 2,
        "trainer.total_steps": 6, "trainer.save_every": 2, "trainer.keep_last": 3})
    sigkill_at_step(args, run_dir, 3, timeout_s=240)
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)["mode"]["rollouter"]
    pending = {group["position"] for group in state["active"]}
    assert pending and state["admitted"] > 0
    finished = train_in_a_process(args)
    assert finished.returncode == 0, finished.stderr[-2000:]

    records = [json.loads(line) for line in (run_dir / "async_groups.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3, 4, 5, 6]
    positions = [position for record in records for position in record["positions"]]
    assert len(positions) == len(set(positions))  # no group trained twice across the kill
    saved_step = int(checkpoint.name.removeprefix("step_"))
    before = {p for record in records if record["step"] <= saved_step for p in record["positions"]}
    after = {p for record in records if record["step"] > saved_step for p in record["positions"]}
    assert not before & pending
    assert pending <= after  # every group admitted and not yet trained at the checkpoint was trained later
    assert set(range(min(positions), max(before) + 1)) <= before | after | pending
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]


def test_an_async_run_resumed_with_another_rollout_n_is_refused_before_any_model_loads(
        tiny_model_dir, arithmetic_data_dir, tmp_path, capsys, monkeypatch):
    """Its checkpoint holds prompt groups in flight with the samples they were admitted with; a sync run may change n."""
    async_dir, sync_dir = tmp_path / "async", tmp_path / "sync"
    run(tiny_model_dir, arithmetic_data_dir, async_dir, **{"trainer.mode": "async", "trainer.total_steps": 1,
                                                           "trainer.save_every": 1, "rollout.segment_tokens": 4})
    run(tiny_model_dir, arithmetic_data_dir, sync_dir, **{"trainer.total_steps": 1, "trainer.save_every": 1})
    capsys.readouterr()
    loaded = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loaded.append(a))
    args = base_args(tiny_model_dir, arithmetic_data_dir, async_dir, **{
        "reward.num_workers": 0, "actor.use_kl_loss": True, "trainer.mode": "async", "trainer.total_steps": 2,
        "rollout.segment_tokens": 4, "rollout.n": 2})
    assert main(["train", *args]) == 2
    assert "rollout.n: 4 -> 2" in capsys.readouterr().err and not loaded
    monkeypatch.undo()
    assert run(tiny_model_dir, arithmetic_data_dir, sync_dir, **{"trainer.total_steps": 2, "rollout.n": 2})[-1]["step"] == 2


class FakeTrainer:
    """``TrainerCalls`` without a model: each sample's length follows from its seed, every token it makes is the
    version of the weights it was generated with, and every call takes a random while, so two runs interleave
    the rollouter's segments and the trainer's updates differently."""

    def __init__(self, run_dir: Path, jitter_seed: int):
        self.rollout_weights = 0
        self.steps = 0
        self.trained: list[list[tuple[str, tuple[int, ...]]]] = []
        """Per update: (sample uid, its token versions) of every sample of the batch."""
        self.jitter = random.Random(jitter_seed)
        self.prompts_drawn = 0
        self.run_dir = run_dir

    def pause(self) -> None:
        time.sleep(self.jitter.random() * 0.004)

    def next_prompts(self) -> Batch:
        first, self.prompts_drawn = self.prompts_drawn, self.prompts_drawn + 2
        return Batch.from_dict(tensors={"input_ids": torch.tensor([[5, 6], [7, 8]]),
                                        "attention_mask": torch.ones(2, 2, dtype=torch.long)},
                               non_tensors={"uid": [f"p{first}", f"p{first + 1}"]})

    def generate(self, batch: Batch, sampling: SamplingParams, seed: int) -> Any:
        self.pause()
        rows, width = len(batch), sampling.max_tokens
        made = batch["attention_mask"].sum(-1) - 2  # tokens so far (after the 2 prompt tokens)
        lengths = torch.tensor([1 + (int(request) * 7 + int(index) * 3) % 8 for request, index in
                                zip(batch["request_seed"], batch["sample_index"], strict=True)])
        new = (lengths - made).clamp(min=0, max=width)
        mask = (torch.arange(width) < new[:, None]).float()
        output = Batch.from_dict(tensors={
            "responses": torch.full((rows, width), self.rollout_weights), "response_mask": mask,
            "rollout_log_probs": -mask, "finished_by_stop": made + new >= lengths})
        return SimpleNamespace(result=lambda: output)

    def score(self, rows: Batch) -> Batch:
        return Batch.from_dict(tensors={"token_level_scores": rows["response_mask"].clone()})

    def train_on_batch(self, batch: Batch, timing: dict, metrics: dict, step_start: float) -> dict[str, float]:
        self.pause()
        versions = [tuple(row[row >= 0].tolist()) for row in batch["token_versions"]]
        self.trained.append(sorted(zip((str(uid) for uid in batch["uid"]), versions, strict=True)))
        return {}

    def sync_rollout_weights(self) -> None:
        self.pause()
        self.rollout_weights += 1

    def calls(self) -> TrainerCalls:
        return TrainerCalls(next_prompts=self.next_prompts, generate=self.generate, score=self.score,
                            compute_log_prob=lambda batch: batch, train_on_batch=self.train_on_batch,
                            sync_rollout_weights=self.sync_rollout_weights, trained_steps=lambda: self.steps,
                            sampling=SamplingParams(max_tokens=8), pad_token_id=0, run_dir=self.run_dir)


def async_config(**trainer_settings: object) -> Config:
    """Async training of 2 prompts x 2 samples of 8 tokens, in 2-token segments, the loglinear proximal policy, and
    ``trainer_settings`` on top."""
    config = Config()
    config.data.train_batch_size, config.data.max_response_length, config.rollout.n = 2, 8, 2
    config.rollout.segment_tokens = 2
    config.trainer.mode, config.trainer.proximal = "async", "loglinear"
    for key, value in trainer_settings.items():
        setattr(config.trainer, key, value)
    return config


def trained_with_jitter(tmp_path: Path, jitter_seed: int, **trainer_settings: object) -> list:
    config = async_config(**trainer_settings)
    tmp_path.mkdir()
    fake = FakeTrainer(tmp_path, jitter_seed)
    mode = AsyncMode(config, fake.calls())
    mode.start()
    try:
        for _ in range(8):
            mode.train(mode.next_batch())
            fake.steps += 1
    finally:
        mode.stop()
    return fake.trained


@pytest.mark.parametrize(("separate_rollout", "max_staleness"), [(False, 1), (True, 2)])
@pytest.mark.parametrize("trigger_sync_steps", [1, 2])
def test_async_deterministic_trains_the_same_samples_with_the_same_versions_however_the_threads_interleave(
        tmp_path, separate_rollout, max_staleness, trigger_sync_steps):
    settings = {"async_deterministic": True, "max_staleness": max_staleness, "separate_rollout": separate_rollout,
                "trigger_sync_steps": trigger_sync_steps}
    runs = [trained_with_jitter(tmp_path / str(seed), seed, **settings) for seed in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert any(len(set(versions)) > 1 for batch in runs[0] for _, versions in batch)  # samples span a sync


NOT_REPRODUCED = ("timing_s/", "perf/", "rollout/tokens_per_s", "async/admitted", "async/ready_groups",
                  "async/rollout_tokens", "async/trainer_idle_fraction", "async/rollouter_idle_fraction")
"""Timings and the rollouter's progress when a step ends: they depend on timing even in deterministic mode."""


def reproduced(rows: list[dict]) -> list[dict]:
    return [{key: value for key, value in row.items() if not key.startswith(NOT_REPRODUCED)} for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("separate_rollout", [False, True])
def test_two_deterministic_async_runs_at_max_staleness_1_give_the_same_metrics_groups_and_weights(
        tiny_model_dir, arithmetic_data_dir, tmp_path, separate_rollout, monkeypatch):
    jitter = random.Random()  # unseeded: each run's segments take their own while, as on a busy machine

    def slow_segment(*args: Any, **kwargs: Any) -> int:
        time.sleep(jitter.random() * 0.02)
        return run_segment(*args, **kwargs)

    monkeypatch.setattr("reinforge.trainer.modes.rollouter.run_segment", slow_segment)
    settings = {"trainer.mode": "async", "trainer.async_deterministic": True, "trainer.max_staleness": 1,
                "rollout.segment_tokens": 2, "trainer.total_steps": 6, "trainer.separate_rollout": separate_rollout}
    runs = [run(tiny_model_dir, arithmetic_data_dir, tmp_path / name, **settings) for name in ("first", "second")]
    assert reproduced(runs[0]) == reproduced(runs[1])
    assert max(row["async/staleness_max"] for row in runs[0]) >= 1.0
    groups = [(tmp_path / name / "async_groups.jsonl").read_text() for name in ("first", "second")]
    assert groups[0] == groups[1]
    weights = [final_actor_weights(tmp_path / name) for name in ("first", "second")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


@pytest.mark.slow
@pytest.mark.parametrize("separate_rollout", [False, True])
def test_a_killed_deterministic_async_run_resumes_to_the_uninterrupted_runs_metrics_groups_and_weights(
        tiny_model_dir, arithmetic_data_dir, tmp_path, separate_rollout):
    settings = {"reward.num_workers": 0, "actor.use_kl_loss": True, "trainer.mode": "async",
                "trainer.async_deterministic": True, "trainer.max_staleness": 1, "rollout.segment_tokens": 2,
                "trainer.total_steps": 5, "trainer.save_every": 2, "trainer.keep_last": 3,
                "trainer.separate_rollout": separate_rollout}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert train_in_a_process(base_args(tiny_model_dir, arithmetic_data_dir, whole, **settings)).returncode == 0
    args = base_args(tiny_model_dir, arithmetic_data_dir, killed, **settings)
    sigkill_at_step(args, killed, 3, timeout_s=240)
    with open(killed / "async_groups.jsonl", "a") as records:  # and a line half-written, as a full disk leaves it
        records.write('{"step": 4, "positions": [1')
    finished = train_in_a_process(args)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert reproduced(read_metrics(killed)) == reproduced(read_metrics(whole))
    assert (killed / "async_groups.jsonl").read_text() == (whole / "async_groups.jsonl").read_text()
    weights = [final_actor_weights(run_dir) for run_dir in (whole, killed)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


def final_actor_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    folder = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return torch.load(folder / "actor_state.pt", weights_only=True)["model"]


class WeightsFake(FakeTrainer):
    """The rollout copy's weights are the number of updates the trainer had made at the sync that set them."""

    def __init__(self, run_dir: Path, jitter_seed: int):
        super().__init__(run_dir, jitter_seed)
        self.updated = 0

    def train_on_batch(self, batch: Batch, timing: dict, metrics: dict, step_start: float) -> dict[str, float]:
        self.updated += 1
        return super().train_on_batch(batch, timing, metrics, step_start)

    def sync_rollout_weights(self) -> None:
        self.rollout_weights = self.updated

    def calls(self) -> TrainerCalls:
        return replace(super().calls(), rollout_copy_weights=lambda: [{"w": torch.tensor(self.rollout_weights)}],
                       load_rollout_weights=lambda weights: setattr(self, "rollout_weights", int(weights["w"])))


def test_between_two_syncs_validation_sees_the_current_weights_and_a_resumed_rollout_its_versions(tmp_path):
    """trainer.trigger_sync_steps=2, three updates: the rollout samples with the weights of update 2. Validation
    (``current_weights``) samples with those of update 3, then the rollout has update 2's again; a checkpoint holds
    update 2's, which the resumed rollout takes back after the trainer synced the restored (update 3's) into it."""
    config = async_config(trigger_sync_steps=2, async_deterministic=True)
    (tmp_path / "run").mkdir()
    fake = WeightsFake(tmp_path / "run", 0)
    mode = AsyncMode(config, fake.calls())
    mode.start()
    try:
        for _ in range(3):
            mode.train(mode.next_batch())
            fake.steps += 1
        with mode.current_weights():
            assert fake.rollout_weights == 3
        assert fake.rollout_weights == 2
        folder = tmp_path / "checkpoint"
        folder.mkdir()
        with mode.paused():
            state = mode.state_dict()
            mode.write_checkpoint(folder)
    finally:
        mode.stop()

    resumed = WeightsFake(tmp_path / "run", 0)
    resumed.updated = 3
    resumed.sync_rollout_weights()  # RLTrainer.load_checkpoint_state: the restored weights first
    again = AsyncMode(config, resumed.calls())
    again.load_state_dict(state, 3)
    again.read_checkpoint(folder)
    assert resumed.rollout_weights == 2


def test_an_async_run_resumed_with_another_trigger_sync_steps_is_refused(tmp_path):
    """The bound counts every group admitted so far in versions of trigger_sync_steps x train_batch_size groups: with
    fewer per version a resumed run admitted nothing while its trainer waited for groups, for ever."""
    old, new = Config(), Config()
    old.trainer.mode = new.trainer.mode = "async"
    old.trainer.trigger_sync_steps, new.trainer.trigger_sync_steps = 2, 1
    with pytest.raises(ValueError, match=r"changed settings it cannot take: trainer.trigger_sync_steps: 2 -> 1"):
        check_resumed_settings(config_to_dict(old), config_to_dict(new), resume_refuses(new), tmp_path)


def test_a_batch_of_groups_from_several_scoring_calls_weighs_a_scores_mean_and_adds_up_counts(tmp_path):
    """reward_model/score/mean rode on each scoring call's first group and was summed over the batch's calls."""
    config = Config()
    config.data.train_batch_size, config.data.max_response_length, config.rollout.n = 3, 8, 2
    mode = AsyncMode(config, FakeTrainer(tmp_path, 0).calls())

    def group(position: int, call_mean: float, errors: float) -> tuple[SimpleNamespace, Batch]:
        rows = Batch.from_dict(tensors={"prompts": torch.ones(2, 2, dtype=torch.long),
                                        "responses": torch.ones(2, 8, dtype=torch.long)},
                               non_tensors={"uid": [f"p{position}"] * 2})
        rows.meta["reward_metrics"] = {"reward/errors": errors, "reward_model/score/mean": call_mean}
        return SimpleNamespace(position=position), rows

    taken = [group(0, 0.5, 1.0), group(1, 0.5, 0.0), group(2, 2.0, 4.0)]  # two calls: groups 0-1 and group 2
    mode.rollouter = SimpleNamespace(take=lambda num_groups: taken)
    metrics = mode.next_batch().meta["reward_metrics"]
    assert metrics == {"reward/errors": 5.0, "reward_model/score/mean": pytest.approx((0.5 + 0.5 + 2.0) / 3)}
