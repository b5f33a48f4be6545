"""``reinforge bench modes``: sync against one_step_off against async training on one GPU, long-tailed workload.

The workload: the Qwen2.5-0.5B architecture with random weights (``reinforge.bench.train``),
64 prompts of 128 random tokens, 8 samples each; every sample's length is drawn between 64
and 4096 tokens from a long tail (64 x 64^(u^3), u uniform: median ~110, ~6% above 2048) and
generated with EOS ignored, so it is exactly that long. A cheap rule reward, GRPO advantages,
one optimizer step per 64 prompts (the decoupled PPO loss on stale batches, its proximal policy
recomputed by one more forward, or with ``--proximal loglinear`` interpolated). All three modes run
the same generation code (``modes.partial.run_segment``) with the native engine, its memory kept
between rollouts. The off-policy modes generate on a second, optimizer-less worker with its own
thread (trainer.separate_rollout; ``--shared-rollout`` uses the training worker's rollout copy
instead, taking turns), weights copied at each sync:

- sync: the training worker generates a whole batch, then updates;
- one_step_off: batch k+1 is generated (a thread submits it) while batch k is scored and
  trained, then the weights are synced;
- async: the Rollouter streams groups under max_staleness (default 1), segments of
  --segment-tokens with partial rollouts, a sync after every update.

On one GPU the rollout and the update share the device (their kernels interleave); whatever the
off-policy modes gain comes from filling the long tail: the device does not idle at small
decode batches while a few long samples finish. Reported per mode: wall time per 1,000 samples trained and the GPU-busy
fraction (``nvidia-smi`` utilization.gpu, the share of time a kernel ran, sampled every 50 ms),
over the measured updates after --warmup ones. ``--cpu`` runs a tiny model with short
lengths as a smoke test (no timing claims, no GPU-busy fraction).

    reinforge bench modes --json modes.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from reinforge.algorithms import compute_advantages
from reinforge.bench.gpu_busy import GpuBusy
from reinforge.bench.table import write_json
from reinforge.bench.train import rule_reward, write_model
from reinforge.config.schema import Config
from reinforge.controller import WorkerGroup
from reinforge.protocol import Batch
from reinforge.rollout.base import SamplingParams
from reinforge.trainer.dynamic_sampling import concat_generated
from reinforge.trainer.modes.decoupled import is_fresh, prepare_stale_batch
from reinforge.trainer.modes.device_turns import DeviceTurns
from reinforge.trainer.modes.partial import group_batch, groups_from_prompts, run_segment
from reinforge.trainer.modes.rollouter import Rollouter
from reinforge.trainer.modes.staleness import StalenessBound, staleness_metrics
from reinforge.workers.actor_rollout import ActorRolloutWorker, seed_for
from reinforge.workers.memory_settings import apply_memory_plan


def long_tail_length(rng: random.Random, low: int, high: int) -> int:
    """low x (high/low)^(u^3): most samples short, a few near ``high``."""
    return int(round(low * (high / low) ** (rng.random() ** 3)))


class PromptSource:
    """Batches of random prompts with per-sample length budgets; batch i is the same in every mode."""

    def __init__(self, args: argparse.Namespace, vocab_size: int):
        self.args, self.vocab_size, self.drawn = args, vocab_size, 0

    def __call__(self) -> Batch:
        args, index = self.args, self.drawn
        self.drawn += 1
        generator = torch.Generator().manual_seed(1000 + index)
        input_ids = torch.randint(0, self.vocab_size, (args.prompts, args.prompt_tokens), generator=generator)
        rng = random.Random(index)
        budgets = np.empty(args.prompts, dtype=object)
        for row in range(args.prompts):
            budgets[row] = [long_tail_length(rng, args.min_tokens, args.max_tokens) for _ in range(args.n)]
        return Batch.from_dict(tensors={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)},
                               non_tensors={"uid": [f"{index}-{row}" for row in range(args.prompts)],
                                            "sample_max_tokens": budgets})


def build_config(args: argparse.Namespace, model_dir: Path) -> Config:
    config = Config()
    config.model.path = str(model_dir)
    config.data.train_batch_size, config.data.max_prompt_length = args.prompts, args.prompt_tokens
    config.data.max_response_length = args.max_tokens
    config.rollout.name, config.rollout.n, config.rollout.free_cache_engine = args.rollout, args.n, False
    config.actor.max_tokens_per_micro_batch = max(args.micro_tokens, args.prompt_tokens + args.max_tokens)
    config.actor.optim.lr, config.actor.loss_agg_mode = 1e-6, "token-mean"
    config.trainer.device = "cpu" if args.cpu else "cuda"
    config.trainer.mode = "async"
    config.trainer.separate_rollout = not args.shared_rollout
    config.trainer.max_staleness, config.rollout.segment_tokens = args.max_staleness, args.segment_tokens
    config.trainer.proximal = args.proximal
    if not args.cpu:  # async holds up to (max_staleness + 1) batches of sequences in flight
        config.rollout.kv_cache_gib = args.kv_cache_gib
    plan = apply_memory_plan(config, log=False)  # the remaining auto settings, as the trainer does (printed below)
    if plan is not None:
        print(plan.table(), flush=True)
    return config


class Runner:
    def __init__(self, args: argparse.Namespace, config: Config, actor: WorkerGroup, rollout: WorkerGroup | None,
                 vocab_size: int):
        self.args, self.config, self.actor, self.rollout = args, config, actor, rollout
        self.sampling = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
        self.prompts = PromptSource(args, vocab_size)

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """Off-policy modes: the rollout worker (its own thread) or the training worker's rollout copy."""
        return (self.rollout or self.actor).generate(batch, sampling, 0)

    def sync_weights(self) -> None:
        if self.rollout is None:
            self.actor.sync_rollout_weights()
        else:
            self.rollout.load_rollout_weights(self.actor.rollout_weights()[0])

    def groups(self, prompts: Batch, first: int):
        return groups_from_prompts(prompts, first, self.args.n, lambda position, uid: seed_for(0, uid))

    def rollout_batch(self, prompts: Batch, version: int, generate=None) -> Batch:
        groups = self.groups(prompts, 0)
        run_segment(generate or self.generate, groups, self.sampling, self.args.max_tokens, version, 0)
        return concat_generated([group_batch(group, self.args.max_tokens, 0) for group in groups], 0)

    def train(self, batch: Batch, version: int, updates_since_sync: int, update_index: int) -> dict[str, float]:
        metrics = staleness_metrics(batch["token_versions"], batch["response_mask"], version)
        if "token_level_scores" not in batch:
            batch["token_level_scores"] = rule_reward(batch)
        if not is_fresh(batch, version, updates_since_sync):
            batch = prepare_stale_batch(self.config, batch, self.actor.compute_log_prob, update_index, metrics)
        group_ids = torch.arange(len(batch) // self.args.n).repeat_interleave(self.args.n)
        batch["advantages"], batch["returns"] = compute_advantages(
            "grpo", token_level_rewards=batch["token_level_scores"], response_mask=batch["response_mask"],
            group_ids=group_ids, config=self.config.algorithm)
        metrics |= self.actor.update_actor(batch)
        return metrics

    # ---- the modes: each returns one (end time, samples, metrics) per update ----------------
    def sync(self, updates: int):
        out = []
        for update in range(updates):
            if self.rollout is None:
                self.actor.sync_rollout_weights()  # the copy holds the current weights, as in sync mode
                batch = self.rollout_batch(self.prompts(), update)
            else:  # the training worker generates with its current weights
                batch = self.rollout_batch(self.prompts(), update, lambda b, p: self.actor.generate(b, p, 0))
            metrics = self.train(batch, update, 0, update)
            out.append((time.perf_counter(), len(batch), metrics))
        return out

    def one_step_off(self, updates: int):
        out, version = [], 0
        self.sync_weights()
        pending = self._in_thread(self.rollout_batch, self.prompts(), version)
        for update in range(updates):
            batch = pending()
            pending = self._in_thread(self.rollout_batch, self.prompts(), version)  # the weights before this update
            metrics = self.train(batch, version, 0, update)
            self.sync_weights()
            version += 1
            out.append((time.perf_counter(), len(batch), metrics))
        pending()
        return out

    def asynchronous(self, updates: int):
        self.sync_weights()
        turns = DeviceTurns()
        rollouter = Rollouter(next_prompts=self.prompts, generate=self.generate,
                              score=lambda batch: Batch.from_dict(tensors={"token_level_scores": rule_reward(batch)}),
                              seed_of=lambda position, uid: seed_for(0, uid),
                              bound=StalenessBound(self.args.max_staleness, self.args.prompts), sampling=self.sampling,
                              n=self.args.n, segment_tokens=self.args.segment_tokens, batch_size=self.args.prompts,
                              pad_token_id=0, turns=turns)
        out, waited = [], 0.0
        rollouter.start()
        try:
            for update in range(updates):
                wait_start = time.perf_counter()
                taken = rollouter.take(self.args.prompts)
                waited += time.perf_counter() - wait_start
                batch = concat_generated([rows for _, rows in taken], 0)
                version = rollouter.version
                with turns.trainer() if self.rollout is None else contextlib.nullcontext():
                    metrics = self.train(batch, version, 0, update)
                with turns.trainer():
                    self.sync_weights()
                    rollouter.set_version(version + 1)
                # running totals (the rollouter's idle time counts when its wait for a sync ends)
                metrics |= {"trainer_wait_s": waited, "rollouter_idle_s": rollouter.idle_s}
                out.append((time.perf_counter(), len(batch), metrics))
        finally:
            rollouter.stop()
        return out

    @staticmethod
    def _in_thread(function, *arguments):
        result: list = []
        thread = threading.Thread(target=lambda: result.append(function(*arguments)))
        thread.start()

        def wait():
            thread.join()
            return result[0]
        return wait


def measure(runner: Runner, mode: str, gpu: GpuBusy, args: argparse.Namespace) -> dict:
    runner.prompts.drawn = 0  # every mode sees the same prompts and lengths
    start = time.perf_counter()
    updates = {"sync": runner.sync, "one_step_off": runner.one_step_off, "async": runner.asynchronous}[mode](
        args.warmup + args.steps)
    measured_start = updates[args.warmup - 1][0] if args.warmup else start
    measured = updates[args.warmup:]
    end = measured[-1][0]
    samples = sum(count for _, count, _ in measured)
    staleness = [metrics.get("async/staleness_mean", 0.0) for _, _, metrics in measured]
    partial = [metrics.get("async/partial_fraction", 0.0) for _, _, metrics in measured]
    result = {"mode": mode, "updates": len(measured), "samples": samples, "wall_s": end - measured_start,
              "s_per_1000_samples": (end - measured_start) / samples * 1000, "gpu_busy": gpu.mean(measured_start, end),
              "staleness_mean": sum(staleness) / len(staleness), "partial_fraction": sum(partial) / len(partial),
              "total_s_with_warmup": end - start, "proximal": args.proximal if mode != "sync" else None}
    if mode == "async":  # who waited, over the measured span: the trainer for finished groups, the rollouter for a sync
        before = updates[args.warmup - 1][2] if args.warmup else {"trainer_wait_s": 0.0, "rollouter_idle_s": 0.0}
        after = measured[-1][2]
        for name in ("trainer_wait", "rollouter_idle"):
            result[f"{name}_fraction"] = min(1.0, (after[f"{name}_s"] - before[f"{name}_s"]) / (end - measured_start))
    print(json.dumps(result), flush=True)
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="reinforge bench modes",
                                     description="sync, one_step_off and async training on a long-tailed workload")
    parser.add_argument("--modes", default="sync,one_step_off,async")
    parser.add_argument("--steps", type=int, default=2, help="measured updates per mode")
    parser.add_argument("--warmup", type=int, default=1, help="updates before measuring (compilation, graphs)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--segment-tokens", type=int, default=512, help="async: partial-rollout segment")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--proximal", choices=["recompute", "loglinear"], default="recompute",
                        help="the off-policy modes' proximal policy (trainer.proximal): recompute runs one more forward "
                             "over each stale batch, loglinear interpolates instead")
    parser.add_argument("--micro-tokens", type=int, default=65536)
    parser.add_argument("--kv-cache-gib", type=float, default=16.0,
                        help="native engine KV cache of each worker (GPU); a batch needs ~3.3 GiB at full length")
    parser.add_argument("--rollout", choices=["native", "hf"], default="native")
    parser.add_argument("--shared-rollout", action="store_true",
                        help="off-policy modes generate on the training worker's rollout copy, taking turns with the "
                             "update (trainer.separate_rollout=false); by default a second worker generates on its "
                             "own thread, overlapping the update on the device")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--cpu", action="store_true", help="tiny model, short lengths: a smoke test")
    args = parser.parse_args(argv)
    if args.cpu:
        args.prompts, args.n, args.prompt_tokens, args.min_tokens, args.max_tokens = 2, 2, 8, 2, 16
        args.segment_tokens, args.rollout, args.micro_tokens = 4, "hf", 256
    if args.max_tokens % args.segment_tokens:
        parser.error(f"--segment-tokens={args.segment_tokens} must divide --max-tokens={args.max_tokens}")
    return args


