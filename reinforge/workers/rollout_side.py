"""The rollout side of ``ActorRolloutWorker``: the rollout engine, how the policy's weights reach it, and generation.

The engine generates from one of two weight sources, fixed at construction:

- the training model (``RolloutSide.on_training_model``, sync mode): FSDP shards, gathered in
  the compute dtype for a rollout, LoRA adapters merged in;
- a rollout copy of its own (``RolloutSide.on_rollout_copy``: the off-policy modes, and the worker of
  trainer.separate_rollout): a plain module in the compute dtype that changes only when the
  trainer hands it new weights (``copy_weights_from``, ``load_weights``), so generation reads the
  last synced version whatever the trainer did since.

How the weights reach the engine depends on the engine, and is one of two strategies, also
chosen at construction: ``InPlaceWeights`` (the hf backend runs the module itself: the
parameters stay gathered, LoRA's merged weights in place, until generation ends) or
``CopiedWeights`` (the native engine copies the weights into its own buffers at wake-up, adds
LoRA's deltas there, and the parameters are sharded again before the first token).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from reinforge.agent import AgentRunner, AsyncEngineClient, BatchingClient, agent_metrics, load_tools
from reinforge.agent.runner import TOOL_CHECK_BY_CALLER, ToolFailureCheck, agent_mean_rows, agent_totals
from reinforge.config.schema import Config
from reinforge.controller.dispatch import PADDING_ROWS, ROW_MEANS, SUMMED_METRICS
from reinforge.engine.device import autocast_context, compute_dtype
from reinforge.engine.distributed import world_size
from reinforge.engine.forward import build_position_ids
from reinforge.engine.fsdp import unsharded
from reinforge.engine.lora import lora_deltas, merge_lora_weights, merged_by_name, merged_weights, transposed_layers
from reinforge.engine.memory_plan import GiB, rollout_concurrency
from reinforge.models.loading import float32_parameter_names
from reinforge.protocol import MULTI_MODAL_KEY, Batch
from reinforge.rollout.base import Completion, GenerationRequest, SamplingParams
from reinforge.rollout.registry import get_rollout_engine
from reinforge.serve.agents import register_configured_agents
from reinforge.workers.agent_rollout import (
    agent_output_batch,
    agent_rows,
    padding_trajectory,
    sample_indices,
    uses_agent_loops,
)


def seed_for(base_seed: int, uid: str) -> int:
    """The seed of a prompt's request: the same uid under the same base seed samples the same responses."""
    digest = hashlib.sha256(f"{base_seed}:{uid}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


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


def plain_name(parameter_name: str) -> str:
    """A parameter's name in the plain HF model: without the wrappers of torch.compile and activation checkpointing."""
    return parameter_name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


# ---- how the weights reach the engine ------------------------------------------------------------


class InPlaceWeights:
    """For an engine that runs the module itself (``reads_model_in_place``, the hf backend).

    ``sharded``: the source is the FSDP-sharded training model, gathered for the whole rollout;
    ``peft_model``: its LoRA wrapper, whose adapted layers compute with merged weights meanwhile.
    """

    def __init__(self, engine: Any, model: torch.nn.Module, peft_model: torch.nn.Module | None, sharded: bool):
        self.rollout_engine, self.model, self.peft_model, self.sharded = engine, model, peft_model, sharded

    @contextlib.contextmanager
    def awake(self, phases: _PhaseTimer) -> Iterator[None]:
        """The engine awake on the current weights; generation runs inside, and the gathered parameters are freed
        on exit. Timed as ``gather_weights``, ``lora_merge`` and ``wake_up``."""
        with unsharded(self.model) if self.sharded else contextlib.nullcontext():
            if self.sharded:
                phases.lap("gather_weights")
            with merged_weights(self.peft_model) if self.peft_model is not None else contextlib.nullcontext():
                if self.peft_model is not None:
                    phases.lap("lora_merge")
                self.rollout_engine.sync_weights(self.model)
                self.rollout_engine.wake_up()
                phases.lap("wake_up")
                yield


class CopiedWeights:
    """For an engine with weight buffers of its own (the native engine), filled at ``wake_up``.

    ``sharded``: the source is the FSDP-sharded training model. On several devices its parameters
    are gathered for the copy; on one device the engine reads each parameter's local shard, which
    is the whole parameter, instead of gathering a second full set (``rollout.native.model.whole``).
    ``peft_model``: its LoRA wrapper; the engine adds each adapted layer's delta to its copy.
    """

    def __init__(self, engine: Any, model: torch.nn.Module, peft_model: torch.nn.Module | None, sharded: bool):
        self.rollout_engine, self.model, self.peft_model, self.sharded = engine, model, peft_model, sharded

    @contextlib.contextmanager
    def awake(self, phases: _PhaseTimer) -> Iterator[None]:
        """The engine awake on its copy of the current weights; the source's parameters are sharded again before
        generation runs inside. Timed as ``gather_weights``, ``wake_up`` and ``lora_merge``."""
        with unsharded(self.model) if self.sharded and world_size() > 1 else contextlib.nullcontext():
            if self.sharded:
                phases.lap("gather_weights")
            self.rollout_engine.sync_weights(self.model)
            self.rollout_engine.wake_up()
            phases.lap("wake_up")
            if self.peft_model is not None:
                self.rollout_engine.add_to_weights(lora_deltas(self.peft_model, self.rollout_engine.device))
                phases.lap("lora_merge")
        yield


# ---- the rollout side ----------------------------------------------------------------------------


def build_rollout_engine(config: Config, device: torch.device, tokenizer: Any, model: torch.nn.Module) -> Any:
    """rollout.name's engine on ``model`` (whose dtype sizes its KV cache); the hf backend where native does not
    support the architecture. Both get the tokenizer for the stop strings of an OpenAI agent's calls."""
    if config.rollout.name not in ("hf", "native"):  # an engine a package adds (reinforge.rollout.registry)
        return get_rollout_engine(config.rollout.name).from_config(config, model=model, tokenizer=tokenizer,
                                                                   device=device)
    eos_ids = stop_token_ids(config, tokenizer, model)
    if config.rollout.name == "native":
        from reinforge.rollout.native import NativeEngine, hf_fallback_notice, unsupported_reason

        reason = unsupported_reason(model)
        if reason is None:
            rollout = config.rollout
            engine = NativeEngine(model, eos_token_ids=eos_ids,
                                  max_model_len=config.data.max_prompt_length + config.data.max_response_length,
                                  gpu_memory_utilization=rollout.gpu_memory_utilization or 0.5,
                                  free_on_sleep=rollout.free_cache_engine,
                                  enable_prefix_caching=rollout.enable_prefix_caching, device=device,
                                  max_prefill_chunk_tokens=rollout.max_prefill_chunk_tokens,
                                  kv_cache_dtype=rollout.kv_cache_dtype, decode_products=rollout.decode_products,
                                  shared_prefix_decode=rollout.shared_prefix_decode, tokenizer=tokenizer,
                                  **planned_concurrency(config))
            if rollout.gpu_memory_utilization is None:  # the memory planner sized the cache
                engine.kv_cache_bytes = int(rollout.kv_cache_gib * GiB)
            return engine
        logging.getLogger(__name__).warning(hf_fallback_notice(reason))
    from reinforge.rollout.hf import HFEngine

    return HFEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=eos_ids, tokenizer=tokenizer)


