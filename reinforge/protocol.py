"""Batch: the unit of data that flows between the controller and the workers.

A Batch holds tensors that share a first (batch) dimension, non-tensor columns
(numpy object arrays such as uids, ground truths or data sources) aligned with
them, and a ``meta`` dict for data about the batch itself: a worker's metrics
(``rollout_metrics``, ``reward_metrics``), a micro-batch's packing plan or rows.
Settings (sampling parameters, seeds, temperatures) reach a worker as arguments
of its method, never through ``meta``.

We keep a small class of our own rather than TensorDict: the operations we need
(split with padding, interleaved repeat, union, mask) are a few lines each, and
a plain dict of tensors pickles efficiently (torch shares storage in pickles).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

MULTI_MODAL_KEY = "multi_modal_inputs"
"""Non-tensor column of a vision-language batch: per row, ``{"pixel_values": (patches, patch dim),
"image_grid_thw": (images, 3)}`` of the row's images in order ({} for a row without images)."""

EMPTY_VALUES = "empty_values"
"""Meta key of a batch's optional non-tensor columns: column -> the value of a row without one. A worker that adds
a column only where some of its rows have a value (a scorer's extras) names it here, so that ``Batch.concat`` fills
the column of a batch that lacks it (a member's share whose rows had none) as one batch of all the rows has it.
``MULTI_MODAL_KEY`` is always optional, {} for a row without images."""

LEFT_PADDED = "left_padded"
"""Meta key of a batch's tensors left-padded along their second dimension (prompt-side tokens): column -> the padding
value. ``Batch.concat`` pads the narrower ones to the widest, as one batch of all the rows pads them."""

SAMPLE_INDEX_KEY = "sample_index"
"""Non-tensor column: each row's index among the samples of its prompt (its ``uid``). A sample's seed comes from it,
so it is the same sample whichever member of a worker group generates it (``samples_of``)."""


def _as_object_array(values: Any) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == object:
        return values
    array = np.empty(len(values), dtype=object)
    for index, value in enumerate(values):
        array[index] = value
    return array


