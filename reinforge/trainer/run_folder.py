"""Opening a run folder: one run at a time, and a resume that agrees with the settings it is given.

A failed write there (a full disk, a folder this user cannot write) is one line naming the path and the fix
(``tracking.jsonl.write_failure``). ``RunLock`` keeps a second run off a folder that a live process is using (``RUN/.lock`` holds
its pid and, on Linux, the process's start time; a lock left by a dead process, or naming a pid
that now belongs to a process started later, is taken over with a warning; two runs starting at once never both
hold it: an empty lock is one whose run is about to write its pid, and a stale one is moved aside and checked
before it counts as taken over). ``config_changes`` lists
the settings that differ between a checkpoint's run and this one: settings the trainer reads
as it goes (sampling, loss coefficients, the optimizer's hyperparameters, which the workers
re-apply after loading the optimizer state, the step count) take effect and are recorded in
``config.yaml``; settings that would make the checkpoint mean something else (the model, the
data and its order, the seed, the estimator) are refused, naming each difference (a setting the checkpoint's config
does not name, added to reinforge after it was written, takes this run's value), and so is another
``trainer.experiment_name``: a second experiment never continues the first one's checkpoints.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any

from reinforge.tracking.jsonl import write_failure

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
LOCK_WRITE_S = 1.0
"""How long a run may take between creating its lock and writing its pid there."""
_HELD: set[Path] = set()
"""Run folders locked by this process (a lock naming our own pid is live only if listed here)."""


class RunFolderInUse(ValueError):
    pass


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22 of proc(5), counted after "pid (comm)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``RUN/.lock`` while this process uses ``RUN``; released by ``release()`` or when garbage-collected."""

    def __init__(self, run_dir: Path):
        self.path = run_dir.resolve() / LOCK_FILE
        self._finalizer: weakref.finalize | None = None

    def acquire(self) -> RunLock:
        folder = self.path.parent
        blocking = next((path for path in (folder, *folder.parents) if path.exists() and not path.is_dir()), None)
        if blocking is not None:
            raise OSError(f"the run folder {folder} (trainer.output_dir) cannot be made: {blocking} is a file, not a "
                          "folder; set trainer.output_dir to a folder, or move the file") from None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            probe = self.path.parent / f".write-test-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as error:
            raise write_failure(self.path.parent, error, "the run folder, trainer.output_dir") from None
        for _ in range(10):
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except OSError as error:
                raise write_failure(self.path, error, "the run folder's lock") from None
            try:
                with os.fdopen(descriptor, "w") as handle:  # the first write: a full disk fails here
                    handle.write(f"{os.getpid()} {_start_time(os.getpid()) or ''}".strip() + "\n")
            except OSError as error:
                self.path.unlink(missing_ok=True)
                raise write_failure(self.path, error, "the run folder's lock") from None
            _HELD.add(self.path)
            self._finalizer = weakref.finalize(self, _release, self.path)
            return self
        raise RunFolderInUse(f"could not lock {self.path.parent} ({self.path} keeps reappearing)")

    def _take_over_if_stale(self) -> None:
        try:
            text = self._written_lock()
        except FileNotFoundError:
            return
        words = text.split()
        pid = int(words[0]) if words and words[0].isdigit() else None
        started = words[1] if len(words) > 1 else None
        in_use = pid is not None and _pid_alive(pid) and (pid != os.getpid() or self.path in _HELD)
        if in_use and started is not None and _start_time(pid) not in (None, started):
            in_use = False  # the pid was reused by a process started after the lock was written
        if in_use:
            raise RunFolderInUse(f"run folder {self.path.parent} is in use by pid {pid} ({self.path}); wait for that "
                                 "run to end or stop it, or pass another trainer.output_dir")
        # moved aside first, then checked: another run may have taken the stale lock over since it was read
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return
        try:
            if aside.read_text().strip() != text:  # that run's lock now: it goes back, and the next try reads it
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
                except OSError:  # a file system without hard links
                    os.replace(aside, self.path)
                return
            logger.warning("taking over %s, left by pid %s, which is no longer running", self.path, text or "?")
        finally:
            aside.unlink(missing_ok=True)

    def _written_lock(self) -> str:
        """The lock's text. A lock is created, then written: an empty one is read again for up to ``LOCK_WRITE_S``,
        until its run has written its pid; still empty, it was left by a run that died in between."""
        deadline = time.monotonic() + LOCK_WRITE_S
        while not (text := self.path.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return text

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


def _release(path: Path) -> None:
    _HELD.discard(path)
    try:
        if path.read_text().split()[:1] == [str(os.getpid())]:
            path.unlink()
    except FileNotFoundError:
        pass


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, this run's value) for every setting that differs."""
    before, after = flatten(old), flatten(new)
    return [(key, before.get(key), after.get(key)) for key in sorted(before.keys() | after.keys())
            if before.get(key) != after.get(key)]


def check_resumed_settings(old: dict[str, Any] | None, new: dict[str, Any], refused: tuple[str, ...],
                           checkpoint: Path) -> None:
    """Refuse changes to ``refused`` keys (or key prefixes ending in '.'); log the ones that will apply."""
    if old is None:
        return
    experiment = old.get("trainer", {}).get("experiment_name"), new.get("trainer", {}).get("experiment_name")
    if experiment[0] is not None and experiment[0] != experiment[1]:
        raise ValueError(f"trainer.output_dir holds experiment {experiment[0]!r} ({checkpoint}) and this run is "
                         f"experiment {experiment[1]!r}; give the new experiment its own trainer.output_dir, or set "
                         f"trainer.experiment_name={experiment[0]} to resume that one")
    changes = config_changes(old, new)
    named = flatten(old)  # a key the checkpoint's config lacks is a setting added since its reinforge wrote it
    blocked = [change for change in changes if change[0] in named
               and any(change[0] == key or (key.endswith(".") and change[0].startswith(key)) for key in refused)]
    if blocked:
        listed = ", ".join(f"{key}: {before!r} -> {after!r}" for key, before, after in blocked)
        raise ValueError(f"resuming {checkpoint} with changed settings it cannot take: {listed}; restore them, or "
                         "start a new run (another trainer.output_dir, or trainer.resume=never to replace this one)")
    if changes:
        listed = ", ".join(f"{key}: {repr(before) if key in named else '(not in the checkpoint)'} -> {after!r}"
                           for key, before, after in changes)
        logger.warning("resuming %s with changed settings, which apply from here on (recorded in config.yaml): %s",
                       checkpoint, listed)