def planned_concurrency(config: Config) -> dict[str, int]:
    """Where the memory planner sizes the native engine's cache, the engine's ``max_num_seqs`` it sized it for:
    one device's sequences of a step (more requests wait their turn; a request of more samples, a validation's
    rollout.val_kwargs.n, runs them in groups of that many)."""
    if config.rollout.gpu_memory_utilization is not None:
        return {}
    sequences = config.data.train_batch_size * config.rollout.n
    return {"max_num_seqs": rollout_concurrency(sequences, config.trainer.nnodes * config.trainer.devices_per_node)}


def stop_token_ids(config: Config, tokenizer: Any, model: torch.nn.Module) -> list[int]:
    """The tokenizer's EOS, the model's generation_config EOS ids, rollout.stop_token_ids and the chat template's
    end-of-turn token (a generation config that lists only <|end_of_text|> or <eos> must still stop at <|eot_id|>
    or <end_of_turn>, where a templated prompt's answer ends)."""
    ids = {tokenizer.eos_token_id, *config.rollout.stop_token_ids}
    if config.data.apply_chat_template is not False:
        from reinforge.data.chat_template import template_end_of_turn_ids

        ids |= set(template_end_of_turn_ids(tokenizer, config.data.chat_template))
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(i for i in ids if i is not None)


