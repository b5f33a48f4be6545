"""DAPO's dynamic sampling: generate until ``train_batch_size`` prompt groups carry a learning signal.

A group (the samples of one prompt, one ``uid``) whose metric is the same for every sample
has zero advantage under group estimators and teaches nothing, so it is dropped. Generation
batches of ``data.gen_batch_size`` prompts are drawn, generated and scored until enough groups
are kept; the kept groups are then truncated, in the order they came, to exactly
``data.train_batch_size`` groups. The loader's position moves by whole generation batches, so a
resumed run draws the same prompts as an uninterrupted one.

A step draws as many generation batches as it needs, so with ``trainer.total_steps`` unset the
run counts its epochs by the data drawn, as verl's loop over epochs does: it ends when the
generation batches of ``trainer.total_epochs`` epochs are used up (``RLTrainer.data_used_up``),
and a step that runs out of them in its middle is dropped (``DataExhausted``), its generated
batches with it. ``len(loader) x total_epochs`` steps, the count without dynamic sampling, is
then only an upper bound (the learning-rate schedule's length, as in verl). With
``trainer.total_steps`` set the run trains that many steps, the data repeating as needed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from reinforge.config.schema import FILTER_METRICS, FilterGroupsConfig
from reinforge.engine.forward import build_position_ids
from reinforge.protocol import Batch
from reinforge.rollout.native.counters import combine_spans
from reinforge.trainer.run_loop import DataExhausted

PROMPT_COLUMNS = ("prompts",)
"""Tensors left-padded to the prompt width."""
logger = logging.getLogger(__name__)

ENGINE_METRICS = ("rollout/", "timing_s/gen/")
"""The rollout metrics that count a generation's work (the engine's counters, the phases of its call): a step's
are summed over its generation batches (``combine_spans``). The others (an agent loop's per-trajectory figures,
``agent.runner.agent_metrics``) are combined over the batches' trajectories (``combine_agent_metrics``)."""
SLOWEST = "timing_s/agent_loop/slowest/"
"""The agent loop's slowest trajectory's figures: those of one trajectory, the slowest of every batch."""

UNLIMITED_WARNING_FIRST = 10
"""With max_num_gen_batches=0 (no limit), a step warns after this many generation batches, then at each doubling."""
SEQUENCE_COLUMNS = ("input_ids", "attention_mask")
"""Tensors over prompt + response, left-padded on the prompt side (position_ids is rebuilt)."""


def group_metric(batch: Batch, metric: str) -> np.ndarray:
    """The per-sample value whose spread within a group decides whether the group is kept.

    ``acc`` is the scorer's ``acc`` extra; a sample without one (a scorer that returns a plain
    float, or a failed sample) counts its score before overlong shaping, as verl's DAPO reward
    manager records ``acc = score`` for a scorer that returns a float.
    """
    if metric == "acc":
        scores = _score_before_shaping(batch).tolist()
        accs = batch["reward_acc"] if "reward_acc" in batch else [None] * len(scores)
        return np.array([float(acc) if acc is not None else score for acc, score in zip(accs, scores, strict=True)])
    if metric == "score":
        return _score_before_shaping(batch)
    if metric == "seq_reward":
        return batch["token_level_scores"].sum(-1).double().numpy()
    if metric == "seq_final_reward":
        return batch["token_level_rewards"].sum(-1).double().numpy()
    raise ValueError(f"algorithm.filter_groups.metric={metric!r} is not one of {', '.join(FILTER_METRICS)}")


def _score_before_shaping(batch: Batch) -> np.ndarray:
    """Each sample's score without the overlong penalty (verl's ``score`` extra)."""
    scores = batch["token_level_scores"].sum(-1)
    if "reward_overlong_penalty" in batch:
        scores = scores - torch.tensor([float(value) for value in batch["reward_overlong_penalty"]])
    return scores.double().numpy()


