"""LongRoPE (Phi-3, Phi-4) in packed passes: each sequence picks its factors by its own length.

transformers' LongRoPE rotary module picks one set of factors for a whole forward: the long ones
when its largest position reaches ``original_max_position_embeddings``, else the short ones
(``longrope_frequency_update``, the same in transformers 5.17 and 5.24). A forward over one
sequence thus uses the long factors at every position iff the sequence is longer than the
original length. A packed row holds many sequences, and the module would pick by the longest
one: a short sequence packed beside a long one would get the long factors, and its log-probs
would depend on what it was packed with.

``choose_factors_per_sequence`` wraps the module: it finds the sequences of each row from the
positions (a sequence's positions rise by one from token to token; any other step starts the next
one), runs the module once over positions all below the original length (short factors) and once
with one extra position at it (long factors), and gives each token the set its sequence's length
picks. Every value is the module's own. Applied to every forward of the model, it also makes a
padded batch (the hf rollout) and each decode step pick per sequence.

With shared prompts (``engine.packing``) a prompt's keys serve all its samples, so they can take
one set only: ``unshared_where_factors_differ`` packs a micro-batch without sharing when the
samples of a prompt fall on both sides of the original length (rare: past 4,096 tokens for Phi-3).
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

from reinforge.engine.packing import PLAN_KEY, plan_packing
from reinforge.protocol import Batch


def longrope_original_length(model: nn.Module) -> int | None:
    """The original length of a LongRoPE model whose positions may pass it, else None."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(parameters, dict) or parameters.get("rope_type", parameters.get("type")) != "longrope":
        return None
    original = parameters.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None)
    maximum = getattr(config, "max_position_embeddings", None)
    if original is None or (maximum is not None and maximum <= original):
        return None
    return int(original)


def choose_factors_per_sequence(model: nn.Module) -> None:
    """Make every LongRoPE rotary module of ``model`` pick short or long factors per sequence (idempotent)."""
    original = longrope_original_length(model)
    if original is None:
        return
    for module in model.modules():
        if getattr(module, "rope_type", None) == "longrope" and not hasattr(module, "_whole_forward_factors"):
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


def unshared_where_factors_differ(model: nn.Module, micro: Batch) -> Batch:
    """``micro`` with an unshared packing plan when one of its prompts has samples on both sides of a LongRoPE
    model's original length (a shared prompt's keys take one set of factors); else ``micro`` as it is.

    Read from the plan's segment lengths (host lists: nothing waits for the device). A sample with an empty
    response has no segment of its own and no response token to score; its prompt keeps its group's factors."""
    original = longrope_original_length(model)
    plan = micro.meta.get(PLAN_KEY)
    if original is None or plan is None or plan.kv_index is None:
        return micro
    groups: list[list[int]] = []  # the sequence lengths of each prompt's samples
    for queries, keys in zip(plan.query_lengths, plan.key_lengths, strict=True):
        if queries == keys:  # a prompt segment (a response's keys are its prompt's and its own) starts a group
            groups.append([])
        else:
            groups[-1].append(keys)
    if any(lengths and min(lengths) <= original < max(lengths) for lengths in groups):
        micro.meta[PLAN_KEY] = plan_packing(micro, share_prompts=False)
    return micro
