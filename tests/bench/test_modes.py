"""`reinforge bench modes --cpu` runs every mode end to end on a tiny model (a smoke test, no timing claims)."""

from __future__ import annotations

import json
import random

from reinforge.bench.modes import long_tail_length
from reinforge.cli import main


def test_bench_modes_runs_the_three_modes_on_the_cpu(tmp_path):
    assert main(["bench", "modes", "--cpu", "--steps", "1", "--json", str(tmp_path / "out.json")]) == 0
    results = {row["mode"]: row for row in json.loads((tmp_path / "out.json").read_text())["results"]}
    assert sorted(results) == ["async", "one_step_off", "sync"]
    assert results["sync"]["staleness_mean"] == 0.0 and results["one_step_off"]["staleness_mean"] == 1.0
    assert all(row["samples"] == 4 and row["s_per_1000_samples"] > 0 for row in results.values())
    assert results["one_step_off"]["proximal"] == "recompute" and results["sync"]["proximal"] is None
    for key in ("trainer_wait_fraction", "rollouter_idle_fraction"):
        assert 0 <= results["async"][key] <= 1


def test_the_off_policy_modes_run_with_the_interpolated_proximal_policy(tmp_path):
    assert main(["bench", "modes", "--cpu", "--steps", "1", "--modes", "one_step_off,async", "--proximal", "loglinear",
                        "--json", str(tmp_path / "out.json")]) == 0
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert [row["proximal"] for row in results] == ["loglinear", "loglinear"]
    assert all(row["staleness_mean"] > 0 for row in results)  # stale batches: the interpolation was used


def test_lengths_are_long_tailed_between_the_bounds():
    rng = random.Random(0)
    lengths = sorted(long_tail_length(rng, 64, 4096) for _ in range(20000))
    assert lengths[0] >= 64 and lengths[-1] <= 4096
    assert 90 < lengths[len(lengths) // 2] < 140 and lengths[int(0.97 * len(lengths))] > 2048
