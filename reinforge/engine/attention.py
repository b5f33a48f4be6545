"""Varlen attention for packed rows: sequences side by side in one row, never attending across.

We register one attention implementation with transformers, ``reinforge_varlen``. Called with
``packed_cu_seqlens`` (the engine's packed forwards pass it through the model's kwargs, which
activation checkpointing replays), it runs causal attention inside each sequence: on CUDA in
bf16/fp16 with PyTorch's flash varlen kernel (no padding, no mask), elsewhere with one masked
SDPA call over the sequences unpacked into a padded batch. With shared prompts
(``engine.packing``) the key side of each segment is gathered by ``packed_kv_index`` (``GatherRows``: the
gradients of a repeated row summed in float32) and may be longer than its query side; the causal mask is then aligned to the end of the keys (query i
of a segment with q queries and k keys sees keys up to i + k - q), which is how the flash
kernel aligns it; ``flash_runs_shared_segments`` checks that once per device, and segments fall
back to masked SDPA if it does not. Without it (``generate`` with padding masks, a KV cache) it is plain SDPA,
with SDPA's masks, so the same model serves rollout and training.

Every difference transformers hands the attention function applies, for any family: the
layer's ``sliding_window`` (W keys including the query: the flash kernel's ``window_size=(W-1, 0)``; ignored where
the model's masks never slide, as eager and SDPA ignore it),
``softcap`` (Gemma 2: on CUDA the Triton kernels of ``engine/softcap_attention.py``, else
``flex_attention`` with a soft-capping score_mod where that compiles, an explicit masked
matmul-softmax elsewhere), ``s_aux`` sinks (GPT-OSS: the explicit path) and a value head
dim of its own (DeepSeek's MLA: V is zero-padded to the q/k dim for the flash kernel and the output
cut back). Generation takes SDPA with transformers' masks, or the explicit path where SDPA cannot
soft-cap or sink.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reinforge.models.window_masks import builds_window_masks
from reinforge.packed_attention import explicit_attention, padded_packed_attention
from reinforge.packed_attention.softcap_kernels import softcap_varlen_attention

NAME = "reinforge_varlen"
OWN_ATTENTION = "_reinforge_own_attention"
"""The attention implementation a model had before ``use_varlen_attention`` (``restore_own_attention``)."""


def use_varlen_attention(model: nn.Module) -> None:
    """Switch ``model`` (an HF PreTrainedModel) and its sub-models to the varlen implementation."""
    from reinforge.engine.longrope import choose_factors_per_sequence

    _register()
    if getattr(model.config, "_attn_implementation", None) != NAME:
        setattr(model, OWN_ATTENTION, getattr(model.config, "_attn_implementation", None))
    model.set_attn_implementation(NAME)
    _note_mask_windows(model)
    choose_factors_per_sequence(model)  # LongRoPE: a short sequence packed beside a long one keeps its factors


OWN_ATTENTION_WHY = "_reinforge_own_attention_why"
"""Why ``restore_own_attention`` gave the model its own implementation back (the training path line says it)."""


def restore_own_attention(model: nn.Module, why: str) -> None:
    """Give ``model`` back the attention implementation it had before ``use_varlen_attention``.

    For a model whose modules compute attention themselves, never calling an attention function of transformers'
    table (GIT, BLOOM, MPT pick their classes when built): the implementation's name then only chooses how
    transformers builds their masks, and theirs expect the masks of their own implementation (an additive float
    mask, never a causal one left out, as the SDPA-style masks of ``reinforge_varlen`` may be).
    """
    own = getattr(model, OWN_ATTENTION, None)
    if own is not None and own != NAME:
        model.set_attn_implementation(own)
        setattr(model, OWN_ATTENTION_WHY, why)


def _note_mask_windows(model: nn.Module) -> None:
    """Give each attention module the window transformers' mask applies to its layer, where the attention function's
    ``sliding_window`` argument does not say it.

    Most families hand their layer's ``sliding_window`` to the attention function and build the same window into
    the layer's mask. A few put it only in the sliding-window mask, which packed passes do not build: Qwen2-MoE and
    PhiMoE, and SmolLM3 without ``use_sliding_window`` (its ``sliding_attention`` layers' attention gets no window,
    yet their masks slide, so eager and SDPA slide them). Their modeling module builds that mask from
    ``config.sliding_window`` for the layers of type ``sliding_attention`` (every layer when the config has no layer
    types), and the same windows are noted on the attention modules as ``_packed_window``; an argument that names a
    window wins over it. A module whose modeling code builds no sliding-window mask at all (OLMoE hands
    ``config.sliding_window`` to every layer, yet its masks are causal, so eager and SDPA attend to every earlier
    token; only flash attention would read the argument) is noted as ``_mask_never_slides``, and its argument is
    ignored.
    """
    import sys

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    model_module = sys.modules.get(type(model).__module__)
    notes_windows = model_module is not None and hasattr(model_module, "create_sliding_window_causal_mask")
    model_slides = builds_window_masks(model_module)
    for module in model.modules():
        layer_index = getattr(module, "layer_idx", None)
        if not (isinstance(layer_index, int) and type(module).__name__.endswith("Attention")):
            continue
        if not model_slides and not builds_window_masks(sys.modules.get(type(module).__module__)):
            module._mask_never_slides = True
        elif window and notes_windows:
            sliding = layer_types is None or layer_types[layer_index] == "sliding_attention"
            module._packed_window = window if sliding else None


@cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


class AttentionCalls:
    """What the varlen attention received while watched (``watch_attention_calls``): calls with the packed
    forward's arguments and calls without them, and calls handed the keys an indexer selected (``sparse``)."""

    def __init__(self) -> None:
        self.packed = 0
        self.unpacked = 0
        self.sparse = 0
        """Calls given ``indices`` (DeepSeek V3.2's and GLM-5's sparse attention: each query attends to the keys
        its indexer chose). transformers folds them into the mask for eager and SDPA only; this implementation
        attends to every key, which differs once a sequence is longer than the indexer's top-k."""