@dataclass
class Batch:
    tensors: dict[str, Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensors = {key: _as_object_array(value) for key, value in self.non_tensors.items()}
        self._check_lengths()

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, Tensor] | None = None,
        non_tensors: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Batch:
        return cls(dict(tensors or {}), dict(non_tensors or {}), dict(meta or {}))

    def _check_lengths(self) -> None:
        lengths = {key: value.shape[0] for key, value in self.tensors.items()}
        lengths |= {key: len(value) for key, value in self.non_tensors.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"Batch columns disagree on the batch size: {lengths}")

    # ---- basic access --------------------------------------------------------------
    def __len__(self) -> int:
        for value in self.tensors.values():
            return value.shape[0]
        for value in self.non_tensors.values():
            return len(value)
        return 0

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, item: str | Tensor | slice | Sequence[int]) -> Any:
        if isinstance(item, str):
            if item in self.tensors:
                return self.tensors[item]
            if item in self.non_tensors:
                return self.non_tensors[item]
            raise KeyError(f"Batch has no column {item!r}; it has {sorted(self.keys())}")
        return self.index(item)

    def __setitem__(self, key: str, value: Tensor | Sequence[Any] | np.ndarray) -> None:
        if len(self.keys()) > 0 and len(value) != len(self):
            raise ValueError(f"column {key!r} has {len(value)} rows but the batch has {len(self)}")
        if isinstance(value, Tensor):
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
        else:
            self.tensors.pop(key, None)
            self.non_tensors[key] = _as_object_array(value)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    # ---- row operations ----------------------------------------------------------------
    def index(self, rows: Tensor | slice | Sequence[int]) -> Batch:
        """Rows picked by a boolean mask, an index tensor/list, or a slice."""
        if isinstance(rows, slice):
            tensor_rows: Any = rows
            numpy_rows: Any = rows
        else:
            rows_tensor = torch.as_tensor(rows)
            if rows_tensor.dtype == torch.bool:
                if rows_tensor.shape[0] != len(self):
                    raise ValueError(f"mask has {rows_tensor.shape[0]} rows but the batch has {len(self)}")
                rows_tensor = rows_tensor.nonzero(as_tuple=True)[0]
            tensor_rows = rows_tensor.long()
            numpy_rows = tensor_rows.cpu().numpy()
        return Batch(
            {key: value[tensor_rows.to(value.device) if isinstance(tensor_rows, Tensor) else tensor_rows]
             for key, value in self.tensors.items()},
            {key: value[numpy_rows] for key, value in self.non_tensors.items()},
            dict(self.meta),
        )

    def select(self, keys: Iterable[str], meta_keys: Iterable[str] | None = None) -> Batch:
        keys = list(keys)
        missing = [key for key in keys if key not in self]
        if missing:
            raise KeyError(f"Batch has no column(s) {missing}; it has {sorted(self.keys())}")
        meta = self.meta if meta_keys is None else {key: self.meta[key] for key in meta_keys}
        return Batch(
            {key: self.tensors[key] for key in keys if key in self.tensors},
            {key: self.non_tensors[key] for key in keys if key in self.non_tensors},
            dict(meta),
        )

    def pop(self, keys: Iterable[str]) -> Batch:
        """Remove the columns and return them as their own batch."""
        popped = self.select(keys, meta_keys=[])
        for key in popped.keys():
            self.tensors.pop(key, None)
            self.non_tensors.pop(key, None)
        return popped

    def union(self, other: Batch) -> Batch:
        """Columns of both; a column present in both must hold the same values."""
        if len(self.keys()) and len(other.keys()) and len(self) != len(other):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        tensors = dict(self.tensors)
        for key, value in other.tensors.items():
            if key in tensors and not (tensors[key].shape == value.shape and torch.equal(tensors[key], value)):
                raise ValueError(f"union: column {key!r} differs between the two batches")
            tensors[key] = value
        non_tensors = dict(self.non_tensors)
        for key, value in other.non_tensors.items():
            if key in non_tensors and not np.array_equal(non_tensors[key], value):
                raise ValueError(f"union: column {key!r} differs between the two batches")
            non_tensors[key] = value
        meta = {**self.meta, **other.meta}
        for name in (EMPTY_VALUES, LEFT_PADDED):  # the columns of both
            if name in self.meta and name in other.meta:
                meta[name] = {**self.meta[name], **other.meta[name]}
        return Batch(tensors, non_tensors, meta)

    def __or__(self, other: Batch) -> Batch:
        return self.union(other)

    def repeat(self, times: int, interleave: bool = True) -> Batch:
        """Each row ``times`` times: interleaved (a a b b) or tiled (a b a b)."""
        if interleave:
            tensors = {key: value.repeat_interleave(times, dim=0) for key, value in self.tensors.items()}
            non_tensors = {key: np.repeat(value, times, axis=0) for key, value in self.non_tensors.items()}
        else:
            tensors = {key: value.repeat(times, *([1] * (value.dim() - 1))) for key, value in self.tensors.items()}
            non_tensors = {key: np.tile(value, times) for key, value in self.non_tensors.items()}
        return Batch(tensors, non_tensors, dict(self.meta))

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order; meta comes from the first (its ``EMPTY_VALUES`` and ``LEFT_PADDED`` are
        those of all).

        Every batch must have the same columns, except an optional non-tensor column (``EMPTY_VALUES``), which a
        batch that lacks it gets with the empty value on each row; tensors must have the same shape past the rows,
        except those ``LEFT_PADDED``, padded on the left to the widest. Anything else is refused, naming the column.
        """
        if not batches:
            raise ValueError("cannot concatenate an empty list of batches")
        declared_empty, left_padded = _declared(batches, EMPTY_VALUES), _declared(batches, LEFT_PADDED)
        empty_values = {MULTI_MODAL_KEY: {}} | declared_empty
        columns = list(dict.fromkeys(key for batch in batches for key in batch.keys()))
        tensors: dict[str, Tensor] = {}
        non_tensors: dict[str, np.ndarray] = {}
        for key in columns:
            lacking = [index for index, batch in enumerate(batches) if key not in batch]
            is_tensor = [index for index, batch in enumerate(batches) if key in batch.tensors]
            if is_tensor and len(is_tensor) != len(batches) - len(lacking):
                raise ValueError(f"cannot concatenate batches whose column {key!r} is a tensor in batches "
                                 f"{is_tensor} and not in the others")
            if lacking and (is_tensor or key not in empty_values):
                raise ValueError(
                    f"cannot concatenate batches with different columns: {key!r} is missing from batches {lacking} "
                    f"of {len(batches)}; a column a worker adds only for some rows must be on every row of every "
                    f"batch (its empty value on a row without one), or named in meta {EMPTY_VALUES!r}")
            if is_tensor:
                tensors[key] = _cat_tensors(key, [batch.tensors[key] for batch in batches], left_padded)
            else:
                non_tensors[key] = np.concatenate([
                    batch.non_tensors[key] if key in batch.non_tensors
                    else _as_object_array([copy.copy(empty_values[key]) for _ in range(len(batch))])
                    for batch in batches])
        meta = dict(batches[0].meta)
        for name, declared in ((EMPTY_VALUES, declared_empty), (LEFT_PADDED, left_padded)):
            if declared:
                meta[name] = declared
        return Batch(tensors, non_tensors, meta)

    def split(self, num_chunks: int) -> list[Batch]:
        """``num_chunks`` batches of equal size, padding with copies of the first rows.

        The number of padding rows is kept in each chunk's ``meta['num_padding']`` (on the last
        chunks) so that ``Batch.concat_unpadded`` can remove it after the workers answer.
        """
        if num_chunks < 1:
            raise ValueError(f"cannot split into {num_chunks} chunks")
        size = len(self)
        chunk_size = -(-size // num_chunks)
        num_padding = chunk_size * num_chunks - size
        padded = self
        if num_padding:
            if size == 0:
                raise ValueError("cannot pad an empty batch")
            padding_rows = torch.arange(num_padding) % size
            padded = Batch.concat([self, self.index(padding_rows)])
        chunks = [padded.index(slice(i * chunk_size, (i + 1) * chunk_size)) for i in range(num_chunks)]
        for chunk in chunks:
            chunk.meta["num_padding"] = num_padding
        return chunks

    @staticmethod
    def concat_unpadded(chunks: Sequence[Batch]) -> Batch:
        """Inverse of ``split``: concatenate, then drop the padding rows added there."""
        merged = Batch.concat(chunks)
        num_padding = int(chunks[0].meta.get("num_padding", 0))
        merged.meta.pop("num_padding", None)
        if num_padding:
            merged = merged.index(slice(0, len(merged) - num_padding))
        return merged

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch({key: value.to(device, non_blocking=non_blocking) for key, value in self.tensors.items()},
                     dict(self.non_tensors), dict(self.meta))

    def __repr__(self) -> str:
        columns = [f"{key}: {tuple(value.shape)} {value.dtype}" for key, value in self.tensors.items()]
        columns += [f"{key}: ({len(value)},) object" for key, value in self.non_tensors.items()]
        return f"Batch({len(self)} rows; " + ", ".join(columns) + f"; meta={sorted(self.meta)})"


def _same_value(first: Any, second: Any) -> bool:
    if first is second:
        return True
    if isinstance(first, float) and isinstance(second, float) and np.isnan(first) and np.isnan(second):
        return True
    try:
        return type(first) is type(second) and bool(first == second)
    except Exception:  # noqa: BLE001 - values without a plain equality (arrays) differ unless identical
        return False


def _declared(batches: Sequence[Batch], name: str) -> dict[str, Any]:
    """The union of the batches' meta ``name`` (``EMPTY_VALUES`` or ``LEFT_PADDED``); two batches that declare a
    column with different values are refused."""
    declared: dict[str, Any] = {}
    owners: dict[str, int] = {}
    for index, batch in enumerate(batches):
        for key, value in (batch.meta.get(name) or {}).items():
            if key in owners and not _same_value(declared[key], value):
                raise ValueError(f"cannot concatenate batches whose meta {name!r} disagree on column {key!r}: "
                                 f"{declared[key]!r} in batch {owners[key]}, {value!r} in batch {index}")
            declared[key] = value
            owners.setdefault(key, index)
    return declared


def _cat_tensors(key: str, values: list[Tensor], left_padded: Mapping[str, Any]) -> Tensor:
    """``values`` concatenated over the rows; a ``LEFT_PADDED`` column's narrower values padded on the left first."""
    shapes = [tuple(value.shape[1:]) for value in values]
    if len(set(shapes)) > 1:
        same_past_width = len({(len(shape), shape[1:]) for shape in shapes}) == 1 and len(shapes[0]) >= 1
        if key not in left_padded or not same_past_width:
            raise ValueError(f"cannot concatenate column {key!r}: its batches have shapes past the rows {shapes}"
                             + ("" if key in left_padded else f", and it is not named in meta {LEFT_PADDED!r}"))
        width = max(shape[0] for shape in shapes)
        values = [torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (width - value.shape[1], 0),
                                          value=left_padded[key]) for value in values]
    return torch.cat(values)


def samples_of(prompts: Batch, n: int) -> Batch:
    """Each prompt ``n`` times (a a b b), each row with its ``SAMPLE_INDEX_KEY``: split over several members (a
    prompt's samples can straddle two), sample k of a prompt is still seeded as its k-th, not as a member's first."""
    batch = prompts.repeat(n, interleave=True)
    batch.non_tensors[SAMPLE_INDEX_KEY] = np.tile(np.arange(n), len(prompts))
    return batch
