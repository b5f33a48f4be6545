"""The hybrid actor-rollout worker: one policy that generates, scores its own tokens, and trains.

The policy is sharded with FSDP2 (``engine.fsdp``; a group of one on a single device).
Generation gathers the full parameters in the compute dtype: the hf backend calls ``generate``
on the training module itself, with the parameters gathered for its duration; the native
engine copies them into its own buffers at wake-up, after which they are sharded again before
the first token. Generation runs under no_grad with the engine awake; training runs with the
engine asleep and the parameters sharded.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from reinforge.agent import AgentRunner, AsyncEngineClient, BatchingClient, agent_metrics, load_tools
from reinforge.agent.runner import ToolFailureCheck
from reinforge.algorithms import ADVANTAGE_ESTIMATORS
from reinforge.config.schema import Config
from reinforge.controller import Dispatch, Worker, register
from reinforge.engine.device import autocast_context, compute_dtype, peak_memory_gb, resolve_device
from reinforge.engine.distributed import world_size
from reinforge.engine.forward import ScoringPass, build_position_ids, response_log_probs
from reinforge.engine.fsdp import decoder_layers, shard_model, unsharded
from reinforge.engine.fused import prepare_for_training
from reinforge.engine.lora import (
    add_lora,
    lora_deltas,
    lora_scaling,
    merge_lora_weights,
    merged_by_name,
    merged_weights,
)
from reinforge.engine.memory_plan import GiB
from reinforge.engine.optim import build_optimizer, build_scheduler
from reinforge.engine.recompute import checkpoint_decoder_layers
from reinforge.engine.train_step import FORWARD_ONLY, ModelUpdate, UpdateSettings
from reinforge.models import load_causal_lm, load_tokenizer
from reinforge.protocol import Batch
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.mismatch import rollout_mismatch_metrics
from reinforge.workers.actor_loss import actor_loss, no_gradient_rows
from reinforge.workers.agent_rollout import agent_output_batch, agent_rows, uses_agent_loops
from reinforge.workers.checkpointing import load_training_state, save_sharded_hf_folder, save_training_state
from reinforge.workers.memory_settings import apply_memory_plan, cap_device_memory


def _response_tensors(completions: list, width: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    """responses (pad_id after the end), response_mask, rollout_log_probs (B, width), finished_by_stop (B,).

    Filled in one numpy pass each (a row at a time took 56 ms for 512 x 512 tokens, the device idle meanwhile).
    """
    lengths = np.fromiter((len(c.token_ids) for c in completions), dtype=np.int64, count=len(completions))
    valid = np.arange(width)[None, :] < lengths[:, None]
    total = int(lengths.sum())
    responses = np.full((len(completions), width), pad_id, dtype=np.int64)
    responses[valid] = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in completions), np.int64, total)
    log_probs = np.zeros((len(completions), width), dtype=np.float32)
    log_probs[valid] = np.fromiter(itertools.chain.from_iterable(c.log_probs for c in completions), np.float32, total)
    finish_stop = np.fromiter((c.finish_reason == "stop" for c in completions), dtype=bool, count=len(completions))
    return (torch.from_numpy(responses), torch.from_numpy(valid.astype(np.float32)), torch.from_numpy(log_probs),
            torch.from_numpy(finish_stop))


class _PhaseTimer:
    """Wall time of consecutive phases; on CUDA each lap waits for the device, so it counts its kernels too.

    Also the time Python's garbage collector ran meanwhile (``gc``), which no phase owns.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[str, float] = {"gc": 0.0}
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)
        self.last = time.perf_counter()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.times["gc"] += time.perf_counter() - self._gc_start

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self.last
        self.last = now

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def metrics(self, prefix: str) -> dict[str, float]:
        return {prefix + name: seconds for name, seconds in self.times.items()}


