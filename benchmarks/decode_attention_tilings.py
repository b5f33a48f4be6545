"""Paged decode attention under each tiling, against a device copy of the same bytes (CUDA).

    python3 benchmarks/decode_attention_tilings.py OUT.json [--shape 1.5b|1.5b-long|0.5b|0.5b-long|phi3-mini|olmo2-1b|gemma2-2b] [--fp8] [--candidates]

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
import json

import torch
import triton.testing

from reinforge.rollout.native import decode_kernels, kv_quant
from reinforge.rollout.native.kv_quant import QuantizedCache

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


def bench(function) -> float:
    return triton.testing.do_bench(function, warmup=10, rep=60, return_mode="median")


def time_case(shape: dict, batch: int, context: int, sms: int, fp8: bool = False, candidates: bool = False) -> dict:
    """Every tiling of ``batch`` sequences at ``context`` tokens (``candidates``: a few), the engine's setting and
    the copy rate."""
    HEADS, KV_HEADS, HEAD_DIM = shape["heads"], shape["kv_heads"], shape["head_dim"]  # noqa: N806
    device = torch.device("cuda")
    blocks = batch * (-(-context // PAGE))
    k = torch.randn(blocks + 1, PAGE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(blocks, device=device).view(batch, -1).to(torch.int32)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    kv_bytes = 2 * batch * context * KV_HEADS * (HEAD_DIM + 4 if fp8 else HEAD_DIM * 2)
    copy_ms = bench(lambda: k.view(-1)[: kv_bytes // 4].clone())  # reads and writes half the bytes
    if fp8:  # e4m3 values and a float32 scale per token and KV head, as the engine's fp8 cache keeps them
        k, v = (QuantizedCache(*kv_quant.quantize(x), torch.bfloat16) for x in (k, v))
    tiling = decode_kernels.decode_tiling(batch, KV_HEADS, HEAD_DIM, context, sms, fp8,
                                          decode_kernels.shared_memory_per_program(device), num_heads=HEADS)
    engine_splits = decode_kernels.decode_num_splits(batch, KV_HEADS, context, sms)
    short = context < decode_kernels.SPLIT_MIN_CONTEXT

    def timed(**options) -> dict:
        ms = bench(functools.partial(decode_kernels.paged_decode_attention, q, k, v, tables, lengths,
                                     HEAD_DIM ** -0.5, **options))
        return {"block_n": options["block_n"], "warps": options["num_warps"], "stages": options["num_stages"],
                "splits": options["num_splits"], "heads_first": options.get("heads_first", False),
                "elementwise": options.get("elementwise", False), "ms": ms, "tbps": kv_bytes / ms / 1e9}

    engine_options = tiling.options() | {
        "num_warps": tiling.num_warps or decode_kernels.default_num_warps(HEAD_DIM, tiling.splits, fp8),
        "num_stages": tiling.num_stages or decode_kernels.default_num_stages(tiling.splits)}
    if candidates:
        small = dict(block_n=32, num_warps=2, num_stages=3, num_splits=1)
        cases = [timed(**engine_options | {"heads_first": not tiling.heads_first}), timed(**small),
                 timed(**small, heads_first=True)]
        engine = timed(**engine_options)
        return {"batch": batch, "context": context, "kv_gb": kv_bytes / 1e9, "copy_tbps": kv_bytes / copy_ms / 1e9,
                "fp8": fp8, "engine": engine, "fastest": min([engine, *cases], key=lambda case: case["ms"]),
                "variants": cases, "cases": cases}
    cases = []
    for block_n, warps, stages, splits in itertools.product(
            (16, 32, 64, 128) if short else (32, 64, 128), (2, 4, 8) if short else (4, 8),
            (1, 2, 3, 4) if short else (2, 3), (1, 2, 4) if short else sorted({1, engine_splits, 2 * engine_splits})):
        if short and splits > 1 and block_n > 64:
            continue
        cases.append(timed(block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits,
                           min_chunk_tokens=64 if short else None))
    engine = timed(**engine_options)
    fastest = min(cases, key=lambda case: case["ms"])
    fastest_options = dict(block_n=fastest["block_n"], num_warps=fastest["warps"], num_stages=fastest["stages"],
                           num_splits=fastest["splits"], min_chunk_tokens=64 if short else None)
    # the grid's other order (KV heads first), and the elementwise products, for the engine's tiling and the fastest
    variants = [timed(**engine_options | {"heads_first": True}), timed(**fastest_options, heads_first=True),
                timed(**engine_options | {"elementwise": True}), timed(**fastest_options, elementwise=True),
                timed(**fastest_options, heads_first=True, elementwise=True)]
    return {"batch": batch, "context": context, "kv_gb": kv_bytes / 1e9, "copy_tbps": kv_bytes / copy_ms / 1e9,
            "fp8": fp8, "engine": engine, "fastest": fastest, "variants": variants, "cases": cases}


def main(out_path: str, shape_name: str, fp8: bool, candidates: bool = False) -> None:
    torch.manual_seed(0)
    sms = decode_kernels.num_sms(torch.device("cuda"))
    shape = SHAPES[shape_name]
    results = []
    for batch, context in shape["cases"]:
        result = time_case(shape, batch, context, sms, fp8, candidates)
        results.append(result)
        engine, fastest = result["engine"], result["fastest"]
        print(f"{batch} x {context}{' fp8' if fp8 else ''}: engine's setting {engine} ; fastest {fastest}; heads "
              f"first and elementwise {result['variants']}; copy {result['copy_tbps']:.2f} TB/s", flush=True)
        torch.cuda.empty_cache()
        with open(out_path, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON results")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--fp8", action="store_true", help="an fp8 cache (e4m3, a float32 scale per vector)")
    parser.add_argument("--candidates", action="store_true",
                        help="the engine's setting and 32-token blocks on 2 warps, each in both grid orders, only")
    args = parser.parse_args()
    main(args.out, args.shape, args.fp8, args.candidates)
