"""``reinforge bench kernels WHICH OUT.json [options]``: one-off sweeps of single CUDA kernels, each writing OUT.json.

- ``decode-attention``: paged decode attention under each tiling against a copy of its bytes (``decode_attention.py``);
- ``decode-products``: a 1.5B decode step's products inside CUDA graphs against reading their weights
  (``decode_products.py``);
- ``rollout-kernels``: a bench shape's standard rollout, its phases and its decode step's kernels
  (``rollout_kernels.py``);
- ``softcap-attention``: the soft-capped packed attention's kernels under each tiling (``softcap_attention.py``);
- ``varlen-attention``: packed causal attention by each varlen kernel PyTorch ships (``varlen_attention.py``).

Each times kernels on a CUDA device and has no CPU mode: without one the command says so in one line and exits 2
before it builds anything. ``--help`` (and ``WHICH --help``) works anywhere.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import ModuleType

import torch

from reinforge.bench.kernels import (
    decode_attention,
    decode_products,
    rollout_kernels,
    softcap_attention,
    varlen_attention,
)

SWEEPS: dict[str, tuple[ModuleType, str]] = {
    "decode-attention": (decode_attention, "paged decode attention under each tiling against a copy of its bytes"),
    "decode-products": (decode_products, "a 1.5B decode step's products in CUDA graphs against reading weights"),
    "rollout-kernels": (rollout_kernels, "a shape's standard rollout: its time, phases and decode step's kernels"),
    "softcap-attention": (softcap_attention, "the soft-capped packed attention's three kernels under each tiling"),
    "varlen-attention": (varlen_attention, "packed causal attention by each varlen kernel PyTorch ships"),
}
"""WHICH -> (its module, with ``add_arguments(parser)`` and ``run(args)``; its summary)."""

PROG = "reinforge bench kernels"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="One-off sweeps of single CUDA kernels, each writing its times to OUT.json (a CUDA device "
                    "needed).", epilog="`reinforge bench kernels WHICH --help` gives a sweep's workload and options.")
    sweeps = parser.add_subparsers(dest="which", metavar="WHICH", required=True)
    for which, (module, summary) in SWEEPS.items():
        sub = sweeps.add_parser(which, help=summary, description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.add_argument("out", metavar="OUT.json", type=Path, help="where the results are written (JSON)")
        module.add_arguments(sub)
    return parser


def kernels_main(argv: list[str]) -> int:
    """Parse, refuse without CUDA (exit 2, one line), then run the sweep."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{PROG} {args.which}: it times CUDA kernels and no CUDA device is visible here "
              "(torch.cuda.is_available() is False); run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    folder = args.out.parent
    if not folder.is_dir():
        parser.error(f"OUT.json {str(args.out)!r}: its folder {str(folder)!r} does not exist; create it or name "
                     "another path")
    if args.out.is_dir():
        parser.error(f"OUT.json {str(args.out)!r} is a folder; name a file in it, "
                     f"e.g. {str(args.out / 'kernels.json')!r}")
    SWEEPS[args.which][0].run(args)
    return 0
