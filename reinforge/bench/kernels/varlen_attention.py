"""Packed causal attention, forward and backward, by each varlen kernel PyTorch ships (CUDA).

    reinforge bench kernels varlen-attention OUT.json

Times the flash kernel the training forward runs today (``aten._flash_attention_forward``/``_backward``, key and
value heads shared by their query heads) against cuDNN's ragged attention (``aten._cudnn_attention_forward``/
``_backward``, cumulative lengths, key and value heads once with the query heads' count, and expanded to it), on
the update's micro-batches: Qwen2.5-1.5B's heads (12 query heads, 2 KV heads of 128) over 8,320-token sequences
(a 128-token prompt and 8,192 generated) and over 640-token sequences (the standard workload), and Qwen2.5-7B's
(28, 4) over 8,320. Each kernel's output and gradients are compared with the flash kernel's (relative norm), and
one segment of fewer queries than keys (the responses of a shared prompt) says where each kernel aligns its causal
mask. It prints one line a case and writes every time to OUT.json as each case ends.

Each kernel runs each case in a process of its own: a kernel that faults the device (cuDNN's ragged attention has
ended in an illegal memory access on some segment lengths, which leaves the CUDA context unusable) then loses its own
row only, reported as that process's last error line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from reinforge.bench.kernels.timing import failure_text, median_ms, relative_error
from reinforge.bench.table import write_json

CASES = (  # name, segments, segment length, query heads, KV heads, head dim
    ("1.5b-8k", 5, 8320, 12, 2, 128),
    ("1.5b-640", 76, 640, 12, 2, 128),
    ("7b-8k", 3, 8320, 28, 4, 128),
)
BACKWARD_FLOP_RATIO = 2.5
"""The backward's FLOPs over the forward's: four products against two, plus recomputing the scores."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options besides OUT.json (``--one CASE KERNEL``: the worker process of one kernel at one case)."""
    parser.add_argument("--one", nargs=2, metavar=("CASE", "KERNEL"), help=argparse.SUPPRESS)


def causal_forward_flops(segments: int, length: int, heads: int, dim: int) -> float:
    """FLOPs of the causal forward (scores and values, 2 each a multiply-add) over ``segments`` of ``length``: each
    query sees itself and the keys before it."""
    return 4 * segments * (length * (length + 1) / 2) * heads * dim


def kernel_row(forward_ms: float, both_ms: float, flops_forward: float, error: float) -> dict:
    """One kernel's times at one case as the JSON lists them (the backward: both less the forward)."""
    backward_ms = both_ms - forward_ms
    return {"forward_ms": forward_ms, "backward_ms": backward_ms, "forward_tflops": flops_forward / forward_ms / 1e9,
            "backward_tflops": BACKWARD_FLOP_RATIO * flops_forward / backward_ms / 1e9, "max_relative_error": error}


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


def bench(function) -> float:
    return median_ms(function, warmup=3, rep=30)


def run_case(name, segments, length, heads, kv_heads, dim, kernels=tuple(KERNELS)) -> dict:
    """The case's row: each of ``kernels`` timed and compared with the first (flash, the reference)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    tokens = segments * length
    generator = torch.Generator(device).manual_seed(0)
    q = torch.randn(tokens, heads, dim, device=device, dtype=dtype, generator=generator)
    k = torch.randn(tokens, kv_heads, dim, device=device, dtype=dtype, generator=generator)
    v = torch.randn(tokens, kv_heads, dim, device=device, dtype=dtype, generator=generator)
    grad = torch.randn(tokens, heads, dim, device=device, dtype=dtype, generator=generator)
    cu = torch.arange(0, tokens + 1, length, device=device, dtype=torch.int32)
    scale = dim ** -0.5
    flops_forward = causal_forward_flops(segments, length, heads, dim)
    row: dict = {"case": name, "tokens": tokens, "forward_tflop": flops_forward / 1e12}
    reference = None
    for kernel_name in ("flash", *[name for name in kernels if name != "flash"]):
        kernel = KERNELS[kernel_name]
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
            error = relative_error((out, *grads), reference)
            forward_ms = bench(lambda forward=forward: forward().detach())
            row[kernel_name] = kernel_row(forward_ms, bench(both), flops_forward, error)
        except Exception as error:  # noqa: BLE001 - a kernel that cannot run this case is reported, not fatal
            row[kernel_name] = {"error": failure_text(error)}
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
    found: dict = {}
    for kernel_name in ("flash", "cudnn"):
        try:
            out = KERNELS[kernel_name](q, k, v, cu_q, cu_k, 1, 2, 1.0)
            found[kernel_name] = float(out.float().mean())
        except Exception as error:  # noqa: BLE001
            found[kernel_name] = failure_text(error)
    return found


def case_line(row: dict) -> str:
    """One printed line of a case: each kernel's times and error, or its failure."""
    parts = []
    for kernel_name in KERNELS:
        found = row[kernel_name]
        parts.append(f"{kernel_name} {found['error']}" if "error" in found else
                     f"{kernel_name} fwd {found['forward_ms']:.2f} ms ({found['forward_tflops']:.0f} TF/s) "
                     f"bwd {found['backward_ms']:.2f} ms ({found['backward_tflops']:.0f} TF/s) "
                     f"err {found['max_relative_error']:.1e}")
    return f"{row['case']}: " + " | ".join(parts)


RESULT_MARK = "varlen-attention result: "
"""The line a worker process prints its row (or the alignment) after, as JSON."""


def in_own_process(out: Path, case: str, kernel: str) -> dict:
    """What ``--one case kernel`` found, run in a process of its own: its JSON line, or its last error line."""
    command = [sys.executable, "-m", "reinforge", "bench", "kernels", "varlen-attention", str(out), "--one", case, kernel]
    done = subprocess.run(command, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "no output")
    return {"error": f"its process exited {done.returncode}: {last.strip()[:200]}"}


def run_one(case: str, kernel: str) -> None:
    """The worker: one kernel at one case (with flash as its reference), or the alignment probe (case ``alignment``)."""
    if case == "alignment":
        found = {kernel: alignment()[kernel]}
    else:
        row = run_case(*next(each for each in CASES if each[0] == case), kernels=(kernel,))
        found = row[kernel] | {"tokens": row["tokens"], "forward_tflop": row["forward_tflop"]}
    print(RESULT_MARK + json.dumps(found), flush=True)


def run(args: argparse.Namespace) -> None:
    if args.one is not None:
        run_one(*args.one)
        return
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "rows": [], "alignment": {}}
    for name, *_ in CASES:
        row: dict = {"case": name}
        for kernel_name in KERNELS:
            found = in_own_process(args.out, name, kernel_name)
            row |= {key: found.pop(key) for key in ("tokens", "forward_tflop") if key in found}
            row[kernel_name] = found
        result["rows"].append(row)
        write_json(Path(args.out), result)
        print(case_line(row), flush=True)
    for kernel_name in ("flash", "cudnn"):
        found = in_own_process(args.out, "alignment", kernel_name)
        result["alignment"][kernel_name] = found.get(kernel_name, found.get("error"))
    write_json(Path(args.out), result)
    print(f"alignment (0.5: to the end of the keys): {result['alignment']}")
