"""What the kernel sweeps share: a kernel's median time by Triton's ``do_bench``, how far outputs are from a
reference, and a failure as one short line for their JSON."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor


def median_ms(function: Callable[[], object], warmup: int, rep: int) -> float:
    """The median milliseconds of ``function`` over ``rep`` ms of calls after ``warmup`` ms of them (CUDA)."""
    import triton.testing

    return triton.testing.do_bench(function, warmup=warmup, rep=rep, return_mode="median")


def relative_error(got: Iterable[Tensor], reference: Iterable[Tensor]) -> float:
    """The largest ||a - b|| / ||b|| over the pairs of ``got`` and ``reference`` (in float32)."""
    return max(float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm().clamp_min(1e-30))
               for a, b in zip(got, reference, strict=True))


def failure_text(error: BaseException, limit: int = 200) -> str:
    """``error``'s type and the first line of its message (at most ``limit`` characters)."""
    first = next(iter(str(error).splitlines()), "")
    return f"{type(error).__name__}: {first[:limit]}"
