"""`reinforge bench rollout --context-sweep --kv-cache-dtype`: the sweep's floor counts the engine's KV cache."""

from __future__ import annotations

import json

import pytest

from reinforge.bench.floor import COPY_BYTES_PER_S, context_floor_ms, kv_token_bytes
from reinforge.bench.rollout import TINY
from reinforge.cli import main
from reinforge.engine.memory_plan import ModelShape


def test_the_fp8_sweep_sets_each_step_beside_the_floor_of_an_fp8_cache(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["bench", "rollout", "--cpu", "--context-sweep", "--kv-cache-dtype", "fp8", "--gen-len", "40",
                 "--out", str(out)]) == 0
    sweep = json.loads(out.read_text())["context_sweep"]
    shape = ModelShape.from_hf_config({"model_type": "qwen2", **TINY})
    # 2 layers x (K, V) x 2 KV heads x (16 e4m3 values + a float32 scale), against 256 bytes in float32
    assert sweep["kv_cache_dtype"] == "fp8" and sweep["kv_bytes_per_token"] == kv_token_bytes(shape, "fp8") == 160
    for row in sweep["buckets"]:
        assert row["floor_ms"] == pytest.approx(context_floor_ms(shape, 2, round(row["mean_context"]), "fp8", 4,
                                                                 COPY_BYTES_PER_S))
        assert row["floor_ms"] < context_floor_ms(shape, 2, round(row["mean_context"]), "auto", 4, COPY_BYTES_PER_S)
    assert "KV cache fp8 (160 bytes a token)" in capsys.readouterr().out


def test_the_kv_cache_dtype_belongs_to_the_context_sweep(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "rollout", "--cpu", "--kv-cache-dtype", "fp8"])
    assert "--kv-cache-dtype fp8 applies to --context-sweep" in capsys.readouterr().err


def test_the_rollout_benches_read_the_models_weights_in_place(monkeypatch, tmp_path):
    """Nothing trains the benchmarked model: its engines share its weights rather than holding a second copy."""
    import reinforge.rollout.native as native

    engines = []

    class Recorded(native.NativeEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(native, "NativeEngine", Recorded)
    assert main(["bench", "rollout", "--cpu", "--context-sweep", "--gen-len", "8", "--out", str(tmp_path / "s.json")]) == 0
    assert main(["bench", "rollout", "--cpu", "--skip-hf", "--skip-greedy-check", "--out", str(tmp_path / "r.json")]) == 0
    assert len(engines) == 2 and all(engine.runner.decoder.weights_fixed for engine in engines)


def test_the_sweep_warms_up_past_the_long_context_threshold_before_it_times(monkeypatch, tmp_path):
    """No bucket's mean holds the compilation or the graph capture of the long-context attention: a warm-up
    rollout of prompts past the threshold runs first, at the timed batch."""
    import reinforge.rollout.native as native
    from reinforge.rollout.native import decode_kernels

    monkeypatch.setattr(decode_kernels, "SPLIT_MIN_CONTEXT", 32)
    rollouts = []

    class Recorded(native.NativeEngine):
        def generate(self, requests):
            rollouts.append([(len(request.prompt_token_ids), request.sampling.max_tokens) for request in requests])
            return super().generate(requests)

    monkeypatch.setattr(native, "NativeEngine", Recorded)
    assert main(["bench", "rollout", "--cpu", "--context-sweep", "--gen-len", "40", "--out", str(tmp_path / "s.json")]) == 0
    (short, long, timed) = rollouts
    assert len(short) == len(long) == len(timed)
    assert all(length > 32 and tokens == 8 for length, tokens in long)
    assert all(tokens == 40 for _, tokens in timed)


def test_a_sweep_of_no_decode_step_is_refused_and_its_floor_of_zero_divides_nothing(capsys):
    from reinforge.bench.rollout import build_model
    from reinforge.bench.rollout_context import context_sweep

    with pytest.raises(SystemExit):
        main(["bench", "rollout", "--cpu", "--context-sweep", "--gen-len", "1"])
    assert "--gen-len 1 with --context-sweep decodes no step" in capsys.readouterr().err
    import torch

    model = build_model(TINY, torch.float32, torch.device("cpu"))
    sweep = context_sweep(model, [[1, 2, 3]], 1, 1, dict(eos_token_ids=[], max_model_len=32, max_num_seqs=2))
    assert sweep["floor_s"] == 0.0 and sweep["over_floor"] is None and sweep["buckets"] == []
