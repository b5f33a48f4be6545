"""The config side of the memory planner: which settings are ``auto``, the machine's memory, the plan applied.

``apply_memory_plan(config)`` runs before any weight is loaded (``RLTrainer``, ``reinforge bench
train``, and each worker for settings still ``auto``, e.g. under Ray where only the workers see
their devices). It replaces every ``auto`` memory setting by the planner's choice, keeps the ones
a user set, logs the plan as a short table, and raises ``MemoryPlanError`` when nothing fits.
``reinforge plan`` prints the same plan for any device size, on a machine without one.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from reinforge.config.schema import Config
from reinforge.engine.memory_plan import (
    FAMILY_PROJECTIONS,
    LORA_PROJECTIONS,
    SETTING_KEYS,
    GiB,
    MemoryPlan,
    ModelShape,
    RunShape,
    Settings,
    estimate,
    judge_sequence_gib,
    needed_kv_gib,
    peak_bytes,
    plan_memory,
)

logger = logging.getLogger(__name__)

AUTO = "auto"
_last_plan: MemoryPlan | None = None
"""The plan this process made last: an out-of-memory message quotes it."""


def host_memory_bytes() -> float:
    """Memory the host can give this run: MemAvailable (Linux), else the physical total."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_memory_bytes(config: Config) -> float | None:
    """The device memory one process plans for; None when this process cannot see the run's device. On the CPU: its
    share of the host's memory, which the machine's trainer.devices_per_node processes divide."""
    if config.trainer.gpu_memory_gib:
        return config.trainer.gpu_memory_gib * GiB
    wants_cuda = config.trainer.device == "cuda" or (config.trainer.device == "auto" and torch.cuda.is_available())
    if wants_cuda:
        return float(torch.cuda.mem_get_info()[1]) if torch.cuda.is_available() else None
    return host_memory_bytes() / max(config.trainer.devices_per_node, 1)  # the machine's CPU processes share it