_WATCHERS: list[AttentionCalls] = []


@contextlib.contextmanager
def watch_attention_calls() -> Iterator[AttentionCalls]:
    """Count the varlen attention's calls, with and without ``packed_cu_seqlens``, inside the block (run it eagerly:
    a compiled region does not count)."""
    calls = AttentionCalls()
    _WATCHERS.append(calls)
    try:
        yield calls
    finally:
        _WATCHERS.remove(calls)


def varlen_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[Tensor, None]:
    """query (1, heads, tokens, dim), key/value (1, kv_heads, tokens, dim) -> (1, tokens, heads, v dim)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    cu_seqlens = kwargs.get("packed_cu_seqlens")
    if _WATCHERS:
        for calls in _WATCHERS:
            if cu_seqlens is None:
                calls.unpacked += 1
            else:
                calls.packed += 1
            if kwargs.get("indices") is not None:
                calls.sparse += 1
    if cu_seqlens is None:
        if softcap is None and sinks is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scale,
                                          **kwargs)
        return _explicit_forward(query, key, value, attention_mask, scale, softcap, sinks), None
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one row of packed sequences, got {query.shape[0]} rows")
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # (tokens, heads, dim)
    if getattr(module, "_mask_never_slides", False):
        window = None
    else:
        window = kwargs.get("sliding_window") or getattr(module, "_packed_window", None)
    out = packed_attention(q, k, v, scale, kwargs, window=window, softcap=softcap, sinks=sinks)
    return out.unsqueeze(0), None


def _explicit_forward(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scale: float,
                      softcap: float | None, sinks: Tensor | None) -> Tensor:
    """transformers' eager attention over a (batch, heads, queries, dim) batch and its mask (bool, additive or None)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    queries, keys = query.shape[2], key.shape[2]
    if attention_mask is None:  # as SDPA reads a mask left out: every key for one query, else causal from the first
        # key (is_causal): a static cache's prefill hands over more key slots than tokens, the last ones still empty
        rows = torch.arange(queries, device=query.device)[:, None] + (keys if queries == 1 else 0)
        mask = (torch.arange(keys, device=query.device)[None, :] <= rows)[None, None]
    elif attention_mask.dtype == torch.bool:
        mask = attention_mask[..., :keys]
    else:
        mask = attention_mask[..., :keys] > torch.finfo(attention_mask.dtype).min / 2
    out = explicit_attention(query, key, value, mask, scale, softcap, sinks)
    return out.transpose(1, 2).contiguous()


