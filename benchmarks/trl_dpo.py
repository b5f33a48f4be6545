"""TRL's DPOTrainer on the DPO workload, the competitor of ``reinforge bench dpo``.

    python3 benchmarks/trl_dpo.py --model-dir DIR [--steps 4] [--pairs 64] [--prompt-tokens 128]
                                  [--response-tokens 512] [--micro-batch 8] [--precompute-ref]
                                  [--checkpointing auto|both|on|off] [--deadline-s S] [--cpu] [--json out.json]

``reinforge bench dpo --trl`` runs it on the same model folder and workload: ``--pairs`` pairs a step of a
prompt of ``--prompt-tokens`` random letters and two completions of ``--response-tokens`` tokens (random
letters, then EOS), bf16, AdamW lr 1e-6, beta 0.1, the sigmoid loss, one optimizer step a batch of pairs
(``--micro-batch`` pairs a forward, gradient accumulation over the rest). TRL is set up as its users would for
speed: bf16, its defaults otherwise. So its reference model runs inside every step
(``precompute_ref_log_probs`` is off by default in TRL); ``--precompute-ref`` computes the reference log-probs
once, before training, as reinforge does (TRL then hashes the model's weights and scores every pair while the
trainer is built, which is timed apart as ``setup_s``). Padding-free batches are not offered: TRL 1.16 warns
and pads. ``DIR`` is a model folder written by ``reinforge bench`` (random weights and the character tokenizer,
so a letter is a token). Step times, checkpointing tries and ``--deadline-s``: ``trl_runs.py``. ``--cpu`` runs
the same setup on the CPU in float32, a smoke test on a tiny model.
"""

from __future__ import annotations

import argparse
import random
import string
import sys
import tempfile
from pathlib import Path

import torch
from trl_runs import Clock, add_run_options, known_settings, reset_peak_memory, run_modes, step_clock, step_record


def run(args: argparse.Namespace, clock: Clock, checkpointing: bool) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    rng = random.Random(0)

    def letters(count: int) -> str:
        return "".join(rng.choice(string.ascii_letters) for _ in range(count))

    rows = [{"prompt": letters(args.prompt_tokens), "chosen": letters(args.response_tokens - 1),
             "rejected": letters(args.response_tokens - 1)} for _ in range(args.pairs * args.steps)]
    dataset = Dataset.from_list(rows)
    micro_batch = min(args.micro_batch, args.pairs)
    if args.pairs % micro_batch:
        raise SystemExit(f"--micro-batch {micro_batch} does not divide the {args.pairs} pairs of a step")
    wanted = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro_batch,
                  gradient_accumulation_steps=args.pairs // micro_batch, learning_rate=1e-6, bf16=not args.cpu,
                  use_cpu=args.cpu, beta=0.1, loss_type="sigmoid", max_length=args.prompt_tokens + args.response_tokens,
                  precompute_ref_log_probs=args.precompute_ref, gradient_checkpointing=checkpointing,
                  max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", seed=0,
                  shuffle_dataset=False, lr_scheduler_type="constant", warmup_ratio=0.0)
    if args.precompute_ref:
        wanted["precompute_ref_batch_size"] = micro_batch
    settings, ignored = known_settings(DPOConfig, wanted)
    config = DPOConfig(**settings)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32 if args.cpu else torch.bfloat16,
                                                 use_kernels=False)  # no Hub kernels: trl_grpo.py says why
    model = model.to("cpu" if args.cpu else "cuda")
    built = clock.phase("model loaded")
    callback, times = step_clock(clock)
    # builds the reference model, or with --precompute-ref scores every pair by the policy
    trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[callback])
    start = clock.phase("trainer built (dataset tokenized, reference ready)")
    reset_peak_memory(clock)
    trainer.train()
    return step_record(clock, checkpointing, start, times, ignored, setup_s=start - built,
                       reference="precomputed" if args.precompute_ref else "in every step")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8, help="pairs per forward/backward")
    parser.add_argument("--precompute-ref", action="store_true",
                        help="reference log-probs computed once before training (TRL's default: in every step)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    clock = Clock(args.deadline_s, args.cpu)
    return run_modes(args, clock, lambda checkpointing: run(args, clock, checkpointing))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
