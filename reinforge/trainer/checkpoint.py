"""Atomic checkpoints in the run folder, the ``latest`` pointer, and resume resolution.

Layout: ``RUN/checkpoints/step_000010/`` holds what each worker wrote (``actor_state.pt``,
``critic_state.pt``, ``hf/`` that loads with ``from_pretrained``) and ``trainer_state.pt``
(step, data position, KL controller, RNG states). A checkpoint is written into a hidden
temporary folder, every file fsynced, then renamed into place; ``latest`` is rewritten
(also by rename) only after that, so a kill at any moment leaves the previous checkpoint
and pointer intact. Older checkpoints beyond ``keep_last`` are removed last.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

STEP_PREFIX = "step_"


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


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

    def save(self, step: int, write: Callable[[Path], None], trainer_state: dict[str, Any]) -> Path:
        """``write(folder)`` lets the workers fill the folder; then it is published atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"{STEP_PREFIX}{step:06d}"
        temporary = self.root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
        write(temporary)
        torch.save(trainer_state, temporary / "trainer_state.pt")
        _fsync_tree(temporary)
        if final.exists():
            shutil.rmtree(final)
        temporary.rename(final)
        pointer = self.root / ".latest.tmp"
        pointer.write_text(final.name + "\n")
        with open(pointer, "rb") as handle:
            os.fsync(handle.fileno())
        pointer.replace(self.root / "latest")
        self._remove_old()
        return final

    def _remove_old(self) -> None:
        steps = sorted(p for p in self.root.glob(f"{STEP_PREFIX}*") if p.is_dir())
        for old in steps[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        folder = self.root / pointer.read_text().strip()
        return folder if (folder / "trainer_state.pt").is_file() else None

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint to resume from for ``trainer.resume`` (auto, never or a path)."""
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest()
        folder = Path(resume)
        if not (folder / "trainer_state.pt").is_file():
            raise FileNotFoundError(f"trainer.resume={resume} is not a checkpoint folder (no trainer_state.pt); "
                                    f"checkpoints live in {self.root}/step_*")
        return folder


def load_trainer_state(folder: Path) -> dict[str, Any]:
    return torch.load(folder / "trainer_state.pt", weights_only=False)
