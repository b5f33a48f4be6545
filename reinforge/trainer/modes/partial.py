"""Prompt groups in flight: samples generated segment by segment, each token tagged with its policy version.

A ``PromptGroup`` is one prompt and its n ``PartialSample``s. ``run_segment`` extends every
unfinished sample by at most ``segment_tokens`` tokens under the rollout's current weights
(version ``version``): the request is the prompt plus the tokens so far, so the engine
recomputes their KV cache under those weights, and the sample keeps its seed and
position-keyed noise, so under unchanged weights a sample generated in segments is the sample
generated whole. ``group_batch`` turns a finished group into the rows ``generate`` would have
returned, plus ``token_versions``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from reinforge.engine.forward import build_position_ids
from reinforge.protocol import MULTI_MODAL_KEY, Batch
from reinforge.rollout.base import SamplingParams


@dataclass
class PartialSample:
    sample_index: int
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The policy version (weight syncs so far) that sampled each token."""
    budget: int | None = None
    """This sample's length limit, below the sampling's max_tokens (benchmarks draw long-tailed ones)."""
    finished: bool = False
    stopped: bool = False
    """Ended by a stop token (not by the length budget)."""


@dataclass
class PromptGroup:
    position: int
    """Admission order (0, 1, ...): the group came from loader batch position // train_batch_size."""
    prompt_ids: list[int]
    columns: dict[str, Any]
    """The prompt row's non-tensor columns (uid, data_source, ground_truth, ...)."""
    request_seed: int
    samples: list[PartialSample]

    @property
    def uid(self) -> str:
        return str(self.columns["uid"])

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "prompt_ids": self.prompt_ids, "columns": self.columns,
                "request_seed": self.request_seed, "samples": [sample.__dict__.copy() for sample in self.samples]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PromptGroup:
        return cls(state["position"], state["prompt_ids"], state["columns"], state["request_seed"],
                   [PartialSample(**sample) for sample in state["samples"]])


def refuse_agent_rows(agent_names: Iterable[Any]) -> None:
    """trainer.mode=async runs no agent loop: one line naming the loops that rows ask for (the trainer checks its
    dataset with it before any model loads, and every prompt batch again)."""
    agents = {str(name) for name in agent_names if name not in (None, "", "single_turn")}
    if agents:
        raise ValueError(f"trainer.mode=async generates plain samples in segments, but rows use the agent loops "
                         f"{sorted(agents)}; train agent rows with trainer.mode=sync or one_step_off")


def groups_from_prompts(prompts: Batch, first_position: int, n: int,
                        seed_of: Callable[[int, str], int]) -> list[PromptGroup]:
    """One group per prompt row; ``seed_of(position, uid)`` is the request seed sync mode would use. An optional
    ``sample_max_tokens`` column gives each prompt's n per-sample length budgets."""
    refuse_agent_rows(prompts.get("agent_name", []))
    groups = []
    for row in range(len(prompts)):
        ids = prompts["input_ids"][row][prompts["attention_mask"][row].bool()].tolist()
        columns = {key: values[row] for key, values in prompts.non_tensors.items()}
        position = first_position + row
        budgets = columns.pop("sample_max_tokens", None) or [None] * n
        groups.append(PromptGroup(position, ids, columns, seed_of(position, str(columns["uid"])),
                                  [PartialSample(index, budget=budgets[index]) for index in range(n)]))
    return groups


def run_segment(generate: Callable[[Batch, SamplingParams], Batch], groups: list[PromptGroup],
                sampling: SamplingParams, segment_tokens: int, version: int, pad_token_id: int) -> int:
    """Extend every unfinished sample of ``groups`` by up to ``segment_tokens`` tokens; returns tokens made. A
    vision-language prompt's images (its ``MULTI_MODAL_KEY`` column) go with every request, as in sync mode."""
    work = [(group, sample) for group in groups for sample in group.samples if not sample.finished]
    if not work:
        return 0
    sequences = [group.prompt_ids + sample.tokens for group, sample in work]
    longest = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(work), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(work), longest), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, longest - len(sequence):] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, longest - len(sequence):] = 1
    batch = Batch.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask},
        non_tensors={"uid": [f"{group.uid}#{sample.sample_index}" for group, sample in work],
                     "request_seed": [group.request_seed for group, _ in work],
                     "sample_index": [sample.sample_index for _, sample in work]})
    if any(MULTI_MODAL_KEY in group.columns for group, _ in work):  # a vision-language prompt's pixels and grids
        batch.non_tensors[MULTI_MODAL_KEY] = _repeated_rows([group.columns.get(MULTI_MODAL_KEY) or {}
                                                             for group, _ in work])
    if any(sample.budget is not None for _, sample in work):
        batch.non_tensors["max_tokens"] = np.array(
            [min(segment_tokens, limit(sample, sampling) - len(sample.tokens)) for _, sample in work], dtype=object)
    output = generate(batch, SamplingParams(**{**sampling.__dict__, "max_tokens": segment_tokens}))
    lengths = output["response_mask"].sum(-1).long().tolist()
    made = 0
    for row, (_, sample) in enumerate(work):
        length = min(lengths[row], limit(sample, sampling) - len(sample.tokens))
        sample.tokens += output["responses"][row, :length].tolist()
        sample.log_probs += output["rollout_log_probs"][row, :length].tolist()
        sample.versions += [version] * length
        made += length
        sample.stopped = bool(output["finished_by_stop"][row])
        sample.finished = sample.stopped or len(sample.tokens) >= limit(sample, sampling)
    return made


def limit(sample: PartialSample, sampling: SamplingParams) -> int:
    return sampling.max_tokens if sample.budget is None else min(sample.budget, sampling.max_tokens)


def group_batch(group: PromptGroup, response_length: int, pad_token_id: int) -> Batch:
    """The finished group as ``generate`` returns it (n rows), with ``token_versions`` (-1 past the end)."""
    n, prompt_length = len(group.samples), len(group.prompt_ids)
    prompts = torch.tensor([group.prompt_ids] * n, dtype=torch.long).reshape(n, prompt_length)
    responses = torch.full((n, response_length), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros((n, response_length), dtype=torch.float32)
    versions = torch.full((n, response_length), -1, dtype=torch.long)
    mask = torch.zeros((n, response_length), dtype=torch.float32)
    for row, sample in enumerate(group.samples):
        length = len(sample.tokens)
        responses[row, :length] = torch.tensor(sample.tokens, dtype=torch.long)
        log_probs[row, :length] = torch.tensor(sample.log_probs, dtype=torch.float32)
        versions[row, :length] = torch.tensor(sample.versions, dtype=torch.long)
        mask[row, :length] = 1.0
    attention_mask = torch.cat([torch.ones((n, prompt_length), dtype=torch.long), mask.long()], dim=1)
    return Batch.from_dict(
        tensors={"prompts": prompts, "responses": responses, "response_mask": mask,
                 "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
                 "position_ids": build_position_ids(attention_mask), "rollout_log_probs": log_probs,
                 "finished_by_stop": torch.tensor([sample.stopped for sample in group.samples]),
                 "token_versions": versions},
        non_tensors={key: _repeated(value, n) for key, value in group.columns.items()})


def _repeated_rows(values: list[Any]) -> np.ndarray:
    """``values`` as an object column, one item a row (dicts stay dicts)."""
    column = np.empty(len(values), dtype=object)
    for row, value in enumerate(values):
        column[row] = value
    return column


def _repeated(value: Any, n: int) -> np.ndarray:
    column = np.empty(n, dtype=object)
    for row in range(n):
        column[row] = value
    return column
