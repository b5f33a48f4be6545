"""Paged decode attention under each tiling, against a device copy of the same bytes (CUDA).

    reinforge bench kernels decode-attention OUT.json [--shape 1.5b|1.5b-long|0.5b|0.5b-long|phi3-mini|olmo2-1b|gemma2-2b] [--fp8] [--candidates]

Pages of 16 tokens, random block tables. ``1.5b``: 12 query heads, 2 KV heads, head dim 128, at 128 x 4,096,
128 x 8,192 and 8 x 8,192 (sequences x context); ``1.5b-long`` the same heads at the contexts a long rollout
passes through (128 sequences from 1,024 to 16,384 tokens, 64 at 32,768). ``0.5b``: 14 query heads, 2 KV heads,
head dim 64, at the standard workload's 512 sequences and contexts of 256, 384 and 640 tokens; ``0.5b-long`` the
same heads at 128 x 2,048 and 128 x 8,192. ``phi3-mini`` (32 KV heads of 96 dims, one query head each),
``olmo2-1b`` (16 of 128) and ``gemma2-2b`` (8 query heads on 4 KV heads of 256 dims, no soft-cap here): the standard
workload's 512 sequences at 256, 384 and 640 tokens. ``--fp8``: the cache in the engine's fp8 layout (e4m3 values, a
float32 scale per vector). It times ``decode_kernels.paged_decode_attention`` at each block size, warp count,
stage count and split count (the engine's own split count, none, and twice the engine's; chunks of 64 tokens or
more for the short contexts) and prints the engine's setting (``decode_kernels.decode_tiling``) beside the fastest,
then both in the grid's other order (``DecodeTiling.heads_first``) and with elementwise products
(``DecodeTiling.elementwise``). ``--candidates`` times only the engine's setting and 32-token blocks on 2 warps
in 3 stages, unsplit, each in both grid orders (seconds a shape instead of minutes).
Results go to OUT.json after each shape.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from pathlib import Path

import torch

from reinforge.bench.kernels.timing import median_ms
from reinforge.bench.table import write_json

PAGE = 16
SHAPES = {"1.5b": dict(heads=12, kv_heads=2, head_dim=128, cases=((128, 4096), (128, 8192), (8, 8192))),
          "1.5b-long": dict(heads=12, kv_heads=2, head_dim=128,
                            cases=((128, 1024), (128, 2048), (128, 4096), (128, 8192), (128, 16384), (64, 32768))),
          "0.5b-long": dict(heads=14, kv_heads=2, head_dim=64, cases=((128, 2048), (128, 8192))),
          "0.5b": dict(heads=14, kv_heads=2, head_dim=64, cases=((512, 256), (512, 384), (512, 640))),
          # the standard workload's decode of families that keep more K and V a token
          "phi3-mini": dict(heads=32, kv_heads=32, head_dim=96, cases=((512, 256), (512, 384), (512, 640))),
          "olmo2-1b": dict(heads=16, kv_heads=16, head_dim=128, cases=((512, 256), (512, 384), (512, 640))),
          "gemma2-2b": dict(heads=8, kv_heads=4, head_dim=256, cases=((512, 256), (512, 384), (512, 640)))}
SMALL_TILING = dict(block_n=32, num_warps=2, num_stages=3, num_splits=1)
"""The candidate beside the engine's setting under ``--candidates``: 32-token blocks, 2 warps, 3 stages, unsplit."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--fp8", action="store_true", help="an fp8 cache (e4m3, a float32 scale per vector)")
    parser.add_argument("--candidates", action="store_true",
                        help="the engine's setting and 32-token blocks on 2 warps, each in both grid orders, only")


def kv_bytes(batch: int, context: int, kv_heads: int, head_dim: int, fp8: bool) -> int:
    """The bytes of K and V one decode step reads: 2 bytes a value in bf16, 1 and a float32 scale a vector in fp8."""
    return 2 * batch * context * kv_heads * (head_dim + 4 if fp8 else head_dim * 2)


def tiling_grid(short: bool, engine_splits: int) -> list[dict]:
    """The tilings timed at one case: ``paged_decode_attention``'s keyword arguments. Short contexts (unsplit by the
    engine) try smaller blocks, more warp and stage counts and 1, 2 or 4 splits of 64 tokens or more (split only
    in blocks of 64 or fewer); long ones unsplit, the engine's split count and twice it."""
    grid = []
    for block_n, warps, stages, splits in itertools.product(
            (16, 32, 64, 128) if short else (32, 64, 128), (2, 4, 8) if short else (4, 8),
            (1, 2, 3, 4) if short else (2, 3), (1, 2, 4) if short else sorted({1, engine_splits, 2 * engine_splits})):
        if short and splits > 1 and block_n > 64:
            continue
        grid.append(dict(block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits,
                         min_chunk_tokens=64 if short else None))
    return grid


