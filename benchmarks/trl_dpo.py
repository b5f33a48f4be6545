"""TRL's DPOTrainer on the DPO workload, the competitor of ``reinforge bench dpo``.

    python3 benchmarks/trl_dpo.py --model-dir DIR [--steps 4] [--pairs 64] [--prompt-tokens 128]
                                  [--response-tokens 512] [--micro-batch 8] [--checkpointing auto|both|on|off]
                                  [--json out.json]

``reinforge bench dpo --trl`` runs it on the same model folder and workload: ``--pairs`` pairs a step of a
prompt of ``--prompt-tokens`` random letters and two completions of ``--response-tokens`` tokens (random
letters, then EOS), bf16, AdamW lr 1e-6, beta 0.1, the sigmoid loss, one optimizer step a batch of pairs
(``--micro-batch`` pairs a forward, gradient accumulation over the rest). The reference log-probs are
computed before training (``precompute_ref_log_probs``), as reinforge computes them, so that neither step
runs a reference model. ``DIR`` is a model folder written by ``reinforge bench`` (random weights and the
character tokenizer, so a letter is a token). The step time is the median time between optimizer steps
2.. . With ``--checkpointing auto`` it runs without gradient checkpointing and, when that runs out of
memory, with it, as TRL's users would; ``both`` runs each and the faster one counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

import torch


def run(args: argparse.Namespace, checkpointing: bool) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    rng = random.Random(0)

    def letters(count: int) -> str:
        return "".join(rng.choice(string.ascii_letters) for _ in range(count))

    rows = [{"prompt": letters(args.prompt_tokens), "chosen": letters(args.response_tokens - 1),
             "rejected": letters(args.response_tokens - 1)} for _ in range(args.pairs * args.steps)]
    dataset = Dataset.from_list(rows)
    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            times.append(time.perf_counter())

    micro_batch = min(args.micro_batch, args.pairs)
    if args.pairs % micro_batch:
        raise SystemExit(f"--micro-batch {micro_batch} does not divide the {args.pairs} pairs of a step")
    fields = {field.name for field in dataclasses.fields(DPOConfig)}
    wanted = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro_batch,
                  gradient_accumulation_steps=args.pairs // micro_batch, learning_rate=1e-6, bf16=True,
                  beta=0.1, loss_type="sigmoid", max_length=args.prompt_tokens + args.response_tokens,
                  max_prompt_length=args.prompt_tokens, max_completion_length=args.response_tokens,
                  precompute_ref_log_probs=True, precompute_ref_batch_size=micro_batch,
                  gradient_checkpointing=checkpointing, max_steps=args.steps, logging_steps=1, report_to="none",
                  save_strategy="no", seed=0, shuffle_dataset=False, lr_scheduler_type="constant",
                  warmup_ratio=0.0)
    config = DPOConfig(**{key: value for key, value in wanted.items() if key in fields})
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).cuda()
    trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[StepTimes()])
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()  # the reference pass runs first, inside train(): step 1's time includes it
    marks = [start, *times]
    step_times = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return {"checkpointing": checkpointing, "step_times_s": step_times,
            "step_s": statistics.median(step_times[1:] or step_times),
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
            "ignored_settings": sorted(set(wanted) - fields)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8, help="pairs per forward/backward")
    parser.add_argument("--checkpointing", choices=["auto", "both", "on", "off"], default="auto")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    modes = {"auto": [False, True], "both": [False, True], "on": [True], "off": [False]}[args.checkpointing]
    results = []
    for checkpointing in modes:
        if args.checkpointing == "auto" and any("step_s" in result for result in results):
            break  # it fit without checkpointing
        try:
            results.append(run(args, checkpointing))
        except torch.OutOfMemoryError as error:
            results.append({"checkpointing": checkpointing, "error": f"out of memory: {str(error).splitlines()[0]}"})
        gc.collect()
        torch.cuda.empty_cache()
        print(json.dumps(results[-1]), flush=True)
    finished = [result for result in results if "step_s" in result]
    best = min(finished, key=lambda result: result["step_s"]) if finished else None
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "best": best}, indent=1))
    if best is None:
        print("trl: every run failed")
        return 1
    print(f"trl: step {best['step_s']:.2f} s (checkpointing {'on' if best['checkpointing'] else 'off'}), "
          f"peak {best['peak_memory_gb']:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
