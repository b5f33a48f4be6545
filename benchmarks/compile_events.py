"""What compiles during which step of ``reinforge bench train``: Triton kernels and dynamo recompiles.

    TORCHINDUCTOR_COMPILE_THREADS=1 PYTHONPATH=. python3 benchmarks/compile_events.py --model 0.5b --steps 6

The 0.5B bench's update takes 3-4 s longer in one step of a run (step 2 or 3, then never again;
BENCHMARKS.md). A kernel compiled late would do that: Triton compiles a new variant of a kernel the
first time an integer argument is 1 or a multiple of 16 where it was not before, and dynamo
recompiles a graph whose guards fail. This runs the bench in this process with every Triton
compile timed (``triton.compile``, which both ``@triton.jit`` kernels and inductor's use; one
compile thread keeps inductor's compiles in this process) and dynamo's recompile log on, and after
each step's line prints the compiles that happened during it: their count, seconds and the slowest.
"""

from __future__ import annotations

import sys
import time

import torch
import triton
import triton.compiler
import triton.compiler.compiler as triton_compiler

events: list[tuple[float, str, str]] = []
"""(seconds, kernel, specialization) of each compile since the last step's line."""

_compile = triton_compiler.compile


def timed_compile(src, *args, **kwargs):
    started = time.monotonic()
    kernel = _compile(src, *args, **kwargs)
    seconds = time.monotonic() - started
    name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", type(src).__name__)
    attrs = getattr(src, "attrs", None)
    events.append((seconds, str(name), str(attrs)[:160]))
    return kernel


triton_compiler.compile = timed_compile
triton.compiler.compile = timed_compile
triton.compile = timed_compile

class StepLines:
    """stdout, with the compiles since the last step printed after each step's line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        if text.startswith('{"variant"'):  # a step's line (reinforge.bench.train prints one per step)
            total = sum(seconds for seconds, _, _ in events)
            self.stream.write(f"\n[compiles in this step] {len(events)} kernels, {total:.2f} s")
            for seconds, name, attrs in sorted(events, reverse=True)[:6]:
                self.stream.write(f"\n    {seconds:6.3f} s  {name}  {attrs}")
            events.clear()
        return written

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


sys.stdout = StepLines(sys.stdout)


def main() -> int:
    torch._logging.set_logs(recompiles=True)
    from reinforge.cli import main as cli

    return cli(["bench", "train", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
