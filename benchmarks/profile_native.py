"""Where a native-engine rollout step spends its time, on the standard bench workload (GPU only).

Times the real run, then each phase of a second run synchronized around every phase (prefill,
decode input preparation + graph replay, sampling, reading tokens back and bookkeeping) and,
separately, the pieces on the device alone: the captured decode graph at the largest batch,
that graph followed by the sampler, the paged-attention kernel, the sampler kernels on bf16
logits (512 x vocab; alone, and through the Sampler with min-p rows, whose thresholds take
the row maxima first), the fused q|k|v and gate|up matrix products next to the separate ones
they replace, one layer's MLP and the LM-head matrix product. Writes JSON to the path given
as the first argument.

    PYTHONPATH=. python3 benchmarks/profile_native.py /tmp/profile.json [--sweep] [--model 1.5b]

``--model`` picks a Qwen2.5 shape of the training bench (0.5b by default). The per-piece figures at
batch 512 (one layer's q|k|v, attention at the mean context, o, MLP; the head; the sampler) add up
to ``pieces_sum_ms_b512``, next to the graph replay they make up.

``--sweep`` also times the paged-attention kernel over tile sizes, warps and pipeline stages,
and the sampler over block widths, blocks per split and warps.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict

import torch
import triton.testing

from reinforge.bench.rollout import build_model, random_prompts
from reinforge.bench.train import QWEN25_SHAPES
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine, triton_kernels
from reinforge.rollout.native.requests import LaunchedStep
from reinforge.rollout.native.sampling import SamplingTensors


def timed(store: dict[str, list[float]], name: str, function):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = function(*args, **kwargs)
        torch.cuda.synchronize()
        store[name].append(time.perf_counter() - start)
        return result
    return wrapper


def main(out_path: str, size: str) -> None:
    shape = QWEN25_SHAPES[size]
    device = torch.device("cuda")
    model = build_model(shape, torch.bfloat16, device)
    engine = NativeEngine(model, eos_token_ids=[0], max_model_len=656, max_num_seqs=512)
    prompts = random_prompts(64, [128], shape["vocab_size"], seed=2)
    sampling = SamplingParams(max_tokens=512, temperature=1.0, n=8, ignore_eos=True)
    requests = [GenerationRequest(prompt, sampling) for prompt in prompts]
    engine.generate([GenerationRequest(prompts[0], SamplingParams(max_tokens=8, n=2, ignore_eos=True))])

    # the real run; the host's waits for sampled tokens are summed: when they are near zero, the
    # host's bookkeeping, not the device, sets the pace
    waits: list[float] = []
    read = LaunchedStep.read

    def timed_read(launched):
        if launched.ready is not None:
            start = time.perf_counter()
            launched.ready.synchronize()
            waits.append(time.perf_counter() - start)
        return read(launched)

    LaunchedStep.read = timed_read
    untimed_start = time.perf_counter()
    engine.generate(requests)
    untimed_s = time.perf_counter() - untimed_start
    LaunchedStep.read = read

    phases: dict[str, list[float]] = defaultdict(list)
    runner = engine.runner
    original = (runner.prefill, runner.decode, engine.sampler, engine._process, engine._step)
    runner.prefill = timed(phases, "prefill", runner.prefill)
    runner.decode = timed(phases, "decode_forward", runner.decode)
    engine.sampler = timed(phases, "sample", engine.sampler)
    engine._process = timed(phases, "process_tokens", engine._process)
    engine._step = timed(phases, "step", engine._step)
    engine.generate(requests)  # synchronized around each phase: no overlap, so slower than the untimed run
    runner.prefill, runner.decode, engine.sampler, engine._process, engine._step = original
    result = {"untimed_generate_s": untimed_s, "untimed_tokens_per_s": 512 * 512 / untimed_s,
              "untimed_host_waits_s": sum(waits), "untimed_steps": len(waits),
              "phases_total_s": {name: sum(values) for name, values in phases.items()},
              "phases_count": {name: len(values) for name, values in phases.items()}}

    graph = runner._graphs[512]
    result["graph_replay_512_ms"] = triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median")
    static = runner._graph_inputs
    result["graph_context_len_mean"] = float(static["context_lens"][:512].float().mean())

    decoder = runner.decoder
    batch, context = 512, 384
    q = torch.randn(batch, decoder.num_heads, decoder.head_dim, device=device, dtype=torch.bfloat16)
    k_cache, v_cache = runner.kv_cache[0, 0], runner.kv_cache[0, 1]
    blocks_per_seq = context // engine.block_size
    block_tables = torch.randperm(k_cache.shape[0] - 1, device=device)[: batch * blocks_per_seq]
    block_tables = block_tables.view(batch, blocks_per_seq).to(torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    result["attention_kernel_ms_b512_ctx384_one_layer"] = triton.testing.do_bench(
        lambda: triton_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 0.125),
        return_mode="median")
    sweep = {}
    for block_n in (32, 64, 128) if "--sweep" in sys.argv else ():
        for num_warps in (2, 4, 8):
            for num_stages in (1, 2, 3):
                try:
                    sweep[f"block_n={block_n},warps={num_warps},stages={num_stages}"] = triton.testing.do_bench(
                        lambda b=block_n, w=num_warps, s=num_stages: triton_kernels.paged_decode_attention(
                            q, k_cache, v_cache, block_tables, context_lens,
                            0.125, b, w, s),
                        return_mode="median")
                except Exception as error:  # a configuration that does not compile is just skipped
                    sweep[f"block_n={block_n},warps={num_warps},stages={num_stages}"] = repr(error)[:80]
    result["attention_kernel_sweep_ms"] = sweep
    logits = torch.randn(batch, shape["vocab_size"], device=device, dtype=torch.bfloat16)
    ones = torch.ones(batch, device=device)
    zeros_int = torch.zeros(batch, dtype=torch.int32, device=device)
    minus_inf = torch.full((batch,), float("-inf"), device=device)
    seeds = torch.arange(batch, device=device, dtype=torch.int64)
    result["sampler_kernel_ms_b512"] = triton.testing.do_bench(
        lambda: triton_kernels.sample(logits, ones, zeros_int, minus_inf, seeds, seeds), return_mode="median")
    min_p_params = SamplingTensors(inv_temperatures=ones, greedy=zeros_int, top_k=zeros_int.long(), top_p=ones,
                                   log_min_p=torch.full((batch,), -3.0, device=device), sample_seeds=seeds,
                                   needs_truncation=False, needs_min_p=True, positions=seeds)
    result["sampler_with_min_p_ms_b512"] = triton.testing.do_bench(
        lambda: engine.sampler(logits, min_p_params), return_mode="median")
    graph_logits = runner._graph_logits[512]
    result["graph_replay_then_sampler_kernel_ms_b512"] = triton.testing.do_bench(
        lambda: (graph.replay(), triton_kernels.sample(graph_logits, ones, zeros_int, minus_inf, seeds, seeds)),
        warmup=50, rep=300, return_mode="median")
    sampler_sweep = {}
    for block_v in (512, 1024, 2048) if "--sweep" in sys.argv else ():
        for blocks_per_split in (2, 4, 8, 16, 32):
            for num_warps in (4, 8):
                name = f"block_v={block_v},blocks_per_split={blocks_per_split},warps={num_warps}"
                try:
                    sampler_sweep[name] = triton.testing.do_bench(
                        lambda b=block_v, s=blocks_per_split, w=num_warps: triton_kernels.sample(
                            logits, ones, zeros_int, minus_inf, seeds, seeds, b, s, w),
                        return_mode="median")
                except Exception as error:  # a configuration that does not compile is just skipped
                    sampler_sweep[name] = repr(error)[:80]
    result["sampler_kernel_sweep_ms"] = sampler_sweep
    hidden = torch.randn(batch, shape["hidden_size"], device=device, dtype=torch.bfloat16)
    result["lm_head_ms_b512"] = triton.testing.do_bench(lambda: model.lm_head(hidden), return_mode="median")
    layer, fused = model.model.layers[0], decoder.weights.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    result["qkv_separate_ms_b512"] = triton.testing.do_bench(
        lambda: (attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)), return_mode="median")
    result["qkv_fused_ms_b512"] = triton.testing.do_bench(
        lambda: torch.nn.functional.linear(hidden, fused.qkv_weight, fused.qkv_bias), return_mode="median")
    result["gate_up_separate_ms_b512"] = triton.testing.do_bench(
        lambda: (mlp.gate_proj(hidden), mlp.up_proj(hidden)), return_mode="median")
    result["gate_up_fused_ms_b512"] = triton.testing.do_bench(
        lambda: torch.nn.functional.linear(hidden, fused.gate_up_weight, fused.gate_up_bias), return_mode="median")
    result["mlp_one_layer_ms_b512"] = triton.testing.do_bench(
        lambda: mlp.down_proj(triton_kernels.silu_and_mul(
            torch.nn.functional.linear(hidden, fused.gate_up_weight, fused.gate_up_bias))),
        return_mode="median")
    attn_out = torch.randn(batch, decoder.num_heads * decoder.head_dim, device=device, dtype=torch.bfloat16)
    result["o_proj_ms_b512"] = triton.testing.do_bench(lambda: attn.o_proj(attn_out), return_mode="median")
    layers = len(model.model.layers)
    result["pieces_sum_ms_b512"] = (
        layers * (result["qkv_fused_ms_b512"] + result["attention_kernel_ms_b512_ctx384_one_layer"]
                  + result["o_proj_ms_b512"] + result["mlp_one_layer_ms_b512"])
        + result["lm_head_ms_b512"] + result["sampler_kernel_ms_b512"])
    result["model"] = size
    engine.sleep()
    with open(out_path, "w") as file:
        json.dump(result, file, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    paths = [argument for argument in sys.argv[1:] if not argument.startswith("--")]
    model_size = sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else "0.5b"
    paths = [path for path in paths if path != model_size]
    main(paths[0] if paths else "profile.json", model_size)
