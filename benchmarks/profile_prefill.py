"""Where an agent turn's prefill spends its time in the native engine (GPU; ``--cpu`` for a smoke run).

An agent's next turn is a prefill of a few dozen new tokens (the tool's output and the template)
per trajectory after a prefix-cache hit. The agent benchmark measured about 20 ms per such step on
the H200 whatever its size, against 2 ms of arithmetic. This script times such prefills alone:
256 prompts of 128 tokens are prefilled once (the cache holds them), then each measured step
sends ``--seqs`` of them back with ``--new-tokens`` more tokens and asks for one token (one
prefill step each). It reports the step's wall time split into the engine's phases, each
synchronized (scheduling, input building, the forward's launch, the forward on the device,
sampling, reading back), then the same without a cached prefix, and a ``torch.profiler`` table
of one step by host time. Writes ``$OUT/profile_prefill.txt``.

    PYTHONPATH=. python3 benchmarks/profile_prefill.py [--cpu] [--seqs 20] [--new-tokens 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from reinforge.bench.rollout import QWEN25_05B, TINY, build_model, random_prompts
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine


class PhaseTimer:
    """Wraps engine and runner methods to add up their synchronized wall time by name."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals: dict[str, list[float]] = {}
        self.enabled = False

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            self.sync()
            start = time.perf_counter()
            result = original(*args, **kwargs)
            launched = time.perf_counter()
            self.sync()
            end = time.perf_counter()
            self.totals.setdefault(f"{label} (host)", []).append(launched - start)
            self.totals.setdefault(f"{label} (synced)", []).append(end - start)
            return result

        setattr(owner, name, timed)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--seqs", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.cpu:
        device, dtype, arch = torch.device("cpu"), torch.float32, TINY
    elif torch.cuda.is_available():
        device, dtype, arch = torch.device("cuda"), torch.bfloat16, QWEN25_05B
    else:
        print("benchmarks/profile_prefill.py needs a CUDA GPU; pass --cpu for the smoke run", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(arch, dtype, device)
    engine = NativeEngine(model, eos_token_ids=[arch["vocab_size"] - 1], max_model_len=1024, max_num_seqs=256,
                          gpu_memory_utilization=0.5, enable_prefix_caching=True)
    prompts = random_prompts(256, [128], arch["vocab_size"], seed=2)
    one = SamplingParams(max_tokens=1, temperature=1.0, ignore_eos=True)
    engine.generate([GenerationRequest(prompt, one) for prompt in prompts])  # the cache now holds every prompt
    generator = torch.Generator().manual_seed(5)

    def step_requests(step: int, cached: bool) -> list[GenerationRequest]:
        chosen = torch.randperm(len(prompts), generator=generator)[:args.seqs].tolist()
        requests = []
        for index in chosen:
            new = torch.randint(0, arch["vocab_size"], (args.new_tokens,), generator=generator).tolist()
            head = prompts[index] if cached else torch.randint(0, arch["vocab_size"], (128,), generator=generator).tolist()
            requests.append(GenerationRequest(head + new, SamplingParams(max_tokens=1, temperature=1.0,
                                                                         ignore_eos=True, seed=step)))
        return requests

    timer = PhaseTimer(device)
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "prefill", "runner.prefill (inputs + forward)")
    timer.wrap(engine.runner.decoder, "forward", "decoder.forward")
    timer.wrap(engine, "_run_prefill", "engine._run_prefill (prefill + sampling)")
    timer.wrap(engine, "_process", "engine._process (read back)")
    lines = [f"profile_prefill  device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}  "
             f"torch {torch.__version__}  seqs {args.seqs}  new tokens {args.new_tokens}  "
             f"flash prefix {engine.runner.decoder.flash_prefix}"]
    for cached in (True, False):
        for step in range(3):  # warm-up: compilation of any new specialization
            engine.generate(step_requests(step, cached))
        walls = []
        timer.totals, timer.enabled = {}, False
        for step in range(args.steps):
            requests = step_requests(100 + step, cached)
            timer.sync()
            start = time.perf_counter()
            engine.generate(requests)
            timer.sync()
            walls.append(time.perf_counter() - start)
        timer.enabled = True
        for step in range(args.steps):
            engine.generate(step_requests(200 + step, cached))
        timer.enabled = False
        lines.append(f"\n{'cached prefix' if cached else 'no cached prefix'}: generate() of one prefill step, "
                     f"unsynchronized wall median {statistics.median(walls) * 1e3:.2f} ms "
                     f"(min {min(walls) * 1e3:.2f}, max {max(walls) * 1e3:.2f})")
        for name, values in timer.totals.items():
            lines.append(f"  {name:<52} median {statistics.median(values) * 1e3:7.2f} ms  ({len(values)} calls)")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    requests = step_requests(300, True)
    with torch.profiler.profile(activities=activities) as profiler:
        engine.generate(requests)
        timer.sync()
    table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    lines.append("\none cached-prefix step under torch.profiler, by host time:\n" + table)
    if device.type == "cuda":
        lines.append(profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=15,
                                                   max_name_column_width=70))
    text = "\n".join(lines)
    (out / "profile_prefill.txt").write_text(text)
    print("\n".join(lines[:16]))
    print(table[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
