"""The ``reinforge data ...`` commands: prepare datasets in the RL schema.

    reinforge data gsm8k --src ../shared/data/gsm8k --out data/gsm8k
    reinforge data retool --src ../shared/data/gsm8k --out data/retool_gsm8k
    reinforge data arithmetic --out data/arithmetic --num-train 2000 --max-digits 3

``add_data_subcommands`` adds these to the CLI's ``data`` parser; ``data_main`` runs them
on their own.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from reinforge.data.gsm8k import convert_gsm8k
from reinforge.data.retool import convert_retool
from reinforge.data.tasks.arithmetic import OPERATORS, write_arithmetic_dataset


def add_data_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``gsm8k``, ``retool`` and ``arithmetic``; each sets ``handler(args) -> int`` as a default."""
    gsm8k = subparsers.add_parser("gsm8k", help="convert GSM8K JSONL into train/test parquet files")
    gsm8k.add_argument("--src", required=True, help="folder with train.jsonl and test.jsonl")
    gsm8k.add_argument("--out", required=True, help="folder to write train.parquet and test.parquet")
    gsm8k.set_defaults(handler=_run_gsm8k)

    retool = subparsers.add_parser("retool", help="GSM8K JSONL as tool_agent rows asking for a \\boxed{} answer "
                                                  "(the ReTool recipe, examples/retool.yaml)")
    retool.add_argument("--src", required=True, help="folder with GSM8K's train.jsonl and test.jsonl")
    retool.add_argument("--out", required=True, help="folder to write train.parquet and test.parquet")
    retool.set_defaults(handler=_run_retool)

    arithmetic = subparsers.add_parser("arithmetic", help="generate the built-in addition/subtraction task")
    arithmetic.add_argument("--out", required=True, help="folder to write train/test/sft_train parquet files")
    arithmetic.add_argument("--num-train", type=int, default=2000)
    arithmetic.add_argument("--num-test", type=int, default=200)
    arithmetic.add_argument("--seed", type=int, default=0)
    arithmetic.add_argument("--min-digits", type=int, default=1)
    arithmetic.add_argument("--max-digits", type=int, default=3)
    arithmetic.add_argument("--operators", default="".join(OPERATORS), help="any of '+-' (default: both)")
    arithmetic.set_defaults(handler=_run_arithmetic)


def data_main(argv: list[str]) -> int:
    """Run ``reinforge data <command> ...`` from ``argv`` (without the leading 'data')."""
    parser = argparse.ArgumentParser(prog="reinforge data", description="prepare datasets in the RL schema")
    add_data_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():  # it was "[Errno 17] File exists"
        raise FileExistsError(f"--out {args.out} (command line) is a file; reinforge data {args.command} writes its "
                              "parquet files into a folder: give one (it may not exist yet)")
    return args.handler(args)


def _run_gsm8k(args: argparse.Namespace) -> int:
    for split, path in convert_gsm8k(args.src, args.out).items():
        print(f"wrote {split} rows to {path}")
    return 0


def _run_retool(args: argparse.Namespace) -> int:
    for split, path in convert_retool(args.src, args.out).items():
        print(f"wrote {split} rows to {path}")
    return 0


def _run_arithmetic(args: argparse.Namespace) -> int:
    for flag, count in (("--num-train", args.num_train), ("--num-test", args.num_test)):
        if count < 1:  # 0 wrote a parquet file of no rows and no columns; a negative count hundreds of rows
            raise ValueError(f"{flag} {count} (command line) must be at least 1: the number of problems to write")
    written = write_arithmetic_dataset(args.out, args.num_train, args.num_test, args.seed, args.min_digits,
                                       args.max_digits, tuple(args.operators))
    for name, path in written.items():
        print(f"wrote {name} rows to {path}")
    return 0
