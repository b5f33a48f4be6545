"""``reinforge export``: an HF model folder from any checkpoint.

A checkpoint's ``hf/`` folder carries the architecture config and the tokenizer; the
weights come from the trainer state (``actor_state.pt``), so export also works for a
checkpoint whose ``hf/`` weights were removed to save space.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from reinforge.models import save_hf_folder
from reinforge.trainer.checkpoint import CheckpointManager


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or the latest checkpoint of a run folder."""
    path = Path(path)
    if (path / "trainer_state.pt").is_file():
        return path
    latest = CheckpointManager(path, keep_last=1).latest()
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint (no trainer_state.pt) nor a run folder with "
                                "checkpoints/latest; pass RUN_DIR or RUN_DIR/checkpoints/step_N")
    return latest


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    folder = resolve_checkpoint(checkpoint)
    hf_folder = folder / "hf"
    state_file = folder / "actor_state.pt"
    if not (hf_folder / "config.json").is_file() or not state_file.is_file():
        raise FileNotFoundError(f"checkpoint {folder} lacks hf/config.json or actor_state.pt; it is incomplete")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_folder))
    state = torch.load(state_file, map_location="cpu", weights_only=True)["model"]
    model.load_state_dict(state)
    tokenizer = AutoTokenizer.from_pretrained(hf_folder)
    return save_hf_folder(model, tokenizer, out_dir, dtype=dtype)
