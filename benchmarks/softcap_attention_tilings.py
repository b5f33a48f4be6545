"""The soft-capped packed attention's three kernels under each tiling, at Gemma 2's training shape (CUDA).

    python3 benchmarks/softcap_attention_tilings.py OUT.json [--tokens 24576] [--segment 640]

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
import json
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.testing

from reinforge.packed_attention import softcap_kernels as kernels

HEADS, KV_HEADS, HEAD_DIM, SOFTCAP, WINDOW = 8, 4, 256, 50.0, 4096
TILES = ((16, 32), (16, 64), (32, 16), (32, 32), (32, 64), (64, 16), (64, 32), (64, 64), (128, 32), (32, 128))


def bench(function) -> float:
    return triton.testing.do_bench(function, warmup=5, rep=40, return_mode="median")


def close(got, reference) -> float:
    return max(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
               for a, b in zip(got, reference, strict=True))


class _CompileOnly:
    """Stands in for a kernel: ``kernel[grid](...)`` compiles it (``warmup``) and runs nothing."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel.warmup(*args, grid=grid, **kwargs)


def compile_all(runs: list) -> None:
    """Every tiling's kernels compiled on 16 threads before any is timed (a compile is a second or two each)."""
    names = ("_forward_kernel", "_backward_kv_kernel", "_backward_q_kernel")
    originals = {name: getattr(kernels, name) for name in names}
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=16) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
        for name in names:
            setattr(kernels, name, _CompileOnly(originals[name]))
        try:
            for run in runs:
                try:
                    run()
                except Exception:  # noqa: BLE001 (its timed run says so)
                    pass
        finally:
            for name in names:
                setattr(kernels, name, originals[name])
    print(f"{len(runs)} tilings compiled in {time.perf_counter() - start:.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--tokens", type=int, default=24576)
    parser.add_argument("--segment", type=int, default=640)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    lengths = [args.segment] * (args.tokens // args.segment)
    if args.tokens % args.segment:
        lengths.append(args.tokens % args.segment)
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
    forward_candidates = [(m, n, warps, stages) for (m, n), warps, stages in itertools.product(TILES, (4, 8), (1, 2, 3))]
    backward_candidates = [blocks for blocks in forward_candidates if blocks[3] < 3]
    results: dict[str, list] = {"forward": [], "backward_kv": [], "backward_q": []}
    runs = ([lambda b=b: kernels._forward(q, k, v, *shape, blocks=b) for b in forward_candidates]
            + [lambda b=b: kernels._backward(grad_out, q, k, v, out, lse, *shape, kv_blocks=b, q_blocks=b)
               for b in backward_candidates])
    compile_all(runs)

    def attempt(kind: str, blocks: tuple, run, reference) -> None:
        try:
            got = run(blocks)
            error = close(got, reference)
            ms = bench(lambda: run(blocks)) if error < 2e-2 else None
            results[kind].append(dict(blocks=list(blocks), ms=ms, relative_error=error))
        except Exception as failure:  # out of shared memory or registers: listed, not timed
            results[kind].append(dict(blocks=list(blocks), ms=None, failed=f"{type(failure).__name__}"))

    for blocks in forward_candidates:
        attempt("forward", blocks, lambda b: kernels._forward(q, k, v, *shape, blocks=b), (out, lse))
    for blocks in backward_candidates:
        attempt("backward_kv", blocks, lambda b: kernels._backward(grad_out, q, k, v, out, lse, *shape, kv_blocks=b),
                reference_grads)
    for blocks in backward_candidates:
        attempt("backward_q", blocks, lambda b: kernels._backward(grad_out, q, k, v, out, lse, *shape, q_blocks=b),
                reference_grads)
    default_ms = {kind: bench(run) for kind, run in (
        ("forward", lambda: kernels._forward(q, k, v, *shape)),
        ("backward", lambda: kernels._backward(grad_out, q, k, v, out, lse, *shape)))}
    summary = {"tokens": args.tokens, "segment": args.segment, "table": table, "table_ms": default_ms,
               "device": torch.cuda.get_device_name(), "results": results}
    with open(args.out, "w") as handle:
        json.dump(summary, handle, indent=1)
    print(f"table's tilings: {table}; forward {default_ms['forward']:.3f} ms, backward (both kernels) "
          f"{default_ms['backward']:.3f} ms")
    for kind, rows in results.items():
        timed = sorted((row for row in rows if row["ms"] is not None), key=lambda row: row["ms"])
        failed = sum(1 for row in rows if row["ms"] is None)
        print(f"{kind}: {len(timed)} timed, {failed} failed or inexact; fastest: "
              + ", ".join(f"{tuple(row['blocks'])} {row['ms']:.3f} ms" for row in timed[:5]))


if __name__ == "__main__":
    main()
