"""`reinforge bench --cpu`: the smoke test of the benchmark (no timing claims)."""

from __future__ import annotations

import json

import pytest

from reinforge.cli import main


def test_bench_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "rollout", "--cpu", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["native"]["num_tokens"] == 4 * 2 * 16
    assert results["greedy_check"]["float32"]["fraction_identical"] == 1.0
    hf, native = results["hf_generate"], results["native"]
    assert hf["tokens_per_s"] == pytest.approx(hf["num_tokens"] / hf["time_s"])
    assert results["speedup_vs_generate"] == pytest.approx(native["tokens_per_s"] / hf["tokens_per_s"])
    assert "native tokens/s" in capsys.readouterr().out


def test_the_profile_needs_a_cuda_device_and_says_so_in_one_line(capsys):
    assert main(["bench", "rollout", "--cpu", "--profile"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("reinforge bench rollout --profile needs a CUDA device")
