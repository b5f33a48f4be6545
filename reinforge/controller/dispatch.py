"""What each dispatch mode does with the controller's arguments and the members' results.

``plan_member_calls`` turns one group call into the arguments of each member it runs on;
``collect_results`` turns the members' results (in rank order) into the group's result.

DP_COMPUTE gathers member results by type:
  - ``Batch``: concatenated in rank order with the split's padding rows removed (a share of padding alone is left
    out whole, its columns unread: a member returns placeholders for padding rows, not their results); a meta value
    that is a dict of metrics on every member (``rollout_metrics``, ``mismatch_metrics``) is
    merged like the metrics below, except that the names a member lists in its meta's
    ``summed_metrics`` (totals over its rows: an agent loop's tool errors) are added up; any other
    meta value comes from rank 0, so per-row values belong in columns, not in meta; the names it lists in
    ``row_means`` (means over its rows that count: a fraction of its samples) are weighted by each member's rows,
    padding left out, so that an uneven split gives the mean over the batch's rows (``row_means`` may instead map
    each name to the number of rows its mean is over, for a mean over only some rows: the external agents' ones);
  - ``dict`` (metrics): numeric values are averaged over the members (each member saw an equal
    share of rows, padding included; names with the word ``max``, ``peak`` or ``slowest`` take the
    largest, with ``min`` the smallest), other values come from rank 0;

A member's chunk names in its meta ``padding_rows`` how many of its last rows are padding (copies of other
rows, added when the rows do not split evenly): a worker that reports totals over its rows leaves them out, and
one whose work on a row costs or acts outside it (generation, agent tools, reward scorers) skips them, returning a
placeholder row of the right shape for each, so that nothing runs twice for a row.
  - ``tuple``: gathered position by position with these same rules;
  - ``None`` from every member: ``None``; anything else: the list of results.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from reinforge.controller.register import Dispatch, MethodSpec
from reinforge.protocol import EMPTY_VALUES, LEFT_PADDED, Batch

Arguments = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class CallPlan:
    member_arguments: list[Arguments]
    """Arguments of member 0, 1, ... of the members that run (only member 0 for rank-zero calls)."""
    num_padding: int = 0
    """DP_COMPUTE: rows of padding added to split the batch evenly."""
    chunk_size: int = 0
    """DP_COMPUTE: rows per member."""


def plan_member_calls(spec: MethodSpec, method_name: str, num_members: int,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallPlan:
    if spec.runs_on_rank_zero_only:
        return CallPlan([(args, kwargs)])
    if spec.dispatch is Dispatch.ONE_TO_ALL:
        return CallPlan([(args, kwargs)] * num_members)
    if spec.dispatch is Dispatch.ALL_TO_ALL:
        return _plan_all_to_all(method_name, num_members, args, kwargs)
    if spec.dispatch is Dispatch.DP_COMPUTE:
        return _plan_dp_compute(method_name, num_members, args, kwargs)
    raise AssertionError(f"unhandled dispatch mode {spec.dispatch}")


def _plan_all_to_all(method_name: str, num_members: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallPlan:
    named = {**{f"argument {index}": value for index, value in enumerate(args)}, **kwargs}
    for name, value in named.items():
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != num_members:
            raise ValueError(f"{method_name} is ALL_TO_ALL: {name} must be a list with one element per member "
                             f"({num_members}), got {type(value).__name__}"
                             + (f" of length {len(value)}" if isinstance(value, Sequence) else ""))
    return CallPlan([(tuple(value[rank] for value in args), {key: value[rank] for key, value in kwargs.items()})
                     for rank in range(num_members)])


def _plan_dp_compute(method_name: str, num_members: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallPlan:
    batch_lengths = {name: len(value) for name, value in
                     [*((f"argument {index}", value) for index, value in enumerate(args)), *kwargs.items()]
                     if isinstance(value, Batch)}
    if not batch_lengths:
        raise TypeError(f"{method_name} is DP_COMPUTE but got no Batch argument to split across the members; "
                        f"pass a Batch or register it with Dispatch.ONE_TO_ALL")
    if len(set(batch_lengths.values())) > 1:
        raise ValueError(f"{method_name} is DP_COMPUTE and its Batch arguments differ in rows: {batch_lengths}; "
                         f"they are split row by row, so they must have the same number of rows")

    def split(value: Any) -> list[Any]:
        return value.split(num_members) if isinstance(value, Batch) else [value] * num_members

    split_args = [split(value) for value in args]
    split_kwargs = {key: split(value) for key, value in kwargs.items()}
    num_rows = next(iter(batch_lengths.values()))
    chunk_size = -(-num_rows // num_members)
    for chunks in [*split_args, *split_kwargs.values()]:
        for rank, chunk in enumerate(chunks):
            if isinstance(chunk, Batch):
                chunk.meta[PADDING_ROWS] = padding_rows_of(rank, chunk_size, num_rows)
    return CallPlan(
        [(tuple(chunks[rank] for chunks in split_args), {key: chunks[rank] for key, chunks in split_kwargs.items()})
         for rank in range(num_members)],
        num_padding=chunk_size * num_members - num_rows, chunk_size=chunk_size)


def collect_results(spec: MethodSpec, plan: CallPlan, method_name: str, results: list[Any]) -> Any:
    if spec.runs_on_rank_zero_only:
        return results[0]
    if spec.dispatch is Dispatch.DP_COMPUTE:
        return _gather_dp(results, plan, method_name)
    return results


def _gather_dp(results: list[Any], plan: CallPlan, method_name: str) -> Any:
    if all(isinstance(result, Batch) for result in results):
        return _gather_batches(results, plan, method_name)
    if all(isinstance(result, Mapping) for result in results):
        return average_metrics(results)
    if all(isinstance(result, tuple) for result in results) and len({len(result) for result in results}) == 1:
        return tuple(_gather_dp(list(position), plan, method_name) for position in zip(*results, strict=True))
    if all(result is None for result in results):
        return None
    return list(results)


def _gather_batches(chunks: list[Batch], plan: CallPlan, method_name: str) -> Batch:
    for rank, chunk in enumerate(chunks):
        if chunk.keys() and len(chunk) != plan.chunk_size:
            raise ValueError(f"{method_name} is DP_COMPUTE but rank {rank} returned a Batch of {len(chunk)} rows "
                             f"for its {plan.chunk_size} input rows; DP_COMPUTE outputs must match inputs row for "
                             f"row so that the padding can be removed")
    num_rows = plan.chunk_size * len(chunks) - plan.num_padding
    counted = [plan.chunk_size - padding_rows_of(rank, plan.chunk_size, num_rows) for rank in range(len(chunks))]
    # a share of padding alone is left out whole: its placeholder rows may lack the columns that only real rows get
    # (a scorer's extras), and are dropped anyway
    kept = [chunk for chunk, rows in zip(chunks, counted, strict=True) if rows] or chunks[:1]
    left = plan.num_padding - plan.chunk_size * (len(chunks) - len(kept))
    try:
        merged = Batch.concat_unpadded([Batch(chunk.tensors, chunk.non_tensors, {**chunk.meta, "num_padding": left})
                                        for chunk in kept])
    except ValueError as error:  # batch k is rank k's share (a share of padding alone comes last)
        raise ValueError(f"{method_name} is DP_COMPUTE and its members' results do not gather (batch k below is "
                         f"rank k's): {error}") from error
    merged.meta.pop(PADDING_ROWS, None)
    # the metrics of a share of padding alone describe no row (its times and its minima would pull the others')
    metered = [(chunk, rows) for chunk, rows in zip(chunks, counted, strict=True) if rows] or [(chunks[0], 0)]
    summed = {name for chunk, _ in metered for name in chunk.meta.get(SUMMED_METRICS, ())}
    weights = {name: [_rows_of_mean(chunk.meta.get(ROW_MEANS, ()), name, rows) for chunk, rows in metered]
               for chunk, _ in metered for name in chunk.meta.get(ROW_MEANS, ())}
    for key, value in metered[0][0].meta.items():
        values = [chunk.meta.get(key) for chunk, _ in metered]
        if key in (EMPTY_VALUES, LEFT_PADDED, ROW_MEANS):  # columns and names, not metrics (Batch.concat merged the
            continue  # columns of every chunk)
        if isinstance(value, Mapping) and all(isinstance(each, Mapping) for each in values):
            merged.meta[key] = average_metrics(values, summed, weights)
    return merged


def _rows_of_mean(row_means: Collection[str] | Mapping[str, float], name: str, counted: int) -> float:
    """The rows a member's mean ``name`` is over: as its ``ROW_MEANS`` maps it, else its rows that count."""
    return float(row_means[name]) if isinstance(row_means, Mapping) and name in row_means else float(counted)


