"""Rotary cos/sin tables of every rope kind a model's layers use, computed by the model's own rotary modules.

Each kind of the architecture table (``LayerSpec.rope``: "global", "local", "none") gets one table pair
(max_model_len, rotary_dim) in the model dtype, so every rope variant (default, linear, llama3, yarn,
longrope, partial rotary) is exactly what transformers computes. Gemma 3's local layers read the rotary
module's sliding-attention frequencies: ``rotary_emb(x, positions, layer_type)`` where the module is per layer
type, ``rotary_emb_local`` where the model has a second module.

LongRoPE (Phi-3/Phi-4 past their original context): transformers picks the short or the long factors for
all positions of one forward from its largest position (long once it reaches
``original_max_position_embeddings``), and Phi-3's ``generate`` drops its cache when a sequence first
grows past that length, so that every key is computed again with the long factors. The engine does the
same: the table rows below the original length hold the short factors and the rows from it on the long
ones; rows ``max_model_len + p`` (p below the original length) hold the long factors again, for the
prefill of a sequence longer than the original length (``rotary_positions``), and a sequence whose
tokens reach the original length + 1 during decoding is prefilled again in full (``Scheduler.recompute``;
the prefix cache keeps blocks computed with either set apart). Every token sampled after that has the
log-prob of a forward over the whole sequence, which is what the trainer computes (``engine/longrope.py``
picks the factors per packed sequence); the tokens sampled before it were drawn, as by ``generate``, from
the short-factor forward of the sequence as it was then, and keep those log-probs: the trainer's forward
over the finished sequence gives them the long factors.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
from torch import Tensor, nn

ROPE_LAYER_TYPES = {"global": "full_attention", "local": "sliding_attention"}
"""A rope kind of the table -> the layer type transformers' per-layer-type rotary modules are called with."""


class RotaryTables:
    def __init__(self, decoder_module: nn.Module, kinds: set[str], max_model_len: int, dtype: torch.dtype,
                 device: torch.device, rope_parameters: dict):
        self.tables: dict[str, tuple[Tensor, Tensor]] = {}
        """rope kind -> (cos, sin), each (rows, rotary_dim): the rows are positions, see ``rotary_positions``."""
        self.max_model_len = max_model_len
        self.original_length: int | None = None
        """LongRoPE's original length when sequences may cross it (then two sets of factors), else None."""
        rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
        original = rope_parameters.get("original_max_position_embeddings")
        if rope_type == "longrope" and original is not None and max_model_len > original:
            self.original_length = original
        for kind in sorted(kinds - {"none"}):
            compute = _table_function(decoder_module, kind, dtype, device)
            cos, sin = compute(max_model_len)  # positions past the original length: the long factors
            if self.original_length is not None:
                short_cos, short_sin = compute(original)
                cos = torch.cat([short_cos, cos[original:], cos[:original]])
                sin = torch.cat([short_sin, sin[original:], sin[:original]])
            self.tables[kind] = (cos, sin)

    def cos_sin(self, kind: str) -> tuple[Tensor, Tensor] | tuple[None, None]:
        return self.tables.get(kind, (None, None))

    def rotary_positions(self, positions: np.ndarray, context_lens: np.ndarray) -> np.ndarray:
        """The table rows of prefilled tokens at ``positions`` whose sequences' prefills end at ``context_lens``
        (one per token): the positions themselves, but for the first positions of a prefill past LongRoPE's
        original length, which read the long factors (rows max_model_len + position)."""
        if self.original_length is None:
            return positions
        long_early = (context_lens > self.original_length) & (positions < self.original_length)
        return np.where(long_early, positions + self.max_model_len, positions)


def _table_function(decoder_module: nn.Module, kind: str, dtype: torch.dtype, device: torch.device):
    """A function of n giving (cos, sin) (n, rotary_dim) for positions 0..n-1 in one forward of the model's module."""
    rotary = decoder_module.rotary_emb
    arguments: tuple = ()
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        arguments = (ROPE_LAYER_TYPES[kind],)
    elif kind == "local":
        rotary = decoder_module.rotary_emb_local
    buffer = next(rotary.buffers(), None)  # the module computes where its frequencies are
    where = buffer.device if buffer is not None else device

    def compute(length: int) -> tuple[Tensor, Tensor]:
        positions = torch.arange(length, device=where)[None, :]
        probe = torch.empty(0, dtype=dtype, device=where)
        with torch.no_grad():
            cos, sin = rotary(probe, positions, *arguments)
        return cos[0].to(device).contiguous(), sin[0].to(device).contiguous()

    return compute
