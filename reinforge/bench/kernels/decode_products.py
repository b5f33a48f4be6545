"""The products of a 1.5B decode step at 8-512 rows, inside CUDA graphs, against reading their weights (CUDA).

    reinforge bench kernels decode-products OUT.json

For q|k|v, o, gate|up, down and the LM head of the Qwen2.5-1.5B shape it captures 50 calls in a row in one CUDA
graph (so no launch gaps count) and reports the median time per call of cuBLAS through ``F.linear`` ((N, K)
weights), ``torch.mm`` on (K, N) weights, and a split-K by batched products (the best of 2, 4 and 8 splits),
beside the weight-read floor at 4.19 TB/s. Results go to OUT.json after each product.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from reinforge.bench.table import write_json

PRODUCTS = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960),
            "head": (151936, 1536)}
"""name -> (N, K) of the weight."""
ROWS = (8, 32, 128, 256, 512)
SPLITS = (2, 4, 8)
CALLS = 50
COPY_BYTES_PER_S = 4.19e12


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options besides OUT.json."""


def floor_us(n: int, k: int) -> float:
    """Microseconds to read an (n, k) bf16 weight once at ``COPY_BYTES_PER_S``."""
    return n * k * 2 / COPY_BYTES_PER_S * 1e6


def graphed_us(function) -> float:
    """Median microseconds per call of ``function`` replayed from a graph of ``CALLS`` calls."""
    function()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            function()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return sorted(times)[len(times) // 2]


def split_k_operands(x: Tensor, weight_kn: Tensor, splits: int) -> tuple[Tensor, Tensor]:
    """``x`` (m, K) and ``weight_kn`` (K, N) cut along K into ``splits`` pieces each: (splits, m, K / splits) and
    (splits, K / splits, N), views of both."""
    (m, k), n = x.shape, weight_kn.shape[1]
    return x.view(m, splits, k // splits).transpose(0, 1), weight_kn.view(splits, k // splits, n)


def split_k(pieces: Tensor, weights: Tensor) -> Tensor:
    """x @ W from ``split_k_operands``: one batched product, its partial sums added in float32."""
    return torch.bmm(pieces, weights).sum(0, dtype=torch.float32).to(torch.bfloat16)


def time_product(name: str, weight: Tensor, weight_kn: Tensor, m: int) -> dict:
    """One product at ``m`` rows: cuBLAS both ways and the best split-K, beside its weight-read floor."""
    n, k = weight.shape
    x = torch.randn(m, k, device=weight.device, dtype=weight.dtype)
    row = {"product": name, "rows": m, "n": n, "k": k, "floor_us": floor_us(n, k),
           "linear_us": graphed_us(lambda: F.linear(x, weight)), "mm_kn_us": graphed_us(lambda: torch.mm(x, weight_kn))}
    best = None
    for splits in SPLITS:
        us = graphed_us(functools.partial(split_k, *split_k_operands(x, weight_kn, splits)))
        best = (splits, us) if best is None or us < best[1] else best
    row["split_k_bmm"] = best
    return row


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    results = []
    for name, (n, k) in PRODUCTS.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        weight_kn = weight.t().contiguous()
        for m in ROWS:
            row = time_product(name, weight, weight_kn, m)
            results.append(row)
            splits, split_us = row["split_k_bmm"]
            print(f"{name:7s} {m:4d} rows: floor {row['floor_us']:6.1f} us | F.linear {row['linear_us']:6.1f} | "
                  f"mm (K, N) {row['mm_kn_us']:6.1f} | split-K {splits} {split_us:6.1f}", flush=True)
        write_json(Path(args.out), results)
