"""The soft-capped packed attention's three kernels under each tiling, at Gemma 2's training shape (CUDA).

    reinforge bench kernels softcap-attention OUT.json [--tokens 24576] [--segment 640]

Gemma-2-2B's heads (8 query heads, 4 KV heads, head dim 256, scores capped at 50, a 4,096-token window) over one
micro-batch of the standard workload: ``--tokens`` packed in segments of ``--segment`` (a 128-token prompt and 512
generated tokens), bf16. It times ``softcap_kernels._forward`` and ``_backward`` with each (BLOCK_M, BLOCK_N, warps,
stages) in turn: the forward alone, the dk|dv kernel with the dq kernel's tiling held at the table's, then the dq
kernel with the dk|dv kernel's held; a tiling is kept only if its outputs equal the table's within bf16 rounding
(a tiling that does not fit shared memory fails to launch and is listed so). It prints the table's first tiling beside
the fastest of each kernel and writes every time to OUT.json.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from reinforge.bench.kernels.timing import median_ms, relative_error
from reinforge.bench.table import write_json

HEADS, KV_HEADS, HEAD_DIM, SOFTCAP, WINDOW = 8, 4, 256, 50.0, 4096
TILES = ((16, 32), (16, 64), (32, 16), (32, 32), (32, 64), (64, 16), (64, 32), (64, 64), (128, 32), (32, 128))
WARPS, STAGES = (4, 8), (1, 2, 3)
KERNEL_NAMES = ("_forward_kernel", "_backward_kv_kernel", "_backward_q_kernel")
EXACT = 2e-2
"""The largest relative error from the table's tiling's outputs at which a tiling is timed (bf16 rounding)."""


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of tokens")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=positive_int, default=24576, help="tokens of the packed micro-batch")
    parser.add_argument("--segment", type=positive_int, default=640,
                        help="tokens a sequence (the last one holds what is left)")


def segment_lengths(tokens: int, segment: int) -> list[int]:
    """``tokens`` cut into segments of ``segment`` tokens, the rest in one shorter last segment."""
    lengths = [segment] * (tokens // segment)
    if tokens % segment:
        lengths.append(tokens % segment)
    return lengths


def candidates() -> tuple[list[tuple], list[tuple]]:
    """The (BLOCK_M, BLOCK_N, warps, stages) timed for the forward, and for each backward kernel (2 stages or
    fewer: the backward keeps more in registers)."""
    forward = [(m, n, warps, stages) for (m, n), warps, stages in itertools.product(TILES, WARPS, STAGES)]
    return forward, [blocks for blocks in forward if blocks[3] < 3]


class _CompileOnly:
    """Stands in for a kernel: ``kernel[grid](...)`` compiles it (``warmup``) and runs nothing."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel.warmup(*args, grid=grid, **kwargs)


def compile_all(kernels, runs: list) -> None:
    """Every tiling's kernels compiled on 16 threads before any is timed (a compile is a second or two each)."""
    from concurrent.futures import ThreadPoolExecutor

    import triton

    originals = {name: getattr(kernels, name) for name in KERNEL_NAMES}
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=16) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
        for name in KERNEL_NAMES:
            setattr(kernels, name, _CompileOnly(originals[name]))
        try:
            for run_one in runs:
                try:
                    run_one()
                except Exception:  # noqa: BLE001 (its timed run says so)
                    pass
        finally:
            for name in KERNEL_NAMES:
                setattr(kernels, name, originals[name])
    print(f"{len(runs)} tilings compiled in {time.perf_counter() - start:.1f} s", flush=True)


def bench(function) -> float:
    return median_ms(function, warmup=5, rep=40)


def summary_lines(summary: dict) -> list[str]:
    """What the sweep prints: the table's tilings and times, then each kernel's timed and failed counts and its
    five fastest tilings."""
    table, default_ms = summary["table"], summary["table_ms"]
    lines = [f"table's tilings: {table}; forward {default_ms['forward']:.3f} ms, backward (both kernels) "
             f"{default_ms['backward']:.3f} ms"]
    for kind, rows in summary["results"].items():
        timed = sorted((row for row in rows if row["ms"] is not None), key=lambda row: row["ms"])
        failed = sum(1 for row in rows if row["ms"] is None)
        lines.append(f"{kind}: {len(timed)} timed, {failed} failed or inexact; fastest: "
                     + ", ".join(f"{tuple(row['blocks'])} {row['ms']:.3f} ms" for row in timed[:5]))
    return lines


def run(args: argparse.Namespace) -> None:
    from reinforge.packed_attention import softcap_kernels as kernels

    device = torch.device("cuda")
    torch.manual_seed(0)
    lengths = segment_lengths(args.tokens, args.segment)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    q = torch.randn(args.tokens, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(args.tokens, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(2))
    grad_out = torch.randn_like(q)
    longest, scale = max(lengths), 1.0 / HEAD_DIM ** 0.5
    shape = (cu, cu, longest, longest, scale, SOFTCAP, WINDOW)
    out, lse = kernels._forward(q, k, v, *shape)
    reference_grads = kernels._backward(grad_out, q, k, v, out, lse, *shape)
    table = {name: kernels._blocks(getattr(kernels, name), HEAD_DIM, torch.bfloat16)[0]
             for name in ("FORWARD_BLOCKS", "BACKWARD_KV_BLOCKS", "BACKWARD_Q_BLOCKS")}
    forward_candidates, backward_candidates = candidates()
    results: dict[str, list] = {"forward": [], "backward_kv": [], "backward_q": []}
    compile_all(kernels, [lambda b=b: kernels._forward(q, k, v, *shape, blocks=b) for b in forward_candidates]
                + [lambda b=b: kernels._backward(grad_out, q, k, v, out, lse, *shape, kv_blocks=b, q_blocks=b)
                   for b in backward_candidates])

    def attempt(kind: str, blocks: tuple, run_one, reference) -> None:
        try:
            error = relative_error(run_one(blocks), reference)
            ms = bench(lambda: run_one(blocks)) if error < EXACT else None
            results[kind].append(dict(blocks=list(blocks), ms=ms, relative_error=error))
        except Exception as failure:  # noqa: BLE001 - out of shared memory or registers: listed, not timed
            results[kind].append(dict(blocks=list(blocks), ms=None, failed=f"{type(failure).__name__}"))

    for blocks in forward_candidates:
        attempt("forward", blocks, lambda b: kernels._forward(q, k, v, *shape, blocks=b), (out, lse))
    for blocks in backward_candidates:
        attempt("backward_kv", blocks, lambda b: kernels._backward(grad_out, q, k, v, out, lse, *shape, kv_blocks=b),
                reference_grads)
    for blocks in backward_candidates:
        attempt("backward_q", blocks, lambda b: kernels._backward(grad_out, q, k, v, out, lse, *shape, q_blocks=b),
                reference_grads)
    default_ms = {kind: bench(run_one) for kind, run_one in (
        ("forward", lambda: kernels._forward(q, k, v, *shape)),
        ("backward", lambda: kernels._backward(grad_out, q, k, v, out, lse, *shape)))}
    summary = {"tokens": args.tokens, "segment": args.segment, "table": table, "table_ms": default_ms,
               "device": torch.cuda.get_device_name(), "results": results}
    write_json(Path(args.out), summary)
    print("\n".join(summary_lines(summary)))
