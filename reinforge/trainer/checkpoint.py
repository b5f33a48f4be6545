"""Atomic, self-checking checkpoints in the run folder, and which one a run resumes from.

Layout: ``RUN/checkpoints/step_000010/`` holds what each worker wrote (``actor_state.pt``,
``critic_state.pt``, ``hf/`` that loads with ``from_pretrained``), ``trainer_state.pt``
(step, data position, KL controller, RNG states, the run's config) and, written last,
``manifest.json``: the size and SHA-256 of every other file. A checkpoint is written into a
hidden temporary folder, every file hashed and fsynced, the manifest written, then the folder
renamed into place; ``latest`` is rewritten (also by rename) after that. A checkpoint counts
only when its manifest matches its files, so a kill at any moment, a truncated or deleted
file, or a damaged ``latest`` pointer never passes for a good checkpoint: resume takes the
newest checkpoint that validates and names the ones it skipped. Older checkpoints beyond
``keep_last`` are removed last. A full disk while writing removes the temporary folder and
says so in one line.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reinforge.atomic_files import fsync_directory_entry, replaced_atomically

logger = logging.getLogger(__name__)

STEP_PREFIX = "step_"
MANIFEST_FILE = "manifest.json"
_STEP_NAME = re.compile(rf"^{STEP_PREFIX}(\d+)$")
_CHUNK = 1 << 22


class CheckpointError(ValueError):
    """No usable checkpoint where the run expects one; the message says what to pass instead."""


class DiskFullError(OSError):
    """ENOSPC while writing a checkpoint; reads as its message alone (no "[Errno 28]")."""

    def __str__(self) -> str:
        return str(self.strerror)


def _hash_and_fsync(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
        os.fsync(handle.fileno())
    return digest.hexdigest()


def _data_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file() and path.name != MANIFEST_FILE)


def seal(folder: Path, step: int) -> dict[str, Any]:
    """Hash and fsync every file of ``folder``, then write its manifest (last) and fsync the folder."""
    files = {str(path.relative_to(folder)): {"size": path.stat().st_size, "sha256": _hash_and_fsync(path)}
             for path in _data_files(folder)}
    if "trainer_state.pt" not in files:
        raise CheckpointError(f"checkpoint {folder} has no trainer_state.pt; it cannot be resumed")
    manifest = {"format": 1, "step": step, "files": files}
    with open(folder / MANIFEST_FILE, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    for sub in sorted({path.parent for path in folder.rglob("*")} | {folder}):
        fsync_directory_entry(sub)
    return manifest


def is_hf_weights(name: str) -> bool:
    """Whether a checkpoint's file ``name`` holds its ``hf/`` model's weights (which may be removed to save space:
    ``actor_state.pt`` keeps them, and ``reinforge export`` writes them again)."""
    return name.startswith("hf/") and name.endswith((".safetensors", ".safetensors.index.json", ".bin"))


def newest_usable(run_dir: str | Path, problem_of: Callable[[Path], str | None]) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of ``run_dir`` that ``problem_of`` finds nothing wrong with (None: none is), and
    "step_N: problem" for each newer one skipped (or each of them, where none is usable)."""
    skipped = []
    for folder in CheckpointManager(run_dir, keep_last=1).step_folders():
        problem = problem_of(folder)
        if problem is None:
            return folder, skipped
        skipped.append(f"{folder.name}: {problem}")
    return None, skipped


def checkpoint_problem(folder: Path, *, hashes: bool = True,
                       may_be_missing: Callable[[str], bool] | None = None) -> str | None:
    """Why ``folder`` is not a complete checkpoint (None when its files match its manifest).

    Sizes are always compared; ``hashes=False`` skips reading the files. A manifest file for which
    ``may_be_missing(name)`` holds may be absent (export reads the weights from ``actor_state.pt``, so it
    takes a checkpoint whose ``hf/`` weights were removed); when present it is checked like the others.
    """
    manifest_path = folder / MANIFEST_FILE
    if not folder.is_dir():
        return "it does not exist"
    if not manifest_path.is_file():
        return f"it has no {MANIFEST_FILE} (its writing was interrupted, or an older reinforge wrote it)"
    try:
        files = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError, TypeError):
        return f"its {MANIFEST_FILE} is unreadable"
    present = {}
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            if may_be_missing is not None and may_be_missing(name):
                continue
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size} bytes, the manifest says {expected['size']} (truncated or changed)"
        present[name] = expected
    if hashes:
        for name, expected in present.items():
            if _hash_and_fsync(folder / name) != expected["sha256"]:
                return f"{name} does not match its SHA-256 in the manifest (damaged or changed)"
    return None