def seed_for(base_seed: int, uid: str) -> int:
    digest = hashlib.sha256(f"{base_seed}:{uid}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class ActorRolloutWorker(Worker):
    def __init__(self, config: Config, total_training_steps: int, rollout_only: bool = False):
        """``rollout_only``: the generating worker of trainer.separate_rollout (role rollout): the model in the
        compute dtype, no optimizer; its weights arrive by ``load_rollout_weights``."""
        super().__init__()
        self.config = config
        self.device = resolve_device(config.trainer.device)
        apply_memory_plan(config)  # settings still auto (a worker process of its own); a no-op after the trainer's
        cap_device_memory(config, self.device)
        self.tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path,
                                        trust_remote_code=config.model.trust_remote_code)
        if config.data.chat_template:  # saved with every checkpoint's hf/: the model is served in the format it learned
            self.tokenizer.chat_template = config.data.chat_template
        if rollout_only:
            self._init_rollout_only(config)
            return
        offload = config.actor.param_offload
        lora = config.model.lora
        # with LoRA the base is frozen: kept in the compute dtype, only the adapters get float32 masters
        self.model = load_causal_lm(config.model.path,
                                    dtype=compute_dtype(self.device, config.model.dtype) if lora.rank else torch.float32,
                                    device=self.device, trust_remote_code=config.model.trust_remote_code,
                                    attn_implementation=config.model.attn_implementation)
        self.rollout_model: torch.nn.Module | None = None
        """Off-policy modes: the rollout's own copy of the weights (compute dtype), refreshed only by
        ``sync_rollout_weights``, so generation uses the last synced version whatever the trainer did since."""
        if config.trainer.mode != "sync" and not config.trainer.separate_rollout:
            self.rollout_model = copy.deepcopy(self.model).to(compute_dtype(self.device, config.model.dtype)).eval()
            self.rollout_model.requires_grad_(False)
        prepare_for_training(self.model, self.device)
        checkpointed = config.model.gradient_checkpointing
        checkpoint_decoder_layers(self.model, len(decoder_layers(self.model)) if checkpointed is True else int(checkpointed))
        self.model_class = type(self.model)
        self.max_logits_bytes = int(config.actor.logits_buffer_gib * GiB)  # the same in scoring and training passes
        self.peft_model = None
        """The PeftModel around self.model when model.lora.rank > 0 (engine.lora); self.model is adapted in place."""
        if lora.rank:
            self.peft_model = add_lora(self.model, lora, base_model_path=config.model.path, seed=config.trainer.seed)
            for parameter in self.model.parameters():
                if parameter.requires_grad:
                    parameter.data = parameter.data.float()
        self.engine = (self._build_engine_in_compute_dtype() if self.rollout_model is None
                       else self._build_engine(self.rollout_model))
        self.agent_runner = AgentRunner(self.tokenizer, config.rollout.multi_turn, load_tools(config.rollout.multi_turn),
                                        config.data.chat_template)
        self.tool_failure_check = ToolFailureCheck(sorted(self.agent_runner.tools))
        shard_model(self.model, self.device, config.model.dtype, offload=offload)
        self.model.train()
        num_mini_batches = config.data.train_batch_size // (config.actor.mini_batch_size or config.data.train_batch_size)
        self.update_settings = UpdateSettings(
            num_mini_batches=num_mini_batches, epochs=config.actor.ppo_epochs,
            max_tokens_per_micro_batch=config.actor.max_tokens_per_micro_batch,
            grad_clip=config.actor.grad_clip, shuffle=config.actor.shuffle, seed=config.trainer.seed)
        self.optimizer = build_optimizer(self.model, config.actor.optim,
                                         offload=config.actor.optimizer_offload and not config.actor.param_offload)
        self.scheduler = build_scheduler(self.optimizer, total_training_steps * num_mini_batches * config.actor.ppo_epochs,
                                         config.actor.optim)

    # ---- rollout ------------------------------------------------------------------
    def _build_engine_in_compute_dtype(self):
        """The rollout engine, built before sharding (it checks the model class) in the dtype it will run in.

        Generation later runs on the FSDP-gathered parameters, which are in the compute dtype; the
        engine sizes its KV cache and rotary tables from the dtype it sees here. The float32
        master weights are put back untouched.
        """
        dtype = compute_dtype(self.device, self.config.model.dtype)
        masters = [parameter.data for parameter in self.model.parameters()]
        self.model.to(dtype)
        try:
            return self._build_engine(self.model)
        finally:
            for parameter, master in zip(self.model.parameters(), masters, strict=True):
                parameter.data = master

    def _build_engine(self, model: torch.nn.Module):
        eos_ids = self.stop_token_ids()
        if self.config.rollout.name == "native":
            from reinforge.rollout.native import NativeEngine, supports_model

            if supports_model(model):
                rollout = self.config.rollout
                engine = NativeEngine(model, eos_token_ids=eos_ids,
                                      max_model_len=self.config.data.max_prompt_length + self.config.data.max_response_length,
                                      gpu_memory_utilization=rollout.gpu_memory_utilization or 0.5,
                                      free_on_sleep=rollout.free_cache_engine,
                                      enable_prefix_caching=rollout.enable_prefix_caching, device=self.device)
                if rollout.gpu_memory_utilization is None:  # the memory planner sized the cache
                    engine.num_kv_blocks = max(math.ceil(rollout.kv_cache_gib * GiB / engine.runner.kv_bytes_per_block()), 1)
                return engine
            import logging

            logging.getLogger(__name__).warning(
                "rollout.name=native does not support %s; using the hf backend", type(model).__name__)
        from reinforge.rollout.hf import HFEngine

        return HFEngine(model, pad_token_id=self.tokenizer.pad_token_id, eos_token_ids=eos_ids)

    def stop_token_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id, *self.config.rollout.stop_token_ids}
        generation_config = getattr(self.model, "generation_config", None)
        eos = getattr(generation_config, "eos_token_id", None)
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return sorted(i for i in ids if i is not None)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate(self, batch: Batch, sampling: SamplingParams, seed: int = 0) -> Batch:
        """Sample one response per row. Rows sharing a uid form one request with n samples.

        ``sampling``: the parameters of one sample (its n is ignored); each request's seed comes
        from ``seed`` and its uid. With ``request_seed`` and ``sample_index`` columns every row is its own
        request, seeded as given (partial samples), with an optional ``max_tokens`` column capping its length. Adds prompts, responses, response_mask, input_ids/attention_mask/position_ids of the
        whole sequence, and rollout_log_probs.
        """
        phases = _PhaseTimer(self.device)
        try:
            return self._generate(batch, sampling, seed, phases)
        finally:
            phases.close()

    def _generate(self, batch: Batch, sampling: SamplingParams, seed: int, phases: _PhaseTimer) -> Batch:
        if uses_agent_loops(batch):
            return self._generate_agents(batch, sampling, seed, phases)
        max_response_length = sampling.max_tokens
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        requests, group_sizes = [], []
        start = 0
        uids = batch["uid"]
        per_row = "request_seed" in batch  # partial samples: one request per row, seeded (and budgeted) as given
        while start < len(batch):
            stop = start + 1
            while not per_row and stop < len(batch) and uids[stop] == uids[start]:
                stop += 1
            tokens = prompt_ids[start][prompt_mask[start].bool()].tolist()
            row_seed = (int(batch["request_seed"][start]), int(batch["sample_index"][start])) if per_row else (
                seed_for(seed, str(uids[start])), 0)
            params = SamplingParams(**{**sampling.__dict__, "n": stop - start, "seed": row_seed[0],
                                       "first_sample": row_seed[1]})
            if per_row and "max_tokens" in batch:  # a per-sample length budget
                params = replace(params, max_tokens=min(sampling.max_tokens, int(batch["max_tokens"][start])))
            # a whole sample is never continued; a partial one is, by its next segment
            requests.append(GenerationRequest(tokens, params, request_id=str(uids[start]), keep_prefix=per_row))
            group_sizes.append(stop - start)
            start = stop
        phases.lap("requests")
        with self._engine_awake_on_weights(phases):
            if self.engine.reads_model_in_place:
                completions = self._generate_awake(requests, phases)
        if not self.engine.reads_model_in_place:  # the engine has its copy: the gathered parameters are freed
            completions = self._generate_awake(requests, phases)
        responses, response_mask, rollout_log_probs, finish_stop = _response_tensors(
            [completion for samples in completions for completion in samples], max_response_length,
            self.tokenizer.pad_token_id)
        attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
        output = Batch.from_dict(
            tensors={"prompts": prompt_ids, "responses": responses, "response_mask": response_mask,
                     "input_ids": torch.cat([prompt_ids, responses], dim=1), "attention_mask": attention_mask,
                     "position_ids": build_position_ids(attention_mask), "rollout_log_probs": rollout_log_probs,
                     "finished_by_stop": finish_stop},
            meta={"rollout_metrics": dict(getattr(self.engine, "last_metrics", {}))},
        )
        phases.lap("assemble")
        output.meta["rollout_metrics"] |= phases.metrics("timing_s/gen/")
        return output

    def _generate_agents(self, batch: Batch, sampling: SamplingParams, seed: int, phases: _PhaseTimer) -> Batch:
        """Every row's agent loop, run concurrently on the engine (see ``workers.agent_rollout``)."""
        rows, samplings = agent_rows(batch, sampling, [seed_for(seed, str(uid)) for uid in batch["uid"]])
        phases.lap("requests")

        engine_counts = getattr(self.engine, "counts", None)
        counts: list[dict[str, float]] = []

        def run() -> list:
            if engine_counts is not None:
                counts.append(engine_counts())
            if hasattr(self.engine, "generate_async"):
                client = AsyncEngineClient(self.engine)
            else:
                client = BatchingClient(self.engine, lambda: autocast_context(self.device, self.config.model.dtype))
            with self._sleep_after(phases):
                outputs = self.agent_runner.run(rows, samplings, client)
                phases.lap("engine")
                if engine_counts is not None:
                    counts.append(engine_counts())
            return outputs

        with self._engine_awake_on_weights(phases):
            if self.engine.reads_model_in_place:
                outputs = run()
        if not self.engine.reads_model_in_place:
            outputs = run()
        self.tool_failure_check(outputs)
        output = agent_output_batch(outputs, batch["input_ids"].shape[1], sampling.max_tokens,
                                    self.tokenizer.pad_token_id)
        num_sampled = float(sum(sum(output.response_mask) for output in outputs))
        engine_seconds = phases.times.get("engine", 0.0)
        output.meta["rollout_metrics"] = agent_metrics(outputs) | {
            "rollout/num_generated_tokens": num_sampled, "rollout/time_s": engine_seconds,
            "rollout/tokens_per_s": num_sampled / engine_seconds if engine_seconds > 0 else 0.0}
        if len(counts) == 2:  # the native engine: its steps, and how much of the turns' prompts the prefix cache held
            from reinforge.rollout.native.counters import count_metrics

            output.meta["rollout_metrics"] |= count_metrics(*counts)
        phases.lap("assemble")
        output.meta["rollout_metrics"] |= phases.metrics("timing_s/gen/")
        return output

    @contextlib.contextmanager
    def _engine_awake_on_weights(self, phases: _PhaseTimer) -> Iterator[None]:
        """Gather the parameters, give them to the engine (LoRA adapters merged in) and wake it.

        An engine that reads the module in place generates inside the block; on exit the gathered
        parameters are freed. The LoRA merge is timed as ``lora_merge``.
        """
        if self.rollout_model is not None:  # off-policy modes: the last synced weights, whatever the trainer did since
            self.engine.sync_weights(self.rollout_model)
            self.engine.wake_up()
            phases.lap("wake_up")
            yield
            return
        # The native engine copies the weights; on one device it reads each parameter's local shard, which
        # is the whole parameter, instead of gathering a second full set first (rollout.native.model.whole).
        gather = self.engine.reads_model_in_place or world_size() > 1
        with unsharded(self.model) if gather else contextlib.nullcontext():
            phases.lap("gather_weights")
            in_place_lora = self.peft_model is not None and self.engine.reads_model_in_place
            with merged_weights(self.peft_model) if in_place_lora else contextlib.nullcontext():
                if in_place_lora:
                    phases.lap("lora_merge")
                self.engine.sync_weights(self.model)
                self.engine.wake_up()
                phases.lap("wake_up")
                if self.peft_model is not None and not in_place_lora:
                    self.engine.add_to_weights(lora_deltas(self.peft_model, self.engine.device))
                    phases.lap("lora_merge")
                yield

    def _generate_awake(self, requests: list[GenerationRequest], phases: _PhaseTimer) -> list:
        with self._sleep_after(phases), autocast_context(self.device, self.config.model.dtype):
            completions = self.engine.generate(requests)
            phases.lap("engine")
        return completions

    @contextlib.contextmanager
    def _sleep_after(self, phases: _PhaseTimer) -> Iterator[None]:
        """The engine sleeps after the generation inside the block, timed as ``sleep``. If generation failed, it
        drops the unfinished requests (``sleep(abandon=True)``): the error, not they, is what the user sees."""
        try:
            yield
        except BaseException:
            self.engine.sleep(abandon=True)
            raise
        self.engine.sleep()
        phases.lap("sleep")

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self) -> None:
        """Off-policy modes: copy the current parameters into the rollout's weights (a new policy version)."""
        if self.rollout_model is None:
            raise RuntimeError("sync_rollout_weights is for trainer.mode=one_step_off or async; "
                               "in sync mode every rollout reads the current weights")
        targets = {name: parameter for name, parameter in self.rollout_model.named_parameters()}
        with torch.no_grad(), unsharded(self.model):
            gathered = {}
            for name, parameter in self.model.named_parameters():
                key = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
                gathered[key] = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
            named = (merged_by_name(gathered, lora_scaling(self.config.model.lora)) if self.peft_model is not None
                     else gathered.items())  # LoRA: the plain model's names, W + s*BA one layer at a time
            for key, value in named:
                if key not in targets:
                    raise RuntimeError(f"the rollout copy has no parameter {key!r}; the training model's "
                                       "parameters must keep their names")
                targets.pop(key).copy_(value.detach())
        if targets:
            raise RuntimeError(f"sync_rollout_weights left {sorted(targets)[:3]} of the rollout copy unset")

    def _init_rollout_only(self, config: Config) -> None:
        self.model = load_causal_lm(config.model.path, dtype=compute_dtype(self.device, config.model.dtype),
                                    device=self.device, trust_remote_code=config.model.trust_remote_code,
                                    attn_implementation=config.model.attn_implementation).eval()
        self.model.requires_grad_(False)
        self.rollout_model, self.peft_model, self.model_class = self.model, None, type(self.model)
        self.engine = self._build_engine(self.model)
        self.agent_runner = AgentRunner(self.tokenizer, config.rollout.multi_turn, load_tools(config.rollout.multi_turn),
                                        config.data.chat_template)
        self.tool_failure_check = ToolFailureCheck(sorted(self.agent_runner.tools))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def rollout_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full parameters in the compute dtype, on the CPU, from rank 0 (None elsewhere), for
        a separate rollout worker's ``load_rollout_weights``."""
        dtype = compute_dtype(self.device, self.config.model.dtype)
        weights: dict[str, torch.Tensor] = {}
        with torch.no_grad(), unsharded(self.model):
            for name, parameter in self.model.named_parameters():
                value = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
                if self.rank == 0:
                    key = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
                    weights[key] = value.detach().to("cpu", dtype, copy=True)  # the gathered storage is freed after
        if self.peft_model is not None and self.rank == 0:
            merge_lora_weights(weights, lora_scaling(self.config.model.lora))  # the plain model's names and weights
        return weights if self.rank == 0 else None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_rollout_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The separate rollout worker takes a new policy version (from the actor's ``rollout_weights``)."""
        assert self.rollout_model is not None
        targets = dict(self.rollout_model.named_parameters())
        missing = sorted(set(targets) - set(weights))
        if missing:
            raise RuntimeError(f"the actor sent no weights for {missing[:3]}; the rollout and training models differ")
        with torch.no_grad():
            for name, parameter in targets.items():
                parameter.copy_(weights[name])

    # ---- scoring ------------------------------------------------------------------
    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """old_log_probs and entropy (B, R) under the current parameters, at the rollout temperature.

        Also sum_pi_squared (B, R), sum_v pi(v)^2 per position, when algorithm.adv_estimator needs it.
        """
        with_sum_pi_squared = ADVANTAGE_ESTIMATORS[self.config.algorithm.adv_estimator].needs_sum_pi_squared
        with ScoringPass(self.model, batch, self.config.actor.max_tokens_per_micro_batch, self.device) as scoring:
            for micro in scoring:
                scoring.add(*response_log_probs(self.model, micro, self.config.rollout.temperature, with_entropy=True,
                                                max_logits_bytes=self.max_logits_bytes,
                                                with_sum_pi_squared=with_sum_pi_squared))
        log_probs, entropy, *sum_pi_squared = scoring.outputs()
        output = Batch.from_dict(tensors={"old_log_probs": log_probs, "entropy": entropy})
        if with_sum_pi_squared:
            output["sum_pi_squared"] = sum_pi_squared[0]
        if "rollout_log_probs" in batch:
            output.meta["mismatch_metrics"] = rollout_mismatch_metrics(
                log_probs, batch["rollout_log_probs"], batch["response_mask"])
        return output

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """ref_log_probs (B, R) with LoRA: the base model is the actor with its adapters disabled (no second copy)."""
        if self.peft_model is None:
            raise RuntimeError("compute_ref_log_prob on the actor needs model.lora.rank > 0; without LoRA the "
                               "reference policy is its own worker (workers.reference)")
        with (self.peft_model.disable_adapter(),
              ScoringPass(self.model, batch, self.config.actor.max_tokens_per_micro_batch, self.device) as scoring):
            for micro in scoring:
                scoring.add(response_log_probs(self.model, micro, self.config.rollout.temperature,
                                               max_logits_bytes=self.max_logits_bytes)[0])
        (log_probs,) = scoring.outputs()
        return Batch.from_dict(tensors={"ref_log_probs": log_probs})

    # ---- training -----------------------------------------------------------------
    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """Policy-gradient update over the batch; returns ``actor/*`` metrics."""
        on_policy = "old_log_probs" not in batch and "proximal_alpha" not in batch
        first_micro: tuple[torch.Tensor, ...] = ()
        settings = replace(self.update_settings, seed=self.update_settings.seed + self.scheduler.last_epoch)
        update = ModelUpdate(self.model, self.optimizer, self.scheduler, settings, self.device)
        for micro, counts in update.micro_batches(batch, no_gradient_rows(self.config, batch)):
            forward_only = micro.meta.get(FORWARD_ONLY, False)
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                log_probs, entropy = response_log_probs(self.model, micro, self.config.rollout.temperature,
                                                        with_entropy=True, max_logits_bytes=self.max_logits_bytes)
                loss, metrics = actor_loss(self.config, micro, counts, log_probs, entropy, on_policy)
            if on_policy and "rollout_log_probs" in micro and not first_micro:
                # compared after the update: reading it back here would stall the device mid-update
                first_micro = (log_probs.detach(), micro["rollout_log_probs"], micro["response_mask"])
            if forward_only:  # every advantage of these rows is 0: their loss has no gradient
                update.record(metrics)
            else:
                update.backward(loss, metrics)
        result = update.metrics("actor")
        if first_micro:
            result |= rollout_mismatch_metrics(*(tensor.cpu() for tensor in first_micro))
        return result | peak_memory_gb(self.device)

    # ---- state ----------------------------------------------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str) -> None:
        """Collective: every rank gathers its shards; rank 0 writes actor_state.pt and hf/."""
        save_training_state(Path(folder), self.model, self.optimizer, self.scheduler)
        save_sharded_hf_folder(self.model, self.model_class, self.tokenizer, Path(folder) / "hf",
                               lora=self.config.model.lora if self.peft_model is not None else None,
                               base_model_path=self.config.model.path, optimizer=self.optimizer)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        load_training_state(Path(folder), self.model, self.optimizer, self.scheduler, self.device)

