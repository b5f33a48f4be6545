"""Packed causal attention, forward and backward, by each varlen kernel PyTorch ships (CUDA).

    python3 benchmarks/varlen_attention_backends.py OUT.json

Times the flash kernel the training forward runs today (``aten._flash_attention_forward``/``_backward``, key and
value heads shared by their query heads) against cuDNN's ragged attention (``aten._cudnn_attention_forward``/
``_backward``, cumulative lengths, key and value heads once with the query heads' count, and expanded to it), on
the update's micro-batches: Qwen2.5-1.5B's heads (12 query heads, 2 KV heads of 128) over 8,320-token sequences
(a 128-token prompt and 8,192 generated) and over 640-token sequences (the standard workload), and Qwen2.5-7B's
(28, 4) over 8,320. Each kernel's output and gradients are compared with the flash kernel's (relative norm), and
one segment of fewer queries than keys (the responses of a shared prompt) says where each kernel aligns its causal
mask. It prints one line a case and writes every time to OUT.json.
"""

from __future__ import annotations

import json
import sys

import torch
import triton.testing

CASES = (  # name, segments, segment length, query heads, KV heads, head dim
    ("1.5b-8k", 5, 8320, 12, 2, 128),
    ("1.5b-640", 76, 640, 12, 2, 128),
    ("7b-8k", 3, 8320, 28, 4, 128),
)


def bench(function) -> float:
    return triton.testing.do_bench(function, warmup=3, rep=30, return_mode="median")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def flash(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                   scale=scale)[0]


def cudnn(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, True, False,
                                                   scale=scale)[0]


def cudnn_expanded(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    groups = q.shape[1] // k.shape[1]
    return cudnn(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), cu_q, cu_k, max_q, max_k, scale)


KERNELS = {"flash": flash, "cudnn": cudnn, "cudnn_expanded": cudnn_expanded}


def run_case(name, segments, length, heads, kv_heads, dim) -> dict:
    device, dtype = torch.device("cuda"), torch.bfloat16
    tokens = segments * length
    generator = torch.Generator(device).manual_seed(0)
    q = torch.randn(tokens, heads, dim, device=device, dtype=dtype, generator=generator)
    k = torch.randn(tokens, kv_heads, dim, device=device, dtype=dtype, generator=generator)
    v = torch.randn(tokens, kv_heads, dim, device=device, dtype=dtype, generator=generator)
    grad = torch.randn(tokens, heads, dim, device=device, dtype=dtype, generator=generator)
    cu = torch.arange(0, tokens + 1, length, device=device, dtype=torch.int32)
    scale = dim ** -0.5
    flops_forward = 4 * segments * (length * (length + 1) / 2) * heads * dim
    row: dict = {"case": name, "tokens": tokens, "forward_tflop": flops_forward / 1e12}
    reference = None
    for kernel_name, kernel in KERNELS.items():
        try:
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]

            def forward(kernel=kernel, inputs=inputs):
                return kernel(*inputs, cu, cu, length, length, scale)

            def both(forward=forward, inputs=inputs):  # the forward and its backward, by each op's autograd formula
                return torch.autograd.grad(forward(), inputs, grad)

            out = forward()
            grads = torch.autograd.grad(out, inputs, grad)
            torch.cuda.synchronize()
            if reference is None:
                reference = (out, *grads)
            error = max(relative(a, b) for a, b in zip((out, *grads), reference, strict=True))
            forward_ms = bench(lambda forward=forward: forward().detach())
            both_ms = bench(both)
            row[kernel_name] = {"forward_ms": forward_ms, "backward_ms": both_ms - forward_ms,
                                "forward_tflops": flops_forward / forward_ms / 1e9,
                                "backward_tflops": 2.5 * flops_forward / (both_ms - forward_ms) / 1e9,
                                "max_relative_error": error}
        except Exception as error:  # noqa: BLE001 - a kernel that cannot run this case is reported, not fatal
            row[kernel_name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    return row


def alignment() -> dict:
    """One segment of 1 query and 2 keys with equal scores: a causal mask aligned to the end of the keys sees both
    keys (0.5), one aligned to their start sees the first only (0.0)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    q = torch.zeros(1, 1, 64, device=device, dtype=dtype)
    k = torch.zeros(2, 1, 64, device=device, dtype=dtype)
    v = torch.stack([torch.zeros(1, 64), torch.ones(1, 64)]).to(device, dtype)
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 2], dtype=torch.int32, device=device)
    found = {}
    for kernel_name in ("flash", "cudnn"):
        try:
            out = KERNELS[kernel_name](q, k, v, cu_q, cu_k, 1, 2, 1.0)
            found[kernel_name] = float(out.float().mean())
        except Exception as error:  # noqa: BLE001
            found[kernel_name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return found


def main() -> None:
    rows = [run_case(*case) for case in CASES]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "rows": rows, "alignment": alignment()}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as file:
            json.dump(result, file, indent=1)
    for row in rows:
        parts = []
        for kernel_name in KERNELS:
            found = row[kernel_name]
            parts.append(f"{kernel_name} {found['error']}" if "error" in found else
                         f"{kernel_name} fwd {found['forward_ms']:.2f} ms ({found['forward_tflops']:.0f} TF/s) "
                         f"bwd {found['backward_ms']:.2f} ms ({found['backward_tflops']:.0f} TF/s) "
                         f"err {found['max_relative_error']:.1e}")
        print(f"{row['case']}: " + " | ".join(parts))
    print(f"alignment (0.5: to the end of the keys): {result['alignment']}")


if __name__ == "__main__":
    main()
