"""Writing a model and its tokenizer as a Hugging Face folder, atomically.

A reader (a resumed run, an eval job, vLLM) must never see a half-written folder, so we write
into ``<out_dir>.tmp-<pid>``, fsync every file, and only then rename it into place. An
existing folder is first renamed aside to ``<out_dir>.old-<pid>`` and deleted once the new one
is in; a crash in between leaves either the old or the new folder complete under one of the
two names. The exported config has ``use_cache`` back on: the folder is for inference.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from reinforge.atomic_files import fsync_directory_entry


def fsync_folder(folder: Path) -> None:
    """Flush every file under ``folder``, then the folder entries themselves, to disk."""
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb") as file:
                os.fsync(file.fileno())
        elif path.is_dir():
            fsync_directory_entry(path)
    fsync_directory_entry(folder)


@contextmanager
def atomic_folder(out_dir: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it replaces ``out_dir``, on error it is removed."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"cannot save a model folder to {out_dir}: a file of that name exists; remove it "
                              "or choose another folder")
    staging = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        yield staging
        readable_as_created(staging)
        fsync_folder(staging)
        if out_dir.exists():
            previous = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
            if previous.exists():
                shutil.rmtree(previous)
            os.rename(out_dir, previous)
            try:
                os.rename(staging, out_dir)
            except OSError:
                os.rename(previous, out_dir)
                raise
            fsync_directory_entry(out_dir.parent)
            shutil.rmtree(previous)
        else:
            os.rename(staging, out_dir)
            fsync_directory_entry(out_dir.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def file_mode_of_umask() -> int:
    """The mode a new file gets from the process's umask (0o644 under the usual 022): read from /proc where Linux
    shows it, else by setting and restoring the umask."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def readable_as_created(folder: Path) -> None:
    """Give each file under ``folder`` the mode the umask gives a new file: transformers writes a model's
    safetensors through a private temporary file (mode 0600), which would leave a checkpoint's or an export's weights
    unreadable to the other users and containers its config and tokenizer files are readable to."""
    mode = file_mode_of_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)


def float32_pattern(module_names: object) -> re.Pattern | None:
    """The names in a model class's ``_keep_in_fp32_modules`` or ``_keep_in_fp32_modules_strict`` as transformers
    matches them (a regular-expression search in a tensor's name, ``*`` for any characters); None for none."""
    if not isinstance(module_names, (list, tuple, set, frozenset)) or not module_names:
        return None
    return re.compile("|".join(f"(?:{name.replace('*', '.*')})" for name in sorted(module_names)))


def kept_in_float32(model: PreTrainedModel, dtype: torch.dtype) -> re.Pattern | None:
    """What transformers keeps in float32 when it loads ``model`` in ``dtype`` (its ``_get_dtype_plan``), as a
    ``float32_pattern``: in float16 or bfloat16 what the model's classes name in ``_keep_in_fp32_modules_strict``
    (DeepSeek's router ``gate.weight``), in float16 also what they name in ``_keep_in_fp32_modules`` (gpt-oss's norms,
    T5's ``wo``); None for none."""
    names: list[str] = []
    for attribute, dtypes in (("_keep_in_fp32_modules_strict", (torch.float16, torch.bfloat16)),
                              ("_keep_in_fp32_modules", (torch.float16,))):
        listed = getattr(model, attribute, None)
        if dtype in dtypes and isinstance(listed, (list, tuple, set, frozenset)):
            names.extend(listed)
    return float32_pattern(set(names))


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules in ``dtype`` meanwhile (torch's default dtype), as from_pretrained builds a model; the previous
    default afterwards."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_as_loaded(model_class: type[PreTrainedModel], config: PretrainedConfig,
                    dtype: torch.dtype) -> PreTrainedModel:
    """A ``model_class`` of ``config`` on the meta device, built with ``dtype`` as the default dtype as from_pretrained
    builds it, eager (a class that picks its attention modules by name at construction knows no other). The config
    and its sub-configs name ``dtype``, as from_pretrained sets them: a class that builds its body with
    ``AutoModel.from_config`` (a sequence classifier's) builds it in the config's dtype, not the default one."""
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    config.dtype = dtype
    for name in getattr(config, "sub_configs", {}):
        sub_config = getattr(config, name, None)
        if sub_config is not None:
            sub_config.dtype = dtype
    with torch.device("meta"), default_dtype(dtype):
        return model_class(config)


