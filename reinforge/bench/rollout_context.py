"""``reinforge bench rollout --context-sweep``: the decode step's time against the context it reads.

A few sequences (``--num-prompts`` x ``--n``, 8 x 1 by default) of one prompt length (128) decode to
``--gen-len`` tokens (32,640 by default: contexts up to 32k), EOS ignored, after short warm-up rollouts
that compile the kernels and capture the CUDA graphs of their batch, at short contexts and past the
long-context threshold (``decode_kernels.SPLIT_MIN_CONTEXT``). Each engine step is timed from
outside: a decode step is launched ahead and read back during the next one, so in the steady state the
wall time between the ends of two steps is one step's. Steps are grouped by the context their
sequences hold (power-of-two buckets: up to 256, 512, ... 32k tokens) and each bucket's mean step time
is set beside the bandwidth floor of a step of as many sequences at the bucket's mean context
(``floor.context_floor_ms``: their KV cache and the weights, over the device copy's rate). The floor counts
the cache the engine keeps (``--kv-cache-dtype``: the model dtype, or fp8's byte a value and float32 scale per
token and KV head). A ratio near 1 says the step reads memory as fast as a copy; one that grows with the
context points at the attention.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from reinforge.bench.floor import COPY_BYTES_PER_S, context_floor_ms, kv_token_bytes, rollout_floor
from reinforge.engine.memory_plan import ModelShape
from reinforge.rollout.base import GenerationRequest, SamplingParams


def build_shape_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> nn.Module:
    """The causal LM of shape ``name`` (``bench.shapes``) with random weights of ``dtype`` on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from reinforge.bench.shapes import shape_config
    from reinforge.models.export import default_dtype

    keys = shape_config(name)
    config = AutoConfig.for_model(keys.pop("model_type"), **keys)
    torch.manual_seed(seed)
    with device, default_dtype(dtype):
        model = AutoModelForCausalLM.from_config(config)
    return model.eval()


def context_bucket(context: int) -> int:
    """The smallest power of two that holds ``context`` tokens."""
    return 1 << max(context - 1, 1).bit_length()


def bucket_steps(steps: list[tuple[int, float]], shape: ModelShape, num_sequences: int, kv_cache_dtype: str,
                 value_bytes: float, bytes_per_s: float) -> list[dict]:
    """Per power-of-two context bucket of ``(context, seconds)`` steps: their count, mean context and time, and
    the floor of a step at that mean context."""
    buckets: dict[int, list[tuple[int, float]]] = {}
    for context, seconds in steps:
        buckets.setdefault(context_bucket(context), []).append((context, seconds))
    rows = []
    for bucket, members in sorted(buckets.items()):
        mean_context = sum(context for context, _ in members) / len(members)
        mean_ms = 1e3 * sum(seconds for _, seconds in members) / len(members)
        floor_ms = context_floor_ms(shape, num_sequences, round(mean_context), kv_cache_dtype, value_bytes,
                                    bytes_per_s)
        rows.append({"context_up_to": bucket, "steps": len(members), "mean_context": mean_context,
                     "mean_step_ms": mean_ms, "floor_ms": floor_ms, "over_floor": mean_ms / floor_ms})
    return rows


def context_sweep(model: nn.Module, prompts: list[list[int]], n: int, gen_len: int, engine_kwargs: dict,
                  bytes_per_s: float = COPY_BYTES_PER_S) -> dict:
    """Decode ``prompts`` (one length) x ``n`` to ``gen_len`` tokens; each decode step's time by context bucket,
    beside the floor of the engine's KV cache dtype (``engine_kwargs["kv_cache_dtype"]``, auto by default)."""
    from reinforge.rollout.native import NativeEngine
    from reinforge.rollout.native.decode_kernels import SPLIT_MIN_CONTEXT

    if len({len(prompt) for prompt in prompts}) != 1:
        raise ValueError("the context sweep times sequences of one context; give prompts of one length")
    prompt_len, num_sequences = len(prompts[0]), len(prompts) * n
    device = next(model.parameters()).device
    engine = NativeEngine(model, **engine_kwargs)
    warmup = SamplingParams(max_tokens=8, n=n, ignore_eos=True)
    engine.generate([GenerationRequest(prompt, warmup) for prompt in prompts])  # kernels and this batch's graph
    if prompt_len + gen_len > SPLIT_MIN_CONTEXT:  # and those of contexts past the long-context threshold, so that
        long_len = SPLIT_MIN_CONTEXT + 8  # no bucket's mean holds a compilation or a graph capture
        engine.generate([GenerationRequest((prompt * -(-long_len // len(prompt)))[:long_len], warmup)
                         for prompt in prompts])
    sampling = SamplingParams(max_tokens=gen_len, temperature=1.0, top_p=1.0, top_k=-1, n=n, ignore_eos=True)
    requests = [GenerationRequest(prompt, sampling, request_id=str(i)) for i, prompt in enumerate(prompts)]
    steps: list[tuple[int, float]] = []
    state = {"end": None, "decoded": False}
    step = engine._step
    warmup_steps = engine.counters.decode_steps  # the counters keep the warm-up rollouts' steps

    def timed_step(*args, **kwargs):
        before = engine.counters.decode_steps
        result = step(*args, **kwargs)
        now = time.perf_counter()
        decoded = engine.counters.decode_steps > before
        if decoded and state["decoded"]:  # the previous call launched a decode step too: steady state
            steps.append((prompt_len + 1 + before - warmup_steps, now - state["end"]))  # its sequences' cached tokens
        state["end"], state["decoded"] = now, decoded
        return result

    engine._step = timed_step
    try:
        start = time.perf_counter()
        completions = engine.generate(requests)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
    finally:
        del engine._step  # the class's method again
        engine.sleep()
    value_bytes = torch.finfo(next(model.parameters()).dtype).bits / 8
    shape = ModelShape.from_hf_config(model.config.to_dict())
    lengths = [len(sample.token_ids) for samples in completions for sample in samples]
    kv_cache_dtype = engine_kwargs.get("kv_cache_dtype", "auto")
    floor = rollout_floor(shape, [prompt_len] * len(lengths), lengths, kv_cache_dtype, value_bytes, bytes_per_s)
    return {"num_sequences": num_sequences, "prompt_len": prompt_len, "gen_len": gen_len, "time_s": elapsed,
            "floor_s": floor.seconds, "over_floor": elapsed / floor.seconds if floor.seconds else None, "bandwidth_tbps": bytes_per_s / 1e12,
            "kv_cache_dtype": kv_cache_dtype, "kv_bytes_per_token": kv_token_bytes(shape, kv_cache_dtype, value_bytes),
            "buckets": bucket_steps(steps, shape, num_sequences, kv_cache_dtype, value_bytes, bytes_per_s)}


def print_sweep(result: dict) -> None:
    print(f"decode step against context: {result['num_sequences']} sequences, prompt {result['prompt_len']} + "
          f"{result['gen_len']} tokens, {result['time_s']:.1f} s against a floor of {result['floor_s']:.1f} s "
          f"({result['over_floor'] or 0:.2f}x) at {result['bandwidth_tbps']:g} TB/s, KV cache {result['kv_cache_dtype']} "
          f"({result['kv_bytes_per_token']:,.0f} bytes a token)")
    print("| context up to | steps | mean step ms | floor ms | step / floor |")
    print("|---|---|---|---|---|")
    for row in result["buckets"]:
        print(f"| {row['context_up_to']} | {row['steps']} | {row['mean_step_ms']:.3f} | {row['floor_ms']:.3f} | "
              f"{row['over_floor']:.2f} |")