def tiling_row(options: dict, ms: float, read_bytes: int) -> dict:
    """One timed tiling as the JSON lists it."""
    return {"block_n": options["block_n"], "warps": options["num_warps"], "stages": options["num_stages"],
            "splits": options["num_splits"], "heads_first": options.get("heads_first", False),
            "elementwise": options.get("elementwise", False), "ms": ms, "tbps": read_bytes / ms / 1e9}


def time_case(shape: dict, batch: int, context: int, sms: int, fp8: bool = False, candidates: bool = False) -> dict:
    """Every tiling of ``batch`` sequences at ``context`` tokens (``candidates``: a few), the engine's setting and
    the copy rate."""
    from reinforge.rollout.native import decode_kernels, kv_quant
    from reinforge.rollout.native.kv_quant import QuantizedCache

    heads, kv_heads, head_dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    device = torch.device("cuda")
    blocks = batch * (-(-context // PAGE))
    k = torch.randn(blocks + 1, PAGE, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(blocks, device=device).view(batch, -1).to(torch.int32)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16)
    read_bytes = kv_bytes(batch, context, kv_heads, head_dim, fp8)
    copy_ms = bench(lambda: k.view(-1)[: read_bytes // 4].clone())  # reads and writes half the bytes
    if fp8:  # e4m3 values and a float32 scale per token and KV head, as the engine's fp8 cache keeps them
        k, v = (QuantizedCache(*kv_quant.quantize(x), torch.bfloat16) for x in (k, v))
    tiling = decode_kernels.decode_tiling(batch, kv_heads, head_dim, context, sms, fp8,
                                          decode_kernels.shared_memory_per_program(device), num_heads=heads)
    engine_splits = decode_kernels.decode_num_splits(batch, kv_heads, context, sms)
    short = context < decode_kernels.SPLIT_MIN_CONTEXT

    def timed(**options) -> dict:
        ms = bench(functools.partial(decode_kernels.paged_decode_attention, q, k, v, tables, lengths,
                                     head_dim ** -0.5, **options))
        return tiling_row(options, ms, read_bytes)

    engine_options = tiling.options() | {
        "num_warps": tiling.num_warps or decode_kernels.default_num_warps(head_dim, tiling.splits, fp8),
        "num_stages": tiling.num_stages or decode_kernels.default_num_stages(tiling.splits)}
    head = {"batch": batch, "context": context, "kv_gb": read_bytes / 1e9, "copy_tbps": read_bytes / copy_ms / 1e9,
            "fp8": fp8}
    if candidates:
        cases = [timed(**engine_options | {"heads_first": not tiling.heads_first}), timed(**SMALL_TILING),
                 timed(**SMALL_TILING, heads_first=True)]
        engine = timed(**engine_options)
        return head | {"engine": engine, "fastest": min([engine, *cases], key=lambda case: case["ms"]),
                       "variants": cases, "cases": cases}
    cases = [timed(**options) for options in tiling_grid(short, engine_splits)]
    engine = timed(**engine_options)
    fastest = min(cases, key=lambda case: case["ms"])
    fastest_options = dict(block_n=fastest["block_n"], num_warps=fastest["warps"], num_stages=fastest["stages"],
                           num_splits=fastest["splits"], min_chunk_tokens=64 if short else None)
    # the grid's other order (KV heads first), and the elementwise products, for the engine's tiling and the fastest
    variants = [timed(**engine_options | {"heads_first": True}), timed(**fastest_options, heads_first=True),
                timed(**engine_options | {"elementwise": True}), timed(**fastest_options, elementwise=True),
                timed(**fastest_options, heads_first=True, elementwise=True)]
    return head | {"engine": engine, "fastest": fastest, "variants": variants, "cases": cases}


def bench(function) -> float:
    return median_ms(function, warmup=10, rep=60)


def run(args: argparse.Namespace) -> None:
    from reinforge.rollout.native import decode_kernels

    torch.manual_seed(0)
    sms = decode_kernels.num_sms(torch.device("cuda"))
    results = []
    for batch, context in SHAPES[args.shape]["cases"]:
        result = time_case(SHAPES[args.shape], batch, context, sms, args.fp8, args.candidates)
        results.append(result)
        engine, fastest = result["engine"], result["fastest"]
        print(f"{batch} x {context}{' fp8' if args.fp8 else ''}: engine's setting {engine} ; fastest {fastest}; heads "
              f"first and elementwise {result['variants']}; copy {result['copy_tbps']:.2f} TB/s", flush=True)
        torch.cuda.empty_cache()
        write_json(Path(args.out), results)