def modes_main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("reinforge bench modes needs a CUDA device; pass --cpu for a smoke test on a tiny model", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or write_model(Path(scratch), tiny=args.cpu)
        config = build_config(args, model_dir)
        actor = WorkerGroup(ActorRolloutWorker, config, 1000, name="actor_rollout", backend="local")
        rollout = None if args.shared_rollout else WorkerGroup(
            ActorRolloutWorker, config, 1000, name="rollout", backend="local", init_kwargs={"rollout_only": True})
        gpu = GpuBusy()
        try:
            runner = Runner(args, config, actor, rollout, _vocab_size(model_dir))
            for mode in args.modes.split(","):
                results.append(measure(runner, mode, gpu, args))
        finally:
            gpu.close()
            actor.shutdown()
            if rollout is not None:
                rollout.shutdown()
    print(f"\n{'mode':<14}{'s / 1000 samples':>18}{'GPU busy':>10}{'staleness':>11}{'partial':>9}"
          f"{'trainer waits':>15}{'rollouter idle':>16}")
    for row in results:
        busy = "n/a" if row["gpu_busy"] is None else f"{row['gpu_busy']:.0%}"
        waits = [f"{row[key]:.0%}" if key in row else "" for key in ("trainer_wait_fraction", "rollouter_idle_fraction")]
        print(f"{row['mode']:<14}{row['s_per_1000_samples']:>18.2f}{busy:>10}{row['staleness_mean']:>11.2f}"
              f"{row['partial_fraction']:>9.2f}{waits[0]:>15}{waits[1]:>16}")
    if args.json:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else "cpu"
        write_json(args.json, {"results": results, "device": device,
                               "settings": {k: str(v) for k, v in vars(args).items()}})
    return 0 if all(math.isfinite(row["s_per_1000_samples"]) for row in results) else 1


def _vocab_size(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]
