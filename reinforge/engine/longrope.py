"""Rotary frequencies that depend on a sequence's length, in packed passes: each sequence picks by its own length.

Two rope types of transformers choose their frequencies from the largest position of a forward
(``dynamic_rope_update``, the same in transformers 5.17 to 5.25):

- LongRoPE (Phi-3, Phi-4) uses its long factors at every position iff the forward's largest
  position reaches ``original_max_position_embeddings``, else its short ones;
- dynamic NTK (``rope_type`` "dynamic") rescales its base for a forward longer than
  ``max_position_embeddings`` to that forward's length, and keeps the frequencies of the longest
  forward so far until one fits the original length again: what a forward computes depends on
  the forwards before it.

A forward over one sequence from a fresh module thus uses the frequencies of that sequence's
length. A packed row holds many sequences, and the module would pick by the longest one: a short
sequence packed beside a long one would get other frequencies, and its log-probs would depend on
what it was packed with (and, for dynamic NTK, on the micro-batches before it).

``choose_factors_per_sequence`` wraps the module: it finds the sequences of each row from the
positions (a sequence's positions rise by one from token to token; any other step starts the next
one) and gives each token the frequencies of its sequence's length. LongRoPE runs the module once
over positions all below the original length (short factors) and once with one extra position at
it (long factors); dynamic NTK runs transformers' own frequency function of the rope type at each
length and the module's forward without its cached state. Every value is the module's own.
Applied to every forward of the model, it also makes a padded batch (the hf rollout) and each
decode step pick per sequence.

With shared prompts (``engine.packing``) a prompt's keys serve all its samples, so they can take
one set only: ``unshared_where_factors_differ`` packs a micro-batch without sharing when the
samples of a prompt would take different frequencies (LongRoPE: on both sides of the original
length, rare: past 4,096 tokens for Phi-3; dynamic NTK: of different lengths past
``max_position_embeddings``).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from reinforge.engine.packing import PLAN_KEY, plan_packing
from reinforge.models.loading import dynamic_rope_length
from reinforge.models.longrope import longrope_original_length
from reinforge.protocol import Batch


def dynamic_original_length(model: nn.Module) -> int | None:
    """The length past which a dynamic-NTK model rescales its frequencies (its max_position_embeddings), else None."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return dynamic_rope_length(config.to_dict())


def choose_factors_per_sequence(model: nn.Module) -> None:
    """Make every LongRoPE or dynamic-NTK rotary module of ``model`` pick its frequencies per sequence (idempotent)."""
    original = longrope_original_length(model)
    dynamic = original is None and dynamic_original_length(model) is not None
    if original is None and not dynamic:
        return
    for module in model.modules():
        if hasattr(module, "_whole_forward_factors"):
            continue
        rope_type = getattr(module, "rope_type", None)
        rope_types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        # the module's forward without transformers' frequency update is what the per-sequence forward runs
        if dynamic and any("dynamic" in str(each) for each in rope_types) and hasattr(module.forward, "__wrapped__"):
            module._whole_forward_factors = module.forward
            module.forward = types.MethodType(_dynamic_per_sequence_forward, module)
        elif not dynamic and rope_type == "longrope":
            module._whole_forward_factors = module.forward
            module.forward = types.MethodType(_per_sequence_forward, module)
            module._longrope_original = original


def sequence_lengths(position_ids: Tensor) -> Tensor:
    """The length of the sequence each token belongs to, like position_ids (rows, tokens): within a row a
    sequence's positions rise by one; the last position of a sequence plus one is its length."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    sequence = starts.long().cumsum(dim=1) - 1  # (rows, tokens): index of each token's sequence in its row
    last = torch.zeros_like(position_ids).scatter_reduce(1, sequence, position_ids, reduce="amax")
    return last.gather(1, sequence) + 1


def _per_sequence_forward(self: nn.Module, x: Tensor, position_ids: Tensor, *args, **kwargs):
    original = self._longrope_original
    whole = self._whole_forward_factors
    # short: the positions of a short sequence are all below the original length, so clamping changes none of them
    short_cos, short_sin = whole(x, position_ids.clamp(max=original - 1), *args, **kwargs)
    # long: one extra position at the original length makes the module pick the long factors
    extended = torch.cat([position_ids, position_ids.new_full((position_ids.shape[0], 1), original)], dim=1)
    long_cos, long_sin = whole(x, extended, *args, **kwargs)
    is_long = (sequence_lengths(position_ids) > original)[..., None]
    return (torch.where(is_long, long_cos[:, :-1], short_cos), torch.where(is_long, long_sin[:, :-1], short_sin))


def _dynamic_per_sequence_forward(self: nn.Module, x: Tensor, position_ids: Tensor, layer_type: str | None = None):
    rope_type = self.rope_type if layer_type is None else self.rope_type[layer_type]
    if "dynamic" not in rope_type:  # Gemma 3: the other layer type's frequencies stay as they are
        return self._whole_forward_factors(x, position_ids, layer_type)
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    prefix = "" if layer_type is None else f"{layer_type}_"
    frequencies, original = ROPE_INIT_FUNCTIONS[rope_type], self.original_max_seq_len
    unscaled = getattr(self, f"{prefix}original_inv_freq").to(x.device)
    distinct, which = torch.unique(sequence_lengths(position_ids).clamp(min=original), return_inverse=True)
    # as transformers computes them past the original length: at a length given as a tensor (float32 arithmetic)
    table = torch.stack([unscaled if length <= original else frequencies(self.config, x.device, seq_len=length,
                                                                          **kwargs)[0] for length in distinct])
    name = f"{prefix}inv_freq"
    kept = getattr(self, name)
    # (rows, tokens, dim / 2): the forward's product of positions and frequencies takes each token's own
    setattr(self, name, table[which])
    try:
        return self._whole_forward_factors.__wrapped__(self, x, position_ids, **kwargs)
    finally:
        setattr(self, name, kept)


def _frequency_choice(model: nn.Module) -> Callable[[int], int] | None:
    """A function of a sequence's length naming the frequencies it takes (equal values: the same ones), or None
    where the model's frequencies do not depend on the length."""
    original = longrope_original_length(model)
    if original is not None:
        return lambda length: int(length > original)
    dynamic = dynamic_original_length(model)
    if dynamic is not None:
        return lambda length: max(length, dynamic)
    return None


def unshared_where_factors_differ(model: nn.Module, micro: Batch) -> Batch:
    """``micro`` with an unshared packing plan when the samples of one of its prompts take different rotary
    frequencies (a LongRoPE model's on both sides of its original length, a dynamic-NTK model's of different
    lengths past its max_position_embeddings: a shared prompt's keys take one set); else ``micro`` as it is.

    Read from the plan's segment lengths (host lists: nothing waits for the device). A sample with an empty
    response has no segment of its own and no response token to score; its prompt keeps its group's factors."""
    choice = _frequency_choice(model)
    plan = micro.meta.get(PLAN_KEY)
    if choice is None or plan is None or plan.kv_index is None:
        return micro
    groups: list[list[int]] = []  # the sequence lengths of each prompt's samples
    for queries, keys in zip(plan.query_lengths, plan.key_lengths, strict=True):
        if queries == keys:  # a prompt segment (a response's keys are its prompt's and its own) starts a group
            groups.append([])
        else:
            groups[-1].append(keys)
    if any(len({choice(length) for length in lengths}) > 1 for lengths in groups):
        micro.meta[PLAN_KEY] = plan_packing(micro, share_prompts=False)
    return micro
