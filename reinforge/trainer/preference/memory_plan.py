"""The memory plan of a preference run: ``trainer.max_tokens_per_micro_batch`` and ``model.gradient_checkpointing``.

A step of ``reinforge dpo`` or ``reinforge rm`` is one update, so the RL planner's update estimate
(``engine.memory_plan.estimate``) sizes it, a pair standing for a prompt group of two samples: ``data.batch_size``
pairs a step spread over the ranks, each its prompt once plus its two completions, at the longest prompt and the
longest completion of the run's pairs (training and validation), cut into micro-batches as
``pairs.pair_micro_batches`` cuts them (a pair never splits, so a budget holds one at least). What an RL run's
rollout adds (the engine's weights, its KV cache) is absent. A reward model computes no logits over the
vocabulary. DPO's stored reference log-probs take 8 bytes a pair; a reference model loaded from
``dpo.reference_path`` exists only during the reference pass, a phase of its own: its float32 shards beside the
policy for one training forward at a time, before any gradient or optimizer state exists (a resumed run scores
before its checkpoint loads).

Settings left ``auto`` get the fastest values that fit (the fewest micro-batches, then the fewest recomputed
layers, logits kept for the backward: the RL planner's costs, the update being the whole step; on one device,
parameters kept gathered from each forward to its backward, so a step gathers them and reduces the gradients
once, when the whole model's compute-dtype copy fits beside the rest); a value a user gave is kept, and a run that cannot fit is refused in one line before the model loads. On the CPU ``auto`` keeps
a fixed budget (``CPU_MICRO_BATCH_TOKENS``, or the longest pair) and recomputes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reinforge.config.preference_schema import DPOConfig, RMConfig
from reinforge.data.preference_dataset import PreferencePair
from reinforge.engine.device import compute_dtype
from reinforge.engine.log_probs import MAX_LOGITS_BYTES
from reinforge.engine.memory_plan import (
    CHUNKED_LOGITS_COST,
    HEADROOM,
    LORA_PROJECTIONS,
    MICRO_BATCH_CANDIDATES,
    MICRO_BATCH_OVERHEAD_TOKENS,
    GiB,
    MemoryPlan,
    MemoryPlanError,
    ModelShape,
    RunShape,
    Settings,
    cheapest_plan,
    checkpoint_choices,
    estimate,
    micro_batch_split,
)
from reinforge.workers.memory_settings import _adapted_projections

AUTO = "auto"
CPU_MICRO_BATCH_TOKENS = 16384
"""The budget ``auto`` gives on the CPU (no device memory to plan for)."""
GATHER_COST = 0.015
"""Step-time fraction of gathering each layer's parameters again for its backward: on one H200 a 1.5B DPO step in
two micro-batches spent about 3% of its 1.38 s on the copies of its four gathers a layer."""
PLANNED = ("micro_batch_tokens", "checkpoint_layers", "logits_buffer_gib", "keep_gathered")
"""The ``PairSettings`` fields a preference plan chooses."""


@dataclass
class PairSettings(Settings):
    """The RL planner's settings, and whether the layers keep their gathered parameters from forward to backward."""

    keep_gathered: bool = False
    """One device only: the whole model's compute-dtype copy is held through each forward and backward."""


@dataclass(frozen=True)
class PairShape:
    """What a step of a preference run puts through the model, per the data (lengths are the run's maxima)."""

    pairs: int
    """Pairs a step (data.batch_size), over every rank."""
    prompt_length: int
    completion_length: int
    num_devices: int = 1
    dtype_bytes: int = 2
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LORA_PROJECTIONS
    vocabulary_logits: bool = True
    """DPO's log-probs come from logits over the vocabulary; a reward model's head has one output."""
    reference_model: bool = False
    """DPO with dpo.reference_path: a second model is loaded for the reference pass."""

    @property
    def pair_tokens(self) -> int:
        """Packed tokens of the largest pair: its prompt once and both completions."""
        return self.prompt_length + 2 * self.completion_length

    def run(self) -> RunShape:
        """The RL planner's shape of the same step: a pair is a prompt with two samples."""
        return RunShape(prompts=self.pairs, samples_per_prompt=2, prompt_length=self.prompt_length,
                        response_length=self.completion_length, num_devices=self.num_devices,
                        dtype_bytes=self.dtype_bytes, lora_rank=self.lora_rank, lora_targets=self.lora_targets)