def kept_group_rows(uids: np.ndarray, values: np.ndarray) -> tuple[list[int], int, int]:
    """Rows of the groups whose values vary (a group of one is kept); returns (rows, kept, groups)."""
    members: dict[str, list[int]] = {}
    for row, uid in enumerate(uids):
        members.setdefault(str(uid), []).append(row)
    rows: list[int] = []
    kept = 0
    for group in members.values():
        if len(group) == 1 or np.std(values[group]) > 0:
            rows.extend(group)
            kept += 1
    return rows, kept, len(members)


def first_groups(batch: Batch, num_groups: int) -> Batch:
    """The rows of the first ``num_groups`` distinct uids, in order."""
    chosen: set[str] = set()
    rows = []
    for row, uid in enumerate(batch["uid"]):
        if str(uid) not in chosen and len(chosen) < num_groups:
            chosen.add(str(uid))
        if str(uid) in chosen:
            rows.append(row)
    return batch.index(rows)


def concat_generated(batches: list[Batch], pad_token_id: int) -> Batch:
    """Generated batches whose prompts were padded to different widths, as one batch.

    Prompt-side tensors are left-padded to the widest prompt, position ids rebuilt; response-side
    tensors already share data.max_response_length. Non-tensor columns a batch lacks become None.
    """
    width = max(batch["prompts"].shape[1] for batch in batches)
    padded = []
    for batch in batches:
        missing = width - batch["prompts"].shape[1]
        tensors = dict(batch.tensors)
        if missing:
            for key in PROMPT_COLUMNS + SEQUENCE_COLUMNS:
                if key in tensors:
                    value = pad_token_id if key in ("prompts", "input_ids") else 0
                    tensors[key] = torch.nn.functional.pad(tensors[key], (missing, 0), value=value)
            if "position_ids" in tensors:
                tensors["position_ids"] = build_position_ids(tensors["attention_mask"])
        padded.append(Batch(tensors, dict(batch.non_tensors), dict(batch.meta)))
    keys = sorted({key for batch in padded for key in batch.non_tensors})
    for batch in padded:
        for key in keys:
            if key not in batch.non_tensors:
                batch.non_tensors[key] = np.full(len(batch), None, dtype=object)
    return Batch.concat(padded)


