"""trainer.mode=async end to end on the tiny model: at max_staleness=0 it is the sync trainer, partial rollouts
train with the loglinear proximal policy, and a killed run resumes without losing or repeating an admitted
prompt group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reinforge.cli import main

from ..test_rl_trainer import base_args, read_metrics, sigkill_at_step, train_in_a_process

NOT_COMPARED = ("timing_s/", "perf/", "rollout/tokens_per_s", "async/")
ROLLOUT_VS_TRAINER = ("training/rollout_probs_diff", "training/rollout_actor_probs_pearson_corr")
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
        "trainer.proximal": "loglinear", "trainer.total_steps": 5, "trainer.separate_rollout": True})
    assert len(rows) == 5 and max(row["async/staleness_max"] for row in rows) >= 1.0
    for row in rows:
        assert row["actor/num_skipped_steps"] == 0  # a non-finite gradient would be skipped and counted here
        assert 0 <= row["async/trainer_idle_fraction"] <= 1 and 0 <= row["async/rollouter_idle_fraction"] <= 1
        assert "timing_s/old_log_prob" not in row  # loglinear needs no extra forward
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
