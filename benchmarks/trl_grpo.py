"""TRL's GRPOTrainer on the standard workload, the competitor of ``reinforge bench train``.

    python3 benchmarks/trl_grpo.py --model-dir DIR [--steps 4] [--checkpointing auto|both|on|off]
                                   [--deadline-s S] [--cpu] [--json out.json]

``reinforge bench train --model SIZES --trl`` runs it beside each size, on the same model folder and
workload. The workload is reinforge's: 64 prompts of 128 tokens, 8 samples each, exactly 512 generated
tokens (EOS suppressed with ``min_new_tokens``; ``--prompts``, ``--n``, ``--prompt-tokens`` and
``--response-tokens`` change them as they do for ``bench train``), bf16, beta 0 (no reference model), no
vLLM (transformers ``generate``), one optimizer step per generation batch of all completions, AdamW lr
1e-6 (``--lora-rank R``: a peft LoRA adapter of rank R, alpha 2R, on ``--lora-targets``, lr 1e-5).
``DIR`` is a model folder written by ``reinforge bench train`` (random weights of a bench shape and the
character tokenizer, so a 128-character prompt is 128 tokens; a folder of random weights without weight files,
``reinforge.models.random_weights``, is built on the device from its seed as reinforge builds it). The step
time is the median time between optimizer steps 2.. ; checkpointing tries and ``--deadline-s``: ``trl_runs.py``.
``--gpu-memory-gib`` caps the process as ``bench train``'s option does; ``--cpu`` runs the same setup on the CPU
in float32, a smoke test on a tiny model.
"""

from __future__ import annotations

import argparse
import random
import string
import sys
import tempfile

import torch
from trl_runs import (
    Clock,
    add_grpo_workload_options,
    add_run_options,
    known_settings,
    reset_peak_memory,
    run_modes,
    step_clock,
    step_record,
    time_generation,
)

from reinforge.models.random_weights import build_random_causal_lm, random_weights_seed


def run(clock: Clock, checkpointing: bool, workload: argparse.Namespace) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rng = random.Random(0)
    prompts = ["".join(rng.choice(string.ascii_letters) for _ in range(workload.prompt_tokens))
               for _ in range(workload.prompts * (workload.steps + 1))]
    completions = workload.prompts * workload.n
    dataset = Dataset.from_dict({"prompt": prompts})

    def reward(completions, **kwargs):
        return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in completions]

    micro_batch = min(workload.micro_batch, completions)
    if completions % micro_batch:
        raise SystemExit(f"--micro-batch {micro_batch} does not divide the {completions} completions of a step")
    wanted = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro_batch,
                  gradient_accumulation_steps=completions // micro_batch, num_generations=workload.n,
                  generation_batch_size=completions, max_completion_length=workload.response_tokens,
                  max_prompt_length=workload.prompt_tokens, beta=0.0, bf16=not clock.cpu, use_cpu=clock.cpu,
                  learning_rate=1e-6, gradient_checkpointing=checkpointing, max_steps=workload.steps, logging_steps=1,
                  report_to="none", use_vllm=False, temperature=1.0, save_strategy="no", seed=0, loss_type="dapo",
                  generation_kwargs={"min_new_tokens": workload.response_tokens}, shuffle_dataset=False)
    settings, ignored = known_settings(GRPOConfig, wanted)
    config = GRPOConfig(**settings)
    tokenizer = AutoTokenizer.from_pretrained(workload.model_dir)
    tokenizer.padding_side = "left"
    dtype, device = (torch.float32, "cpu") if clock.cpu else (torch.bfloat16, "cuda")
    if random_weights_seed(workload.model_dir) is not None:  # no weight files: built on the device, as reinforge does
        model = build_random_causal_lm(workload.model_dir, dtype=dtype, device=torch.device(device))
    else:
        # no Hub kernels (transformers 5.25 fetches them by default; the device has no network), as reinforge loads
        model = AutoModelForCausalLM.from_pretrained(workload.model_dir, dtype=dtype, use_kernels=False).to(device)
    clock.phase("model loaded")
    peft_config = None
    if workload.lora_rank:  # the adapter reinforge's shape trains: same rank, alpha 2 x rank, same projections
        from peft import LoraConfig

        peft_config = LoraConfig(r=workload.lora_rank, lora_alpha=2 * workload.lora_rank, lora_dropout=0.0,
                                 target_modules=workload.lora_targets.split(","), task_type="CAUSAL_LM")
        config.learning_rate = 1e-5  # reinforge's LoRA learning rate
    callback, times = step_clock(clock)
    time_generation(clock)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[callback],
                          **({"peft_config": peft_config} if peft_config is not None else {}))
    start = clock.phase("trainer built")
    reset_peak_memory(clock)
    trainer.train()
    return step_record(clock, checkpointing, start, times, ignored)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grpo_workload_options(parser)
    parser.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (peft)")
    parser.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj",
                        help="its projections, comma-separated")
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.gpu_memory_gib is not None and not args.cpu:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * 2**30 / total))
    clock = Clock(args.deadline_s, args.cpu)
    return run_modes(args, clock, lambda checkpointing: run(clock, checkpointing, args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
