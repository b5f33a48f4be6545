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
from reinforge.trainer.checkpoint import CheckpointManager, checkpoint_problem


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or the newest valid checkpoint of a run folder; a damaged one is refused."""
    path = Path(path)
    if (path / "trainer_state.pt").is_file():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(f"checkpoint {path} is not usable: {problem}; export another checkpoint")
        return path
    latest = CheckpointManager(path, keep_last=1).resolve("auto", set_aside=False)
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint (no trainer_state.pt) nor a run folder with "
                                "checkpoints; pass RUN_DIR or RUN_DIR/checkpoints/step_N")
    return latest


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                      force: bool = False) -> Path:
    """Write ``out_dir`` as an HF model folder; a non-empty ``out_dir`` is refused unless ``force``."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FileExistsError(f"{out} already exists and is not empty; pick an empty folder or pass --force to "
                              "write over it")
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
