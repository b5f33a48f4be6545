"""reinforge bench dpo: the CPU smoke run times DPO steps and the reference pass; --trl is for the GPU."""

import json

import pytest

from reinforge.bench import bench_main


@pytest.mark.slow
def test_the_cpu_smoke_run_times_steps_and_the_reference_pass(tmp_path):
    out = tmp_path / "dpo.json"
    assert bench_main(["dpo", "--cpu", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["model"] == "tiny"
    reinforge = results["reinforge"]
    assert len(reinforge["step_times_s"]) == 2 and reinforge["step_s"] > 0 and reinforge["reference_pass_s"] > 0
    assert reinforge["packed_tokens_per_step"] == 4 * (8 + 2 * 16)  # a pair's prompt once
    assert reinforge["reference_pass_pairs"] == 4 * 2  # every pair of the run's two steps
    assert reinforge["reference_pairs_per_s"] > 0 and reinforge["training_pairs_per_s"] > 0


def test_trl_is_compared_on_a_gpu_only():
    with pytest.raises(SystemExit, match="--trl compares on a GPU"):
        bench_main(["dpo", "--cpu", "--trl"])
