"""``reinforge bench train``: full GRPO steps on the standard workload, timed phase by phase.

The workload: a model shape (``--model``: the Qwen2.5 sizes 0.5b|1.5b|3b|7b, or gemma2-2b, phi3-mini,
olmo2-1b, mistral-7b, olmoe-1b-7b, qwen3-30b-a3b of ``shapes.py``) with random weights (saved
once as an HF folder so the workers load it as they would any model), 64 prompts of 128 random
tokens, n=8 samples each, exactly 512 generated tokens (EOS ignored; ``--response-tokens``). A
step is what the RL trainer does: rollout, a cheap rule reward on token ids, GRPO advantages, one
on-policy optimizer step (beta = 0, AdamW lr 1e-6, grad clip 1, token-mean). ``--variant kl``
adds the reference model and a low-variance KL loss; ``--variant ppo`` adds the critic (values,
GAE, critic update); ``--lora RANK`` trains an adapter; ``--reward-model SIZE`` scores with a reward model of
that shape (random weights, one label) instead of the rule (its time and share of the step reported). Memory settings not given on the command
line are the memory planner's, as in a run (its plan is printed and saved with the results, with
the allocator's peak of each phase beside the estimate); ``--gpu-memory-gib`` plans for, and caps
the process at, a smaller card. Reported: the median of steps 2.. (the first compiles and warms
up) of step, rollout and update time, update tokens/s, MFU (the FLOPs the update computes,
``engine.perf.update_flops_per_token`` x tokens / time, against the datasheet's 989 TFLOP/s;
``mfu_measured_peak`` against the 799 TFLOP/s a bf16 matrix product reaches on an H200; both count the
tokens the model ran, ``mfu_workload_tokens`` all 512 x 640 of the workload, which is not MFU when
prompts are shared; a mixture of experts counts its active parameters; ``mfu_with_attention`` adds the
attention products, ``engine.perf``) and peak memory. Each step's rollout is set against its memory-bandwidth
floor (``floor.py``: the KV cache and weight bytes its decode steps must read, for the lengths it generated,
over ``--bandwidth-tbps``): ``rollout_floor_s`` and ``rollout_over_floor``; ``rollout_floor_roofline_s`` and
``rollout_over_roofline`` count each step's weight products at the longer of their reads and their FLOPs at
the matrix rate, which many live sequences make the bound. Long responses
(``--prompts 16 --response-tokens 16384``) take minutes a step: ``--deadline-s`` starts no step that would
end past it. ``--cpu`` runs a tiny model of the shape's family as a smoke test (no timing claims).

One size runs in this process. Several sizes (``--model 0.5b,1.5b,3b,7b``), ``--trl`` (TRL's GRPOTrainer
beside each) or ``--out DIR`` run every case in a process of its own and print one markdown table at the
end (``sizes.py``, ``table.py``). ``--profile`` prints the last step's update kernels (CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from reinforge.bench.floor import COPY_BYTES_PER_S, MATMUL_FLOPS_PER_S
from reinforge.bench.shapes import QWEN25_SIZES, SHAPES, shape_config
from reinforge.bench.table import write_json
from reinforge.config.schema import DECODE_PRODUCTS

QWEN25_SHAPES = {size: shape_config(size) for size in QWEN25_SIZES}
"""The Qwen2.5 architectures (random weights)."""
QWEN25_05B = QWEN25_SHAPES["0.5b"]


def write_model(folder: Path, tiny: bool, size: str = "0.5b") -> Path:
    """Shape ``size`` with random bf16 weights and the character tokenizer in ``folder/model``; ``tiny``: a tiny
    float32 model of the shape's family (``reinforge.models.tiny``), for the CPU smoke test."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from reinforge.models import build_char_tokenizer, save_tiny_model
    from reinforge.models.export import default_dtype

    family = SHAPES[size].family
    if SHAPES[size].vision:
        from reinforge.bench.vision import write_vision_model

        return write_vision_model(folder, tiny, size)
    if tiny:
        return save_tiny_model(folder / "model", arch=family)
    tokenizer = build_char_tokenizer()
    keys = {key: value for key, value in shape_config(size).items() if key != "model_type"}
    config = AutoConfig.for_model(family, **keys, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    if not SHAPES[size].weights_on_disk:  # the actor builds them on the device (reinforge.models.random_weights)
        from reinforge.models.random_weights import write_random_weights_folder

        return write_random_weights_folder(folder / "model", config, tokenizer, seed=0)
    check_disk_room(size, folder)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"), default_dtype(torch.bfloat16):
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    del model
    return folder / "model"


def write_reward_model(folder: Path, tiny: bool, size: str) -> Path:
    """A sequence-classification model (num_labels=1) of shape ``size`` with random bf16 weights and the character
    tokenizer in ``folder/reward_model``; ``tiny``: a tiny float32 one of the shape's family."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from reinforge.models import build_char_tokenizer, save_tiny_model
    from reinforge.models.export import default_dtype

    tokenizer = build_char_tokenizer()
    family = SHAPES[size].family
    if tiny:
        config = AutoConfig.from_pretrained(save_tiny_model(folder / "reward_model_shape", arch=family))
    else:
        keys = {key: value for key, value in shape_config(size).items() if key != "model_type"}
        config = AutoConfig.for_model(family, **keys, bos_token_id=None, eos_token_id=tokenizer.eos_token_id)
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    torch.manual_seed(1)
    with (torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu"),
          default_dtype(torch.float32 if tiny else torch.bfloat16)):
        model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(folder / "reward_model")
    tokenizer.save_pretrained(folder / "reward_model")
    del model
    return folder / "reward_model"


def check_disk_room(size: str, folder: Path) -> None:
    """Refuse in one line, before any weight is made, a shape whose bf16 weights the disk of ``folder`` cannot hold
    (mistral-7b's take 14 GiB)."""
    import shutil

    from reinforge.engine.memory_plan import GiB, ModelShape

    needed = 2 * ModelShape.from_hf_config(shape_config(size)).num_params * 1.02  # bf16, and the files' headers
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise SystemExit(f"the {size} model's random weights need {needed / GiB:.0f} GiB on disk but {folder} has "
                         f"{free / GiB:.0f} GiB free; point TMPDIR at a larger disk")


def build_config(model_dir: Path, args: argparse.Namespace):
    from reinforge.config.schema import Config

    config = Config()
    config.model.path = str(model_dir)
    if args.checkpointing is not None:
        config.model.gradient_checkpointing = args.checkpointing
    config.data.train_batch_size = args.prompts
    config.data.max_prompt_length = args.prompt_tokens
    if getattr(args, "vision_prompts", None) is not None:  # the letters, the image's tokens and the chat template's
        config.data.max_prompt_length = args.vision_prompts.prompt_length
        config.data.max_image_tokens = args.vision_prompts.image_tokens  # the planner counts these patches
    config.data.max_response_length = args.response_tokens
    config.rollout.name = args.rollout
    config.rollout.n = args.n
    config.rollout.kv_cache_dtype = getattr(args, "kv_cache_dtype", "auto")
    config.rollout.decode_products = getattr(args, "decode_products", "cublas")
    config.rollout.shared_prefix_decode = getattr(args, "shared_prefix_decode", "off") == "on"
    if args.keep_rollout_memory is not None:
        config.rollout.free_cache_engine = not args.keep_rollout_memory
    if args.micro_tokens is not None:
        config.actor.max_tokens_per_micro_batch = args.micro_tokens
    if args.optimizer_offload is not None:
        config.actor.optimizer_offload = args.optimizer_offload
    if getattr(args, "keep_gathered", None) is not None:
        config.actor.keep_gathered = args.keep_gathered
    config.trainer.gpu_memory_gib = args.gpu_memory_gib
    config.actor.optim.lr = 1e-6
    shape = SHAPES[args.model]
    rank, targets = shape.adapter(args.lora)  # --lora replaces the shape's own adapter rank
    if rank:
        config.model.lora.rank, config.model.lora.alpha = rank, 2 * rank
        config.model.lora.target_modules = list(targets)
        config.actor.optim.lr = 1e-5  # about 10x full fine-tuning's
    config.actor.grad_clip = 1.0
    config.actor.loss_agg_mode = "token-mean"
    config.trainer.device = "cpu" if args.cpu else "cuda"
    if args.variant == "kl":
        config.actor.use_kl_loss = True
        if args.ref_offload:
            config.ref.param_offload = True
    if args.variant == "ppo":
        config.algorithm.adv_estimator = "gae"
        config.algorithm.lam = 0.95
    if getattr(args, "reward_model_dir", None) is not None:
        config.reward.reward_model.enable = True
        config.reward.reward_model.model_path = str(args.reward_model_dir)
    return config


def prompt_batch(args: argparse.Namespace, vocab_size: int, step: int):
    import numpy as np

    from reinforge.protocol import Batch

    if getattr(args, "vision_prompts", None) is not None:  # an image and letters a prompt (bench/vision.py)
        return args.vision_prompts.batch(step)
    generator = torch.Generator().manual_seed(1000 + step)
    input_ids = torch.randint(0, vocab_size, (args.prompts, args.prompt_tokens), generator=generator)
    batch = Batch.from_dict(tensors={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)},
                            non_tensors={"uid": np.array([f"{step}-{i}" for i in range(args.prompts)], dtype=object)})
    return batch.repeat(args.n, interleave=True)


def rollout_sampling(args: argparse.Namespace):
    """One sample's parameters: temperature 1 (the config's rollout.temperature), exactly response_tokens tokens."""
    from reinforge.rollout.base import SamplingParams

    return SamplingParams(max_tokens=args.response_tokens, temperature=1.0, ignore_eos=True)


def rule_reward(batch) -> torch.Tensor:
    """Fraction of even token ids in the response, placed on its last token."""
    mask = batch["response_mask"]
    score = ((batch["responses"] % 2 == 0).float() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    scores = torch.zeros_like(mask)
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    scores[torch.arange(len(mask)), last] = score
    return scores


def scored_batch(args: argparse.Namespace, vocab_size: int, step: int, rollout):
    """A step's rollout with its prompts' uids and the rule reward (``token_level_scores``)."""
    batch = prompt_batch(args, vocab_size, step)
    batch.tensors.pop("input_ids")
    batch.tensors.pop("attention_mask")
    batch.non_tensors.pop("multi_modal_inputs", None)  # the rollout returns the images with its sequences
    batch = batch | rollout
    batch["token_level_scores"] = rule_reward(batch)
    return batch


def add_advantages(batch, args: argparse.Namespace, config) -> None:
    """``advantages`` and ``returns`` of the config's estimator (groups of n samples; values if present)."""
    from reinforge.algorithms import compute_advantages

    group_ids = torch.arange(args.prompts).repeat_interleave(args.n)
    batch["advantages"], batch["returns"] = compute_advantages(
        config.algorithm.adv_estimator, token_level_rewards=batch["token_level_scores"],
        response_mask=batch["response_mask"], group_ids=group_ids, config=config.algorithm,
        values=batch.get("values"))


def host_memory_gb() -> dict[str, float]:
    """The process's resident host memory now, in GiB, split as the kernel counts it (Linux; {} elsewhere):
    anonymous pages (the heap), shared ones (where CUDA's pinned host buffers show, such as offloaded
    weights) and file-backed ones (mmapped weight files: page cache the
    kernel can drop and read again)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {f"host_{name.lower()}_gb": int(fields[name].split()[0]) / 2**20
            for name in ("RssAnon", "RssFile", "RssShmem") if name in fields}


def run_variant(args: argparse.Namespace, model_dir: Path) -> dict:
    from reinforge.controller.worker import freeze_long_lived_objects
    from reinforge.engine.memory_plan import ModelShape
    from reinforge.models.architectures import text_config
    from reinforge.workers.actor_rollout import ActorRolloutWorker
    from reinforge.workers.critic import CriticWorker
    from reinforge.workers.memory_settings import apply_memory_plan
    from reinforge.workers.reference import ReferenceWorker
    from reinforge.workers.reward_model import RewardModelWorker

    if SHAPES[args.model].vision:
        from reinforge.bench.vision import VisionPrompts

        args.vision_prompts = VisionPrompts(model_dir, args)
    config = build_config(model_dir, args)
    plan = apply_memory_plan(config, log=False)  # as the trainer does, before any weight loads (printed below)
    if plan is not None:
        print(plan.table(), flush=True)
    actor = ActorRolloutWorker(config, args.steps)
    reference = None
    if args.variant == "kl":  # a LoRA actor is its own reference (adapters disabled), as in the trainer
        reference = actor if config.model.lora.rank else ReferenceWorker(config)
    critic = CriticWorker(config, args.steps) if args.variant == "ppo" else None
    reward_model = RewardModelWorker(config) if config.reward.reward_model.enable else None
    freeze_long_lived_objects()  # as the trainer's worker construction does
    device = actor.device
    vocab_size = text_config(actor.model.config).vocab_size  # a vision-language model's is its text config's
    model_shape = ModelShape.from_model_path(str(model_dir))
    rows: list[dict] = []
    phase_keys: set[str] = set()  # the row keys of the rollout's timed phases, apart from its other figures
    stopped_early = False
    for step in range(args.steps):
        if rows and past_deadline(args, rows[-1]["step_s"] - rows[-1]["compile_s"]):
            print(f"stopping after {len(rows)} of {args.steps} steps: one more would end past --deadline-s "
                  f"{args.deadline_s:g}", flush=True)
            stopped_early = True
            break
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timing: dict[str, float] = {}

        def timed(name, fn, *fn_args, timing=timing):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            result = fn(*fn_args)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timing[name] = time.perf_counter() - start
            return result

        step_start, compiled_before = time.perf_counter(), compile_seconds()
        generated = timed("rollout", actor.generate, prompt_batch(args, vocab_size, step), rollout_sampling(args), step)
        phase_peaks, host = {}, host_memory_gb()  # sampled at the rollout's end and the step's end
        if device.type == "cuda":
            phase_peaks["rollout_peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        rollout_phases = {key.removeprefix("timing_s/gen/"): value
                          for key, value in generated.meta.get("rollout_metrics", {}).items()
                          if key.startswith("timing_s/gen/")
                          or key in ("rollout/cuda_graph_capture_s", "rollout/vision_encode_s")}
        batch = scored_batch(args, vocab_size, step, generated)
        if reward_model is not None:  # its score replaces the rule's, as in a run (reward.combine.mode=replace)
            scored = timed("reward_model", reward_model.compute_rm_score, batch)
            batch["token_level_scores"] = scored["rm_scores"]
            if device.type == "cuda":
                phase_peaks["reward_model_peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
                torch.cuda.reset_peak_memory_stats(device)
        if reference is not None:
            batch = batch | timed("ref", reference.compute_ref_log_prob, batch)
        if critic is not None:
            batch = batch | timed("values", critic.compute_values, batch)
        add_advantages(batch, args, config)
        if critic is not None:
            critic_metrics = timed("update_critic", critic.update_critic, batch)
        update = actor.update_actor
        if args.profile and step == args.steps - 1:  # the last step's update, its time inflated by the profiler
            update = profiled(update, args.json)
        metrics = timed("update_actor", update, batch)
        step_time = time.perf_counter() - step_start
        at_end = host_memory_gb()
        host = {key: max(value, at_end.get(key, 0.0)) for key, value in host.items()}
        tokens = float(batch["attention_mask"].sum())
        computed = metrics.get("perf/computed_tokens/actor", tokens)
        mfu = metrics.get("perf/mfu/actor")
        floor = measured_floor(model_shape, batch, config, args)
        row = {"step": step + 1, "step_s": step_time, **{f"{k}_s": v for k, v in timing.items()},
               "compile_s": compile_seconds() - compiled_before,
               "update_tokens": tokens, "computed_tokens": computed,
               "update_tokens_per_s": tokens / timing["update_actor"], "mfu": mfu,
               "mfu_workload_tokens": mfu * tokens / computed if mfu is not None else None,
               "mfu_measured_peak": metrics.get("perf/mfu_measured_peak/actor"),
               "mfu_with_attention": metrics.get("perf/mfu_with_attention/actor"),
               **floor.as_dict(), "rollout_over_floor": timing["rollout"] / floor.seconds if floor.seconds else None,
               "rollout_over_roofline": timing["rollout"] / floor.roofline_seconds if floor.roofline_seconds else None,
               "response_tokens": float(batch["response_mask"].sum()),
               "pg_loss": metrics.get("actor/pg_loss"), "grad_norm": metrics.get("actor/grad_norm"),
               "kl_loss": metrics.get("actor/kl_loss"),
               **{key.removeprefix("training/"): value for key, value in metrics.items()  # rollout vs trainer
                  if key.startswith("training/rollout_")},
               **{f"moe_{key.removeprefix('actor/moe/')}": value for key, value in metrics.items()
                  if key.startswith("actor/moe/")},
               **{f"rollout_{name.removeprefix('rollout/')}": value for name, value in rollout_phases.items()}, **host}
        phase_keys |= {f"rollout_{name.removeprefix('rollout/')}" for name in rollout_phases}
        if critic is not None:
            row["vf_loss"] = critic_metrics.get("critic/vf_loss")
        if reward_model is not None:
            row["reward_model_share"] = timing["reward_model"] / step_time
        if device.type == "cuda":
            phase_peaks["update_peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            row |= phase_peaks
            row["peak_memory_gb"] = max(phase_peaks.values())
            stats = torch.cuda.memory_stats(device)
            # the allocator at its limit: each retry frees every cached block (synchronizing) and asks the
            # device again, slow enough to dominate a step; reserved beyond allocated is fragmentation
            row["alloc_retries"] = float(stats.get("num_alloc_retries", 0))
            row["reserved_peak_gb"] = stats.get("reserved_bytes.all.peak", 0) / 2**30
        rows.append(row)
        print(json.dumps({"variant": args.variant, **row}), flush=True)
    measured = measured_steps(rows, args.steps if args.profile else None)
    if [row["step"] for row in measured] == [1]:
        print("the medians are of step 1 alone, which compiles and captures graphs: no steady step (give --steps 2 "
              "or more)", flush=True)
    left_out = [row["step"] for row in rows[1:] if row not in measured]
    if left_out:
        print(f"medians over steps {', '.join(str(row['step']) for row in measured)}; left out step(s) "
              f"{', '.join(map(str, left_out))} (profiled, or compiled again for more than {RECOMPILE_S:.0f} s)",
              flush=True)
    summary = {key: statistics.median(r[key] for r in measured) for key in rows[0]
               if all(isinstance(r.get(key), float) for r in measured)}
    for key in ("peak_memory_gb", "rollout_peak_gb", "reward_model_peak_gb", "update_peak_gb", "host_rssanon_gb", "host_rssfile_gb",
                "host_rssshmem_gb"):
        summary[key] = max((r.get(key) or 0.0) for r in rows)
    # the process's peak resident host memory (pinned buffers included), in GiB: what a host's RAM must hold
    summary["host_peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result = {"variant": args.variant, "steps": rows, "median": summary,
              "median_steps": [row["step"] for row in measured], "rollout_phase_keys": sorted(phase_keys),
              "shape": shape_summary(args, model_dir, config),
              "floor": {"bandwidth_tbps": args.bandwidth_tbps, **floor_dtypes(config, args)}}
    if stopped_early:
        result["stopped_at_deadline"] = True
    if plan is not None:
        result["plan"] = {"table": plan.table(), "settings": vars(plan.settings),
                          "estimated_gb": {phase: sum(items.values()) / 2**30 for phase, items in plan.phases.items()},
                          "consumers_gb": {phase: {k: v / 2**30 for k, v in items.items()}
                                           for phase, items in plan.phases.items()}}
    return result


RECOMPILE_S = 1.0
"""A step after the first that spent longer than this compiling (a graph torch.compile made again) is no steady step."""


def measured_steps(rows: list[dict], profiled_step: int | None) -> list[dict]:
    """The steps the medians are taken over: the steady ones. Those after the first (which compiles), less the one
    whose update ran under the profiler (its time inflated) and any that compiled again for longer than
    ``RECOMPILE_S`` (each row's ``compile_s``), unless nothing else is left."""
    kept = [row for row in rows[1:] if row["step"] != profiled_step and (row.get("compile_s") or 0.0) <= RECOMPILE_S]
    return kept or rows[1:] or rows


def compile_seconds() -> float:
    """Seconds this process has spent compiling frames with torch.compile (dynamo, AOTAutograd and inductor); 0 where
    torch keeps no such clock."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))


def past_deadline(args: argparse.Namespace, last_step_s: float) -> bool:
    """Whether a step as long as the last one (less what it spent compiling, which the next does not repeat) would
    end past the single case's ``--deadline-s``."""
    deadline = getattr(args, "deadline_at", None)
    return deadline is not None and time.monotonic() + last_step_s > deadline


def floor_dtypes(config, args: argparse.Namespace) -> dict:
    """What the floor counts by: the rollout's KV cache dtype (auto: the compute dtype; fp8: a byte a value and
    a float32 scale per token and KV head) and the compute dtype's bytes a value (float32 on the CPU)."""
    return {"kv_cache_dtype": str(getattr(config.rollout, "kv_cache_dtype", "auto")), "value_bytes": 4 if args.cpu else 2}


def measured_floor(model_shape, batch, config, args: argparse.Namespace):
    """The rollout's bandwidth floor (``floor.py``) for the prompt and response lengths this step generated."""
    from reinforge.bench.floor import rollout_floor
    from reinforge.engine.micro_batches import sequence_extents
    from reinforge.rollout.native.engine import BLOCK_SIZE

    prompt_lengths, response_lengths = sequence_extents(batch)
    groups = None
    if config.rollout.name == "native" and config.rollout.shared_prefix_decode and "uid" in batch:
        groups = [str(uid) for uid in batch["uid"]]  # a prompt's samples read its blocks once a step
    return rollout_floor(model_shape, prompt_lengths.tolist(), response_lengths.tolist(),
                         **floor_dtypes(config, args), bytes_per_s=args.bandwidth_tbps * 1e12, groups=groups,
                         page=BLOCK_SIZE)


def shape_summary(args: argparse.Namespace, model_dir: Path, config) -> dict:
    """The case's family, training (full or LoRA rN) and total and active parameters (from its config.json)."""
    from reinforge.engine.memory_plan import ModelShape

    sizes = ModelShape.from_model_path(str(model_dir))
    rank = config.model.lora.rank
    return {"name": args.model, "family": SHAPES[args.model].family, "training": f"LoRA r{rank}" if rank else "full",
            "params": sizes.num_params, "active_params": sizes.num_active_params}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reinforge bench train", description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=["grpo", "kl", "ppo"], default="grpo")
    parser.add_argument("--steps", type=_positive_int, default=6)
    parser.add_argument("--prompts", type=_positive_int, default=64)
    parser.add_argument("--n", type=_positive_int, default=8)
    parser.add_argument("--prompt-tokens", type=_positive_int, default=128)
    parser.add_argument("--response-tokens", type=_positive_int, default=512)
    parser.add_argument("--model", type=_sizes, default=["0.5b"], metavar="SIZE[,SIZE...]",
                        help=f"model shape(s), random weights (reinforge.bench.shapes): {', '.join(SHAPES)}; "
                             "several run one after another, each in a process of its own, with one table at the end")
    parser.add_argument("--trl", action="store_true",
                        help="also run TRL's GRPOTrainer on each size's workload (benchmarks/trl_grpo.py of a source "
                             "checkout), in a process of its own, and compare")
    parser.add_argument("--trl-checkpointing", choices=["auto", "both", "on", "off"], default="auto",
                        help="TRL's gradient checkpointing with --trl (auto: off, then on if off runs out of memory; "
                             "on skips the try without it where that is known not to fit)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="write each case's JSON into DIR (with several sizes or --trl: bench_out by default; "
                             "`reinforge bench table DIR` prints their table again)")
    parser.add_argument("--deadline-s", type=_positive_seconds, default=None, metavar="S",
                        help="stop within S seconds of the start: no step starts that would end past it (the steps "
                             "done are reported); with several sizes, --trl or --out each case gets the time left, "
                             "a case that cannot start in time is skipped and one that overruns is ended, and the "
                             "table says so")
    parser.add_argument("--bandwidth-tbps", type=_positive_rate, default=COPY_BYTES_PER_S / 1e12, metavar="TB/S",
                        help="the device memory rate the rollout's bandwidth floor divides by (default: what a "
                             "device copy reached on an H200, reinforge.bench.floor)")
    parser.add_argument("--lora", type=_rank, default=0, metavar="RANK", help="train a LoRA adapter of this rank")
    parser.add_argument("--gpu-memory-gib", type=_positive_gib, default=None,
                        help="plan for and cap the process at this much GPU memory (stands in for smaller cards)")
    parser.add_argument("--micro-tokens", type=_positive_int, default=None,
                        help="token budget of one micro-batch (default: the memory planner's)")
    parser.add_argument("--rollout", choices=["native", "hf"], default=None,
                        help="the rollout engine (default: native; with --cpu, transformers' generate (hf) unless "
                             "--kv-cache-dtype fp8)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the native engine's KV cache: auto (the model dtype) or fp8 (rollout.kv_cache_dtype)")
    parser.add_argument("--decode-products", choices=DECODE_PRODUCTS, default="cublas",
                        help="what runs the native engine's decode-step products (rollout.decode_products)")
    parser.add_argument("--shared-prefix-decode", choices=["on", "off"], default="off",
                        help="whether a decode step reads a prompt's blocks once for its samples "
                             "(rollout.shared_prefix_decode)")
    parser.add_argument("--checkpointing", type=_checkpointing, default=None, metavar="all|none|K",
                        help="activation checkpointing of all, none or the first K layers (default: the planner's)")
    parser.add_argument("--optimizer-offload", type=_flag, default=None, metavar="true|false",
                        help="optimizer state on the CPU (default: the planner's)")
    parser.add_argument("--keep-gathered", type=_flag, default=None, metavar="true|false",
                        help="keep each layer gathered through a mini-batch of the update (actor.keep_gathered; "
                             "default: the planner's)")
    parser.add_argument("--keep-rollout-memory", type=_flag, default=None, metavar="true|false",
                        help="keep the native engine's KV cache, weight copy and CUDA graphs between rollouts "
                             "(rollout.free_cache_engine=false)")
    parser.add_argument("--ref-offload", action="store_true", help="reference weights on the CPU (kl variant)")
    parser.add_argument("--reward-model", type=_reward_model_size, default=None, metavar="SIZE",
                        help="score with a reward model of this shape (random weights) instead of the rule reward")
    parser.add_argument("--profile", action="store_true",
                        help="CUDA: run the last step's update under torch.profiler and print its kernels by "
                             "device time (one size, in this process)")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a model folder written earlier")
    parser.add_argument("--json", type=Path, default=None, help="write the results here (one size)")
    parser.add_argument("--cpu", action="store_true", help="tiny model on the CPU, a smoke test")
    return parser


RUN_OPTIONS = ("model", "trl", "trl_checkpointing", "out", "deadline_s", "model_dir", "json", "profile", "help")
"""Options of the invocation rather than of one case: they are not passed on to each size's process."""


def profiled(function, json_path: Path | None):
    """``function`` run under ``torch.profiler``: its kernels by device time are printed (and written beside the
    results, ``*.profile.txt``, when they are written)."""
    from torch.profiler import ProfilerActivity, profile

    def run(*arguments):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            result = function(*arguments)
            torch.cuda.synchronize()
        table = profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=80)
        print(f"the last step's update under torch.profiler, by self device time:\n{table}", flush=True)
        if json_path is not None:
            json_path.with_suffix(".profile.txt").write_text(table)
        return result

    return run


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.sizes, args.model = args.model, args.model[0]
    args.case_options = case_options(parser, args)
    several = len(args.sizes) > 1 or args.trl or args.out is not None
    if several and args.model_dir is not None and len(args.sizes) > 1:
        parser.error("--model-dir names the folder of one size; give one --model size with it")
    if several and args.json is not None:
        parser.error("--json writes one size's results; with several sizes, --trl or --out give --out DIR instead")
    if args.json is not None and not args.json.parent.is_dir():  # found out before the run, not after it
        parser.error(f"--json {args.json}: its folder {args.json.parent} does not exist; create it or give a path "
                     "in an existing folder")
    if args.profile and several:
        parser.error("--profile profiles one size in this process; give one --model size and no --trl or --out")
    if args.trl and (args.variant != "grpo" or args.cpu or args.reward_model is not None):
        parser.error("--trl compares the grpo variant with the rule reward on a GPU (TRL's GRPOTrainer); drop --trl, "
                     "or --variant / --reward-model / --cpu")
    native_only = [flag for flag, given in (("--kv-cache-dtype", args.kv_cache_dtype != "auto"),
                                            ("--shared-prefix-decode", args.shared_prefix_decode != "off"),
                                            ("--decode-products", args.decode_products != "cublas")) if given]
    if args.rollout == "hf" and native_only:  # the floor would count a cache generate never kept
        parser.error(f"{' and '.join(native_only)} {'set' if len(native_only) > 1 else 'sets'} the native engine, and "
                     "--rollout hf runs transformers' generate; drop them or --rollout hf")
    if args.trl_checkpointing != "auto" and not args.trl:
        parser.error(f"--trl-checkpointing {args.trl_checkpointing} sets TRL's checkpointing; it needs --trl")
    if args.cpu:  # a tiny workload, except where the command line asked for one of its sizes
        for key, small in (("prompts", 2), ("n", 2), ("prompt_tokens", 8), ("response_tokens", 8)):
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, small)
        # transformers' generate keeps no fp8 cache: --kv-cache-dtype fp8 needs the native engine (its PyTorch path)
        if args.rollout is None:
            args.rollout = "native" if native_only else "hf"
        args.steps = min(args.steps, 2)
    args.rollout = args.rollout or "native"
    return args


def case_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The command-line options of one case (those given that differ from their defaults), as text again."""
    options = []
    for action in parser._actions:
        if action.dest in RUN_OPTIONS or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            options.append(flag)
        elif action.dest == "checkpointing":
            options += [flag, "all" if value is True else "none" if value is False else str(value)]
        elif isinstance(value, bool):
            options += [flag, str(value).lower()]
        elif isinstance(value, float):
            options += [flag, f"{value:g}"]
        else:
            options += [flag, str(value)]
    return options


def _sizes(text: str) -> list[str]:
    """The shapes of a comma-separated ``--model``, each once; an empty or unknown name is refused."""
    sizes = [size.strip().lower() for size in text.split(",")]
    if not all(sizes):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty name between or beside its commas; give one or more "
                                         f"of {','.join(SHAPES)}, separated by single commas")
    unknown = [size for size in sizes if size not in SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"{text!r} names no model shape{'s' if len(unknown) > 1 else ''} "
                                         f"{', '.join(unknown)}; give one or more of {','.join(SHAPES)}")
    return list(dict.fromkeys(sizes))


def _reward_model_size(text: str) -> str:
    size = text.strip().lower()
    if size not in SHAPES:
        raise argparse.ArgumentTypeError(f"unknown reward model shape {text!r}; use one of {', '.join(SHAPES)}")
    return size


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} s leaves no time; give a positive number of seconds, e.g. 570")
    if value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} s is no deadline; leave --deadline-s out to run every step")
    return value


def _positive_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate in TB/s") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} TB/s is no device's rate; give a positive one, e.g. 4.19")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _rank(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text} is no LoRA rank; give 0 (no LoRA) or a positive rank, e.g. 32") \
            from None


def _positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in GiB; give a positive size, e.g. 80") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} GiB is no device; give a positive size, e.g. 80")
    return value


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() == "true"


def _checkpointing(text: str) -> bool | int:
    """all (True), none (False) or a count of layers from the first (0 or more)."""
    if text in ("all", "none"):
        return text == "all"
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is no checkpointing setting; give all, none or a number of "
                                         "layers (0 or more), e.g. 8")
    return value


def bench_train_main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.deadline_s is not None:
        args.deadline_at = time.monotonic() + args.deadline_s
    if len(args.sizes) > 1 or args.trl or args.out is not None:
        from reinforge.bench.sizes import run_sizes

        return run_sizes(args, argv)
    if args.profile and (args.cpu or not torch.cuda.is_available()):
        print("reinforge bench train --profile needs a CUDA device (it times kernels); drop --profile or --cpu",
              file=sys.stderr)
        return 2
    if not args.cpu and not torch.cuda.is_available():
        print("reinforge bench train needs a CUDA device; pass --cpu for a smoke test on a tiny model", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or write_model(Path(scratch), tiny=args.cpu, size=args.model)
        if args.reward_model is not None:
            args.reward_model_dir = write_reward_model(Path(scratch), tiny=args.cpu, size=args.reward_model)
        result = run_variant(args, model_dir)
    result["settings"] = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
                          if isinstance(value, str | int | float | bool | list | Path | None)}  # the options, not
    # the objects a run keeps on them (a vision-language shape's prompts)
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else "cpu"
    result["torch"] = torch.__version__
    if result["device"] != "cpu":
        result["alloc_conf"] = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        try:  # what the allocator really runs with (an unknown or misspelt setting is ignored by it)
            result["expandable_segments"] = torch.cuda.memory._snapshot()["allocator_settings"]["expandable_segments"]
        except (KeyError, TypeError, RuntimeError, AttributeError):
            pass
    if args.json is not None:
        write_json(args.json, result)
    print_summary(result, args)
    return 0


def print_summary(result: dict, args: argparse.Namespace) -> None:
    """The run's closing lines, from its medians: the step, the reward model's and vision tower's parts, the
    rollout's bandwidth floor, its timed phases (seconds) and its other figures (the floor's, its probabilities
    against the trainer's, its peak), at three significant digits (a tiny model's floor and differences are tiny)."""
    median = result["median"]
    print(f"{args.variant}: step {median.get('step_s', 0):.2f} s, rollout {median.get('rollout_s', 0):.2f} s, "
          f"update {median.get('update_actor_s', 0):.2f} s, {median.get('update_tokens_per_s', 0):.0f} tok/s, "
          f"MFU {median.get('mfu') or 0:.3f} ({median.get('mfu_with_attention') or 0:.3f} with attention), "
          f"peak {median.get('peak_memory_gb', 0):.1f} GiB, "
          f"host peak {median.get('host_peak_gb', 0):.1f} GiB (at phase ends: anonymous "
          f"{median.get('host_rssanon_gb', 0):.1f}, shared/pinned {median.get('host_rssshmem_gb', 0):.1f}, "
          f"file-backed {median.get('host_rssfile_gb', 0):.1f})")
    figures = {key: value for key, value in median.items() if key.startswith("rollout_") and key != "rollout_s"}
    phases = {key: figures.pop(key) for key in list(figures) if key in result.get("rollout_phase_keys", ())}
    if "reward_model_s" in median:
        print(f"  reward model ({args.reward_model}): {median['reward_model_s']:.2f} s, "
              f"{median.get('reward_model_share', 0):.1%} of the step, "
              f"peak {median.get('reward_model_peak_gb', 0):.1f} GiB while it scores")
    if "rollout_vision_encode_s" in median:  # a vision-language shape: the vision tower's part of the step
        print(f"  vision encoder {median['rollout_vision_encode_s']:.2f} s, "
              f"{median['rollout_vision_encode_s'] / median['step_s']:.1%} of the step; rollout "
              f"{median.get('response_tokens', 0) / median.get('rollout_s', 1):.0f} generated tokens/s")
    if median.get("rollout_floor_s"):  # three significant digits: a tiny model's floor is microseconds
        print(f"  rollout bandwidth floor {median['rollout_floor_s']:.3g} s over "
              f"{median['rollout_floor_decode_steps']:.0f} decode steps at {args.bandwidth_tbps:g} TB/s "
              f"(KV {median['rollout_floor_kv_gb']:.3g} GB as {getattr(args, 'kv_cache_dtype', 'auto')}, weights "
              f"{median['rollout_floor_weight_gb']:.3g} GB read); rollout / floor {median.get('rollout_over_floor') or 0:.3g}")
        if median.get("rollout_floor_roofline_s", 0) > median["rollout_floor_s"] * 1.01:
            print(f"  with the products' {median['rollout_floor_product_tflop']:.3g} TFLOP at "
                  f"{MATMUL_FLOPS_PER_S / 1e12:.0f} TFLOP/s where they take longer than their weight reads: "
                  f"{median['rollout_floor_roofline_s']:.3g} s; rollout / that {median.get('rollout_over_roofline') or 0:.3g}")
    for heading, shown in (("rollout phases (medians, s)", phases), ("rollout figures (medians)", figures)):
        if shown:  # the figures: the floor's, the rollout's probabilities against the trainer's, its peak
            print(f"  {heading}: " + ", ".join(f"{key.removeprefix('rollout_')} {value:.3g}"
                                               for key, value in shown.items()))
