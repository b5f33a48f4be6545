"""What FSDP's per-micro-batch re-gathering costs the update on one GPU (GPU only; an experiment, not a setting).

Every decoder layer is an FSDP unit: it is all-gathered before its forward, freed after it, and
gathered again for its backward, in every micro-batch. On one device the gathers are copies (a
float32 shard cast to bf16, then a one-rank all-gather), and the 1.5B update's copy kernels took
about 0.28 s of 5.2 s (eighth session's profile). This runs the training bench's workload through
the actor worker: steps 1-3 as configured, then steps 4-6 with every unit told to keep its
parameters after the forward (``set_reshard_after_forward(False)``: the backward's gather goes), and
prints the update times and peaks of both. The planner counts none of the extra memory (the whole
model in bf16 during the update), so run it where the plan leaves room.

    PROFILE_ARGS="--model 1.5b" PYTHONPATH=. python3 benchmarks/fsdp_reshard.py
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    from reinforge.engine.fsdp import fsdp_units
    from reinforge.workers.actor_rollout import ActorRolloutWorker

    args = parse_args(os.environ.get("PROFILE_ARGS", "").split())
    updates: dict[str, list[float]] = {"reshard after forward": [], "keep after forward": []}
    peaks: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or write_model(Path(scratch), tiny=False, size=args.model)
        config = build_config(model_dir, args)
        actor = ActorRolloutWorker(config, 6)
        vocab_size = actor.model.config.vocab_size
        for step in range(6):
            mode = "reshard after forward" if step < 3 else "keep after forward"
            if step == 3:
                for unit in fsdp_units(actor.model):
                    unit.set_reshard_after_forward(False, recurse=False)
                torch.cuda.reset_peak_memory_stats()
            rollout = actor.generate(prompt_batch(args, vocab_size, step), rollout_sampling(args), step)
            batch = scored_batch(args, vocab_size, step, rollout)
            add_advantages(batch, args, config)
            torch.cuda.synchronize()
            start = time.perf_counter()
            actor.update_actor(batch)
            torch.cuda.synchronize()
            if step % 3:  # the first step of each mode warms up
                updates[mode].append(time.perf_counter() - start)
            peaks[mode] = torch.cuda.max_memory_allocated() / 2**30  # since this mode began
    result = {mode: {"update_s": statistics.median(times), "peak_gb": peaks[mode]} for mode, times in updates.items()}
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fsdp_reshard.json").write_text(json.dumps({"model": args.model, **result}, indent=1))
    for mode, row in result.items():
        print(f"{args.model}  {mode:<22} update {row['update_s']:.2f} s  peak {row['peak_gb']:.1f} GiB")


if __name__ == "__main__":
    main()