def micro_batches_of(pair: PairShape, budget: int) -> tuple[int, int]:
    """(micro-batches a step on one rank, packed tokens of the largest) at full lengths."""
    return micro_batch_split(pair.run(), max(budget, pair.pair_tokens))


def estimate_pairs(shape: ModelShape, pair: PairShape, settings: Settings) -> dict[str, dict[str, float]]:
    """Bytes per consumer on one device: the ``update`` phase, and the ``reference pass`` with a reference model."""
    phases, _ = estimate(shape, pair.run(), dataclasses.replace(settings, keep_rollout_memory=False))
    update = phases["update"]
    if getattr(settings, "keep_gathered", False):  # every layer's and the root's, in the compute dtype
        update["gathered parameters"] = pair.dtype_bytes * shape.num_params
    if not pair.vocabulary_logits:
        update.pop("logits")
        update.pop("head gradient")
    estimated = {"update": update}
    if pair.reference_model:
        reference = {name: value for name, value in update.items() if name not in ("gradients", "optimizer state")}
        reference["reference model"] = 4 * shape.num_params / pair.num_devices  # loaded in float32, sharded
        estimated["reference pass"] = reference
    return estimated


def _choices(shape: ModelShape, pair: PairShape) -> dict[str, list[tuple[Any, float]]]:
    """Each planned setting's values, fastest first, with the step-time fraction each adds."""
    sizes = [size for size in MICRO_BATCH_CANDIDATES if size >= pair.pair_tokens] or [pair.pair_tokens]
    fewest = micro_batches_of(pair, sizes[0])[0]
    step_tokens = max(pair.run().mini_batch_tokens, 1)
    return {
        "micro_batch_tokens": [(size, MICRO_BATCH_OVERHEAD_TOKENS * (micro_batches_of(pair, size)[0] - fewest)
                                / step_tokens) for size in sizes],
        "checkpoint_layers": checkpoint_choices(shape),
        "logits_buffer_gib": [(24.0, 0.0), (0.0, CHUNKED_LOGITS_COST)] if pair.vocabulary_logits else [(24.0, 0.0)],
        "keep_gathered": [(True, 0.0), (False, GATHER_COST)] if pair.num_devices == 1 else [(False, 0.0)],
    }


def step_cost(shape: ModelShape, pair: PairShape, settings: PairSettings) -> float:
    """The step-time fraction ``settings`` add over the fastest settings (the sum the search minimises)."""
    choices = _choices(shape, pair)
    return sum(dict(choices[name]).get(getattr(settings, name), 0.0) for name in PLANNED)


def _search(shape: ModelShape, pair: PairShape, given: dict[str, Any],
            gpu_bytes: float) -> tuple[MemoryPlan | None, MemoryPlan]:
    """(the cheapest plan that fits or None, the smallest plan tried); on a tie, the larger micro-batch."""
    choices = {name: ([(given[name], 0.0)] if name in given else values)
               for name, values in _choices(shape, pair).items()}

    def make(values: dict[str, Any]) -> MemoryPlan:
        settings = PairSettings(**values)
        return MemoryPlan(settings, set(given), estimate_pairs(shape, pair, settings), {}, gpu_bytes * HEADROOM,
                          float("inf"))

    return cheapest_plan(choices, make, lambda plan: plan.peak[1])