def dtypes_of_built(built: PreTrainedModel, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype of each floating-point tensor of ``built``'s state dict (a model ``build_as_loaded`` built in
    ``dtype``) once ``from_pretrained(folder, dtype=dtype)`` loads it: its own, except what transformers keeps in
    float32.

    Its own is ``dtype`` or float32 for a tensor the model's classes create in float32 whatever the default dtype
    (DeepSeek V3's ``e_score_correction_bias``); float32 also for one ``kept_in_float32`` matches.
    """
    kept = kept_in_float32(built, dtype)
    as_loaded = {}
    for name, tensor in built.state_dict().items():
        if tensor.is_floating_point():
            as_loaded[name] = torch.float32 if kept is not None and kept.search(name) else tensor.dtype
    return as_loaded


def dtypes_as_loaded(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype of each floating-point tensor of ``model``'s state dict in a model that
    ``from_pretrained(folder, dtype=dtype)`` loads (``dtypes_of_built`` of a meta copy of ``model``)."""
    return dtypes_of_built(build_as_loaded(type(model), model.config, dtype), dtype)


def cast_state(state: dict[str, Tensor], as_loaded: dict[str, torch.dtype], dtype: torch.dtype) -> dict[str, Tensor]:
    """``state`` in place: each floating-point tensor in its dtype in ``as_loaded`` (``dtypes_of_built``), ``dtype``
    where that names none. Returns ``state``.

    A tensor to cast is cast onto the CPU, one at a time: the model's device holds no second copy, and the state's
    own tensor is freed as its cast is made where nothing else holds it. Tensors that share storage (tied
    embeddings) still share it, which is how save_pretrained recognises them and writes the weight once.
    """
    cast: dict[tuple, Tensor] = {}
    for name in list(state):
        tensor = state[name]
        target = as_loaded.get(name, dtype)
        if not tensor.is_floating_point() or tensor.dtype == target:
            continue
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
                    target)
        if identity not in cast:
            cast[identity] = tensor.detach().to("cpu", target)
        state[name] = cast[identity]
    return state


def cast_state_as_loaded(state: dict[str, Tensor], model: PreTrainedModel, dtype: torch.dtype) -> dict[str, Tensor]:
    """``state``, a state dict of ``model``, in place: each floating-point tensor in the dtype a folder of it loads
    back in with ``from_pretrained(folder, dtype=dtype)`` (``dtypes_as_loaded``, ``cast_state``). Returns ``state``."""
    return cast_state(state, dtypes_as_loaded(model, dtype), dtype)


def state_dict_in_dtype(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, Tensor]:
    """The model's state dict as a folder saved in ``dtype`` holds it (``cast_state_as_loaded``); the model itself is
    not cast."""
    return cast_state_as_loaded(dict(model.state_dict()), model, dtype)


