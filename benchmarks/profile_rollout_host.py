"""Where the host's time goes in a training step's rollout (GPU only).

Builds the standard workload's actor worker (as ``reinforge bench train --keep-rollout-memory true``),
runs two warm-up steps, then profiles the third rollout with cProfile (the host's Python, the
device's work shows up as waits) and times the batch assembly's pieces alone on this host.
Writes ``$OUT/rollout_host.txt``.

    PYTHONPATH=. python3 benchmarks/profile_rollout_host.py
"""

from __future__ import annotations

import cProfile
import io
import itertools
import os
import pstats
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from reinforge.bench.train import (
    add_advantages,
    build_config,
    parse_args,
    prompt_batch,
    rollout_sampling,
    scored_batch,
    write_model,
)

OUT = Path(os.environ.get("OUT", "bench_out"))
OUT.mkdir(parents=True, exist_ok=True)


def host_microbench() -> str:
    """The conversions of the batch assembly on synthetic data: how fast this host's Python is."""
    rows = [[random.randrange(150000) for _ in range(512)] for _ in range(512)]

    def best(fn, repeats: int = 5) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3

    fromiter = best(lambda: np.fromiter(itertools.chain.from_iterable(rows), np.int64, 512 * 512))
    mask = torch.ones(512, 640, dtype=torch.long)
    cumsum = best(lambda: (torch.cumsum(mask, dim=-1) - 1).clamp(min=0) * mask)
    return (f"host: 262,144 ints to numpy {fromiter:.2f} ms, position ids of 512 x 640 {cumsum:.2f} ms, "
            f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")


def main() -> None:
    from reinforge.controller.worker import freeze_long_lived_objects
    from reinforge.workers.actor_rollout import ActorRolloutWorker

    args = parse_args(["--keep-rollout-memory", "true", *os.environ.get("PROFILE_ARGS", "").split()])
    report = [host_microbench()]
    with tempfile.TemporaryDirectory() as scratch:
        config = build_config(args.model_dir or write_model(Path(scratch), tiny=False, size=args.model), args)
        actor = ActorRolloutWorker(config, 4)
        freeze_long_lived_objects()
        vocab_size = actor.model.config.vocab_size
        for step in range(3):
            prompts = prompt_batch(args, vocab_size, step)
            torch.cuda.synchronize()
            start = time.perf_counter()
            if step == 2:
                profiler = cProfile.Profile()
                profiler.enable()
            rollout = actor.generate(prompts, rollout_sampling(args), step)
            if step == 2:
                profiler.disable()
            seconds = time.perf_counter() - start
            phases = {k.removeprefix("timing_s/gen/"): round(v, 4) for k, v in rollout.meta["rollout_metrics"].items()
                      if k.startswith("timing_s/gen/")}
            report.append(f"step {step + 1}: rollout {seconds:.3f} s {phases}")
            batch = scored_batch(args, vocab_size, step, rollout)
            add_advantages(batch, args, config)
            actor.update_actor(batch)
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(35)
        report.append(stream.getvalue())
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(30)
        report.append(stream.getvalue())
    text = "\n".join(report)
    (OUT / "rollout_host.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
