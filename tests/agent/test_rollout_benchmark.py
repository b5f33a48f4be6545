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
        assert module.main(["--cpu", "--trajectories", "4", "--serial", "1", "--out", str(out)]) == 0
    finally:
        AGENT_LOOPS.pop("bench_turns", None)  # the script registers its loop; other tests list the registry
    results = json.loads(out.read_text())
    planned = sum(sum(t["turn_tokens"]) for t in module.plan(4, 0, (4, 16), 4, (0.005, 0.05)))
    for name in ("single_turn", "agent", "synchronous_turns"):
        assert results[name]["sampled_tokens"] == planned  # same trajectories, same sampled tokens
    assert 0 < results["agent"]["engine_busy_fraction"] <= 1
    assert results["serial"]["time_s_extrapolated"] > 0
    assert "agent / single-turn" in capsys.readouterr().out
