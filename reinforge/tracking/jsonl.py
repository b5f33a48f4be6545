"""JSON-lines files of a run: ``metrics.jsonl`` (one object per step) and ``samples.jsonl``.

Every line is flushed and fsynced as it is written, so a killed run loses at most the line it
was writing; readers skip such a half-written line, and a writer that opens the file again starts on a line of its
own. On resume, lines of steps after the checkpoint are dropped so that the files stay exact (a resumed step is
logged again). Every line is strict JSON: a NaN or infinite value is written as ``null``, as JavaScript and pandas
write it (Python's own ``NaN`` and ``Infinity`` are no JSON, and jq, DuckDB or a browser refuse the line).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import warnings
from pathlib import Path
from typing import IO, Any

from reinforge.atomic_files import replaced_atomically
from reinforge.tracking.backends import RunInfo, TrackingBackend, register_tracking_backend

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


class LogWriteError(OSError):
    """A failed write of a log line, naming the file; reads as its message alone (no "[Errno 28]")."""

    def __str__(self) -> str:
        return str(self.strerror)


_FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
_NOT_ALLOWED = (errno.EACCES, errno.EPERM, errno.EROFS)


def write_failure(path: Path, error: OSError, what: str, setting: str = "trainer.output_dir") -> LogWriteError:
    """One line for a failed write of a run's file or folder ``path`` (``what`` it is): the path, the reason (not
    "[Errno 28]") and the fix, which may point ``setting`` elsewhere. A ``LogWriteError`` is returned as it is."""
    if isinstance(error, LogWriteError):
        return error
    reason = error.strerror or str(error) or type(error).__name__
    if error.errno in _FULL_DISK:
        fix = f"free space on its disk, or set {setting} to a folder on another disk, and run the same command again"
    elif error.errno in _NOT_ALLOWED:
        fix = f"set {setting} to a folder this user can write"
    else:
        fix = f"check that folder, or set {setting} to another one"
    return LogWriteError(error.errno, f"cannot write {path} ({what}): {reason}; {fix}", str(path))


def _finite(value: Any) -> Any:
    """``value`` with each NaN or infinite float in it (in lists and dicts too) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def json_line(record: dict[str, Any]) -> str:
    """``record`` as one line of strict JSON (no newline): NaN and infinities as null, other objects as their str."""
    try:
        return json.dumps(record, default=str, allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere in it
        return json.dumps(_finite(record), default=str, allow_nan=False)


def open_for_appending(path: Path) -> IO[str]:
    """``path`` opened to append lines; a last line a kill cut short is ended first, so that the next line is a
    line of its own (readers skip the cut one) rather than glued to it and lost with it."""
    try:
        with open(path, "rb") as existing:
            existing.seek(0, os.SEEK_END)
            cut = existing.tell() > 0 and existing.seek(-1, os.SEEK_END) >= 0 and existing.read(1) != b"\n"
    except FileNotFoundError:
        cut = False
    handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - the caller closes it
    if cut:
        try:
            handle.write("\n")
            handle.flush()
        except BaseException:
            handle.close()
            raise
    return handle


def append_json_line(handle: IO[str], record: dict[str, Any]) -> None:
    try:
        handle.write(json_line(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    except OSError as error:
        if error.errno not in _FULL_DISK:  # a read-only or failing disk: still one line naming the file
            raise write_failure(Path(handle.name), error, "a log line") from error
        full = "disk quota exceeded" if error.errno == errno.EDQUOT else "no space left on device"
        raise LogWriteError(error.errno, f"{full} while writing {handle.name}; free space there and run the same "
                                         "command to resume", handle.name) from error


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; malformed lines (a half-written last one) are skipped with a warning."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as handle:  # bytes a crash left are a malformed line
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                warnings.warn(f"{path}: skipping malformed line {number} (a run killed while writing it?)",
                              stacklevel=2)
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def _kept(line: str, step: int) -> bool:
    """Whether a line of a JSON-lines file stays when the file is cut back to ``step``: a record of that step or
    an earlier one (or of none); a malformed line goes."""
    try:
        record = json.loads(line)
        return isinstance(record, dict) and int(record.get("step", 0)) <= step
    except (ValueError, TypeError, OverflowError):  # a cut line, or a step that is no number
        return False


def truncate_after_step(path: Path, step: int) -> int:
    """Rewrite ``path`` without the records whose ``step`` is greater than ``step``; returns how many went.

    Malformed lines go too; the others are kept as they are, read and written one at a time (a long run's
    ``samples.jsonl`` holds gigabytes). The file is replaced atomically, so a crash here leaves the old or the new one.
    """
    if not path.exists():
        return 0
    with open(path, encoding="utf-8", errors="replace") as handle:
        dropped = sum(1 for line in handle if line.strip() and not _kept(line, step))
    if not dropped:
        return 0
    try:
        with (replaced_atomically(path) as temporary, open(path, encoding="utf-8", errors="replace") as source,
              open(temporary, "w", encoding="utf-8") as handle):
            for line in source:
                if line.strip() and _kept(line, step):
                    handle.write(line if line.endswith("\n") else line + "\n")
    except OSError as error:
        raise write_failure(path, error, f"dropping its lines after step {step}, to resume there") from None
    return dropped


@register_tracking_backend("jsonl")
class JsonlBackend(TrackingBackend):
    """``RUN_DIR/metrics.jsonl``: {"step": 3, "critic/score/mean": 0.5, ...} per line; samples in ``samples.jsonl``."""

    def __init__(self, run: RunInfo):
        self.metrics_path = run.run_dir / METRICS_FILE
        self.samples_path = run.run_dir / SAMPLES_FILE
        self._metrics = open_for_appending(self.metrics_path)  # open for the whole run
        self._samples: IO[str] | None = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        append_json_line(self._metrics, _with_step(metrics, step))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if self._samples is None:
            self._samples = open_for_appending(self.samples_path)
        for row in rows:
            append_json_line(self._samples, _with_step(row, step))

    def truncate_after(self, step: int) -> None:
        self.close()
        truncate_after_step(self.metrics_path, step)
        truncate_after_step(self.samples_path, step)
        self._metrics = open_for_appending(self.metrics_path)

    def close(self) -> None:
        # every whole line is already on disk; a close can only fail on the rest of a line a full disk cut
        with contextlib.suppress(OSError):
            self._metrics.close()
        if self._samples is not None:
            with contextlib.suppress(OSError):
                self._samples.close()
            self._samples = None


def _with_step(record: dict[str, Any], step: int) -> dict[str, Any]:
    """``record`` as a line: ``step`` first, and the row's own step even where the record has a value named "step"
    (a reward function's log_metric), as TRL's log_history keeps it: resume, plots and bench read each row's step."""
    return {**record, "step": step} if "step" in record else {"step": step, **record}
