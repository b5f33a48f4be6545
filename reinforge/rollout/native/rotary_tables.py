"""Rotary cos/sin tables of every rope kind a model's layers use, computed by the model's own rotary modules.

Each kind of the architecture table (``LayerSpec.rope``: "global", "local", "none") gets one table pair
(max_model_len, rotary_dim) in the model dtype, so every rope variant (default, linear, llama3, yarn,
longrope, partial rotary) is exactly what transformers computes. Gemma 3's local layers read the rotary
module's sliding-attention frequencies: ``rotary_emb(x, positions, layer_type)`` where the module is per layer
type, ``rotary_emb_local`` where the model has a second module.

LongRoPE (Phi-3/Phi-4 past their original context): transformers picks the short or the long factors for
all positions of one forward from its largest position (long when it reaches
``original_max_position_embeddings``). The tables here do the same per step: ``select(max_position)``
copies the regime's tables into the buffers every layer reads (in place, so captured graphs follow) when a
step's largest position crosses the original length. A training forward over a whole sequence longer than
the original length uses the long factors for its first positions too, whose keys the engine cached under
the short factors while the sequence was shorter (as ``generate`` does): such samples' log-probs differ from
the trainer's by that much; sequences within the original length are exact.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

ROPE_LAYER_TYPES = {"global": "full_attention", "local": "sliding_attention"}
"""A rope kind of the table -> the layer type transformers' per-layer-type rotary modules are called with."""


class RotaryTables:
    def __init__(self, decoder_module: nn.Module, kinds: set[str], max_model_len: int, dtype: torch.dtype,
                 device: torch.device, rope_parameters: dict):
        self.tables: dict[str, tuple[Tensor, Tensor]] = {}
        """rope kind -> (cos, sin), each (max_model_len, rotary_dim): the buffers the layers read."""
        self._regimes: dict[str, dict[str, tuple[Tensor, Tensor]]] = {}
        self.original_length: int | None = None
        self.regime = "long"
        rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
        original = rope_parameters.get("original_max_position_embeddings")
        two_regimes = rope_type == "longrope" and original is not None and max_model_len > original
        for kind in sorted(kinds - {"none"}):
            compute = _table_function(decoder_module, kind, dtype, device)
            long = compute(max_model_len)
            self.tables[kind] = (long[0].clone(), long[1].clone())
            if two_regimes:
                self._regimes[kind] = {"long": long, "short": compute(original)}
        if two_regimes:
            self.original_length = original
            self.select(0)

    def cos_sin(self, kind: str) -> tuple[Tensor, Tensor] | tuple[None, None]:
        return self.tables.get(kind, (None, None))

    def select(self, max_position: int) -> None:
        """Use the tables transformers uses for a forward whose largest position is ``max_position``."""
        if self.original_length is None:
            return
        regime = "long" if max_position + 1 > self.original_length else "short"
        if regime == self.regime:
            return
        self.regime = regime
        for kind, (cos, sin) in self.tables.items():
            source_cos, source_sin = self._regimes[kind][regime]
            cos[:len(source_cos)].copy_(source_cos)
            sin[:len(source_sin)].copy_(source_sin)


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