def run_shape(config: Config) -> RunShape:
    from reinforge.algorithms.roles import critic_enabled, reference_needed

    # trainer.gpu_memory_gib names a GPU's size for device auto; a CPU run (trainer.device=cpu) it only caps
    on_gpu = config.trainer.device == "cuda" or (
        config.trainer.device == "auto" and (torch.cuda.is_available() or config.trainer.gpu_memory_gib is not None))
    dtype_bytes = 4 if config.model.dtype == "float32" or not on_gpu else 2
    mini_batch = config.actor.mini_batch_size or config.data.train_batch_size
    lora = getattr(config.model, "lora", None)
    native = native_engine_runs(config)
    return RunShape(prompts=config.data.train_batch_size, samples_per_prompt=config.rollout.n,
                    prompt_length=config.data.max_prompt_length, response_length=config.data.max_response_length,
                    num_mini_batches=max(config.data.train_batch_size // mini_batch, 1),
                    num_devices=config.trainer.nnodes * config.trainer.devices_per_node,
                    devices_per_host=config.trainer.devices_per_node, dtype_bytes=dtype_bytes,
                    eager=not on_gpu,
                    reference=reference_needed(config), critic=critic_enabled(config), **_critic_shape(config),
                    lora_rank=int(getattr(lora, "rank", 0) or 0), lora_targets=_adapted_projections(lora, _model_type(config.model.path)),
                    off_policy=config.trainer.mode != "sync", **_reward_model_shape(config), **_judge_shape(config),
                    # validation and checkpoints between two syncs copy the rollout's weights to the host
                    rollout_weights_on_host=config.trainer.mode == "async" and config.trainer.trigger_sync_steps > 1,
                    # another engine (hf, the native one's fallback, a package's) keeps it in the model dtype
                    kv_cache_dtype=str(getattr(config.rollout, "kv_cache_dtype", "auto")) if native else "auto",
                    native_engine=native,
                    kv_cache_fraction=float(config.rollout.gpu_memory_utilization or 0.0)
                    if native and on_gpu else 0.0,
                    fp8_kv_cache_runs=fp8_kv_cache_runs_here(config),
                    prefill_tokens=prefill_forward_tokens(config),
                    image_tokens=config.data.max_image_tokens or config.data.max_prompt_length,
                    train_vision=not config.actor.freeze_vision_tower)


def fp8_kv_cache_runs_here(config: Config) -> bool:
    """Whether this machine's GPU, where the run trains on it, can keep the native engine's fp8 cache
    (``kv_quant.fp8_device_refusal``); True where the run plans for no GPU of this machine."""
    if config.trainer.device == "cpu" or not torch.cuda.is_available():
        return True
    from reinforge.rollout.native.kv_quant import fp8_device_refusal

    try:
        return fp8_device_refusal(torch.device("cuda", torch.cuda.current_device())) is None
    except (RuntimeError, AssertionError):  # a GPU torch cannot ask (no CUDA build, a broken driver): not known here
        return True


def prefill_forward_tokens(config: Config) -> int:
    """The most new tokens one of the native engine's prefill forwards runs: its step (``ENGINE_MAX_BATCHED_TOKENS``
    new tokens, of one sequence or several), or the whole of a longer sequence up to rollout.max_prefill_chunk_tokens
    where that is larger."""
    from reinforge.engine.memory_plan import ENGINE_MAX_BATCHED_TOKENS

    chunk = config.rollout.max_prefill_chunk_tokens or 0
    return max(ENGINE_MAX_BATCHED_TOKENS, min(chunk, config.data.max_prompt_length + config.data.max_response_length))


def native_engine_runs(config: Config) -> bool:
    """Whether the rollout runs on the native engine: rollout.name=native on a model it runs. Only its settings
    (rollout.kv_cache_dtype, gpu_memory_utilization, kv_cache_gib, free_cache_engine) size the rollout's memory."""
    return config.rollout.name == "native" and native_fallback_reason(config) is None


def native_fallback_reason(config: Config) -> str | None:
    """Why rollout.name=native rolls out with the hf backend instead: the engine's own ``unsupported_reason``, which
    ``rollout_side.build_rollout_engine`` asks of the loaded model, asked here of the model built on the meta device
    from model.path's config. None where rollout.name is not native, where the engine runs the model, or where
    transformers cannot build it here (the load says why)."""
    if config.rollout.name != "native" or not config.model.path:
        return None
    try:  # the key of the cache: a folder whose config.json changes is asked again
        config_text = (Path(config.model.path).expanduser() / "config.json").read_text()
    except OSError:
        config_text = ""  # a hub id
    return _unsupported_reason(config.model.path, bool(config.model.trust_remote_code), config_text)


@functools.lru_cache(maxsize=16)
def _unsupported_reason(path: str, trust_remote_code: bool, config_text: str) -> str | None:
    from reinforge.models.loading import meta_model
    from reinforge.rollout.native import unsupported_reason

    model = meta_model(path, trust_remote_code)
    return None if model is None else unsupported_reason(model)


def _reward_model_shape(config: Config) -> dict[str, Any]:
    """RunShape's reward-model fields: its sizes when it shares the actor's devices (not on a pool of its own)."""
    settings = config.reward.reward_model
    if not settings.enable or not settings.model_path or settings.enable_resource_pool:
        return {}
    return {"reward_model": ModelShape.from_model_path(settings.model_path, "reward.reward_model.model_path"),
            "reward_model_offload": bool(settings.offload),
            "reward_model_tokens": int(settings.max_tokens_per_micro_batch or 0)}


def _critic_shape(config: Config) -> dict[str, Any]:
    """RunShape's critic fields: its own model's sizes (critic.model_path, where it is another model than the
    policy's) and where it keeps its state (critic.param_offload, critic.optimizer_offload)."""
    from reinforge.algorithms.roles import critic_enabled

    critic = config.critic
    if not critic_enabled(config):
        return {}
    own = critic.model_path and critic.model_path != config.model.path
    return {"critic_model": ModelShape.from_model_path(critic.model_path, "critic.model_path") if own else None,
            "critic_tokens": int(critic.max_tokens_per_micro_batch or 0),
            "critic_offload": "param" if critic.param_offload else "optimizer" if critic.optimizer_offload else ""}


def _judge_shape(config: Config) -> dict[str, Any]:
    """RunShape's judge field: the sizes of reward.judge's own model (the policy as its own judge costs nothing)."""
    judge = config.reward.judge
    if not judge.enable or not judge.model_path or judge.model_path == "policy":
        return {}
    return {"judge": ModelShape.from_model_path(judge.model_path, "reward.judge.model_path"),
            "judge_length": int(judge.max_prompt_length) + int(judge.max_tokens)}


def _adapted_projections(lora: Any, model_type: str | None = None) -> tuple[str, ...]:
    """Which of a decoder layer's projections ``model.lora.target_modules`` adapts (the seven Llama-style ones for
    all-linear, or where it names none the planner knows: the larger estimate). The default targets of a
    ``model_type`` that names its projections otherwise become its own, as the load makes them
    (``engine.lora._targets_for``: Phi-3's fused qkv_proj and gate_up_proj, DeepSeek's latent attention)."""
    from reinforge.config.schema import LoraConfig
    from reinforge.engine.lora import LINEAR_LAYERS

    names = list(getattr(lora, "target_modules", None) or ["all-linear"])
    if names == LoraConfig().target_modules and model_type in LINEAR_LAYERS:
        names = list(LINEAR_LAYERS[model_type])
    targets = {str(name).rsplit(".", 1)[-1] for name in names}
    return tuple(name for name in (*LORA_PROJECTIONS, *FAMILY_PROJECTIONS) if name in targets) or LORA_PROJECTIONS


def _model_type(path: str) -> str | None:
    """The ``model_type`` of the config.json in the folder ``path`` (None where there is no readable one)."""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def _setting(config: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def given_settings(config: Config, num_layers: int) -> dict[str, Any]:
    """The memory settings a user set, by ``Settings`` field name (``auto`` ones are absent)."""
    given: dict[str, Any] = {}
    for name, key in SETTING_KEYS.items():
        value = _setting(config, key)
        if value == AUTO:
            continue
        if name == "checkpoint_layers":
            value = num_layers if value is True else 0 if value is False else min(int(value), num_layers)
        elif name == "keep_rollout_memory":
            value = not value
        given[name] = value
    on_cpu = config.trainer.device == "cpu" or (config.trainer.device == "auto" and not torch.cuda.is_available()
                                                and config.trainer.gpu_memory_gib is None)
    if on_cpu:  # the device is host memory: moving state to the host frees nothing
        for name in ("optimizer_offload", "param_offload", "ref_offload"):
            given.setdefault(name, False)
    if not native_engine_runs(config):
        given.setdefault("keep_rollout_memory", False)  # only the native engine keeps memory between rollouts
    return given


def config_values(settings: Settings, shape: ModelShape, run: RunShape) -> dict[str, Any]:
    """The plan's settings as their config keys read them (the inverse of ``given_settings``)."""
    checkpointed = settings.checkpoint_layers
    values = {**vars(settings),
              "checkpoint_layers": True if checkpointed >= shape.num_layers else False if checkpointed == 0
              else checkpointed,
              # rounded up to the MiB: the engine's pool must hold every block the plan counted
              "kv_cache_gib": math.ceil(max(settings.kv_cache_gib or needed_kv_gib(shape, run),
                                            judge_sequence_gib(run)) * 1024) / 1024,
              "keep_rollout_memory": not settings.keep_rollout_memory}
    return {key: values[name] for name, key in SETTING_KEYS.items()}


def _plan(config: Config, gpu_bytes: float, host_bytes: float | None = None) -> tuple[ModelShape, RunShape, MemoryPlan]:
    shape, run = ModelShape.from_model_path(config.model.path), run_shape(config)
    if host_bytes is None:
        host_bytes = config.trainer.host_memory_gib * GiB if config.trainer.host_memory_gib else host_memory_bytes()
    given = given_settings(config, shape.num_layers)
    _check_kv_cache_holds_one_sequence(config, shape, run, given)
    forced = frozenset(name for name in given if _setting(config, SETTING_KEYS[name]) == AUTO)
    plan = plan_memory(shape, run, given, gpu_bytes, host_bytes, forced)
    _check_utilization_holds_one_sequence(shape, run, plan.phases["rollout"])
    return shape, run, plan


def _check_given_settings(config: Config, gpu_bytes: float) -> None:
    """With every memory setting given (nothing to plan), the native engine's KV cache still must hold one sequence
    at full length, as ``_plan`` checks it: rollout.kv_cache_gib, or what rollout.gpu_memory_utilization leaves; and
    an estimate above the device is said in one warning (where the planner can read the model's sizes)."""
    from reinforge.engine.memory_plan import MemoryPlanError

    native = native_engine_runs(config)
    try:
        shape, run = ModelShape.from_model_path(config.model.path), run_shape(config)
    except MemoryPlanError:
        if native:
            raise
        return  # nothing to check against: the run's settings are its own
    given = given_settings(config, shape.num_layers)
    if native:
        _check_kv_cache_holds_one_sequence(config, shape, run, given)
    settings = Settings(**given)
    if settings.param_offload:
        settings.keep_gathered = False
    phases = estimate(shape, run, settings, gpu_bytes)[0]
    if run.kv_cache_fraction and native:
        _check_utilization_holds_one_sequence(shape, run, phases["rollout"])
    phase, peak = peak_bytes(phases)
    if peak > gpu_bytes:  # the settings are the user's: said, not refused (reinforge plan refuses them)
        logger.warning("every memory setting is given, and the memory plan estimates their %s at %.1f GiB, more than "
                       "the %.1f GiB of the device: the run may run out of memory; `reinforge plan` with these "
                       "settings names the largest consumers, or set some to auto to let the planner choose",
                       phase, peak / GiB, gpu_bytes / GiB)


def _check_utilization_holds_one_sequence(shape: ModelShape, run: RunShape, rollout: dict[str, float]) -> None:
    """The cache rollout.gpu_memory_utilization leaves (``RunShape.kv_cache_fraction``) beside the rollout's other
    consumers (``rollout``, the plan's rollout phase) must hold one sequence at full length: the native engine fails
    in its first rollout otherwise."""
    from reinforge.engine.memory_plan import MemoryPlanError, rollout_concurrency

    if not run.kv_cache_fraction:
        return
    left = rollout["kv cache"] / GiB
    one = needed_kv_gib(shape, run, share=rollout_concurrency(run.sequences, run.num_devices))
    if left < one:
        held = sum(rollout.values()) - left * GiB
        raise MemoryPlanError(
            f"rollout.gpu_memory_utilization={run.kv_cache_fraction:g} leaves {left:.2f} GiB for the KV cache beside "
            f"the rollout's other {held / GiB:.1f} GiB, less than one sequence of data.max_prompt_length + "
            f"data.max_response_length = {run.prompt_length + run.response_length} tokens ({one:.3g} GiB); raise "
            "it, or leave it null to let the planner size the cache")


def _check_kv_cache_holds_one_sequence(config: Config, shape: ModelShape, run: RunShape, given: dict[str, Any]) -> None:
    """A rollout.kv_cache_gib the user set must hold one sequence at full length: a smaller native cache fails in
    the middle of the first rollout (the scheduler cannot re-admit a sequence that outgrew it)."""
    from reinforge.engine.memory_plan import MemoryPlanError, rollout_concurrency

    size = given.get("kv_cache_gib")
    if not size or config.rollout.gpu_memory_utilization is not None or not native_engine_runs(config):
        return
    judge = judge_sequence_gib(run)
    if size < judge:
        raise MemoryPlanError(
            f"rollout.kv_cache_gib={size:g}, which the judge's engine takes too, cannot hold one judge sequence of "
            f"reward.judge.max_prompt_length + reward.judge.max_tokens = {run.judge_length} tokens ({judge:.3g} GiB "
            f"for reward.judge.model_path's model); raise it to at least {math.ceil(judge * 100) / 100:g}, or set it "
            "to auto")
    one = needed_kv_gib(shape, run, share=rollout_concurrency(run.sequences, run.num_devices))
    if size < one:
        length = run.prompt_length + run.response_length
        raise MemoryPlanError(
            f"rollout.kv_cache_gib={size:g} cannot hold one sequence of data.max_prompt_length + "
            f"data.max_response_length = {length} tokens ({one:.3g} GiB with rollout.kv_cache_dtype="
            f"{run.kv_cache_dtype}); raise it to at least {math.ceil(one * 100) / 100:g}, or set it to auto")


def memory_plan(config: Config, gpu_bytes: float | None = None, host_bytes: float | None = None) -> MemoryPlan:
    """The plan for ``config`` on a device of ``gpu_bytes`` (default: this machine's) without changing it."""
    gpu_bytes = gpu_bytes if gpu_bytes is not None else device_memory_bytes(config)
    if gpu_bytes is None:
        raise ValueError("no device to plan for; pass its size (trainer.gpu_memory_gib)")
    return _plan(config, gpu_bytes, host_bytes)[2]


def has_auto_settings(config: Config) -> bool:
    return any(_setting(config, key) == AUTO for key in SETTING_KEYS.values())


def apply_memory_plan(config: Config, log: bool = True) -> MemoryPlan | None:
    """Replace every ``auto`` memory setting of ``config`` (in place) by the plan's; None when this process
    cannot see the run's device (the workers plan then). Raises ``MemoryPlanError`` when nothing fits, and, with
    every setting given, where the native engine's KV cache cannot hold one sequence (``_check_given_settings``)."""
    if not has_auto_settings(config):
        if (gpu_bytes := device_memory_bytes(config)) is not None:
            _check_given_settings(config, _within_card(config, gpu_bytes))
        return None
    gpu_bytes = device_memory_bytes(config)
    if gpu_bytes is None:
        return None
    gpu_bytes = _within_card(config, gpu_bytes)
    shape, run, plan = _plan(config, gpu_bytes)
    for key, value in config_values(plan.settings, shape, run).items():
        if _setting(config, key) == AUTO:
            section, name = key.split(".")
            setattr(getattr(config, section), name, value)
    if log:
        logger.info("%s", plan.table())
    global _last_plan
    _last_plan = plan
    return plan


def _within_card(config: Config, gpu_bytes: float) -> float:
    """``gpu_bytes``, or the card's own memory where trainer.gpu_memory_gib asks for more than the GPU this process
    trains on has (said once in a warning): the cap cannot give more than the card (``cap_device_memory``)."""
    wants_cuda = config.trainer.device in ("cuda", "auto")
    if not config.trainer.gpu_memory_gib or not wants_cuda or not torch.cuda.is_available():
        return gpu_bytes
    card = float(torch.cuda.mem_get_info()[1])
    if gpu_bytes <= card:
        return gpu_bytes
    logger.warning("trainer.gpu_memory_gib=%g is more than the %.1f GiB of this process's GPU; the memory plan is for "
                   "the GPU's %.1f GiB (lower trainer.gpu_memory_gib, or leave it null to plan for the whole GPU)",
                   config.trainer.gpu_memory_gib, card / GiB, card / GiB)
    return card


def cap_device_memory(config: Config, device: torch.device) -> None:
    """With ``trainer.gpu_memory_gib``, make the caching allocator refuse more than that (a smaller card)."""
    if device.type != "cuda" or not config.trainer.gpu_memory_gib:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()  # the call needs an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(config.trainer.gpu_memory_gib * GiB / total, 1.0), index)


_DEVICE_OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|\b(CUDA|HIP|XPU|MPS)( error:)? out of memory")
"""A device's out-of-memory error in an error's text (a worker's, relayed by Ray), not any text naming memory."""


_TORCH_OOM_FIGURES = (("tried to allocate", re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")),
                      ("free", re.compile(r"of which ([\d.]+ [KMGT]?i?B) is free")),
                      ("reserved by PyTorch but unallocated",
                       re.compile(r"([\d.]+ [KMGT]?i?B) is reserved by PyTorch but unallocated")))
"""The figures of torch's out-of-memory message kept in the one line (its advice and the rest are left out)."""


def _allocator_state(text: str) -> str:
    """'; tried to allocate 2.00 GiB, 1.23 GiB free, ...' from torch's message, or '' when it has none of them."""
    figures = [f"{name} {match.group(1)}" if name == "tried to allocate" else f"{match.group(1)} {name}"
               for name, pattern in _TORCH_OOM_FIGURES if (match := pattern.search(text))]
    return f"; {', '.join(figures)}" if figures else ""


def _raised_at(error: BaseException) -> str:
    """'; at reinforge/x.py:12 (function)', the innermost frame of reinforge's own code the error passed through."""
    frame, found = error.__traceback__, None
    while frame is not None:
        path = frame.tb_frame.f_code.co_filename.replace("\\", "/")
        if "/reinforge/" in path and "/tests/" not in path:
            found = (path[path.rindex("/reinforge/") + 1:], frame.tb_lineno, frame.tb_frame.f_code.co_name)
        frame = frame.tb_next
    return f"; at {found[0]}:{found[1]} ({found[2]})" if found else ""


_RELAYED_FRAME = re.compile(r'File "[^"]*/(reinforge/[^"]+\.py)", line (\d+), in (\w+)')
"""A frame of reinforge's code in a traceback relayed as text (a Ray member's, in the error's notes)."""


def _raised_in_worker_at(chain: list[BaseException]) -> str:
    """``_raised_at`` of the innermost error of ``chain`` that passed through reinforge's code: a worker's own error
    under the controller's wrapper, whose frames (or, relayed from a Ray member, whose traceback text) name the
    phase that ran out, where the wrapper's name only the controller's wait."""
    for error in reversed(chain):
        relayed = [frame for frame in _RELAYED_FRAME.findall("\n".join(getattr(error, "__notes__", None) or []))
                   if not frame[0].startswith("reinforge/tests/")]
        if relayed:
            path, line, function = relayed[-1]
            return f"; at {path}:{line} ({function})"
        found = _raised_at(error)
        if found:
            return found
    return ""


def describe_out_of_memory(error: BaseException) -> str | None:
    """One line for a device's out-of-memory error anywhere in ``error``'s chain (a worker's too), else None."""
    chain, seen = [], error
    while seen is not None and len(chain) < 16:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    oom = next((item for item in chain if isinstance(item, torch.OutOfMemoryError)
                or _DEVICE_OUT_OF_MEMORY.search(str(item))), None)
    if oom is None:
        return None
    first_line = (str(oom).strip().splitlines() or [type(oom).__name__])[0]
    where = f"in a worker ({first_line[:160]})" if not isinstance(oom, torch.OutOfMemoryError) else "on the device"
    measured = _allocator_state(str(oom)) + _raised_in_worker_at(chain[chain.index(oom):])
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        measured += f"; measured peak {torch.cuda.max_memory_allocated() / GiB:.1f} GiB"
    plan = ""
    if _last_plan is not None:
        phase, peak = _last_plan.peak
        settings = _last_plan.settings
        plan = (f"; the plan estimated {peak / GiB:.1f} GiB ({phase}) with max_tokens_per_micro_batch="
                f"{settings.micro_batch_tokens}, gradient_checkpointing={settings.checkpoint_layers} layers, "
                f"free_cache_engine={not settings.keep_rollout_memory}")
    return (f"out of memory {where}{measured}{plan}; set lower actor.max_tokens_per_micro_batch or "
            "model.gradient_checkpointing=true, or leave them auto; REINFORGE_DEBUG=1 shows the full traceback")
