"""``reinforge export``: an HF model folder from any checkpoint.

A checkpoint's ``hf/`` folder carries the architecture config and the tokenizer; the
weights come from the trainer state (``actor_state.pt``), so export also works for a
checkpoint whose ``hf/`` weights were removed to save space. A LoRA checkpoint's state holds
only the adapters: export merges them into the base model named in ``adapter/adapter_config.json``
and writes the adapters too, in peft's format, under ``OUT/adapter``.

The weights are written in the dtype ``hf/config.json`` names, the run's compute dtype (bfloat16 for a GPU run),
unless a dtype is given: float32 writes the master weights of the state as they are, which keeps the updates of an
RL run too small for bfloat16 to resolve. The rollouts and validation sampled from the bfloat16-rounded weights,
so the bfloat16 folder is exactly the policy they measured.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
)

from reinforge.engine.lora import merge_lora_weights, read_adapter_config, transposed_layers
from reinforge.models import load_causal_lm, save_hf_folder
from reinforge.models.loading import DTYPES, NO_HUB_KERNELS, is_local_path
from reinforge.models.reward_model import classifier_auto_class
from reinforge.models.vision import is_vision_language, load_processor
from reinforge.trainer.checkpoint import checkpoint_problem, is_hf_weights, newest_usable

logger = logging.getLogger(__name__)


def export_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be exported (None when it can): ``checkpoint_problem``, except that ``hf/`` weights
    removed to save space are allowed, since export reads the weights from ``actor_state.pt``."""
    return checkpoint_problem(folder, may_be_missing=is_hf_weights)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or the newest valid checkpoint of a run folder; a damaged one is refused."""
    path = Path(path)
    if (path / "trainer_state.pt").is_file():
        problem = export_problem(path)
        if problem is not None:
            raise ValueError(f"checkpoint {path} is not usable: {problem}; export another checkpoint")
        return path
    folder, skipped = newest_usable(path, export_problem)
    if folder is not None:
        if skipped:
            logger.warning("exporting %s, the newest usable checkpoint; skipped %s", folder.name, "; ".join(skipped))
        return folder
    if skipped:
        raise ValueError(f"no checkpoint of {path} is usable ({'; '.join(skipped)}); pass another checkpoint "
                         "folder (RUN_DIR/checkpoints/step_N)")
    raise FileNotFoundError(f"{path} is neither a checkpoint (no trainer_state.pt) nor a run folder with "
                            "checkpoints; pass RUN_DIR or RUN_DIR/checkpoints/step_N")


def checkpoint_dtype(hf_folder: Path) -> torch.dtype:
    """The dtype the config.json of a checkpoint's ``hf_folder`` names for its weights; float32 where it names none."""
    config = json.loads((hf_folder / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ValueError(f"{hf_folder / 'config.json'} names dtype {name!r}, which export does not write; pass "
                         f"--dtype ({', '.join(DTYPES)})")
    return DTYPES[name]


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                      force: bool = False) -> Path:
    """Write ``out_dir`` as an HF model folder in ``dtype`` (None: the checkpoint's, ``checkpoint_dtype``); a non-empty
    ``out_dir`` is refused unless ``force``."""
    out = Path(out_dir)
    if out.name in ("", ".", ".."):  # the working folder (or one above): the folder is written beside, then renamed
        out = out.resolve()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a folder; choose a folder for the model (it may not exist yet)")
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} already exists and is not empty; pick an empty folder or pass --force to "
                              "write over it")
    folder = resolve_checkpoint(checkpoint)
    source, target = folder.resolve(), out.resolve()
    if source == target or source.is_relative_to(target) or target.is_relative_to(source):
        raise FileExistsError(f"{out} holds (or is inside) the checkpoint {folder} being exported; "
                              "write the model to a folder outside the run")
    if source.parent.name == "checkpoints" and target.is_relative_to(source.parent):
        # the run's later saves, resumes and keep_last pruning rename or delete what is in there
        raise FileExistsError(f"{out} is inside {folder.parent}, the run's checkpoints folder, where training "
                              "removes or replaces folders; write the model to a folder outside it")
    hf_folder = folder / "hf"
    state_file = folder / "actor_state.pt"
    if not (hf_folder / "config.json").is_file() or not state_file.is_file():
        raise FileNotFoundError(f"checkpoint {folder} lacks hf/config.json or actor_state.pt; it is incomplete")
    dtype = dtype or checkpoint_dtype(hf_folder)
    state = torch.load(state_file, map_location="cpu", weights_only=True)["model"]
    tokenizer = AutoTokenizer.from_pretrained(hf_folder)
    config = AutoConfig.from_pretrained(hf_folder)
    classifier = classifier_auto_class(config)  # a reward model's Auto class (sequence or token classifier)
    adapter_folder = folder / "adapter"
    if (adapter_folder / "adapter_config.json").is_file():  # a VLM's folder keeps its processor, as hf/ does
        return _export_lora(adapter_folder, state, load_processor(hf_folder) if is_vision_language(config) else
                            tokenizer, out, dtype, config if classifier else None, hf_folder)
    # a reward model of `reinforge rm` stays the classifier it trained as: its score head is in the state, no lm_head
    if is_vision_language(config):  # the state holds what trained; a frozen vision tower comes from hf/
        model = AutoModelForImageTextToText.from_pretrained(hf_folder, dtype=torch.float32, **NO_HUB_KERNELS)
        model.load_state_dict(state, strict=False)
        return save_hf_folder(model, load_processor(hf_folder), out, dtype=dtype, processor_files_from=hf_folder)
    model_class = classifier or AutoModelForCausalLM
    model = model_class.from_config(config, dtype=torch.float32)  # the state's float32, not the dtype hf/ names
    if set(model.state_dict()) - set(state):  # frozen weights (a multimodal wrapper's tower, which text never reaches)
        model = model_class.from_pretrained(hf_folder, dtype=torch.float32, **NO_HUB_KERNELS)  # are not in the state: hf/ holds them
        unexpected = model.load_state_dict(state, strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"checkpoint {folder}'s actor_state.pt holds weights its hf/ model does not have "
                             f"({', '.join(unexpected[:3])}, ...); it is not this run's checkpoint")
    else:
        model.load_state_dict(state)
        if (hf_folder / "generation_config.json").is_file():  # from_config derives one from the config alone
            model.generation_config = GenerationConfig.from_pretrained(hf_folder)
    return save_hf_folder(model, tokenizer, out, dtype=dtype, processor_files_from=hf_folder)