def padding_rows_of(rank: int, chunk_size: int, num_rows: int) -> int:
    """How many of member ``rank``'s ``chunk_size`` rows are padding when ``num_rows`` rows are split in chunks of
    ``chunk_size``, in rank order (the last chunks hold the padding)."""
    return min(chunk_size, max(0, (rank + 1) * chunk_size - num_rows))


PADDING_ROWS = "padding_rows"
"""The meta key under which each member's chunk of a DP_COMPUTE call says how many of its last rows are padding."""

SUMMED_METRICS = "summed_metrics"
"""The meta key under which a member's ``Batch`` names the metrics of its meta dicts that are totals over its rows,
added up over the members instead of averaged."""


ROW_MEANS = "row_means"
"""The meta key under which a member's ``Batch`` names the metrics of its meta dicts that are means over its rows
that count (padding left out), weighted by those rows over the members instead of averaged; or maps each such name
to the number of rows its mean is over, its weight."""


def average_metrics(per_member: list[Mapping[str, Any]], summed: Collection[str] = (),
                    weights: Mapping[str, Sequence[float]] | None = None) -> dict[str, Any]:
    """Mean over members of each numeric value (largest for ``max``/``peak``/``slowest`` names, smallest for ``min``,
    the sum for the names in ``summed``, the mean weighted by ``weights[name]``, one weight per member, for those
    names; where the weights of the members that have it add up to 0, the plain mean). The figures under one
    ``.../slowest/`` prefix all come from one member, the one whose record took longest (``_slowest_records``).

    Members lacking a key are left out; non-numeric values come from the first member that has them.
    """
    merged: dict[str, Any] = {}
    weights = weights or {}
    for key in dict.fromkeys(key for metrics in per_member for key in metrics):
        values = [metrics[key] for metrics in per_member if key in metrics]
        numbers_only = [_as_number(value) for value in values]
        if all(number is not None for number in numbers_only) and len(values) > 1:
            words = set(re.split(r"[/_.\s]+", key.lower()))
            reduce = sum if key in summed else max if words & {"max", "peak", "slowest"} else \
                min if "min" in words else np.mean
            if key in weights and key not in summed:
                member_weights = [float(weight) for weight, metrics in zip(weights[key], per_member, strict=True)
                                  if key in metrics]
                if sum(member_weights) > 0:
                    merged[key] = float(sum(number * weight for number, weight in
                                            zip(numbers_only, member_weights, strict=True)) / sum(member_weights))
                    continue
            merged[key] = float(reduce(numbers_only))
        else:
            merged[key] = values[0]
    return merged | _slowest_records(per_member)


def _slowest_records(per_member: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The figures under a ``.../slowest/`` prefix describe one record (the slowest trajectory: its times, its
    lengths): all are taken from the member whose record took longest, the sum of its times (its figures other than
    ``*_length``: generation and tool calls, as ``agent_metrics`` picks each member's slowest), not each from its own
    maximum."""
    groups: dict[str, list[str]] = {}
    for key in dict.fromkeys(key for metrics in per_member for key in metrics):
        prefix, found, _ = key.partition("/slowest/")
        if found:
            groups.setdefault(prefix + found, []).append(key)
    records: dict[str, Any] = {}
    for keys in groups.values():
        times = [key for key in keys if not key.endswith("_length")] or keys[:1]
        holders = [metrics for metrics in per_member
                   if any(key in metrics for key in times)
                   and all(_as_number(metrics[key]) is not None for key in times if key in metrics)]
        if len(holders) > 1:
            slowest = max(holders, key=lambda metrics: sum(_as_number(metrics[key]) for key in times if key in metrics))
            for key in (key for key in keys if key in slowest):
                number = _as_number(slowest[key])
                records[key] = slowest[key] if number is None else number
    return records


def _as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real | np.number):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    return None