class GatherRows(torch.autograd.Function):
    """``values.index_select(0, index)`` whose backward sums the gradients of a repeated row (a shared prompt's keys
    and values, gathered once for its own segment and once for each of its responses) in float32: index_add on
    bfloat16 serialises the atomic adds of neighbouring values, several times slower than on float32."""

    @staticmethod
    def forward(ctx, values: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.num_rows = values.shape[0]
        return values.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (index,) = ctx.saved_tensors
        total = grad.new_zeros((ctx.num_rows, *grad.shape[1:]), dtype=torch.float32)
        total.index_add_(0, index, grad.float())
        return total.to(grad.dtype), None


def packed_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, kwargs: dict, window: int | None = None,
                     softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Causal attention inside each packed segment: q (tokens, heads, dim), k/v (tokens, kv_heads, dim) -> like q.

    ``kwargs`` are the packed forward's (``packed_cu_seqlens`` and the rest, see the module docstring);
    ``window``, ``softcap`` and ``sinks`` are the layer's (see ``reinforge.packed_attention``). The output
    has v's head dim.
    """
    cu_seqlens = kwargs["packed_cu_seqlens"]
    kv_index = kwargs.get("packed_kv_index")
    cu_seqlens_k, max_key_length = cu_seqlens, kwargs["packed_max_length"]
    if kv_index is not None:
        k, v = GatherRows.apply(k, kv_index), GatherRows.apply(v, kv_index)
        cu_seqlens_k, max_key_length = kwargs["packed_cu_seqlens_k"], kwargs["packed_max_length_k"]
    on_flash_device = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
    if (on_flash_device and softcap is None and sinks is None and _VARLEN_KERNEL is not None
            and (kv_index is None or kwargs.get("packed_flash_shared", False))):
        return _flash_varlen(q, k, v, cu_seqlens, cu_seqlens_k, int(kwargs["packed_max_length"]),
                             int(max_key_length), scale, window)
    if (q.is_cuda and softcap is not None and sinks is None and v.shape[-1] == q.shape[-1]
            and kwargs.get("packed_softcap_kernel", False)):
        return softcap_varlen_attention(q, k, v, cu_seqlens, cu_seqlens_k, int(kwargs["packed_max_length"]),
                                        int(max_key_length), scale, softcap, window)
    if on_flash_device and sinks is None and kwargs.get("packed_flex", False):
        return _flex_outside_compiled_layers(q, k, v, cu_seqlens, cu_seqlens_k, scale, window, softcap)
    # the length lists are read only here (from the cumulative lengths if they were left out)
    query_lengths = kwargs.get("packed_lengths") or _lengths(cu_seqlens)
    key_lengths = query_lengths if kv_index is None else kwargs.get("packed_key_lengths") or _lengths(cu_seqlens_k)
    return padded_packed_attention(q, k, v, query_lengths, key_lengths, scale, window=window, softcap=softcap,
                                   sinks=sinks)


def _load_flex_attention():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return flex_attention, create_block_mask


_FLEX_ATTENTION = _load_flex_attention()


@cache
def _compiled_flex(backend: str = "inductor"):
    # automatic dynamic shapes: the first length compiles static, the next marks the token dimensions (and the block
    # mask's block counts) dynamic. ``dynamic=True`` makes every dimension symbolic from the start, and the
    # soft-cap's backward then fails to trace (a data-dependent scalar breaks the graph and the higher-order op runs
    # eagerly, which fails)
    return torch.compile(_FLEX_ATTENTION[0], backend=backend)


def flex_packed_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, cu_seqlens_k: Tensor, scale: float,
                          window: int | None, softcap: float | None, compiled: bool) -> Tensor:
    """The packed causal attention as ``flex_attention``: a block mask of the segments (and window), the soft-cap
    as a score_mod on the scaled scores; q (tokens, heads, dim), k/v (key tokens, kv_heads, dim) -> like q."""
    flex_attention, create_block_mask = _FLEX_ATTENTION
    num_queries, num_keys = q.shape[0], k.shape[0]
    query_segment = torch.searchsorted(cu_seqlens[1:].contiguous(), torch.arange(num_queries, device=q.device),
                                       right=True)
    key_segment = torch.searchsorted(cu_seqlens_k[1:].contiguous(), torch.arange(num_keys, device=q.device),
                                     right=True)
    # positions within the segment's keys; a query's is aligned to the end of its segment's keys
    key_position = torch.arange(num_keys, device=q.device) - cu_seqlens_k[key_segment]
    query_position = (torch.arange(num_queries, device=q.device) - cu_seqlens[query_segment]
                      + (cu_seqlens_k[1:] - cu_seqlens_k[:-1] - cu_seqlens[1:] + cu_seqlens[:-1])[query_segment])

    def visible(batch, head, query_index, key_index):
        seen = ((query_segment[query_index] == key_segment[key_index])
                & (key_position[key_index] <= query_position[query_index]))
        if window is not None:
            seen = seen & (key_position[key_index] > query_position[query_index] - window)
        return seen

    def soft_cap(score, batch, head, query_index, key_index):
        return torch.tanh(score / softcap) * softcap

    block_mask = create_block_mask(visible, None, None, num_queries, num_keys, device=q.device)
    attend = _compiled_flex() if compiled else flex_attention
    out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                 score_mod=soft_cap if softcap is not None else None, block_mask=block_mask, scale=scale,
                 enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


@torch.compiler.disable
def _flex_outside_compiled_layers(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, cu_seqlens_k: Tensor,
                                  scale: float, window: int | None, softcap: float | None) -> Tensor:
    """Compiled flex attention as its own graph: a compiled decoder layer calls it across a graph break."""
    return flex_packed_attention(q, k, v, cu_seqlens, cu_seqlens_k, scale, window, softcap, compiled=True)


@cache
def flex_runs_on(device: torch.device) -> bool:
    """Whether compiled ``flex_attention`` runs soft-capped, windowed packed attention on ``device``, both ways.

    Probed once per device, outside any compiled region, against the explicit padded path, where the
    soft-capped Triton kernels do not run; the packed forwards of a soft-capped model pass the answer as
    ``packed_flex``. Where it does not run either, soft-capped layers take the explicit path (exact,
    slower, more memory) and a warning says so.
    """
    if device.type != "cuda" or _FLEX_ATTENTION is None:
        return False
    generator = torch.Generator().manual_seed(0)
    works, reason = True, ""
    try:
        # a second length turns the compiled graph dynamic in the token count, a third in the block mask's blocks
        for lengths in ([5, 7], [9, 11], [100, 200]):
            q, k, v = (torch.randn(sum(lengths), 2, 64, generator=generator) for _ in range(3))
            cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
            expected = padded_packed_attention(q, k, v, lengths, lengths, 0.125, window=3, softcap=2.0)
            with torch.inference_mode(False), torch.enable_grad():
                q, k, v = (x.to(device, torch.bfloat16).requires_grad_() for x in (q, k, v))
                out = flex_packed_attention(q, k, v, cu.to(device), cu.to(device), 0.125, 3, 2.0, compiled=True)
                out.float().sum().backward()
            works = works and bool(torch.allclose(out.float().cpu(), expected, atol=3e-2, rtol=3e-2))
        reason = "its output differs from the explicit path"
    except Exception as error:  # any failure of the compiler or the kernel: the explicit path is exact
        works, reason = False, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if not works:
        import warnings

        warnings.warn(f"compiled flex_attention does not run soft-capped attention on {device} ({reason}); those "
                      "layers take the explicit padded path, which is exact but slower and holds more memory",
                      stacklevel=2)
    return works


def _lengths(cu_seqlens: Tensor) -> list[int]:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()


def _load_varlen_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


# resolved at import, not on first call: a compiled decoder layer traces the attention function
_VARLEN_KERNEL, _VARLEN_PARAMETERS = _load_varlen_kernel()


NATIVE_GQA_FALLBACK = True
"""Where ``varlen_attn`` has no ``enable_gqa`` (torch < 2.12), call the flash op under it with the
unexpanded key/value heads (the kernel shares each KV head across its query heads; its autograd
formula sums their gradients) instead of repeating key and value for every query head, which
cost a copy forward and a reduction backward in every layer."""


def _flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, cu_seqlens_k: Tensor, max_length: int,
                  max_key_length: int, scale: float, window: int | None = None) -> Tensor:
    """Flash varlen attention; a window W is the kernel's ``window_size=(W-1, 0)``; V of a smaller head dim is
    zero-padded to q's (the kernel needs one head dim) and the output cut back to it."""
    value_dim = v.shape[-1]
    if value_dim != q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - value_dim))
    return _flash_varlen_same_dim(q, k, v, cu_seqlens, cu_seqlens_k, max_length, max_key_length, scale,
                                  window)[..., :value_dim]


