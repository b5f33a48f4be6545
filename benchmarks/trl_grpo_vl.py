"""TRL's GRPOTrainer on the vision-language workload, the competitor of ``reinforge bench train --model qwen2.5-vl-3b``.

    python3 benchmarks/trl_grpo_vl.py --model-dir DIR [--steps 4] [--checkpointing auto|both|on|off]
                                      [--deadline-s S] [--cpu] [--json out.json]

``reinforge bench train --model qwen2.5-vl-3b --trl`` runs it beside reinforge's case, on the same model folder
(random Qwen2.5-VL-3B weights and the processor ``reinforge.bench.vision`` writes) and workload: 64 prompts, each
one user turn of one random 448 x 448 image and 128 random letters (``reinforge.bench.vision.prompt_images``),
8 samples each, exactly 512 generated tokens (EOS suppressed with ``min_new_tokens``; ``--prompts``, ``--n``,
``--prompt-tokens`` and ``--response-tokens`` change them as they do for ``bench train``). TRL takes the
images as the dataset's ``image`` column beside conversational prompts, applies the processor's chat template
and generates with transformers' ``generate`` (no vLLM); bf16, beta 0, one optimizer step per generation batch
of all completions, AdamW lr 1e-6, the vision tower frozen as reinforge's is by default (``actor.freeze_vision_tower``;
``--train-vision-tower`` trains it, TRL's own default). The dataset's images are decoded by 8 loader processes
(``--loader-workers``): transformers' Trainer fetches a batch for each gradient-accumulation micro-step and TRL's
loader returns the whole generation batch each time, so one process alone decodes 32 x 512 images a step and
leaves the GPU idle for most of it. The step time is the median time between optimizer steps 2.. ; checkpointing tries and ``--deadline-s``: ``trl_runs.py``. ``--cpu``
runs the same setup on the CPU in float32 on a tiny model folder (``bench train --model qwen2.5-vl-3b --cpu``'s),
a smoke test.
"""

from __future__ import annotations

import argparse
import os
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


def run(clock: Clock, checkpointing: bool, workload: argparse.Namespace) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText
    from trl import GRPOConfig, GRPOTrainer

    from reinforge.bench.vision import IMAGE_SIDE, TINY_IMAGE_SIDE, prompt_images
    from reinforge.models.vision import load_processor

    side = TINY_IMAGE_SIDE if clock.cpu else IMAGE_SIDE
    images, texts = prompt_images(workload.prompts * (workload.steps + 1), workload.prompt_tokens, side, seed=0)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": text}] for text in texts], "image": images})
    clock.phase("dataset built")
    completions = workload.prompts * workload.n

    def reward(completions, **kwargs):
        texts = [completion[-1]["content"] if isinstance(completion, list) else completion
                 for completion in completions]
        texts = [text if isinstance(text, str) else str(text) for text in texts]
        return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in texts]

    micro_batch = min(workload.micro_batch, completions)
    if completions % micro_batch:
        raise SystemExit(f"--micro-batch {micro_batch} does not divide the {completions} completions of a step")
    wanted = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro_batch,
                  gradient_accumulation_steps=completions // micro_batch, num_generations=workload.n,
                  generation_batch_size=completions, max_completion_length=workload.response_tokens,
                  beta=0.0, bf16=not clock.cpu, use_cpu=clock.cpu, learning_rate=1e-6,
                  gradient_checkpointing=checkpointing, max_steps=workload.steps, logging_steps=1, report_to="none",
                  use_vllm=False, temperature=1.0, save_strategy="no", seed=0, loss_type="dapo",
                  generation_kwargs={"min_new_tokens": workload.response_tokens}, shuffle_dataset=False,
                  log_completions=False, dataloader_num_workers=workload.loader_workers,
                  dataloader_persistent_workers=workload.loader_workers > 0)
    settings, ignored = known_settings(GRPOConfig, wanted)
    config = GRPOConfig(**settings)
    processor = load_processor(workload.model_dir)
    if getattr(processor, "chat_template", None) is None:
        processor.chat_template = processor.tokenizer.chat_template
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(workload.model_dir,
                                                        dtype=torch.float32 if clock.cpu else torch.bfloat16,
                                                        use_kernels=False)  # no Hub kernels: trl_grpo.py says why
    model = model.to("cpu" if clock.cpu else "cuda")
    if not workload.train_vision_tower:
        model.model.visual.requires_grad_(False)
    clock.phase("model loaded")
    callback, times = step_clock(clock)
    time_generation(clock)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=processor, callbacks=[callback])
    start = clock.phase("trainer built")
    reset_peak_memory(clock)
    trainer.train()
    return step_record(clock, checkpointing, start, times, ignored)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grpo_workload_options(parser, prompt_tokens_help="random letters beside each prompt's image")
    parser.add_argument("--train-vision-tower", action="store_true",
                        help="train the vision tower too (reinforge: actor.freeze_vision_tower=false)")
    parser.add_argument("--loader-workers", type=int, default=None,
                        help="processes decoding the dataset's images (transformers' dataloader_num_workers; "
                             "default: 8 on a GPU, at most the CPU count, 0 with --cpu)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.loader_workers is None:
        args.loader_workers = 0 if args.cpu else min(8, os.cpu_count() or 1)
    if args.gpu_memory_gib is not None and not args.cpu:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * 2**30 / total))
    clock = Clock(args.deadline_s, args.cpu)
    return run_modes(args, clock, lambda checkpointing: run(clock, checkpointing, args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
