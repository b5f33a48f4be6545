"""Validation metrics: mean@N, best@N and maj@N per data source.

Each prompt is answered N times. A row without a ``data_source`` (a Python API run's rows have none) counts under
``UNNAMED_DATA_SOURCE``. ``mean@N`` averages every sample, ``best@N`` takes each
prompt's best sample, ``maj@N`` scores the answer most samples agree on (the scorer's
``pred`` extra; the response text when the scorer gives none). Metrics cover the score
("reward") and every numeric extra the scorer returns (such as ``acc``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from reinforge.protocol import MULTI_MODAL_KEY, Batch, samples_of
from reinforge.rollout.base import SamplingParams
from reinforge.workers.reward import raise_if_every_row_failed

UNNAMED_DATA_SOURCE = "default"
"""The data source in the metric names of rows that have none: ``val-core/default/reward/mean@1``."""


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float, bool)) and not isinstance(value, str)


def summarize_validation(records: list[dict[str, Any]], num_samples: int) -> dict[str, float]:
    """records: one per sample with ``data_source``, ``uid``, ``reward``, optional ``pred`` and extras."""
    groups: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        groups[record["data_source"] or UNNAMED_DATA_SOURCE][record["uid"]].append(record)
    metrics: dict[str, float] = {}
    for source, prompts in groups.items():
        first = next(iter(prompts.values()))[0]
        metric_names = [key for key, value in first.items()
                        if key not in ("data_source", "uid", "pred", "response") and _numeric(value)]
        for name in metric_names:
            per_prompt = [[float(sample[name]) for sample in samples if _numeric(sample.get(name))]
                          for samples in prompts.values()]
            per_prompt = [values for values in per_prompt if values]
            if not per_prompt:
                continue
            prefix = f"val-core/{source}/{name}"
            metrics[f"{prefix}/mean@{num_samples}"] = sum(sum(v) / len(v) for v in per_prompt) / len(per_prompt)
            if num_samples > 1:
                metrics[f"{prefix}/best@{num_samples}"] = sum(max(v) for v in per_prompt) / len(per_prompt)
                majority = []
                for samples in prompts.values():
                    votes = Counter(str(sample.get("pred", sample.get("response"))) for sample in samples)
                    winner = votes.most_common(1)[0][0]
                    chosen = next(s for s in samples if str(s.get("pred", s.get("response"))) == winner)
                    majority.append(float(chosen[name]))
                metrics[f"{prefix}/maj@{num_samples}"] = sum(majority) / len(majority)
    return metrics


def without_prompt_tensors(batch: Batch) -> Batch:
    """The batch minus the prompt-only tensors that generation replaces with whole sequences (and the prompts'
    images, which generation returns with the images its tools added)."""
    kept = Batch(dict(batch.tensors), dict(batch.non_tensors), dict(batch.meta))
    kept.tensors.pop("input_ids", None)
    kept.tensors.pop("attention_mask", None)
    kept.non_tensors.pop(MULTI_MODAL_KEY, None)
    return kept


def reward_extras(batch: Batch) -> dict[str, list]:
    """The scorer's per-sample extras (acc, pred, ...) from the reward_<key> columns."""
    return {key.removeprefix("reward_"): list(values) for key, values in batch.non_tensors.items()
            if key.startswith("reward_")}


def run_validation(prompt_batches: Iterable[Batch], num_samples: int, sampling: SamplingParams, seed: int,
                   generate: Callable[[Batch, SamplingParams, int], Batch],
                   score: Callable[[Batch], Batch]) -> dict[str, float]:
    """Answer every prompt ``num_samples`` times with ``generate(batch, sampling, seed)``, score with ``score``, summarise."""
    records: list[dict[str, Any]] = []
    for prompts in prompt_batches:
        batch = samples_of(prompts, num_samples)
        batch = without_prompt_tensors(batch) | generate(batch, sampling, seed)
        batch = batch | raise_if_every_row_failed(score(batch))
        scores = batch["token_level_scores"].sum(-1)
        extras = reward_extras(batch)
        for row in range(len(batch)):
            record = {"data_source": batch["data_source"][row], "uid": batch["uid"][row], "reward": float(scores[row])}
            record |= {key: values[row] for key, values in extras.items()}
            records.append(record)
    return summarize_validation(records, num_samples)
