"""``reinforge bench rollout --profile``: where a native-engine decode step spends its time (CUDA only).

On the rollout bench's workload and model it times, after a warm-up rollout:
- the engine's phases over a whole rollout, each synchronized (prefill, decode forward, sampling, reading
  tokens back and bookkeeping): no overlap, so their sum exceeds an untimed rollout's time, also reported;
- the pieces on the device alone at the largest decode batch: the captured decode graph, one layer's fused
  q|k|v product, paged attention at the mean context, o projection and gated MLP (by the kernels a decode step
  of that batch picked), the LM head and the sampler kernel. The layers' pieces times the layer count plus the
  head and the sampler make up ``pieces_sum_ms``, next to the graph replay they compose;
- every kernel of the captured decode step under torch.profiler: launches and device time a step.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

from reinforge.rollout.base import GenerationRequest


def _timed(store: dict[str, list[float]], name: str, function):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = function(*args, **kwargs)
        torch.cuda.synchronize()
        store[name].append(time.perf_counter() - start)
        return result
    return wrapper


def profile_rollout(model: nn.Module, requests: list[GenerationRequest], engine_kwargs: dict) -> dict:
    """The phase totals (s) of a rollout of ``requests`` and the decode step's pieces (ms) at the largest batch."""
    import triton.testing

    from reinforge.rollout.native import NativeEngine, triton_kernels

    engine = NativeEngine(model, **engine_kwargs)
    engine.generate(requests)  # warm-up: Triton compilation and the CUDA graphs of every decode batch
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(requests)
    torch.cuda.synchronize()
    result: dict = {"untimed_generate_s": time.perf_counter() - start}

    phases: dict[str, list[float]] = defaultdict(list)
    runner = engine.runner
    wrapped = [(runner, "prefill", "prefill"), (runner, "decode", "decode_forward"), (engine, "sampler", "sample"),
               (engine, "_process", "read_back_and_bookkeeping")]
    own = [(owner, attribute, vars(owner).get(attribute)) for owner, attribute, _ in wrapped]  # instance attributes
    for owner, attribute, name in wrapped:
        setattr(owner, attribute, _timed(phases, name, getattr(owner, attribute)))
    try:
        engine.generate(requests)  # synchronized around each phase
    finally:
        for owner, attribute, function in own:
            if function is None:
                delattr(owner, attribute)  # the class's method again
            else:
                setattr(owner, attribute, function)
    result["phases_s"] = {name: sum(values) for name, values in phases.items()}
    result["phases_count"] = {name: len(values) for name, values in phases.items()}

    def bench(function) -> float:
        return triton.testing.do_bench(function, warmup=25, rep=200, return_mode="median")

    batch = max(runner._graphs)
    device = runner.device
    result["batch"] = batch
    result["graph_replay_ms"] = bench(runner._graphs[batch].replay)
    decoder, shape = runner.decoder, model.config
    context = int(runner._graph_inputs["context_lens"][:batch].float().mean())
    result["mean_context"] = context
    q = torch.randn(batch, decoder.attention[0].num_heads, decoder.spec.head_dim, device=device, dtype=torch.bfloat16)
    k_cache, v_cache = runner.attention_caches(0)  # an fp8 cache as the kernels read it
    blocks_per_seq = -(-context // engine.block_size)
    tables = torch.randperm(k_cache.shape[0] - 1, device=device)[: batch * blocks_per_seq].view(batch, -1)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    result["attention_ms"] = bench(lambda: triton_kernels.paged_decode_attention(
        q, k_cache, v_cache, tables.to(torch.int32), lengths, decoder.spec.attn_scale,
        **runner.decode_tiling(batch, context).options()))  # as the decode graph runs it, no device read
    layer, hidden = decoder.weights.layers[0], torch.randn(batch, shape.hidden_size, device=device,
                                                           dtype=torch.bfloat16)
    result["qkv_ms"] = bench(lambda: nn.functional.linear(hidden, layer["qkv_weight"], layer["qkv_bias"]))
    attention_out = torch.randn(batch, decoder.attention[0].q_size, device=device, dtype=torch.bfloat16)
    o_proj = model.model.layers[0].self_attn.o_proj
    result["o_proj_ms"] = bench(lambda: o_proj(attention_out))
    # the decoder's MLP block as a decode step runs it: the kernels its choice picked for this batch (dense_choice.py)
    result["mlp_ms"] = bench(lambda: decoder.mlps[0].forward(layer, hidden, decode=True))
    result["lm_head_ms"] = bench(lambda: model.lm_head(hidden))
    logits = torch.randn(batch, shape.vocab_size, device=device, dtype=torch.bfloat16)
    ones, seeds = torch.ones(batch, device=device), torch.arange(batch, device=device, dtype=torch.int64)
    zeros, minus_inf = torch.zeros(batch, dtype=torch.int32, device=device), torch.full((batch,), float("-inf"),
                                                                                          device=device)
    result["sampler_ms"] = bench(lambda: triton_kernels.sample(logits, ones, zeros, minus_inf, seeds, seeds))
    per_layer = result["qkv_ms"] + result["attention_ms"] + result["o_proj_ms"] + result["mlp_ms"]
    result["pieces_sum_ms"] = len(model.model.layers) * per_layer + result["lm_head_ms"] + result["sampler_ms"]
    result["graph_kernels"] = _graph_kernels(runner._graphs[batch].replay)
    engine.sleep()
    return result


def _graph_kernels(replay, replays: int = 20) -> list[dict]:
    """The kernels of a captured decode step by device time: name, launches and microseconds per replay."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels[event.name]
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
    return sorted(({"kernel": name, "launches_per_step": count / replays, "us_per_step": total / replays}
                   for name, (count, total) in kernels.items()), key=lambda row: -row["us_per_step"])


def print_profile(result: dict) -> None:
    print("rollout phases, each synchronized (s): " + ", ".join(
        f"{name} {seconds:.2f} ({result['phases_count'][name]} calls)" for name, seconds in result["phases_s"].items())
        + f"; untimed rollout {result['untimed_generate_s']:.2f}")
    pieces = ("graph_replay_ms", "qkv_ms", "attention_ms", "o_proj_ms", "mlp_ms", "lm_head_ms", "sampler_ms",
              "pieces_sum_ms")
    print(f"decode step at batch {result['batch']}, mean context {result['mean_context']} (ms; layer pieces for one "
          "layer): " + ", ".join(f"{name.removesuffix('_ms')} {result[name]:.3f}" for name in pieces))
    rows = result.get("graph_kernels", [])
    total = sum(row["us_per_step"] for row in rows)
    print(f"the captured decode step's kernels (torch.profiler, {total:.0f} us of device time a step):")
    for row in rows[:25]:
        print(f"  {row['us_per_step']:8.1f} us  {row['launches_per_step']:5.0f} x  {row['kernel'][:110]}")