def cast_as_loaded(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s floating-point parameters to ``dtype`` in place, as transformers loads a checkpoint in it.

    The buffers keep their dtype (the rotary ``inv_freq``: rounded to bf16 it shifts every position's angle, far
    out at long positions; DeepSeek V3's float32 ``e_score_correction_bias``), and so do the parameters transformers
    keeps in float32 in ``dtype`` (``float32_parameter_names``: DeepSeek's router weight, whose rounding changes which
    experts a token is sent to; in float16 also gpt-oss's norms).
    """
    kept = float32_parameter_names(model, dtype)
    for name, parameter in model.named_parameters():
        if parameter.is_floating_point() and name not in kept:
            parameter.data = parameter.data.to(dtype)


def rollout_copy_of(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen copy of the plain model in ``dtype`` (``cast_as_loaded``), for ``RolloutSide.on_rollout_copy``."""
    rollout_model = copy.deepcopy(model).eval()
    cast_as_loaded(rollout_model, dtype)
    rollout_model.requires_grad_(False)
    return rollout_model


def full_weights_on_cpu(model: torch.nn.Module, dtype: torch.dtype, rank: int,
                        lora_scale: float | None) -> dict[str, torch.Tensor] | None:
    """Collective over the ranks sharding ``model``: its full parameters in ``dtype``, on the CPU, under the plain
    model's names, from rank 0 (None elsewhere). ``lora_scale``: LoRA's scaling, the adapters merged in. The
    parameters transformers keeps in float32 (DeepSeek's routers) stay float32."""
    weights: dict[str, torch.Tensor] = {}
    kept = float32_parameter_names(model, dtype)
    with torch.no_grad(), unsharded(model):
        for name, parameter in model.named_parameters():
            value = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
            if rank == 0:  # a copy: the gathered storage is freed
                weights[plain_name(name)] = value.detach().to("cpu", torch.float32 if name in kept else dtype, copy=True)
    if lora_scale is not None and rank == 0:
        merge_lora_weights(weights, lora_scale, transposed_layers(model))  # the plain model's names and weights
    return weights if rank == 0 else None


class RolloutSide:
    """The rollout engine on its weight source, the agent runner, and ``generate``."""

    def __init__(self, config: Config, device: torch.device, tokenizer: Any, engine: Any,
                 weights: InPlaceWeights | CopiedWeights, rollout_model: torch.nn.Module | None):
        self.config, self.device, self.tokenizer = config, device, tokenizer
        self.rollout_engine = engine
        self.weights = weights
        self.rollout_model = rollout_model
        """The rollout's own copy of the weights (compute dtype), or None where it reads the training model."""
        register_configured_agents(config.rollout.multi_turn)  # rollout.multi_turn.openai_agents, as agent loops
        self.agent_runner = AgentRunner(tokenizer, config.rollout.multi_turn, load_tools(config.rollout.multi_turn),
                                        config.data.chat_template, _vision_processor(config))
        self.tool_failure_check = ToolFailureCheck(sorted(self.agent_runner.tools))

    @classmethod
    def on_training_model(cls, config: Config, device: torch.device, tokenizer: Any, model: torch.nn.Module,
                          peft_model: torch.nn.Module | None) -> RolloutSide:
        """Generation from the training model, called before it is sharded (the engine checks the model class).

        The engine is built with the model in the compute dtype, the dtype it will run in once the
        parameters are gathered (it sizes its KV cache and rotary tables from it); the float32
        master weights are put back untouched.
        """
        masters = [parameter.data for parameter in model.parameters()]
        cast_as_loaded(model, compute_dtype(device, config.model.dtype))  # the buffers keep their dtype
        try:
            engine = build_rollout_engine(config, device, tokenizer, model)
        finally:
            for parameter, master in zip(model.parameters(), masters, strict=True):
                parameter.data = master
        return cls(config, device, tokenizer, engine, _strategy(engine)(engine, model, peft_model, sharded=True), None)

    @classmethod
    def on_rollout_copy(cls, config: Config, device: torch.device, tokenizer: Any,
                        rollout_model: torch.nn.Module) -> RolloutSide:
        """Generation from ``rollout_model``, a plain module in the compute dtype that only the trainer's syncs change."""
        engine = build_rollout_engine(config, device, tokenizer, rollout_model)
        return cls(config, device, tokenizer, engine, _strategy(engine)(engine, rollout_model, None, sharded=False),
                   rollout_model)

    # ---- new weights for the rollout copy ------------------------------------------------------
    def copy_weights_from(self, model: torch.nn.Module, lora_scale: float | None) -> None:
        """Collective over the ranks sharding ``model``: its current parameters into the rollout copy (a new policy
        version). ``lora_scale``: the model is LoRA-adapted; the copy gets W + s*BA under the plain names."""
        if self.rollout_model is None:
            raise RuntimeError("sync_rollout_weights is for trainer.mode=one_step_off or async; "
                               "in sync mode every rollout reads the current weights")
        targets = dict(self.rollout_model.named_parameters())
        with torch.no_grad(), unsharded(model):
            gathered = {plain_name(name): parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
                        for name, parameter in model.named_parameters()}
            named = (merged_by_name(gathered, lora_scale, transposed_layers(model)) if lora_scale is not None
                     else gathered.items())  # LoRA: one merged layer at a time
            for key, value in named:
                if key not in targets:
                    raise RuntimeError(f"the rollout copy has no parameter {key!r}; the training model's "
                                       "parameters must keep their names")
                targets.pop(key).copy_(value.detach())
        if targets:
            raise RuntimeError(f"sync_rollout_weights left {sorted(targets)[:3]} of the rollout copy unset")

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The rollout copy takes a new policy version (``full_weights_on_cpu`` of the actor)."""
        assert self.rollout_model is not None
        targets = dict(self.rollout_model.named_parameters())
        missing = sorted(set(targets) - set(weights))
        if missing:
            raise RuntimeError(f"the actor sent no weights for {missing[:3]}; the rollout and training models differ")
        with torch.no_grad():
            for name, parameter in targets.items():
                parameter.copy_(weights[name])

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, batch: Batch, sampling: SamplingParams, seed: int) -> Batch:
        """``ActorRolloutWorker.generate``: one response per row, timed phase by phase (``timing_s/gen/*``)."""
        phases = _PhaseTimer(self.device)
        try:
            if uses_agent_loops(batch):
                return self._generate_agents(batch, sampling, seed, phases)
            return self._generate_requests(batch, sampling, seed, phases)
        finally:
            phases.close()

    def _generate_requests(self, batch: Batch, sampling: SamplingParams, seed: int, phases: _PhaseTimer) -> Batch:
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        requests = []
        start = 0
        uids = batch["uid"]
        per_row = "request_seed" in batch  # partial samples: one request per row, seeded (and budgeted) as given
        images = batch.non_tensors.get(MULTI_MODAL_KEY)  # a vision-language batch: each row's pixels and grids
        indices = sample_indices(batch)
        counted = counted_rows(batch)  # the padding rows after them are not generated (``padding_completions``)
        while start < counted:
            stop = start + 1
            while not per_row and stop < counted and uids[stop] == uids[start] and \
                    indices[stop] == indices[stop - 1] + 1:
                stop += 1
            tokens = prompt_ids[start][prompt_mask[start].bool()].tolist()
            row_seed = (int(batch["request_seed"][start]), indices[start]) if per_row else (
                seed_for(seed, str(uids[start])), indices[start])
            params = SamplingParams(**{**sampling.__dict__, "n": stop - start, "seed": row_seed[0],
                                       "first_sample": row_seed[1]})
            if per_row and "max_tokens" in batch:  # a per-sample length budget
                params = replace(params, max_tokens=min(sampling.max_tokens, int(batch["max_tokens"][start])))
            # a whole sample is never continued; a partial one is, by its next segment
            requests.append(GenerationRequest(tokens, params, request_id=str(uids[start]), keep_prefix=per_row,
                                              multi_modal_inputs=(images[start] or None) if images is not None else None))
            start = stop
        phases.lap("requests")
        completions = []
        # no rows (then on every rank: DP_COMPUTE pads chunks): no gather, no wake-up, no KV cache; a share of padding
        # rows alone takes part in the gather of the weights (a collective over the members) and generates nothing
        if len(batch):
            with (self.weights.awake(phases), self._sleep_after(phases),
                  autocast_context(self.device, self.config.model.dtype)):
                completions = self.rollout_engine.generate(requests) if requests else []
                phases.lap("engine")
        samples = [completion for per_request in completions for completion in per_request]
        samples += padding_completions(len(batch) - counted)
        responses, response_mask, rollout_log_probs, finish_stop = _response_tensors(
            samples, sampling.max_tokens, self.tokenizer.pad_token_id)
        attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
        output = Batch.from_dict(
            tensors={"prompts": prompt_ids, "responses": responses, "response_mask": response_mask,
                     "input_ids": torch.cat([prompt_ids, responses], dim=1), "attention_mask": attention_mask,
                     "position_ids": build_position_ids(attention_mask), "rollout_log_probs": rollout_log_probs,
                     "finished_by_stop": finish_stop},
            non_tensors={} if images is None else {MULTI_MODAL_KEY: images},  # the sequences' images, as they came
            meta={"rollout_metrics": dict(getattr(self.rollout_engine, "last_metrics", {})) if requests else {}},
        )
        phases.lap("assemble")
        output.meta["rollout_metrics"] |= phases.metrics("timing_s/gen/")
        output.meta[SUMMED_METRICS] = rollout_totals(output.meta["rollout_metrics"])  # several workers add them up
        return output

    def _generate_agents(self, batch: Batch, sampling: SamplingParams, seed: int, phases: _PhaseTimer) -> Batch:
        """Every row's agent loop, run concurrently on the engine (see ``workers.agent_rollout``)."""
        rows, samplings = agent_rows(batch, sampling, [seed_for(seed, str(uid)) for uid in batch["uid"]])
        phases.lap("requests")
        engine = self.rollout_engine
        engine_counts = getattr(engine, "counts", None)
        counts: list[dict[str, float]] = []
        counted_row_count = counted_rows(batch)
        with self.weights.awake(phases), self._sleep_after(phases):
            if engine_counts is not None:
                counts.append(engine_counts())
            if hasattr(engine, "generate_async"):
                client = AsyncEngineClient(engine)
            else:
                client = BatchingClient(engine, lambda: autocast_context(self.device, self.config.model.dtype))
            # a padding row runs no loop: its tools (a sandbox, a side effect) would run twice for the row it copies
            outputs = self.agent_runner.run(rows[:counted_row_count], samplings[:counted_row_count], client)
            phases.lap("engine")
            if engine_counts is not None:
                counts.append(engine_counts())
        outputs += [padding_trajectory(row) for row in rows[counted_row_count:]]
        # one of several members sees only its share: the caller checks the gathered batch (``gathered``)
        by_caller = bool(batch.meta.get(TOOL_CHECK_BY_CALLER))
        if not by_caller:
            self.tool_failure_check(outputs)
        output = agent_output_batch(outputs, batch["input_ids"].shape[1], sampling.max_tokens,
                                    self.tokenizer.pad_token_id)
        counted = outputs[:counted_row_count]  # the padding rows' placeholders count nowhere
        num_sampled = float(sum(sum(output.response_mask) for output in counted))
        engine_seconds = phases.times.get("engine", 0.0)
        trajectories = agent_metrics(counted)
        output.meta["rollout_metrics"] = dict(trajectories)
        if counted:  # a share of padding alone generated nothing: no rate of its own to average with the others'
            output.meta["rollout_metrics"] |= {
                "rollout/num_generated_tokens": num_sampled, "rollout/time_s": engine_seconds,
                "rollout/tokens_per_s": num_sampled / engine_seconds if engine_seconds > 0 else 0.0}
        if counted and len(counts) == 2:  # the native engine: its steps, and how much of the turns' prompts the prefix
            # cache held
            from reinforge.rollout.native.counters import count_metrics

            output.meta["rollout_metrics"] |= count_metrics(*counts)
        phases.lap("assemble")
        output.meta["rollout_metrics"] |= phases.metrics("timing_s/gen/")
        metrics = output.meta["rollout_metrics"]
        output.meta[SUMMED_METRICS] = agent_totals(metrics) + rollout_totals(metrics)  # several workers add them up
        # the trajectories' means: several workers' are weighted by the trajectories each is over
        output.meta[ROW_MEANS] = agent_mean_rows(trajectories, counted)
        if by_caller:
            output.meta[TOOL_CHECK_BY_CALLER] = list(self.tool_failure_check.tool_names)
        return output

    @contextlib.contextmanager
    def _sleep_after(self, phases: _PhaseTimer) -> Iterator[None]:
        """The engine sleeps after the generation inside the block, timed as ``sleep``. If generation failed, it
        drops the unfinished requests (``sleep(abandon=True)``): the error, not they, is what the user sees."""
        try:
            yield
        except BaseException:
            self.rollout_engine.sleep(abandon=True)
            raise
        self.rollout_engine.sleep()
        phases.lap("sleep")


ROLLOUT_TOTALS = ("rollout/num_generated_tokens", "rollout/num_preempted", "rollout/prefix_cache_hit_tokens",
                  "rollout/prefill_tokens", "rollout/num_prefill_steps", "rollout/num_decode_steps",
                  "rollout/num_decode_rows")
"""The engine's rollout metrics that count over its requests: the members of a group generate their shares side by
side, so their counts add up (the seconds and rates stay their mean). A member's padding rows are not generated
(``counted_rows``), so these count the batch's rows alone: the steps are those the members' engines ran for them
(a prompt whose samples are split over two members is prefilled by each)."""


def rollout_totals(metrics: dict[str, Any]) -> tuple[str, ...]:
    return tuple(name for name in ROLLOUT_TOTALS if name in metrics)


def counted_rows(batch: Batch) -> int:
    """The rows of a member's share that count: all but its padding rows (``PADDING_ROWS``, copies of other members'
    rows that a DP_COMPUTE split adds so that every member's share has as many rows, and which the controller drops).
    Padding rows are not generated: they get placeholders of the right shape (``padding_completions``,
    ``padding_trajectory``)."""
    return len(batch) - int(batch.meta.get(PADDING_ROWS, 0))


def padding_completions(num_rows: int) -> list[Completion]:
    """The responses of ``num_rows`` padding rows: empty, never sampled (the controller drops the rows)."""
    return [Completion([], [], "length") for _ in range(num_rows)]


def _vision_processor(config: Config) -> Any:
    """A vision-language model's processor (its agents' tools may return images; resized within data.min_pixels and
    data.max_pixels as the prompts' are), else None."""
    from reinforge.models.vision import run_processor

    return run_processor(config.model, config.data)


def _strategy(engine: Any) -> type[InPlaceWeights] | type[CopiedWeights]:
    return InPlaceWeights if engine.reads_model_in_place else CopiedWeights