def plan_pairs(shape: ModelShape, pair: PairShape, given: dict[str, Any], gpu_bytes: float,
               command: str = "dpo") -> MemoryPlan:
    """The fastest settings of ``PLANNED`` that fit ``gpu_bytes``; ``given`` holds those a user set (by ``Settings``
    field name). Raises ``MemoryPlanError`` (one line: the peak, its largest consumers and what would fit)."""
    best, smallest = _search(shape, pair, given, gpu_bytes)
    if best is not None:
        return best
    phase, peak = smallest.peak
    fixes = []
    if given and _search(shape, pair, {}, gpu_bytes)[0] is not None:
        fixes.append(" and ".join(f"{CONFIG_KEYS[name]}=auto" for name in given))
    else:
        half = max(pair.completion_length // 2, 1)
        options = [("model.lora.rank=32", dataclasses.replace(pair, lora_rank=32, reference_model=False)),
                   (f"completions of at most {half} tokens (data.max_length)",
                    dataclasses.replace(pair, completion_length=half)),
                   (f"{2 * pair.num_devices} devices (torchrun --nproc_per_node)",
                    dataclasses.replace(pair, num_devices=2 * pair.num_devices))]
        fixes = [text for text, option in options if option != pair and _search(shape, option, given, gpu_bytes)[0]]
    advice = " or ".join(fixes) if fixes else "a larger device or a smaller model"
    message = (f"the {command} run does not fit the device: pairs of up to {pair.prompt_length} + 2 x "
                   f"{pair.completion_length} tokens need {peak / GiB:.1f} GiB per device at the {phase} peak even "
                   f"with {describe(smallest.settings, shape)}, but {smallest.gpu_budget / GiB:.1f} GiB are usable "
                   f"({smallest.largest_consumers()}); it would fit with {advice}")
    raise MemoryPlanError(message)


CONFIG_KEYS = {"micro_batch_tokens": "trainer.max_tokens_per_micro_batch",
               "checkpoint_layers": "model.gradient_checkpointing"}
"""The config keys of the planned settings a user can set (the logits' buffer has none: the plan's own)."""


def describe(settings: PairSettings, shape: ModelShape) -> str:
    layers = settings.checkpoint_layers
    recompute = ("no layer recomputed" if layers == 0 else "every layer recomputed" if layers >= shape.num_layers
                 else f"{layers} of {shape.num_layers} layers recomputed")
    logits = "logits kept" if settings.logits_buffer_gib else "logits in chunks"
    gathered = ", parameters kept gathered for the backward" if settings.keep_gathered else ""
    return f"micro-batches of {settings.micro_batch_tokens} tokens, {recompute}, {logits}{gathered}"


def checkpoint_setting(layers: int, shape: ModelShape) -> bool | int:
    """model.gradient_checkpointing's value for recomputing ``layers`` decoder layers."""
    return True if layers >= shape.num_layers else False if layers == 0 else layers


@dataclass
class PreferencePlan:
    """What the trainer applies: the config's auto settings are replaced in place; the rest is here."""

    line: str
    """The plan in one line, logged at start."""
    max_logits_bytes: int = MAX_LOGITS_BYTES
    """A micro-batch's logits are kept for the backward up to this size (``engine.forward.response_log_probs``)."""
    keep_gathered: bool = False
    """Each layer keeps its gathered parameters from its forward to its backward (``engine.fsdp.shard_model``)."""
    plan: MemoryPlan | None = None
    """None on the CPU."""


def pair_shape_of(config: RMConfig | DPOConfig, pairs: Sequence[PreferencePair], device: torch.device,
                  num_devices: int) -> PairShape:
    """The step's shape: ``data.batch_size`` pairs at the longest prompt and completion of ``pairs``."""
    # a pair without a prompt (rm) runs its completions' first tokens as the prompt (collate_pairs)
    prompt = max((len(pair.prompt_ids) or 1 for pair in pairs), default=1)
    completion = max((max(len(pair.chosen_ids), len(pair.rejected_ids)) for pair in pairs), default=1)
    dpo = isinstance(config, DPOConfig)
    lora = config.model.lora
    return PairShape(pairs=config.data.batch_size, prompt_length=prompt, completion_length=completion,
                     num_devices=num_devices, dtype_bytes=compute_dtype(device, config.model.dtype).itemsize,
                     lora_rank=int(lora.rank or 0), lora_targets=_adapted_projections(lora), vocabulary_logits=dpo,
                     reference_model=dpo and config.dpo.reference_path not in (None, config.model.path))


def given_settings(config: RMConfig | DPOConfig, num_layers: int) -> dict[str, Any]:
    """The planned settings a user set, by ``Settings`` field name (``auto`` ones are absent)."""
    given: dict[str, Any] = {}
    budget = config.trainer.max_tokens_per_micro_batch
    if budget != AUTO:
        given["micro_batch_tokens"] = int(budget)
    checkpointing = config.model.gradient_checkpointing
    if checkpointing != AUTO:
        given["checkpoint_layers"] = (num_layers if checkpointing is True else 0 if checkpointing is False
                                      else min(int(checkpointing), num_layers))
    return given


def apply_preference_plan(config: RMConfig | DPOConfig, pairs: Sequence[PreferencePair], device: torch.device,
                          num_devices: int, gpu_bytes: float | None = None) -> PreferencePlan:
    """Replace ``config``'s auto budget and recompute by the plan's, in place, before the model loads.

    ``pairs``: every pair of the run (training and validation). ``gpu_bytes``: the device's memory (default: the
    device's own). Raises ``MemoryPlanError`` when nothing fits.
    """
    command = "dpo" if isinstance(config, DPOConfig) else "rm"
    trainer, model = config.trainer, config.model
    if device.type != "cuda" and gpu_bytes is None:
        longest = max((len(pair.prompt_ids) + len(pair.chosen_ids) + len(pair.rejected_ids) for pair in pairs),
                      default=1)
        chosen = trainer.max_tokens_per_micro_batch == AUTO
        if chosen:
            trainer.max_tokens_per_micro_batch = max(CPU_MICRO_BATCH_TOKENS, longest)
        return PreferencePlan(f"memory plan ({device.type}): trainer.max_tokens_per_micro_batch="
                              f"{trainer.max_tokens_per_micro_batch} ({'auto: a fixed budget' if chosen else 'set'}), "
                              f"model.gradient_checkpointing={model.gradient_checkpointing}"
                              + (" (no layer recomputed)" if model.gradient_checkpointing == AUTO else ""))
    shape = ModelShape.from_model_path(model.path)
    pair = pair_shape_of(config, pairs, device, num_devices)
    if gpu_bytes is None:
        gpu_bytes = float(torch.cuda.mem_get_info(device)[1])
    given = given_settings(config, shape.num_layers)
    plan = plan_pairs(shape, pair, given, gpu_bytes, command)
    settings = plan.settings
    if "micro_batch_tokens" not in given:
        trainer.max_tokens_per_micro_batch = settings.micro_batch_tokens
    if "checkpoint_layers" not in given:
        model.gradient_checkpointing = checkpoint_setting(settings.checkpoint_layers, shape)
    num_micro, largest = micro_batches_of(pair, settings.micro_batch_tokens)
    phase, peak = plan.peak
    consumers = sorted(plan.phases[phase].items(), key=lambda item: -item[1])
    line = (f"memory plan: trainer.max_tokens_per_micro_batch={trainer.max_tokens_per_micro_batch} "
            f"({'set' if 'micro_batch_tokens' in given else 'auto'}; {num_micro} micro-batch(es) a step of up to "
            f"{largest} tokens, {pair.pairs} pairs of up to {pair.prompt_length} + 2 x {pair.completion_length}), "
            f"model.gradient_checkpointing={model.gradient_checkpointing} "
            f"({'set' if 'checkpoint_layers' in given else 'auto'}), "
            f"logits {'kept' if settings.logits_buffer_gib else 'in chunks'}, parameters "
            f"{'kept gathered for the backward' if settings.keep_gathered else 'gathered again for the backward'}; "
            f"peak {peak / GiB:.1f} of "
            f"{plan.gpu_budget / GiB:.1f} usable GiB ({phase}: "
            + ", ".join(f"{name} {value / GiB:.1f}" for name, value in consumers if value > 0) + ")")
    return PreferencePlan(line, int(settings.logits_buffer_gib * GiB), bool(settings.keep_gathered), plan)
