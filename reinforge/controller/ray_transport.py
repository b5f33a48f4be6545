"""How a Batch crosses Ray's object store: tensors as numpy buffers, read back without a copy.

Ray stores numpy arrays out of band (pickle protocol 5) and hands them to readers on the same
node as views of its shared memory; torch tensors it would pickle into the payload and copy
again on every read. ``WireBatch`` therefore pickles a Batch as numpy arrays plus the rest, and
unpickles straight into a ``Batch`` whose tensors are ``torch.from_numpy`` views.

Those views are shared with every reader of the same object (all members of a ONE_TO_ALL
call on one node), so a worker must not write into an input tensor in place; the local
backend already shares input tensors between members the same way.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from reinforge.protocol import Batch

# dtypes numpy lacks travel as integers of the same width and are viewed back on arrival
_CARRIER_DTYPES = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
_DTYPES_BY_NAME = {str(dtype): dtype for dtype in _CARRIER_DTYPES}


class WireBatch:
    """A Batch on its way through Ray; unpickling it gives the Batch back."""

    def __init__(self, batch: Batch):
        self.batch = batch

    def __reduce__(self) -> tuple[Any, ...]:
        arrays, viewed_as = {}, {}
        for key, tensor in self.batch.tensors.items():
            tensor = tensor.detach().cpu().contiguous()
            if tensor.dtype in _CARRIER_DTYPES:
                viewed_as[key] = str(tensor.dtype)
                tensor = tensor.view(_CARRIER_DTYPES[tensor.dtype])
            arrays[key] = tensor.numpy()
        return _rebuild_batch, (arrays, viewed_as, self.batch.non_tensors, self.batch.meta)


def _rebuild_batch(arrays: dict[str, np.ndarray], viewed_as: dict[str, str],
                   non_tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Batch:
    tensors = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for key, array in arrays.items():
            tensor = torch.from_numpy(array)
            if key in viewed_as:
                tensor = tensor.view(_DTYPES_BY_NAME[viewed_as[key]])
            tensors[key] = tensor
    return Batch(tensors, non_tensors, meta)


def to_wire(value: Any) -> Any:
    """``value`` with every Batch in it (at the top, or in a tuple, list or dict) wrapped for Ray."""
    if isinstance(value, Batch):
        return WireBatch(value)
    if type(value) in (tuple, list):
        return type(value)(to_wire(item) for item in value)
    if type(value) is dict:
        return {key: to_wire(item) for key, item in value.items()}
    return value
