"""DeepSeek V2/V3 multi-head latent attention over a compressed paged cache.

Per token the cache holds one shared "head" of ``kv_lora_rank + qk_rope_head_dim`` values: the latent
``c`` (after ``kv_a_layernorm``) and the rotated ``k_rope``, instead of every head's keys and values
(576 values a token for V3 instead of 128 heads x 2 x 192). Attention runs in the latent space: each
head's ``k_nope = W_uk c`` is never formed; its query is absorbed instead (``q_nope W_uk``, one
(nope -> latent) product per head), so the score ``q_nope . k_nope + q_rope . k_rope`` becomes
``[q_nope W_uk | q_rope] . [c | k_rope]``, a multi-query attention with one key head whose values are
the keys themselves. The first ``kv_lora_rank`` dims of its output are the attention-weighted latent,
which ``W_uv`` turns into each head's value output. Decode reads the cache this way (on the Triton path
``latent_paged_decode``, a paged kernel over each sequence's own blocks; else ``latent_decode_attention``,
graph-safe), and so does a prefill after a prefix-cache hit (``latent_prefix_attention``). A prefill without
cached tokens has every key at hand and expands them as transformers does (``kv_b_proj`` of the
latent, heads of qk_head_dim), which costs less than latent heads once a sequence has many tokens.

Rotary embedding: DeepSeek rotates interleaved pairs ``(x0, x1), (x2, x3), ...`` (V2 as a complex
product in float32, V3 in the model dtype; V3 with ``rope_interleave=False`` rotates halves as Llama
does). Both rotated queries and keys are written with the real parts first, then the imaginary parts;
a score is a sum over pairs, so the layout is free as long as the query's and the key's agree. The
attention scale is transformers' (``(nope + rope) ** -0.5``, times yarn's mscale squared).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reinforge.models.architectures import LayerSpec
from reinforge.rollout.native.attention import AttentionMetadata, prefill_attention
from reinforge.rollout.native.layers import BlockContext

LATENT_NORM_EPS = 1e-6
"""transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not config.rms_norm_eps."""


def mla_rotary_tables(rotary: nn.Module, max_model_len: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin: (max_model_len, qk_rope_head_dim // 2), one angle per rotated pair, from the model's own rotary
    module (V2's returns complex ``freqs_cis``, V3's cos and sin of ``cat(freqs, freqs)``); float32 for V2's
    complex product, ``dtype`` for V3's rotation in the model dtype."""
    buffer = next(rotary.buffers(), None)
    where = buffer.device if buffer is not None else device
    positions = torch.arange(max_model_len, device=where)[None, :]
    probe = torch.empty(0, dtype=dtype, device=where)
    with torch.no_grad():
        out = rotary(probe, positions)
    if isinstance(out, tuple):
        cos, sin = out
        half = cos.shape[-1] // 2
        return cos[0, :, :half].to(device).contiguous(), sin[0, :, :half].to(device).contiguous()
    return out[0].real.float().to(device).contiguous(), out[0].imag.float().to(device).contiguous()


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of x: (tokens, heads, rope_dim) by per-token cos, sin: (tokens, rope_dim // 2).

    Interleaved pairs come out real parts first, then imaginary parts (transformers' V3 layout; V2's complex
    product gives the same values interleaved). Computed in cos's dtype, returned in x's."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if interleaved:
        real, imaginary = x[..., 0::2].to(cos.dtype), x[..., 1::2].to(cos.dtype)
        return torch.cat([real * cos - imaginary * sin, imaginary * cos + real * sin], dim=-1).to(x.dtype)
    half = x.shape[-1] // 2  # Llama's x * cos + rotate_half(x) * sin, cos and sin repeated over both halves
    first, second = x[..., :half].to(cos.dtype), x[..., half:].to(cos.dtype)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def latent_decode_attention(q: Tensor, cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                            scale: float) -> Tensor:
    """One query per sequence over its cached latents, reading every block of its table and masking the unused.

    q: (batch, heads, dim); cache: (num_blocks, block_size, 1, dim); block_tables: (batch, max_blocks);
    context_lens: (batch,). Shapes depend only on the tables' width and nothing waits for the host, so a
    decode CUDA graph captures it. Returns (batch, heads, dim): the keys are the values.
    """
    batch, num_heads, dim = q.shape
    keys = cache[block_tables.long()].reshape(batch, -1, dim)  # (batch, max_blocks * block_size, dim)
    scores = torch.einsum("bhd,bsd->bhs", q.float(), keys.float()) * scale
    visible = torch.arange(keys.shape[1], device=q.device)[None, :] < context_lens[:, None]
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("bhs,bsd->bhd", probs.to(keys.dtype), keys)


def latent_prefix_attention(q: Tensor, cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """Each sequence's packed queries over its cached and new latents (all in the cache), causal from its prefix.

    q: (tokens, heads, dim); cache: (num_blocks, block_size, 1, dim). The one key head is shared by every query
    head as it is (never repeated per head: a latent is hundreds of values wide). Returns (tokens, heads, dim).
    """
    assert meta.seq_lens is not None and meta.block_tables is not None and meta.context_lens is not None
    assert meta.prefix_lens is not None and meta.batch_index is not None and meta.token_index is not None
    num_seqs, max_len, max_context = len(meta.seq_lens), max(meta.seq_lens), meta.max_context_len
    tables = meta.block_tables[:, : -(-max_context // cache.shape[1])].long()
    keys = cache[tables].flatten(1, 2)[:, :max_context, 0]  # (num_seqs, context, dim)
    grid = q.new_zeros(num_seqs, max_len, *q.shape[1:])
    grid[meta.batch_index, meta.token_index] = q
    scores = torch.einsum("sqhd,skd->shqk", grid.float(), keys.float()) * scale
    query_positions = meta.prefix_lens[:, None] + torch.arange(max_len, device=q.device)[None, :]
    key_positions = torch.arange(max_context, device=q.device)
    # padding queries (past a sequence's length) still see key 0, so no row is all masked
    visible = (key_positions[None, None, :] <= query_positions[:, :, None]) \
        & (key_positions[None, None, :] < meta.context_lens[:, None, None])
    probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(dim=-1)
    out = torch.einsum("shqk,skd->sqhd", probs.to(keys.dtype), keys)
    return out[meta.batch_index, meta.token_index]


class MLAAttention:
    """One MLA layer as an attention block of the decoder (see ``layers.py``), over a compressed paged cache.

    Copies: mla_in_weight (q_in + kv_lora_rank + qk_rope_head_dim, hidden), the two projections that read the
    hidden state (``q_a_proj``, or ``q_proj`` without a q low rank, then ``kv_a_proj_with_mqa``) as one
    product, mla_in_bias likewise or None; q_a_norm (q_lora_rank,) and q_b (heads * qk_head_dim, q_lora_rank),
    or None without a q low rank; kv_a_norm (kv_lora_rank,); kv_b (heads * (qk_nope_head_dim + v_head_dim),
    kv_lora_rank), each head's k_nope rows then its v rows; o_weight (hidden, heads * v_head_dim), o_bias.
    ``tables``: ``mla_rotary_tables`` of the model, shared by its layers.
    """

    float32_copies: frozenset[str] = frozenset()

    def __init__(self, context: BlockContext, layer: LayerSpec, tables: tuple[Tensor, Tensor]):
        spec = context.spec
        if spec.mla is None:
            raise ValueError(f"{spec.model_type}: MLAAttention runs multi-head latent attention; this model has none")
        self.mla = mla = spec.mla
        self.num_heads = context.config.num_attention_heads
        self.scale = spec.attn_scale
        self.use_triton = context.use_triton and _triton_decode is not None
        self.cos, self.sin = tables
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self.latent_dim = mla.kv_lora_rank + mla.qk_rope_head_dim
        self.q_in = self.num_heads * self.qk_head_dim if mla.q_lora_rank is None else mla.q_lora_rank
        self.cache_entry = (1, 1, self.latent_dim)
        """One shared head of latent and rotated key per token."""

    def sources(self, attention: nn.Module) -> dict[str, list[Tensor] | None]:
        low_rank = self.mla.q_lora_rank is not None
        q_in = attention.q_a_proj if low_rank else attention.q_proj
        kv_a = attention.kv_a_proj_with_mqa
        in_bias = None if q_in.bias is None and kv_a.bias is None else [
            linear.weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias
            for linear in (q_in, kv_a)]
        return {"mla_in_weight": [q_in.weight, kv_a.weight], "mla_in_bias": in_bias,
                "q_a_norm": [attention.q_a_layernorm.weight] if low_rank else None,
                "q_b": [attention.q_b_proj.weight] if low_rank else None,
                "kv_a_norm": [attention.kv_a_layernorm.weight], "kv_b": [attention.kv_b_proj.weight],
                "o_weight": [attention.o_proj.weight],
                "o_bias": None if attention.o_proj.bias is None else [attention.o_proj.bias]}

    def project(self, weights: dict[str, Tensor | None], x: Tensor,
                positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q_nope (tokens, heads, nope), the rotated q_rope (tokens, heads, rope) and the cache entries
        (tokens, 1, latent_dim)."""
        mla = self.mla
        num_tokens = x.shape[0]
        q_in, latent, k_rope = F.linear(x, weights["mla_in_weight"], weights["mla_in_bias"]).split(
            [self.q_in, mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        if weights["q_b"] is not None:
            q_in = F.linear(_rms_norm(q_in, weights["q_a_norm"], LATENT_NORM_EPS), weights["q_b"])
        q_nope, q_rope = q_in.reshape(num_tokens, self.num_heads, self.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent = _rms_norm(latent, weights["kv_a_norm"], LATENT_NORM_EPS)
        cos, sin = self.cos[positions], self.sin[positions]
        q_rope = rotate_pairs(q_rope, cos, sin, mla.rope_interleave)
        k_rope = rotate_pairs(k_rope[:, None, :], cos, sin, mla.rope_interleave)
        return q_nope, q_rope, torch.cat([latent[:, None, :], k_rope], dim=-1)

    def forward(self, weights: dict[str, Tensor | None], x: Tensor, positions: Tensor, cache: Tensor,
                meta: AttentionMetadata) -> Tensor:
        """x: (tokens, hidden) -> the attention's output projection (tokens, hidden).

        cache: this layer's (1, num_blocks, block_size, 1, latent_dim) (``cache_entry`` per token)."""
        mla, num_tokens = self.mla, x.shape[0]
        q_nope, q_rope, entry = self.project(weights, x, positions)
        cache = cache[0]
        cache.view(-1, 1, self.latent_dim)[meta.slot_mapping] = entry
        kv_b = weights["kv_b"].view(self.num_heads, -1, mla.kv_lora_rank)
        k_up, v_up = kv_b[:, : mla.qk_nope_head_dim], kv_b[:, mla.qk_nope_head_dim:]
        if meta.is_prefill and meta.prefix_lens is None:
            # every key is new: expand them as transformers does, attention over qk_head_dim-wide heads
            latent, k_rope = entry.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
            k_nope_v = F.linear(latent[:, 0], weights["kv_b"]).view(num_tokens, self.num_heads, -1)
            k_nope, values = k_nope_v.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
            keys = torch.cat([k_nope, k_rope.expand(-1, self.num_heads, -1)], dim=-1)
            out = prefill_attention(torch.cat([q_nope, q_rope], dim=-1), keys, values, meta, self.scale)
            return F.linear(out.reshape(num_tokens, -1), weights["o_weight"], weights["o_bias"])
        query = torch.cat([torch.einsum("thn,hnl->thl", q_nope, k_up), q_rope], dim=-1)
        if meta.is_prefill:
            out = latent_prefix_attention(query, cache, meta, self.scale)
        elif self.use_triton:
            out = latent_paged_decode(query, cache, meta.block_tables, meta.context_lens, self.scale,
                                      mla.kv_lora_rank)
        else:
            out = latent_decode_attention(query, cache, meta.block_tables, meta.context_lens, self.scale)
        values = torch.einsum("thl,hvl->thv", out[..., : mla.kv_lora_rank], v_up)
        return F.linear(values.reshape(num_tokens, -1), weights["o_weight"], weights["o_bias"])


def latent_paged_decode(q: Tensor, cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float,
                        kv_lora_rank: int, block_n: int = 32, heads_per_program: int = 16) -> Tensor:
    """What ``latent_decode_attention`` computes, in one Triton kernel: a program per sequence and group of heads
    reads only its sequence's blocks (online softmax), the latent and rotary parts of each key as two dot
    products. Returns (batch, heads, kv_lora_rank): the attention-weighted latent only."""
    return _triton_decode(q, cache, block_tables, context_lens, scale, kv_lora_rank, block_n, heads_per_program)


try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # the PyTorch path runs everywhere without Triton
    _triton_decode = None
else:
    @triton.jit
    def _latent_decode_kernel(q_ptr, cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, scale, num_heads,
                              stride_qb, stride_qh, stride_ob, stride_oh, stride_table, stride_slot,
                              LATENT: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE: tl.constexpr,
                              ROPE_PAD: tl.constexpr, HEADS: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                              IEEE: tl.constexpr, STATIC_LOOP_END: tl.constexpr):
        seq = tl.program_id(0)
        heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        head_mask = heads < num_heads
        latent_dims = tl.arange(0, LATENT_PAD)
        rope_dims = tl.arange(0, ROPE_PAD)
        latent_mask = latent_dims < LATENT
        rope_mask = rope_dims < ROPE
        q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
        q_latent = tl.load(q_rows + latent_dims[None, :], mask=head_mask[:, None] & latent_mask[None, :], other=0.0)
        q_rope = tl.load(q_rows + LATENT + rope_dims[None, :], mask=head_mask[:, None] & rope_mask[None, :],
                         other=0.0)
        context_len = tl.load(context_lens_ptr + seq)
        running_max = tl.full([HEADS], float("-inf"), tl.float32)
        running_sum = tl.zeros([HEADS], tl.float32)
        acc = tl.zeros([HEADS, LATENT_PAD], tl.float32)
        # STATIC_LOOP_END is 0 when compiled; Triton's interpreter loops only to a Python int
        for start in range(0, STATIC_LOOP_END if STATIC_LOOP_END else context_len, BLOCK_N):
            positions = start + tl.arange(0, BLOCK_N)
            valid = positions < context_len
            block_ids = tl.load(block_tables_ptr + seq * stride_table + positions // PAGE, mask=valid, other=0)
            rows = cache_ptr + (block_ids.to(tl.int64) * PAGE + positions % PAGE)[:, None] * stride_slot
            latent = tl.load(rows + latent_dims[None, :], mask=valid[:, None] & latent_mask[None, :], other=0.0)
            rope = tl.load(rows + LATENT + rope_dims[None, :], mask=valid[:, None] & rope_mask[None, :], other=0.0)
            if IEEE:
                scores = tl.dot(q_latent, tl.trans(latent), input_precision="ieee") \
                    + tl.dot(q_rope, tl.trans(rope), input_precision="ieee")
            else:
                scores = tl.dot(q_latent, tl.trans(latent)) + tl.dot(q_rope, tl.trans(rope))
            scores = tl.where(valid[None, :], scores * scale, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            probs = tl.exp(scores - new_max[:, None])
            correction = tl.exp(running_max - new_max)
            running_sum = running_sum * correction + tl.sum(probs, axis=1)
            if IEEE:
                acc = acc * correction[:, None] + tl.dot(probs.to(latent.dtype), latent, input_precision="ieee")
            else:
                acc = acc * correction[:, None] + tl.dot(probs.to(latent.dtype), latent)
            running_max = new_max
        out = acc / running_sum[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + latent_dims[None, :], out.to(q_latent.dtype),
                 mask=head_mask[:, None] & latent_mask[None, :])

    _INTERPRETED = isinstance(_latent_decode_kernel, InterpretedFunction)

    def _triton_decode(q: Tensor, cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float,
                       kv_lora_rank: int, block_n: int, heads_per_program: int) -> Tensor:
        batch, num_heads, dim = q.shape
        page = cache.shape[1]
        out = torch.empty(batch, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
        # compiled, each program loops to its own sequence's length; the interpreter loops to the longest
        static_loop_end = int(context_lens.max()) if _INTERPRETED and batch else 0
        heads = max(16, min(heads_per_program, triton.next_power_of_2(num_heads)))
        rope = dim - kv_lora_rank
        _latent_decode_kernel[(batch, triton.cdiv(num_heads, heads))](
            q, cache, block_tables, context_lens, out, scale, num_heads, q.stride(0), q.stride(1),
            out.stride(0), out.stride(1), block_tables.stride(0), dim,
            LATENT=kv_lora_rank, LATENT_PAD=max(16, triton.next_power_of_2(kv_lora_rank)), ROPE=rope,
            ROPE_PAD=max(16, triton.next_power_of_2(rope)), HEADS=heads, PAGE=page,
            BLOCK_N=max(block_n, 16), IEEE=q.dtype == torch.float32, STATIC_LOOP_END=static_loop_end,
            num_warps=4, num_stages=2)
        return out
