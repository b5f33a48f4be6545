"""`reinforge bench train` for long responses: each step's bandwidth floor, a deadline between steps, and closing lines
that show tiny figures."""

from __future__ import annotations

import json

import pytest

from reinforge.bench.floor import rollout_floor
from reinforge.cli import main
from reinforge.engine.memory_plan import ModelShape


@pytest.mark.slow
def test_a_step_reports_its_floor_and_no_step_starts_past_the_deadline(tmp_path, capsys):
    from reinforge.models import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model", arch="qwen2")
    out = tmp_path / "bench.json"
    assert main(["bench", "train", "--cpu", "--steps", "2", "--deadline-s", "0.01", "--bandwidth-tbps", "2",
                 "--model-dir", str(model_dir), "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["stopped_at_deadline"] and len(results["steps"]) == 1  # the first step always runs
    assert "stopping after 1 of 2 steps: one more would end past --deadline-s 0.01" in capsys.readouterr().out
    [step] = results["steps"]
    # --cpu: 2 prompts x 2 samples, 8 prompt tokens, exactly 8 generated, float32 values
    floor = rollout_floor(ModelShape.from_model_path(str(model_dir)), [8] * 4, [8] * 4, value_bytes=4,
                          bytes_per_s=2e12)
    assert step["rollout_floor_s"] == pytest.approx(floor.seconds) and step["rollout_floor_decode_steps"] == 7
    assert step["rollout_over_floor"] == pytest.approx(step["rollout_s"] / floor.seconds)
    assert results["floor"] == {"bandwidth_tbps": 2.0, "kv_cache_dtype": "auto", "value_bytes": 4}


@pytest.mark.slow
def test_the_next_step_is_estimated_without_the_compilation_the_first_one_paid(tmp_path, monkeypatch):
    """A first step that spent most of its time compiling does not stop the bench at a deadline that leaves room
    for a step without it: each step records its compile seconds, and the estimate leaves them out."""
    import time

    import torch

    from reinforge.bench import train
    from reinforge.models import save_tiny_model

    before = train.compile_seconds()
    torch.compile(lambda x: x.sin().cos(), backend="eager", dynamic=True)(torch.randn(4))
    assert train.compile_seconds() > before  # the counter reads torch.compile's own clock

    compiled = iter([0.0, 30.0, 30.0])  # the first step compiles for 30 s, the second for none
    monkeypatch.setattr(train, "compile_seconds", lambda: next(compiled, 30.0))
    scored, slept = train.scored_batch, []

    def first_step_long(*args, **kwargs):  # the first step takes 6 s, standing in for its compilation
        if not slept:
            slept.append(time.sleep(6.0))
        return scored(*args, **kwargs)

    monkeypatch.setattr(train, "scored_batch", first_step_long)
    model_dir = save_tiny_model(tmp_path / "model", arch="qwen2")
    out = tmp_path / "bench.json"
    # 10 s: a second step as long as the first would end past it; one without the compilation would not
    assert main(["bench", "train", "--cpu", "--steps", "2", "--deadline-s", "10", "--model-dir", str(model_dir),
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert len(results["steps"]) == 2 and not results.get("stopped_at_deadline")
    assert [step["compile_s"] for step in results["steps"]] == [30.0, 0.0]


def test_the_closing_lines_show_tiny_figures_apart_from_the_rollouts_phases(capsys):
    """A tiny model's floor (microseconds) and its rollout-against-trainer differences (1e-9) read 0.000, among the
    rollout's phases in seconds."""
    import argparse

    from reinforge.bench.train import print_summary

    median = {"step_s": 0.27, "rollout_s": 0.15, "rollout_floor_s": 4.81e-06, "rollout_floor_decode_steps": 47.0,
              "rollout_floor_kv_gb": 0.00308, "rollout_floor_weight_gb": 0.0171, "rollout_over_floor": 30417.3,
              "rollout_probs_diff_mean": 9.09e-10, "rollout_engine": 0.143, "rollout_wake_up": 1.27e-05}
    result = {"median": median, "rollout_phase_keys": ["rollout_engine", "rollout_wake_up"]}
    print_summary(result, argparse.Namespace(variant="grpo", bandwidth_tbps=4.19, kv_cache_dtype="auto"))
    lines = capsys.readouterr().out.splitlines()
    assert ("  rollout bandwidth floor 4.81e-06 s over 47 decode steps at 4.19 TB/s (KV 0.00308 GB as auto, weights "
            "0.0171 GB read); rollout / floor 3.04e+04") in lines
    assert "  rollout phases (medians, s): engine 0.143, wake_up 1.27e-05" in lines
    assert ("  rollout figures (medians): floor_s 4.81e-06, floor_decode_steps 47, floor_kv_gb 0.00308, "
            "floor_weight_gb 0.0171, over_floor 3.04e+04, probs_diff_mean 9.09e-10") in lines
