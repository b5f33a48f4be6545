"""The standard rollout of a bench shape on the native engine: its time, its phases and the decode step's kernels (CUDA).

    reinforge bench kernels rollout-kernels OUT.json --shape SHAPE

SHAPE is a shape of ``reinforge bench train --model`` (``reinforge/bench/shapes.py``), built with random bf16 weights on
the device, read in place by the engine (``weights_fixed``), which may take 92% of the device's memory (so every
sequence of the workload fits at once, as in training, where the planner sizes the cache). The workload: 64 prompts
of 128 random tokens, 8 samples each, 512 tokens each (EOS ignored), temperature 1. Two rollouts run first (the first
compiles and captures), the second timed; a third runs with each engine phase synchronized; then the captured decode
step of the largest batch (512) replays under torch.profiler, with the cache as the last step left it, and its kernels
are printed by device time. Results go to OUT.json at the end.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

from reinforge.bench.shapes import SHAPES
from reinforge.bench.table import write_json

PROMPTS, SAMPLES, PROMPT_TOKENS, RESPONSE_TOKENS = 64, 8, 128, 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", required=True, choices=list(SHAPES),
                        help="a shape of reinforge bench train --model, built with random bf16 weights")


def run(args: argparse.Namespace) -> None:
    from reinforge.bench.rollout import random_prompts
    from reinforge.bench.rollout_context import build_shape_model
    from reinforge.bench.rollout_profile import _graph_kernels, _timed
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.native import NativeEngine

    shape = args.shape
    model = build_shape_model(shape, torch.bfloat16, torch.device("cuda"))
    vocab = model.config.vocab_size
    engine = NativeEngine(model, eos_token_ids=[vocab - 1], max_model_len=PROMPT_TOKENS + RESPONSE_TOKENS + 16,
                          max_num_seqs=PROMPTS * SAMPLES, gpu_memory_utilization=0.92, weights_fixed=True)
    sampling = SamplingParams(max_tokens=RESPONSE_TOKENS, temperature=1.0, top_p=1.0, top_k=-1, n=SAMPLES,
                              ignore_eos=True)
    requests = [GenerationRequest(prompt, sampling, request_id=str(index))
                for index, prompt in enumerate(random_prompts(PROMPTS, [PROMPT_TOKENS], vocab, seed=2))]
    result: dict = {"shape": shape, "rollouts_s": []}
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(requests)
        torch.cuda.synchronize()
        result["rollouts_s"].append(time.perf_counter() - start)
    print(f"{shape}: rollout {result['rollouts_s'][-1]:.2f} s (the first, compiling: {result['rollouts_s'][0]:.2f} s)",
          flush=True)

    phases: dict[str, list[float]] = defaultdict(list)
    runner = engine.runner
    for owner, attribute, name in [(runner, "prefill", "prefill"), (runner, "decode", "decode_forward"),
                                   (engine, "sampler", "sample"), (engine, "_process", "read_back_and_bookkeeping")]:
        setattr(owner, attribute, _timed(phases, name, getattr(owner, attribute)))
    engine.generate(requests)
    result["phases_s"] = {name: sum(values) for name, values in phases.items()}
    print("phases, each synchronized (s): " + ", ".join(
        f"{name} {seconds:.2f} ({len(phases[name])} calls)" for name, seconds in result["phases_s"].items()))

    batch = max(runner._graphs)
    result["graph_kernels"] = _graph_kernels(runner._graphs[batch].replay)
    total = sum(row["us_per_step"] for row in result["graph_kernels"])
    print(f"the captured decode step of {batch} sequences: {total:.0f} us of device time")
    for row in result["graph_kernels"][:30]:
        print(f"  {row['us_per_step']:8.1f} us  {row['launches_per_step']:5.0f} x  {row['kernel'][:110]}")
    write_json(Path(args.out), result)
