"""reinforge bench dpo: the CPU smoke run times DPO steps and the reference pass; --trl is for the GPU.

benchmarks/trl_dpo.py runs as a process of its own forked from a preloaded interpreter (forked_python.py): its
imports of torch and transformers are done once, not in each of the three runs."""

import json
import sys
from pathlib import Path

import pytest

from reinforge.bench import bench_main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import forked_python  # noqa: E402

TRL_DPO = Path(__file__).resolve().parents[2] / "benchmarks" / "trl_dpo.py"


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
    assert 0 < reinforge["reference_first_micro_batch_s"] < reinforge["reference_pass_s"]


def test_trl_is_compared_on_a_gpu_only():
    with pytest.raises(SystemExit, match="--trl compares on a GPU"):
        bench_main(["dpo", "--cpu", "--trl"])


def test_trls_script_is_ended_past_its_deadline_with_one_line_saying_so(tmp_path, monkeypatch):
    import argparse
    import time

    from reinforge.bench import dpo

    script = tmp_path / "trl_dpo.py"
    script.write_text("import time\ntime.sleep(60)\n")  # a TRL setup that never ends
    monkeypatch.setattr(dpo, "trl_script", lambda: script)
    monkeypatch.setattr(dpo, "TRL_GRACE_S", 0.5)
    args = argparse.Namespace(steps=2, pairs=4, prompt_tokens=8, response_tokens=16, trl_checkpointing="auto",
                              trl_deadline_s=0.5, trl_precompute_ref=False)
    start = time.perf_counter()
    result = dpo.run_trl(args, tmp_path, tmp_path)
    assert time.perf_counter() - start < 30
    assert result == {"error": "benchmarks/trl_dpo.py was still running 1 s after it started and was ended (its "
                               "last 'trl: ...' line above says where it was)"}


def _trl_script_args(tmp_path, *extra: str) -> list[str]:
    from reinforge.bench.train import write_model

    model_dir = write_model(tmp_path, tiny=True, size="1.5b")
    return ["--cpu", "--model-dir", str(model_dir), "--steps", "3", "--pairs", "4", "--prompt-tokens", "8",
            "--response-tokens", "16", "--micro-batch", "2", "--json", str(tmp_path / "trl.json"), *extra]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--precompute-ref",)], ids=["reference-in-each-step", "precomputed"])
def test_trls_dpo_script_builds_and_steps_on_the_cpu(tmp_path, extra):
    pytest.importorskip("trl")
    completed = forked_python.run([TRL_DPO, *_trl_script_args(tmp_path, *extra)], timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    best = json.loads((tmp_path / "trl.json").read_text())["best"]
    assert len(best["step_times_s"]) == 3 and best["reference"] == ("precomputed" if extra else "in every step")
    assert "precompute_ref_log_probs" not in best["ignored_settings"] and "stopped_at_deadline" not in best


@pytest.mark.slow
def test_trls_dpo_script_stops_after_the_step_that_passes_its_deadline(tmp_path):
    pytest.importorskip("trl")
    completed = forked_python.run([TRL_DPO, *_trl_script_args(tmp_path, "--deadline-s", "0", "--checkpointing", "both")],
                                  timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    runs = json.loads((tmp_path / "trl.json").read_text())["runs"]
    assert len(runs[0]["step_times_s"]) == 1 and runs[0]["stopped_at_deadline"]
    assert runs[1] == {"checkpointing": True, "error": "not started: past the deadline"}