def _flash_varlen_same_dim(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, cu_seqlens_k: Tensor,
                           max_length: int, max_key_length: int, scale: float, window: int | None) -> Tensor:
    parameters = _VARLEN_PARAMETERS
    options = {}
    left = -1 if window is None else window - 1
    grouped = q.shape[1] != k.shape[1]
    if ((window is not None and "window_size" not in parameters)
            or (grouped and "enable_gqa" not in parameters and NATIVE_GQA_FALLBACK)):
        # the flash op shares each KV head across its query heads and takes the window itself
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens.to(torch.int32), cu_seqlens_k.to(torch.int32), max_length, max_key_length, 0.0,
            True, False, scale=scale, window_size_left=None if window is None else left,
            window_size_right=None if window is None else 0)[0]
    if grouped and "enable_gqa" in parameters:
        options["enable_gqa"] = True
    elif grouped:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "window_size" in parameters:
        options["window_size"] = (left, 0)
    else:
        options["is_causal"] = True
    if "scale" in parameters:
        options["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        q = q * (scale * q.shape[-1] ** 0.5)
    return _VARLEN_KERNEL(q, k, v, cu_seqlens.to(torch.int32), cu_seqlens_k.to(torch.int32), max_length,
                            max_key_length, **options)


def flash_applies(device: torch.device, dtype: torch.dtype, shared: bool) -> bool:
    """Whether packed attention on ``device`` in ``dtype`` runs the flash varlen kernel."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _VARLEN_KERNEL is not None
            and (not shared or flash_runs_shared_segments(device)))


@cache
def flash_runs_shared_segments(device: torch.device) -> bool:
    """Whether the flash kernel aligns causal masks to the end of the keys on ``device``.

    Probed once per device, outside any compiled region: the one query of a (1 query, 2 keys)
    segment must see both keys. The packed forwards pass the answer as ``packed_flash_shared``.
    """
    if device.type != "cuda" or _VARLEN_KERNEL is None:
        return False
    dtype = torch.bfloat16
    q = torch.zeros(1, 1, 64, device=device, dtype=dtype)
    k = torch.zeros(2, 1, 64, device=device, dtype=dtype)  # equal scores: both keys seen -> 0.5, one -> 0
    v = torch.stack([torch.zeros(1, 64), torch.ones(1, 64)]).to(device, dtype)
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 2], dtype=torch.int32, device=device)
    out = _flash_varlen(q, k, v, cu_q, cu_k, 1, 2, 1.0)
    aligned = abs(float(out.float().mean()) - 0.5) < 1e-2
    if not aligned:
        import warnings

        warnings.warn("the flash varlen kernel aligns causal masks to the start; shared-prompt segments fall back "
                      "to masked SDPA, which is correct but slow", stacklevel=2)
    return aligned
