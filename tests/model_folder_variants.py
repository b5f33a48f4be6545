"""Copies of a tiny model folder that another role must refuse to read the policy's token ids with: one whose
tokenizer gives two of the policy's tokens each other's ids, and one without a tokenizer whose embedding has fewer
rows than the policy's vocabulary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def with_swapped_tokens(model_dir: Path, out: Path) -> Path:
    """``model_dir`` copied to ``out`` with the ids of the tokens 'a' and 'b' swapped in its tokenizer.json."""
    shutil.copytree(model_dir, out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out


def with_fewer_rows(model_dir: Path, out: Path, rows: int = 100) -> Path:
    """``model_dir`` copied to ``out`` without its tokenizer files, its vocabulary cut to ``rows`` (config.json and
    the embedding in model.safetensors, when the folder holds weights)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (out / name).unlink(missing_ok=True)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"vocab_size": rows}))
    if (out / "model.safetensors").is_file():
        weights = load_file(out / "model.safetensors")
        weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:rows].clone()
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
