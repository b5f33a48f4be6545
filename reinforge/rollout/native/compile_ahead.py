"""Compiling the Triton candidates of a timed kernel choice together, on a pool of threads, before any is timed.

A timed choice (``dense_choice.DenseMLPChoice``, ``moe_choice.ExpertKernelChoice``) tries tens of tilings, each a
kernel of its own to compile: one after another that is most of a first step's warm-up (a second or two each).
Most of a compile runs outside the interpreter lock (MLIR's passes, LLVM, ptxas), so the compiles overlap on
threads. Inside ``compile_ahead``, every kernel started through ``launch`` is handed to Triton's asynchronous
compile (``triton.AsyncCompileMode``) and not run; leaving it waits for every compile. The choice then times its
candidates as before, each finding its kernel compiled. A compile that fails is left to the candidate's own run,
which drops it in one line as before.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

logger = logging.getLogger(__name__)

_COMPILING_ONLY = contextvars.ContextVar("reinforge_compiling_only", default=False)
"""Whether ``launch`` compiles without running (set inside ``compile_ahead``)."""

MAX_THREADS = 16
"""At most this many compiles at once (each holds its own MLIR context and ptxas process)."""


def launch(kernel: triton.JITFunction, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
    """``kernel[grid](*args, **kwargs)``, or inside ``compile_ahead`` its compile alone (``kernel.warmup``)."""
    if _COMPILING_ONLY.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def compile_ahead(runs: Iterable[Callable[[], object]], what: str, threads: int | None = None) -> None:
    """Compile every Triton kernel that ``runs`` start through ``launch``, on ``threads`` threads (by default one a
    CPU core, at most ``MAX_THREADS``), running none of them. The runs' torch work still runs (on outputs left
    unwritten) and their results are dropped. Does nothing without CUDA, under Triton's interpreter or inside
    another asynchronous compile; a run that raises is skipped (its own timed run says why), and a failure of the
    asynchronous compile itself leaves every candidate to compile when it is first timed, said in one line."""
    runs = list(runs)
    if (len(runs) < 2 or not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
            or not hasattr(triton, "AsyncCompileMode") or _COMPILING_ONLY.get()):
        return
    threads = threads or min(len(runs), os.cpu_count() or 1, MAX_THREADS)
    start = time.perf_counter()
    try:
        skipped = _compile_on_threads(runs, threads)
    except Exception as error:  # noqa: BLE001 (the candidates then compile one by one, as they are timed)
        logger.warning("%s: not compiled ahead (%s: %s); each compiles when it is first timed", what,
                       type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return
    logger.info("%s: %d candidates compiled ahead on %d threads in %.1f s%s", what, len(runs), threads,
                time.perf_counter() - start, f" ({skipped} could not start)" if skipped else "")


def _compile_on_threads(runs: list[Callable[[], object]], threads: int) -> int:
    """Every run started with ``launch`` compiling only, inside Triton's asynchronous compile; returns how many
    runs raised (skipped)."""
    skipped = 0
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="triton-compile") as pool:
        with triton.AsyncCompileMode(pool, ignore_errors=True):
            token = _COMPILING_ONLY.set(True)
            try:
                for run in runs:
                    try:
                        run()
                    except Exception:  # noqa: BLE001 (the candidate's timed run raises it again, in one line)
                        skipped += 1
            finally:
                _COMPILING_ONLY.reset(token)
    return skipped
