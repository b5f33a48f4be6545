"""TRL's GRPOTrainer on the standard workload, the competitor of ``reinforge bench train``.

    python3 benchmarks/trl_grpo.py --model-dir DIR [--steps 4] [--checkpointing both|on|off] [--json out.json]

The workload is reinforge's: 64 prompts of 128 tokens, 8 samples each, exactly 512 generated
tokens (EOS suppressed with ``min_new_tokens``), bf16, beta 0 (no reference model), no vLLM
(transformers ``generate``), one optimizer step per generation batch of 512 completions, AdamW
lr 1e-6. ``DIR`` is a model folder written by ``reinforge bench train`` (random Qwen2.5 weights
and the character tokenizer, so a 128-character prompt is 128 tokens). The step time is the
median time between optimizer steps 2.. . With ``--checkpointing both`` it runs once with
gradient checkpointing and once without, and the faster one counts (TRL's users pick it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

import torch


def run(model_dir: Path, steps: int, checkpointing: bool, micro_batch: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rng = random.Random(0)
    prompts = ["".join(rng.choice(string.ascii_letters) for _ in range(128)) for _ in range(64 * (steps + 1))]
    dataset = Dataset.from_dict({"prompt": prompts})

    def reward(completions, **kwargs):
        return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in completions]

    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            times.append(time.perf_counter())

    fields = {field.name for field in dataclasses.fields(GRPOConfig)}
    wanted = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro_batch,
                  gradient_accumulation_steps=512 // micro_batch, num_generations=8, generation_batch_size=512,
                  max_completion_length=512, max_prompt_length=128, beta=0.0, bf16=True, learning_rate=1e-6,
                  gradient_checkpointing=checkpointing, max_steps=steps, logging_steps=1, report_to="none",
                  use_vllm=False, temperature=1.0, save_strategy="no", seed=0, loss_type="dapo",
                  generation_kwargs={"min_new_tokens": 512}, shuffle_dataset=False)
    config = GRPOConfig(**{key: value for key, value in wanted.items() if key in fields})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimes()])
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
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
    parser.add_argument("--checkpointing", choices=["both", "on", "off"], default="both")
    parser.add_argument("--micro-batch", type=int, default=16, help="completions per forward/backward")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.checkpointing]
    results = []
    for checkpointing in modes:
        try:
            results.append(run(args.model_dir, args.steps, checkpointing, args.micro_batch))
        except torch.OutOfMemoryError as error:
            results.append({"checkpointing": checkpointing, "error": f"out of memory: {str(error).splitlines()[0]}"})
        torch.cuda.empty_cache()
        print(json.dumps(results[-1]), flush=True)
    finished = [result for result in results if "step_s" in result]
    best = min(finished, key=lambda result: result["step_s"]) if finished else None
    summary = {"runs": results, "best": best}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if best is None:
        print("trl: every run failed")
        return 1
    print(f"trl: step {best['step_s']:.2f} s (checkpointing {'on' if best['checkpointing'] else 'off'}), "
          f"peak {best['peak_memory_gb']:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