def save_hf_folder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path, *,
                   dtype: torch.dtype | None = None, processor_files_from: str | Path | None = None,
                   adapter_folder: str | Path | None = None, cast: bool = True) -> Path:
    """Save ``model`` (safetensors, in ``dtype`` or its own) and ``tokenizer`` into ``out_dir``, atomically.

    In ``dtype``, what transformers keeps in float32 when it loads the folder in that dtype is written in float32
    (``cast_state_as_loaded``), and config.json names ``dtype``.

    Writes config.json, generation_config.json (for models that generate), the weights and the
    tokenizer files. Call it from one process only. Returns ``out_dir``.
    ``processor_files_from``: the model folder (or cached hub id) it was trained from, whose processor files the
    folder keeps when ``tokenizer`` wrote none (``copy_processor_files``).
    ``adapter_folder``: LoRA adapters in peft's format, copied to ``out_dir/adapter`` with the rest, so that the folder
    appears with them or not at all.
    ``cast=False``: the model's weights are in ``dtype`` as loaded already (``cast_state``); they are written as they
    are, and config.json still names ``dtype``.
    """
    out_dir = Path(out_dir)
    if dtype is None:
        state_dict = None
    else:
        state_dict = state_dict_in_dtype(model, dtype) if cast else dict(model.state_dict())
    with atomic_folder(out_dir) as staging:
        model.save_pretrained(staging, state_dict=state_dict)
        prepare_config_for_inference(staging / "config.json", dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
            use_portable_tokenizer_class(staging)
            keep_tokenizer_settings_as_loaded(staging, tokenizer)
        if processor_files_from:
            copy_processor_files(processor_files_from, staging)
        if adapter_folder is not None:
            shutil.copytree(adapter_folder, staging / "adapter")
    return out_dir


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
"""The files of a model folder that configure its processor (its image processor, the processor's class)."""
NESTED_PROCESSOR_KEYS = {"preprocessor_config.json": "image_processor", "video_preprocessor_config.json": "video_processor"}
"""The key under which a saved processor_config.json holds a file's settings instead of writing the file."""


def copy_processor_files(source: str | Path, out_dir: Path) -> None:
    """Copy the processor files of the model ``source`` (a folder, or a hub id in the local cache; nothing is
    downloaded) into ``out_dir`` where it lacks them: a multimodal wrapper trained on text alone (Gemma 3, Llava) saves
    its tokenizer only, and a processor built without its video processor (where torchvision is missing) saves no video
    settings; without them the folder loads with neither its image processor nor ``AutoProcessor``."""
    saved = out_dir / "processor_config.json"
    nested = json.loads(saved.read_text()) if saved.is_file() else {}
    for name in PROCESSOR_FILES:
        if (out_dir / name).exists() or NESTED_PROCESSOR_KEYS.get(name) in nested:
            continue
        if Path(source).expanduser().is_dir():
            found = Path(source).expanduser() / name
            found = found if found.is_file() else None
        else:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(source), name)
            found = Path(cached) if isinstance(cached, str) else None
        if found is not None:
            shutil.copyfile(found, out_dir / name)


def prepare_config_for_inference(config_path: Path, dtype: torch.dtype | None) -> None:
    """Turn use_cache back on and name the dtype the weights were saved in (dtype or torch_dtype by version)."""
    config = json.loads(config_path.read_text())
    if "use_cache" in config:
        config["use_cache"] = True
    for key in ("dtype", "torch_dtype"):
        if key in config and dtype is not None:
            config[key] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def use_portable_tokenizer_class(folder: Path) -> None:
    """Write the generic tokenizer class as PreTrainedTokenizerFast, which transformers 4.x knows too.

    transformers 5 names it TokenizersBackend; both versions load PreTrainedTokenizerFast.
    """
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return
    tokenizer_config = json.loads(config_path.read_text())
    if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


AS_LOADED = "reinforge_as_loaded"
"""The attribute in which ``load_tokenizer`` keeps the pad token and padding side a tokenizer had before it padded on
the left with a pad token, for training and rollouts."""


def keep_tokenizer_settings_as_loaded(folder: Path, tokenizer) -> None:
    """Write the pad token and padding side ``tokenizer`` (or a processor's) was loaded with back into the folder's
    tokenizer_config.json: the model's own tokenizer, not the one training padded with (an EOS pad token would
    mask the EOS labels of a later fine-tune; its batched generation would pad on the side it was given)."""
    loaded = getattr(tokenizer, AS_LOADED, None) or getattr(getattr(tokenizer, "tokenizer", None), AS_LOADED, None)
    config_path = folder / "tokenizer_config.json"
    if loaded is None or not config_path.is_file():
        return
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["padding_side"] = loaded["padding_side"]
    if loaded["pad_token"] is None:
        tokenizer_config.pop("pad_token", None)
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
