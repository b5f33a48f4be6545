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


def test_the_context_sweep_times_decode_steps_by_context_bucket_beside_their_floor(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["bench", "rollout", "--cpu", "--context-sweep", "--out", str(out)]) == 0
    sweep = json.loads(out.read_text())["context_sweep"]
    assert sweep["num_sequences"] == 2 and sweep["prompt_len"] == 16 and sweep["gen_len"] == 200
    buckets = sweep["buckets"]
    assert [row["context_up_to"] for row in buckets] == [32, 64, 128, 256]
    # every decode step after the first is timed: contexts 18 .. 215 (16 prompt tokens, 200 generated)
    assert sum(row["steps"] for row in buckets) == 198
    assert [row["steps"] for row in buckets] == [15, 32, 64, 87]  # 18-32, 33-64, 65-128, 129-215: warm-ups not counted
    for row in buckets:
        assert row["context_up_to"] / 2 < row["mean_context"] <= row["context_up_to"]
        assert row["over_floor"] == pytest.approx(row["mean_step_ms"] / row["floor_ms"])
    assert buckets[-1]["floor_ms"] > buckets[0]["floor_ms"]  # a longer context reads more KV
    assert "| context up to | steps | mean step ms | floor ms | step / floor |" in capsys.readouterr().out


def test_context_buckets_are_powers_of_two():
    from reinforge.bench.rollout_context import context_bucket

    assert [context_bucket(c) for c in (1, 2, 3, 1024, 1025, 32768)] == [2, 2, 4, 1024, 2048, 32768]


@pytest.mark.parametrize("flag, value", [("--bandwidth-tbps", "0"), ("--bandwidth-tbps", "-1"), ("--n", "0"),
                                         ("--num-prompts", "0"), ("--gen-len", "-4")])
def test_a_workload_flag_out_of_range_is_refused_by_its_name(flag, value, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench", "rollout", "--cpu", flag, value])
    assert exited.value.code == 2 and flag in capsys.readouterr().err
