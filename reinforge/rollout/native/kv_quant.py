"""An fp8 KV cache (``kv_cache_dtype="fp8"``): e4m3 keys and values with one float32 scale per token and KV head.

Each (token, KV head) vector x is stored as round(x / s) in float8 e4m3 (``torch.float8_e4m3fn``) with
s = amax(|x|) / 448, its largest magnitude mapped to e4m3's largest finite value, and read back as the stored
value times s. A scale per vector (not per tensor or per head over time) needs no calibration and follows each
token's own range, so an outlier token costs only its own precision; e4m3 keeps 3 mantissa bits, a relative
error of at most 2^-4 per element. The scales cost 4 bytes per head vector (a 128-dim head: 132 bytes against
bf16's 256, so the cache holds 1.94x the tokens).

Layout: the cache stays one tensor, (layers, 2, num_blocks, block_bytes) uint8, so copying, indexing and
counting blocks work as for the model-dtype cache. A block's bytes hold its fp8 values, (block_size, kv_heads,
head_dim), then their float32 scales, (block_size, kv_heads). ``layer_caches`` views one layer's K and V as
``QuantizedCache`` pairs of strided views; the Triton kernels take them (quantising in the rotary-and-cache-write
kernel, dequantising on load in the paged decode kernels) and the PyTorch paths index them like a cache tensor
(``QuantizedCache.__getitem__`` dequantises what it gathers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reinforge.models.kv_layout import FP8_SCALE_BYTES, fp8_block_bytes

FP8_MAX = 448.0
"""The largest finite float8 e4m3 (fn) value."""
KV_CACHE_DTYPES = ("auto", "fp8")
"""``rollout.kv_cache_dtype`` values: auto keeps the model dtype."""


def block_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block of one layer's K (or V) in the fp8 layout: the values, then one float32 scale per vector
    (``models/kv_layout.py``, which the memory planner and the bandwidth floor count by too). The scales start at a
    multiple of 4 bytes: values of an odd count (a block of an odd number of tokens, heads and dims) are followed by
    up to 3 unused bytes, which the planner's 16-token blocks never need."""
    return fp8_block_bytes(block_size, num_kv_heads, head_dim) + _value_bytes(block_size, num_kv_heads, head_dim) \
        - block_size * num_kv_heads * head_dim


def _value_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes before a block's scales: its fp8 values, rounded up to a whole float32."""
    return -(-block_size * num_kv_heads * head_dim // FP8_SCALE_BYTES) * FP8_SCALE_BYTES


@dataclass
class QuantizedCache:
    """One layer's fp8 K (or V) cache as strided views of its blocks.

    values: (num_blocks, block_size, kv_heads, head_dim) float8_e4m3fn; scales: (num_blocks, block_size, kv_heads)
    float32; dtype: the model dtype that reads dequantise to.
    """

    values: Tensor
    scales: Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    def __getitem__(self, index) -> Tensor:
        """The dequantised vectors at ``index`` (any index of the leading (block, offset) dims), in ``dtype``."""
        # gathered as bytes: not every device's indexing kernels take float8
        values = self.values.view(torch.uint8)[index].view(torch.float8_e4m3fn)
        return (values.float() * self.scales[index].unsqueeze(-1)).to(self.dtype)

    def rows(self, slots: Tensor) -> Tensor:
        """The dequantised vectors of cache slots (block * block_size + offset): (len(slots), kv_heads, head_dim)."""
        block_size = self.values.shape[1]
        return self[slots // block_size, slots % block_size]

    def write(self, x: Tensor, slots: Tensor) -> None:
        """Quantise x (tokens, kv_heads, head_dim) into ``slots`` (tokens,)."""
        values, scales = quantize(x)
        block_size = self.values.shape[1]
        blocks, offsets = slots // block_size, slots % block_size
        self.values.view(torch.uint8)[blocks, offsets] = values.view(torch.uint8)
        self.scales[blocks, offsets] = scales


def kernel_cache_args(k_cache: Tensor | QuantizedCache, v_cache: Tensor | QuantizedCache,
                      placeholder: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """What a Triton kernel reading or writing the cache takes: (k values, v values, k scales, v scales, the scales'
    block stride). A bf16 cache has no scales: ``placeholder`` (any tensor) stands in for them, stride 0, not read."""
    if isinstance(k_cache, QuantizedCache):
        return k_cache.values, v_cache.values, k_cache.scales, v_cache.scales, k_cache.scales.stride(0)
    return k_cache, v_cache, placeholder, placeholder, 0


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., dim) as float8 e4m3 values (..., dim) and float32 scales (...,), one per vector (amax / 448)."""
    x32 = x.float()
    scales = x32.abs().amax(dim=-1) / FP8_MAX
    safe = torch.where(scales > 0, scales, 1.0)
    return (x32 / safe.unsqueeze(-1)).to(torch.float8_e4m3fn), scales


def dequantize(values: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """What ``quantize`` stored, back in ``dtype``."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


def layer_caches(cache: Tensor, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[QuantizedCache,
                                                                                               QuantizedCache]:
    """One layer's fp8 cache (2, num_blocks, block_bytes) uint8 as its K and V ``QuantizedCache``."""
    num_blocks, num_bytes = cache.shape[1], cache.shape[2]
    block_size = num_bytes // fp8_block_bytes(1, num_kv_heads, head_dim)  # the padding is under 4 bytes, a token more
    value_bytes = block_size * num_kv_heads * head_dim

    def split(entry: Tensor) -> QuantizedCache:
        values = entry[:, :value_bytes].view(torch.float8_e4m3fn).view(num_blocks, block_size, num_kv_heads, head_dim)
        scales = entry[:, _value_bytes(block_size, num_kv_heads, head_dim):].view(torch.float32).view(
            num_blocks, block_size, num_kv_heads)
        return QuantizedCache(values, scales, dtype)

    return split(cache[0]), split(cache[1])


FP8_MIN_CAPABILITY = (8, 9)
"""The CUDA compute capability from which Triton compiles float8 e4m3 (Ada, Hopper and later); an A100 (8.0) or an
RTX 3090 (8.6) has none, so the Triton kernels that read and write an fp8 cache fail to compile there."""


def fp8_refusal(model_type: str, has_latent_attention: bool, device: torch.device | None = None,
                use_triton: bool = False) -> str | None:
    """Why ``kv_cache_dtype=fp8`` cannot run for this model and build (and on ``device`` through the Triton kernels
    when ``use_triton``), in one line; None when it can."""
    if has_latent_attention:
        return (f"rollout.kv_cache_dtype=fp8: {model_type}'s latent attention (MLA) keeps its compressed cache in the "
                "model dtype; use rollout.kv_cache_dtype=auto")
    if not hasattr(torch, "float8_e4m3fn"):
        return f"rollout.kv_cache_dtype=fp8 needs torch.float8_e4m3fn (torch {torch.__version__} has none); use auto"
    if use_triton and device is not None:
        return fp8_device_refusal(device)
    return None


def fp8_device_refusal(device: torch.device) -> str | None:
    """Why the native engine's Triton kernels cannot keep an fp8 cache on ``device``, in one line; None when they can
    (any CUDA device of compute capability 8.9 or more, and every other device, which runs the PyTorch path)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) >= FP8_MIN_CAPABILITY:
        return None
    return (f"rollout.kv_cache_dtype=fp8: the native engine's fp8 kernels need a GPU of compute capability "
            f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer (Ada, Hopper), and this "
            f"{torch.cuda.get_device_name(device)} is {'.'.join(map(str, capability))}; use rollout.kv_cache_dtype=auto")
