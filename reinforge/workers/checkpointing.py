"""Saving and loading a worker's training state: parameters, optimizer, LR schedule.

Files are written into the checkpoint's temporary folder; the trainer makes the folder
visible atomically (see reinforge.trainer.checkpoint), so these writes need no renames.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def save_training_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler, prefix: str = "actor") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, folder / f"{prefix}_state.pt")


def load_training_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler, device: torch.device,
                        prefix: str = "actor") -> None:
    path = folder / f"{prefix}_state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {folder} has no {path.name}; it was not written by this trainer "
                                "or is incomplete; pass another trainer.resume path or trainer.resume=never")
    state = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
