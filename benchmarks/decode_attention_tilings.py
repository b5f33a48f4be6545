"""Paged decode attention of the 1.5B shape under each tiling, against a device copy of the same bytes (CUDA).

    python3 benchmarks/decode_attention_tilings.py OUT.json

12 query heads, 2 KV heads, head dim 128, pages of 16 tokens, random block tables; for 128 x 4,096, 128 x 8,192 and
8 x 8,192 (sequences x context) it times ``decode_kernels.paged_decode_attention`` at each block size, warp count,
stage count and split count (the engine's own split count, none, and twice the engine's) and prints the engine's
setting beside the fastest. Results go to OUT.json after each shape.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys

import torch
import triton.testing

from reinforge.rollout.native import decode_kernels

HEADS, KV_HEADS, HEAD_DIM, PAGE = 12, 2, 128, 16
CASES = ((128, 4096), (128, 8192), (8, 8192))


def bench(function) -> float:
    return triton.testing.do_bench(function, warmup=10, rep=60, return_mode="median")


def time_case(batch: int, context: int, sms: int) -> dict:
    """Every tiling of ``batch`` sequences at ``context`` tokens, the engine's setting and the copy rate."""
    device = torch.device("cuda")
    blocks = batch * (-(-context // PAGE))
    k = torch.randn(blocks + 1, PAGE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(blocks, device=device).view(batch, -1).to(torch.int32)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    copy_ms = bench(lambda: k.view(-1)[: kv_bytes // 4].clone())  # reads and writes half the bytes
    engine_splits = decode_kernels.decode_num_splits(batch, KV_HEADS, context, sms)
    cases = []
    for block_n, warps, stages, splits in itertools.product(
            (32, 64, 128), (4, 8), (2, 3), sorted({1, engine_splits, 2 * engine_splits})):
        options = dict(block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits)
        ms = bench(functools.partial(decode_kernels.paged_decode_attention, q, k, v, tables, lengths,
                                     HEAD_DIM ** -0.5, **options))
        cases.append({"block_n": block_n, "warps": warps, "stages": stages, "splits": splits, "ms": ms,
                      "tbps": kv_bytes / ms / 1e9})
    engine = next(case for case in cases
                  if (case["block_n"], case["warps"], case["stages"], case["splits"]) == (64, 4, 2, engine_splits))
    return {"batch": batch, "context": context, "kv_gb": kv_bytes / 1e9, "copy_tbps": kv_bytes / copy_ms / 1e9,
            "engine": engine, "fastest": min(cases, key=lambda case: case["ms"]), "cases": cases}


def main(out_path: str) -> None:
    torch.manual_seed(0)
    sms = decode_kernels.num_sms(torch.device("cuda"))
    results = []
    for batch, context in CASES:
        result = time_case(batch, context, sms)
        results.append(result)
        engine, fastest = result["engine"], result["fastest"]
        print(f"{batch} x {context}: engine's setting {engine['ms']:.3f} ms ({engine['tbps']:.2f} TB/s); fastest "
              f"{fastest}; copy {result['copy_tbps']:.2f} TB/s", flush=True)
        torch.cuda.empty_cache()
        with open(out_path, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
