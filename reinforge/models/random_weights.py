"""Model folders whose random weights are built where the model loads, instead of being read from files.

Such a folder holds config.json, a tokenizer and ``random_weights.json`` (the seed), and no weight files.
``load_causal_lm`` builds its model from config.json directly on the device it loads to: every weight
drawn from the seed in bfloat16 (what written files would have held), then cast to the dtype asked for.
Two loads of one folder give the same weights, so every worker of a run (actor, reference) reads one
model. The benchmarks use it for shapes whose weights the disk or host memory would not hold
(Qwen3-30B-A3B: 57 GiB of bf16 weights against a 64 GiB disk); only the causal LM's loader builds it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from reinforge.models.export import default_dtype

logger = logging.getLogger(__name__)

RANDOM_WEIGHTS_FILE = "random_weights.json"
DRAWN_DTYPE = torch.bfloat16


def write_random_weights_folder(folder: Path, config: Any, tokenizer: Any, seed: int = 0) -> Path:
    """config.json (a transformers config), the tokenizer and ``random_weights.json`` in ``folder``; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed}) + "\n")
    return folder


def random_weights_seed(path: str | Path) -> int | None:
    """The seed of a random-weights folder, or None when ``path`` is not one."""
    file = Path(path).expanduser() / RANDOM_WEIGHTS_FILE
    if not file.is_file():
        return None
    try:
        return int(json.loads(file.read_text())["seed"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{file} does not name a seed ({error}); write it as {{\"seed\": 0}}") from None


def build_random_causal_lm(path: str | Path, *, dtype: torch.dtype, device: torch.device,
                           trust_remote_code: bool = False, attn_implementation: str = "sdpa"):
    """The causal LM of a random-weights folder, built on ``device`` in ``dtype`` (the global generator untouched)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from reinforge.models.classes import named_class

    seed = random_weights_seed(path)
    if seed is None:
        raise FileNotFoundError(f"{path} has no {RANDOM_WEIGHTS_FILE}; it is not a random-weights model folder")
    config = AutoConfig.from_pretrained(str(Path(path).expanduser()), trust_remote_code=trust_remote_code)
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device), default_dtype(DRAWN_DTYPE):
        torch.manual_seed(seed)
        named = named_class(config)
        model = (named._from_config(config, attn_implementation=attn_implementation) if named is not None
                 else AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code,
                                                       attn_implementation=attn_implementation))
    logger.info("model.path=%s holds random weights (%s, seed %d): built on %s from its config.json",
                path, RANDOM_WEIGHTS_FILE, seed, device)
    return model.to(dtype)
