"""`reinforge bench --cpu`: the smoke test of the benchmark (no timing claims)."""

from __future__ import annotations

import json

from reinforge.bench.rollout import bench_main


def test_bench_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_main(["--cpu", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["native"]["num_tokens"] == 4 * 2 * 16
    assert results["greedy_check"]["float32"]["fraction_identical"] == 1.0
    assert results["hf_generate"]["tokens_per_s"] > 0
    assert "native tokens/s" in capsys.readouterr().out
