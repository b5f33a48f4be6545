"""What the command line prints when a command fails: one line, the failure's own words.

A failure inside a worker reaches the controller wrapped (``WorkerCallError``, a Ray task
error with the remote traceback in its text); the user needs the worker's own last error
line and where it happened, not 85 lines of traceback. ``REINFORGE_DEBUG=1`` re-raises
instead, and the line says so. (Out-of-memory errors get their own line with the memory plan,
``workers.memory_settings.describe_out_of_memory``.)
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator
from typing import NoReturn

DEBUG_HINT = "REINFORGE_DEBUG=1 shows the full traceback"
_WHERE = re.compile(r"^(.*? raised in \w+): ")


_WRAPPERS = ("WorkerCallError", "RayTaskError", "RayActorError")


def _innermost(error: BaseException) -> BaseException:
    """The error a worker raised, unwrapped from the controller's and Ray's wrappers (not its own causes)."""
    seen = {id(error)}
    while (any(name in type(error).__name__ for name in _WRAPPERS) and error.__cause__ is not None
           and id(error.__cause__) not in seen):
        error = error.__cause__
        seen.add(id(error))
    return error


_EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Failure|Interrupt|Exit)\b[^:\s]*: ")


def _last_line(error: BaseException) -> str:
    """The error's own line: the last ``Type: message`` line of a traceback in its text (a Ray task's, a
    member's log), else the first line of its message, prefixed with its type."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    raised = [line for line in lines if _EXCEPTION_LINE.match(line)]
    if raised:
        return raised[-1]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def one_line_report(error: BaseException) -> str:
    """``error: <where>: <the failure's last line>; <advice>; REINFORGE_DEBUG=1 shows the full traceback``."""
    root = _innermost(error)
    where = _WHERE.match(str(error).strip().splitlines()[0] if str(error).strip() else "")
    message = _last_line(root)
    if where is not None and root is not error:
        message = f"{where.group(1)}: {message}"
    message = " ".join(message.split())
    return f"error: {message} ({DEBUG_HINT})"


def _usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    command = parser.prog.split(" [")[0]  # plan's prog spells out its flags
    parser.exit(2, f"{command}: error: {message}; {command} --help lists what it takes\n")


@contextlib.contextmanager
def one_line_usage_errors() -> Iterator[None]:
    """While a command runs, argparse's mistakes (an unknown flag, a missing argument) are one line that points to
    --help, not the command's whole usage (a dozen lines for serve or bench) above the error; exit status 2 as before."""
    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _usage_error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original  # type: ignore[method-assign]
