"""`reinforge bench agent --cpu` runs on a tiny model and reports every number it promises."""

from __future__ import annotations

import inspect
import json

import pytest

from reinforge.agent import AGENT_LOOPS
from reinforge.bench.agent import critical_path, plan
from reinforge.cli import main
from reinforge.rollout.native.engine import NativeEngine


@pytest.mark.slow
def test_bench_agent_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "agent.json"
    try:
        assert main(["bench", "agent", "--cpu", "--trajectories", "4", "--serial", "1", "--admission-wait", "16,0",
                            "--out", str(out)]) == 0
    finally:
        AGENT_LOOPS.pop("bench_turns", None)  # the bench registers its loop; other tests list the registry
    results = json.loads(out.read_text())
    planned = sum(sum(t["turn_tokens"]) for t in plan(4, 0, (4, 16), 4, (0.005, 0.05)))
    for name in ("single_turn", "agent", "synchronous_turns"):
        assert results[name]["sampled_tokens"] == planned  # same trajectories, same sampled tokens
    assert 0 < results["agent"]["engine_busy_fraction"] <= 1
    assert results["agent"]["gpu_busy_fraction"] is None  # no nvidia-smi reading without a CUDA device
    assert results["serial"]["time_s_extrapolated"] > 0
    [one_by_one] = results["agent_admission_sweep"]  # the second --admission-wait value, the fraction repeated
    default_fraction = inspect.signature(NativeEngine).parameters["admission_fraction"].default
    assert (one_by_one["admission_wait"], one_by_one["admission_fraction"]) == (0, default_fraction)
    assert one_by_one["sampled_tokens"] == planned
    for name in ("single_turn", "agent", "synchronous_turns"):  # the engine's steps of each run
        run = results[name]
        assert run["prefill_steps"] >= 1 and run["decode_steps"] >= 1 and 1 <= run["decode_batch_mean"] <= 4
    assert results["agent"]["admission_wait"] == 16
    printed = capsys.readouterr().out
    assert "agent / single-turn" in printed and "steps, synchronous turns" in printed
    assert "critical-path bound" in printed
    assert results["critical_path"]["time_s"] >= max(sum(t["sleeps"]) for t in plan(4, 0, (4, 16), 4, (0.005, 0.05)))


def test_critical_path_bound_by_hand():
    trajectories = [{"turn_tokens": [100, 100], "sleeps": [0.5]},   # 200 steps + 0.5 s
                    {"turn_tokens": [300], "sleeps": []},           # 300 steps
                    {"turn_tokens": [50, 50, 50], "sleeps": [0.2, 0.2]}]
    single = {"time_s": 1.0, "decode_steps": 499, "prefill_steps": 1, "tokens_per_s": 650 / 1.0}
    bound = critical_path(trajectories, single)
    assert bound["step_s"] == pytest.approx(0.002)
    assert (bound["tokens"], bound["tool_sleep_s"]) == (200, 0.5)  # 0.9 s beats 0.6 s and 0.7 s
    assert bound["time_s"] == pytest.approx(0.9)
    assert bound["max_ratio"] == pytest.approx(650 / 0.9 / 650)