def load_trained_weights(checkpoint: str | Path, model: torch.nn.Module) -> bool:
    """Copy the trained weights of ``checkpoint`` (or a run folder's newest) into ``model``, a loaded model of the
    architecture that was trained (a LoRA checkpoint's adapters merged into its weights, ``model`` being the base);
    parameters the checkpoint does not hold (a frozen vision tower) stay as they are. False, with ``model``
    unchanged, when the checkpoint holds weights ``model`` lacks (a reward model's score head on a causal LM)."""
    folder = resolve_checkpoint(checkpoint)
    state = torch.load(folder / "actor_state.pt", map_location="cpu", weights_only=True)["model"]
    adapter_folder = folder / "adapter"
    if (adapter_folder / "adapter_config.json").is_file():
        scaling, _ = read_adapter_config(adapter_folder)
        state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()} | state
        state = merge_lora_weights(state, scaling, transposed_layers(model))
    if set(state) - set(model.state_dict()):
        return False
    model.load_state_dict(state, strict=False)
    return True


def _export_lora(adapter_folder: Path, adapters: dict[str, torch.Tensor], tokenizer, out_dir: Path,
                 dtype: torch.dtype, classifier_config=None, hf_folder: Path | None = None) -> Path:
    """A LoRA checkpoint: the base model with the trained adapters merged in at ``out_dir``, the adapters
    alone in peft's format at ``out_dir/adapter`` (``PeftModel.from_pretrained(base, out_dir / "adapter")``).
    ``tokenizer``: what the folder keeps beside the model (a vision-language model's processor); the processor
    files of the checkpoint's ``hf_folder`` are kept too (``save_hf_folder``'s ``processor_files_from``).
    A reward model's (``classifier_config``: its hf/ config) is its base's backbone under the trained score head,
    which its state holds with the adapters. The base loads in ``dtype`` and each merged weight is rounded to it
    once, as the run's checkpoints merge the adapters into the base it trained on (loaded in its compute dtype)."""
    scaling, base_path = read_adapter_config(adapter_folder)
    if not base_path:
        raise FileNotFoundError(f"{adapter_folder}/adapter_config.json names no base model; cannot merge the adapters")
    if is_local_path(base_path) and not Path(base_path).expanduser().is_dir():  # moved or deleted since the run
        raise FileNotFoundError(f"{adapter_folder}/adapter_config.json names the base model {base_path}, which does "
                                "not exist (any more); the adapters are merged into it: put the base model back "
                                "there")
    base = (load_causal_lm(base_path, dtype=dtype, device="cpu") if classifier_config is None
            else classifier_auto_class(classifier_config).from_pretrained(base_path, config=classifier_config,
                                                                          dtype=dtype, **NO_HUB_KERNELS))
    state = base.state_dict() | adapters
    base.load_state_dict(merge_lora_weights(state, scaling, transposed_layers(base)))
    # the adapters were written with actor_state.pt, from the same tensors
    return save_hf_folder(base, tokenizer, out_dir, dtype=dtype, processor_files_from=hf_folder,
                          adapter_folder=adapter_folder)