def combine_reward_metrics(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The reward metrics of several scoring calls (each call's metrics and its number of samples) as one call's:
    a mean (``*/mean``: a reward model's or a judge's score) weighted by the calls' samples, the others (counts of
    errors and timeouts, seconds) summed."""
    combined: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics, samples in parts:
        for name, value in metrics.items():
            mean = name.endswith("/mean")
            combined[name] = combined.get(name, 0.0) + (value * samples if mean else value)
            if mean:
                weights[name] = weights.get(name, 0.0) + samples
    for name, weight in weights.items():
        combined[name] /= max(weight, 1)
    return combined


def combine_agent_metrics(spans: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The agent loop's per-trajectory metrics of several generation batches (each batch's metrics and its number of
    samples) as those of all their trajectories: ``*/min`` the smallest, ``*/max`` the largest, ``*/mean`` the mean
    weighted by the batches' samples, the slowest trajectory's figures the slowest batch's, and the totals (tool
    errors, calls, ``agent/tool/*``) summed."""
    combined: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics, samples in spans:
        for name, value in metrics.items():
            if name.startswith(SLOWEST):
                continue
            if name not in combined:
                combined[name] = value * samples if name.endswith("/mean") else value
                weights[name] = samples
            elif name.endswith("/min"):
                combined[name] = min(combined[name], value)
            elif name.endswith("/max"):
                combined[name] = max(combined[name], value)
            elif name.endswith("/mean"):
                combined[name] += value * samples
                weights[name] += samples
            else:
                combined[name] += value
    for name in combined:
        if name.endswith("/mean"):
            combined[name] /= max(weights[name], 1)
    with_slowest = [metrics for metrics, _ in spans if any(name.startswith(SLOWEST) for name in metrics)]
    if with_slowest:
        slowest = max(with_slowest, key=lambda metrics: metrics.get(f"{SLOWEST}generate_sequences", 0.0)
                      + metrics.get(f"{SLOWEST}tool_calls", 0.0))
        combined |= {name: value for name, value in slowest.items() if name.startswith(SLOWEST)}
    return combined


def _warns_at(num_gen_batches: int) -> bool:
    """10, 20, 40, 80... generation batches (``UNLIMITED_WARNING_FIRST`` and its doublings)."""
    times, rest = divmod(num_gen_batches, UNLIMITED_WARNING_FIRST)
    return rest == 0 and times > 0 and times & (times - 1) == 0


def collect_kept_groups(first: Batch, next_prompts: Callable[[], Batch], generate_scored: Callable[[Batch], Batch],
                        config: FilterGroupsConfig, num_groups: int,
                        pad_token_id: int) -> tuple[Batch, dict[str, float]]:
    """Generate and score batches of prompts (``first``, then ``next_prompts()``) until ``num_groups``
    groups pass the filter; returns the rows of the first ``num_groups`` kept groups and the metrics ``train/num_gen_batches``, ``train/kept_group_fraction`` and ``train/num_kept_groups``.
    The rows' meta has the reward counts, the engine's rollout metrics and the agent loop's of every generation batch.
    """
    kept: list[Batch] = []
    engine_spans: list[dict[str, float]] = []
    agent_spans: list[tuple[dict[str, float], int]] = []
    reward_parts: list[tuple[dict[str, float], int]] = []
    num_kept = num_generated = num_gen_batches = num_samples = 0
    prompts = first
    while True:
        num_gen_batches += 1
        scored = generate_scored(prompts)
        rows, kept_here, groups_here = kept_group_rows(scored["uid"], group_metric(scored, config.metric))
        num_generated += groups_here
        num_kept += kept_here
        reward_parts.append((scored.meta.get("reward_metrics", {}), len(scored)))
        num_samples += len(scored)
        generated = scored.meta.get("rollout_metrics", {})
        engine_spans.append({key: value for key, value in generated.items() if key.startswith(ENGINE_METRICS)})
        agent_spans.append(({key: value for key, value in generated.items() if not key.startswith(ENGINE_METRICS)},
                            len(scored)))
        kept.append(scored.index(rows))
        if num_kept >= num_groups:
            break
        if 0 < config.max_num_gen_batches <= num_gen_batches:
            raise RuntimeError(
                f"dynamic sampling kept {num_kept} of the data.train_batch_size={num_groups} prompt groups it needs "
                f"after algorithm.filter_groups.max_num_gen_batches={config.max_num_gen_batches} generation batches "
                f"(the metric {config.metric} was the same for every sample of the others); raise "
                "max_num_gen_batches (0 means no limit) or data.gen_batch_size, or use easier or harder data")
        if config.max_num_gen_batches == 0 and _warns_at(num_gen_batches):
            logger.warning("dynamic sampling has kept %d of the data.train_batch_size=%d prompt groups one step needs "
                           "after %d generation batches, and algorithm.filter_groups.max_num_gen_batches=0 sets no "
                           "limit (the metric %s was the same for every sample of the others): check the scorer, "
                           "or set max_num_gen_batches to stop the run", num_kept, num_groups, num_gen_batches,
                           config.metric)
        try:
            prompts = next_prompts()
        except DataExhausted as exhausted:
            raise DataExhausted(f"{exhausted} while the step in progress had kept only {num_kept} of the "
                                f"data.train_batch_size={num_groups} prompt groups it needs (its {num_gen_batches} "
                                "generation batch(es) are dropped)", exhausted.fix) from None
    merged = first_groups(concat_generated(kept, pad_token_id), num_groups)
    reward_metrics = combine_reward_metrics(reward_parts)
    if "reward/overlong/count" in reward_metrics:  # over every sample generated, like the counts
        reward_metrics["reward/overlong/fraction"] = reward_metrics["reward/overlong/count"] / max(num_samples, 1)
    merged.meta["reward_metrics"] = reward_metrics
    # the engine's counts and phases, and the agent loop's figures, over every generation batch
    merged.meta["rollout_metrics"] = combine_agent_metrics(agent_spans) | combine_spans(engine_spans)
    metrics = {"train/num_gen_batches": float(num_gen_batches), "train/num_kept_groups": float(num_kept),
               "train/kept_group_fraction": num_kept / max(num_generated, 1)}
    return merged, metrics

