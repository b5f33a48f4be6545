"""A file written whole or not at all: the one way reinforge replaces a file a reader may open at any moment.

``replaced_atomically(path)`` yields a temporary path beside ``path``; the caller writes the new content there.
When the block ends, the temporary file is flushed to disk and renamed over ``path`` (one ``rename``, atomic on
POSIX), then the folder entry is flushed too. If the block raises, the temporary file is removed and ``path``
keeps its earlier content (or stays absent): a process killed or a disk filled mid-write never leaves a half-written
file where a reader looks. The temporary's name ends in ``.tmp`` and carries the process id, so no glob of the
real files reads it and two processes writing the same file do not write into one temporary.

Imports nothing of reinforge (the bottom layer).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_directory_entry(folder: Path) -> None:
    """Flush ``folder``'s entries (a rename or a new file in it) to disk."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def temporary_beside(path: Path) -> Path:
    """Where ``replaced_atomically`` has ``path``'s new content written: ``.<name>.<pid>.tmp`` in its folder."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextmanager
def replaced_atomically(path: str | Path, *, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; the file written there replaces ``path`` when the block ends.

    ``durable``: the file's bytes and the rename are flushed to disk before returning (a power cut then leaves the
    old or the new file, never an empty one); off for files a rerun rewrites anyway. On any exception in the block,
    or in the flush or the rename, the temporary file is removed and the exception propagates.
    """
    path = Path(path)
    temporary = temporary_beside(path)
    try:
        yield temporary
        if durable:
            descriptor = os.open(temporary, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        os.replace(temporary, path)
        if durable:
            fsync_directory_entry(path.parent)
    finally:
        temporary.unlink(missing_ok=True)
