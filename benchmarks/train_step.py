"""One device call: the trainer's CUDA path checked end to end, then the training-step bench.

    PYTHONPATH=. python3 benchmarks/train_step.py [log_probs grpo grpo_kept kl_kept ppo_kept check ...]
    # $OUT/*.json, a table last

Steps per variant: GRPO_STEPS (grpo*, default 5) and KL_PPO_STEPS (kl*, ppo*, default 3); medians
are of steps 2.. . Variants: ``grpo``, ``kl``, ``ppo`` run ``reinforge.bench.train`` with the
default configuration; ``*_kept`` add ``--keep-rollout-memory true`` (``rollout.free_cache_engine=false``);
``grpo_96k`` raises the micro-batch budget to 96k tokens.
``log_probs`` times the fused log-prob/entropy (16k rows x 151936 vocab, forward + backward:
the Triton row kernels chunked, and with the logits kept for the backward).
``check`` runs ``reinforge train`` through the CLI on a tiny model on CUDA, 2 GRPO steps with the
native rollout and 2 GAE steps with a KL loss and the hf rollout; metrics must be finite.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "bench_out"))
OUT.mkdir(parents=True, exist_ok=True)
RESULTS: dict = {}


def log_probs_microbench() -> dict:
    from reinforge.engine import log_probs as module

    rows, hidden_size, vocab = 16384, 896, 151936
    hidden = (torch.randn(rows, hidden_size, device="cuda") * 0.05).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device="cuda") * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    result = {}
    for name, max_logits_bytes in (("triton_chunked", 0), ("triton_stored", module.MAX_LOGITS_BYTES)):
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            start = time.perf_counter()
            lp, ent = module.linear_log_probs(hidden, weight, targets, 1.0, max_logits_bytes=max_logits_bytes)
            (lp.sum() + ent.sum()).backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        result[name] = min(times[1:])
        result[f"{name}_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    print("log_probs", json.dumps(result), flush=True)
    return result


def bench(model_dir: Path, variant: str, steps: int, extra: list[str], name: str | None = None) -> dict:
    from reinforge.bench.train import bench_train_main

    path = OUT / f"{name or variant}.json"
    bench_train_main(["--variant", variant, "--steps", str(steps), "--model-dir", str(model_dir), "--json", str(path),
                      *extra])
    gc.collect()
    torch.cuda.empty_cache()
    return json.loads(path.read_text())["median"]


def check_cli(folder: Path) -> dict:
    from reinforge.cli import main
    from reinforge.data.tasks.arithmetic import write_arithmetic_dataset
    from reinforge.models import save_tiny_model

    model = save_tiny_model(folder / "tiny")
    write_arithmetic_dataset(folder / "data", num_train=64, num_test=8, max_digits=2)
    outcome = {}
    for name, extra in {"grpo_native": ["rollout.name=native"],
                        "gae_kl_hf": ["rollout.name=hf", "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
                                      "ref.param_offload=true"]}.items():
        run_dir = folder / name
        code = main(["train", f"model.path={model}", f"data.train_files=[{folder / 'data' / 'train.parquet'}]",
                     "data.train_batch_size=4", "data.max_prompt_length=64", "data.max_response_length=16",
                     "rollout.n=4", f"trainer.output_dir={run_dir}", "trainer.loggers=[jsonl]",
                     "trainer.total_steps=2", "trainer.val_before_train=false", "trainer.device=cuda",
                     "actor.optim.lr=1e-3", *extra])
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        last = lines[-1]
        finite = all(math.isfinite(v) for k, v in last.items() if isinstance(v, float) and k.startswith("actor/"))
        outcome[name] = {"exit": code, "steps": len(lines), "finite": finite,
                         "hf_saved": any((run_dir / "checkpoints").glob("step_*2/hf/config.json")),
                         "pg_loss": last.get("actor/pg_loss"), "grad_norm": last.get("actor/grad_norm")}
    print("check", json.dumps(outcome), flush=True)
    return outcome


def main() -> int:
    from reinforge.bench.train import write_model

    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        model_dir = write_model(scratch, tiny=False)
        grpo_steps = int(os.environ.get("GRPO_STEPS", "5"))
        other_steps = int(os.environ.get("KL_PPO_STEPS", "3"))
        steps = [("log_probs", log_probs_microbench),
                 ("grpo", lambda: bench(model_dir, "grpo", grpo_steps, [])),
                 ("grpo_kept", lambda: bench(model_dir, "grpo", grpo_steps, ["--keep-rollout-memory", "true"], "grpo_kept")),
                 ("kl_kept", lambda: bench(model_dir, "kl", other_steps, ["--keep-rollout-memory", "true"], "kl_kept")),
                 ("ppo_kept", lambda: bench(model_dir, "ppo", other_steps, ["--keep-rollout-memory", "true"], "ppo_kept")),
                 ("grpo_96k", lambda: bench(model_dir, "grpo", grpo_steps, ["--micro-tokens", "98304"], "grpo_96k")),
                  ("check", lambda: check_cli(scratch / "check")),
                  ("kl", lambda: bench(model_dir, "kl", other_steps, [])),
                  ("ppo", lambda: bench(model_dir, "ppo", other_steps, []))]
        wanted = sys.argv[1:] or [name for name, _ in steps]
        for name, fn in steps:
            if name not in wanted:
                continue
            try:
                RESULTS[name] = fn()
            except Exception:
                traceback.print_exc()
                RESULTS[name] = {"error": traceback.format_exc(limit=3)[-600:]}
            (OUT / "results.json").write_text(json.dumps(RESULTS, indent=1))
    print("\n| what | step s | rollout s | update s | update tok/s | MFU | MFU (workload tokens) | peak GiB |")
    for name in ("grpo", "grpo_kept", "kl_kept", "ppo_kept", "grpo_96k", "kl", "ppo"):
        m = RESULTS.get(name, {})
        if "step_s" in m:
            print(f"| {name} | {m['step_s']:.2f} | {m['rollout_s']:.2f} | {m['update_actor_s']:.2f} | "
                  f"{m['update_tokens_per_s']:.0f} | {m.get('mfu') or 0:.3f} | {m.get('mfu_workload_tokens') or 0:.3f} "
                  f"| {m['peak_memory_gb']:.1f} |")
        else:
            print(f"| {name} | {m.get('error', 'not run')[-200:]} |")
    print("log_probs", RESULTS.get("log_probs"), "check", RESULTS.get("check"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
