"""benchmarks/agent_rollout.py runs on the CPU (tiny model) and reports every number it promises."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from reinforge.agent import AGENT_LOOPS

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "agent_rollout.py"


@pytest.mark.slow
def test_agent_rollout_benchmark_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("agent_rollout_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "agent.json"
    try:
        assert module.main(["--cpu", "--trajectories", "4", "--serial", "1", "--admission-wait", "16,0",
                            "--out", str(out)]) == 0
    finally:
        AGENT_LOOPS.pop("bench_turns", None)  # the script registers its loop; other tests list the registry
    results = json.loads(out.read_text())
    planned = sum(sum(t["turn_tokens"]) for t in module.plan(4, 0, (4, 16), 4, (0.005, 0.05)))
    for name in ("single_turn", "agent", "synchronous_turns"):
        assert results[name]["sampled_tokens"] == planned  # same trajectories, same sampled tokens
    assert 0 < results["agent"]["engine_busy_fraction"] <= 1
    assert results["serial"]["time_s_extrapolated"] > 0
    [one_by_one] = results["agent_admission_sweep"]  # the second --admission-wait value, the fraction repeated
    assert (one_by_one["admission_wait"], one_by_one["admission_fraction"]) == (0, 0.125)
    assert one_by_one["sampled_tokens"] == planned
    for name in ("single_turn", "agent", "synchronous_turns"):  # the engine's steps of each run
        run = results[name]
        assert run["prefill_steps"] >= 1 and run["decode_steps"] >= 1 and 1 <= run["decode_batch_mean"] <= 4
    assert results["agent"]["admission_wait"] == 16
    printed = capsys.readouterr().out
    assert "agent / single-turn" in printed and "steps, synchronous turns" in printed
