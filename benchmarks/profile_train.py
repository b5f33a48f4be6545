"""Where a GRPO step of the training bench spends its time (GPU only).

Runs the standard workload through the actor worker (as ``reinforge bench train``): step 1
warms up, step 2 is timed phase by phase (weights gathered, KV cache allocated, generation,
sleep, batch assembly; update), step 3's update runs under ``torch.profiler``. Writes
``$OUT/profile_train.json`` (phases) and ``$OUT/profile_train.txt`` (the kernel table).

    PYTHONPATH=. python3 benchmarks/profile_train.py        (PROFILE_ARGS="--micro-tokens 98304" passes bench flags)
"""

from __future__ import annotations

import json
import os
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

OUT = Path(os.environ.get("OUT", "bench_out"))
OUT.mkdir(parents=True, exist_ok=True)


def synced(fn, *args):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn(*args)
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    from reinforge.engine.fsdp import fsdp_units, reshard, unsharded
    from reinforge.workers.actor_rollout import ActorRolloutWorker

    args = parse_args(os.environ.get("PROFILE_ARGS", "").split())
    phases: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or write_model(Path(scratch), tiny=False, size=args.model)
        config = build_config(model_dir, args)
        actor = ActorRolloutWorker(config, 4)
        vocab_size = actor.model.config.vocab_size
        engine = actor.rollout_engine
        for step in range(3):
            prompts = prompt_batch(args, vocab_size, step)
            if step == 1:  # the rollout's pieces, each synchronized
                with unsharded(actor.model):
                    _, phases["rollout_sync_weights"] = synced(engine.sync_weights, actor.model)
                    _, phases["rollout_wake_up"] = synced(engine.wake_up)
                    _, phases["rollout_sleep_then_wake"] = synced(lambda: (engine.sleep(), engine.wake_up()))
                    engine.sleep()
                _, phases["rollout_unshard"] = synced(lambda: [unit.unshard() for unit in fsdp_units(actor.model)])
                reshard(actor.model)
            rollout, seconds = synced(actor.generate, prompts, rollout_sampling(args), step)
            phases[f"step{step + 1}_rollout"] = seconds
            phases[f"step{step + 1}_engine_metrics"] = dict(getattr(engine, "last_metrics", {}))
            batch = scored_batch(args, vocab_size, step, rollout)
            add_advantages(batch, args, config)
            if step == 2:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    _, seconds = synced(actor.update_actor, batch)
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60)
                (OUT / "profile_train.txt").write_text(table)
                by_self = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=90)
                (OUT / "profile_train_self.txt").write_text(by_self)
                print(by_self, flush=True)
            else:
                _, seconds = synced(actor.update_actor, batch)
            phases[f"step{step + 1}_update"] = seconds
            print(step + 1, json.dumps({k: v for k, v in phases.items() if not isinstance(v, dict)}), flush=True)
    phases["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    (OUT / "profile_train.json").write_text(json.dumps(phases, indent=1, default=str))
    print(json.dumps(phases, default=str))


if __name__ == "__main__":
    main()