_FULL_DISK_WORDS = ("no space left on device", "storagefull", "file write failed", "unexpected pos")
_NEARLY_FULL_BYTES = 64 * 2**20


def _disk_full(error: BaseException, folder: Path) -> OSError | None:
    """The full-disk error behind ``error`` (through causes, e.g. a worker group's WorkerCallError), if any.

    torch.save and safetensors report a full disk in their own words (``file write failed``,
    ``unexpected pos 64 vs 0``, ``StorageFull``) rather than as ENOSPC; those count when the disk
    of ``folder`` is nearly full (check before removing what was written).
    """
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for item in chain:
        if isinstance(item, OSError) and item.errno in (errno.ENOSPC, errno.EDQUOT):
            return item
    for item in chain:
        if any(words in str(item).lower() for words in _FULL_DISK_WORDS):
            with contextlib.suppress(OSError):
                if shutil.disk_usage(folder).free < _NEARLY_FULL_BYTES or "space" in str(item).lower():
                    return OSError(errno.ENOSPC, str(item).strip().splitlines()[-1])
    return None


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int):
        self.root = run_dir / "checkpoints"
        self.keep_last = keep_last

    def step_folders(self) -> list[Path]:
        """``step_N`` folders, newest first."""
        if not self.root.is_dir():
            return []
        found = [(int(match.group(1)), path) for path in self.root.iterdir()
                 if path.is_dir() and (match := _STEP_NAME.match(path.name))]
        return [path for _, path in sorted(found, reverse=True)]

    def folder_of(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is (or would be) published."""
        return self.root / f"{STEP_PREFIX}{step:06d}"

    def save(self, step: int, write: Callable[[Path], None], trainer_state: dict[str, Any]) -> Path:
        """``write(folder)`` lets the workers fill the folder; then it is sealed and published atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.folder_of(step)
        temporary = self.root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(temporary, ignore_errors=True)
        try:
            temporary.mkdir()
            write(temporary)
            torch.save(trainer_state, temporary / "trainer_state.pt")
            seal(temporary, step)
        except BaseException as error:
            full = _disk_full(error, self.root)  # while the written files still fill the disk
            shutil.rmtree(temporary, ignore_errors=True)
            if full is not None:
                where = full.filename or temporary
                what = "disk quota exceeded" if full.errno == errno.EDQUOT else "no space left on device"
                raise DiskFullError(full.errno, f"{what} while writing {where} (checkpoint of step {step}; its "
                                                "temporary folder was removed); free space in "
                                                f"{self.root} or lower trainer.keep_last, then run the same command "
                                                "to resume") from error
            raise
        problem = checkpoint_problem(temporary, hashes=False)
        if problem is not None:
            shutil.rmtree(temporary, ignore_errors=True)
            raise CheckpointError(f"the checkpoint of step {step} did not validate after writing: {problem}")
        if final.exists():
            shutil.rmtree(final)
        temporary.rename(final)
        fsync_directory_entry(self.root)
        with replaced_atomically(self.root / "latest") as pointer:
            pointer.write_text(final.name + "\n")
        self.remove_old()
        return final

    def remove_old(self) -> None:
        """Remove checkpoints beyond ``keep_last`` and temporary folders of interrupted writes."""
        for old in self.step_folders()[self.keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

    def latest(self) -> Path | None:
        """The newest checkpoint that validates (sizes only; ``resolve`` also checks hashes)."""
        return next((folder for folder in self.step_folders() if checkpoint_problem(folder, hashes=False) is None),
                    None)

    def resolve(self, resume: str, *, set_aside: bool = True) -> Path | None:
        """The checkpoint to resume from for ``trainer.resume`` (auto, never or a path), checked against its manifest.

        ``auto`` takes the newest checkpoint that validates and warns about newer ones it skips; when the
        run has checkpoints and none validates, it refuses rather than start over on top of them. With
        ``set_aside`` (a run that will write checkpoints, holding the folder's lock) the skipped ones,
        and this run's checkpoints newer than a path given, are renamed so that nothing writes over them.
        """
        if resume == "never":
            return None
        if resume != "auto":
            folder = Path(resume)
            problem = checkpoint_problem(folder)
            if problem is not None and (folder / "checkpoints").is_dir():  # a run folder, not one of its checkpoints
                latest = CheckpointManager(folder, keep_last=1).latest()
                fix = (f"pass its latest checkpoint, trainer.resume={latest}" if latest is not None
                       else f"it has no complete checkpoint in {folder / 'checkpoints'}")
                raise CheckpointError(f"trainer.resume={resume} is a run folder, not a checkpoint; {fix}")
            if problem is not None:
                raise CheckpointError(f"trainer.resume={resume} is not a usable checkpoint: {problem}; "
                                      f"checkpoints live in {self.root}/step_*")
            if set_aside:
                self._set_aside_newer_than(folder)
            return folder
        skipped = []
        for folder in self.step_folders():
            problem = checkpoint_problem(folder)
            if problem is None:
                for bad, reason in skipped:
                    kept = self._set_aside(bad) if set_aside else bad
                    logger.warning("skipping checkpoint %s: %s; using the older %s (the skipped one is kept as %s)",
                                   bad.name, reason, folder.name, kept.name)
                self._check_pointer(folder)
                return folder
            skipped.append((folder, problem))
        if skipped:
            reasons = "; ".join(f"{bad.name}: {reason}" for bad, reason in skipped)
            raise CheckpointError(f"no checkpoint in {self.root} validates ({reasons}); pass trainer.resume=never to "
                                  "start over (this replaces them) or trainer.resume=PATH for another checkpoint")
        return None

    def _set_aside(self, folder: Path, suffix: str = "invalid") -> Path:
        """Rename a checkpoint (one that failed validation, or a newer one) so that training never writes over it."""
        number = 0
        while (target := folder.with_name(f"{folder.name}.{suffix}{'' if number == 0 else f'-{number}'}")).exists():
            number += 1
        folder.rename(target)
        return target

    def _set_aside_newer_than(self, chosen: Path) -> None:
        """Resuming by path from an older checkpoint (this run's or another's): this run's newer checkpoints,
        which training would write over, are kept, renamed."""
        match = _STEP_NAME.match(chosen.name)
        chosen_step = int(match.group(1)) if match is not None else int(load_trainer_state(chosen)["step"])
        ours = chosen.resolve().parent == self.root.resolve()
        for folder in self.step_folders():
            step = _STEP_NAME.match(folder.name)
            if step is not None and int(step.group(1)) > chosen_step:
                kept = self._set_aside(folder, "superseded")
                logger.warning("resuming from the older %s: the newer %s is kept as %s, not written over",
                               chosen.name if ours else chosen, folder.name, kept.name)

    def _check_pointer(self, chosen: Path) -> None:
        pointer = self.root / "latest"
        named = pointer.read_text(errors="replace").strip() if pointer.is_file() else None
        if named != chosen.name:
            logger.warning("checkpoints/latest %s; using %s, the newest checkpoint that validates",
                           "is missing" if named is None else f"names {named!r}", chosen.name)

    def remove_all(self) -> int:
        """Delete every checkpoint (for ``trainer.resume=never``); returns how many there were."""
        folders = self.step_folders()
        for folder in folders:
            shutil.rmtree(folder)
        for leftover in (self.root / "latest", *self.root.glob(".tmp-*")):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            elif leftover.exists():
                leftover.unlink()
        return len(folders)


def load_trainer_state(folder: Path) -> dict[str, Any]:
    return torch.load(folder / "trainer_state.pt", weights_only=False)
