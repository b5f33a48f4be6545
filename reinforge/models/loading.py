"""Loading a causal LM and its tokenizer from a local folder or a hub id.

Before transformers sees a local folder we check it ourselves, so a wrong path, a folder
without weights or a checkpoint that was cut off mid-write fails with one line naming the
path and what is missing, instead of a long traceback from deep inside from_pretrained.
The model comes back with ``use_cache`` off (training never reuses the KV cache; generation
reads its own ``generation_config``); train or eval mode is left to the caller.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from reinforge.models.classes import causal_lm_class, named_class
from reinforge.models.export import AS_LOADED, kept_in_float32
from reinforge.models.vision import is_vision_language

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
INCOMPLETE_SUFFIXES = (".tmp", ".incomplete", ".partial")
UNFINISHED_FOLDER = re.compile(r"\.(tmp|old)-\d+$")
"""The names export.save_hf_folder gives a folder while it is being written or replaced."""

NO_HUB_KERNELS = {"use_kernels": False}
"""Passed to every ``from_pretrained`` of a model: transformers 5.25 and later swap layers of a model they load for
kernels downloaded from the Hugging Face Hub (``kernels`` package; rotary embedding, RMSNorm, activations) unless
told not to. Those change the training forward's rounding against the rollout's, and without network access the
download's publisher check fails the load. reinforge trains and samples with transformers' own modules."""

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype for a config name; ``auto`` is bfloat16 on CUDA and float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def is_local_path(path: str) -> bool:
    """Whether ``path`` names a local folder rather than a hub id such as ``Qwen/Qwen2.5-0.5B``."""
    return Path(path).expanduser().exists() or not HUB_ID.match(path)


def check_model_folder(path: str | Path, key: str = "model.path") -> None:
    """Raise FileNotFoundError with one line if ``path`` (the setting ``key``) is not a complete, loadable model
    folder."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"model folder {folder} does not exist; check {key}")
    if not folder.is_dir():
        raise FileNotFoundError(f"model path {folder} is a file; point {key} at the folder that holds config.json")
    if UNFINISHED_FOLDER.search(folder.name):
        raise FileNotFoundError(f"model folder {folder} is a temporary folder of an unfinished save; "
                                f"use the folder without the {folder.name.rsplit('.', 1)[-1]!r} suffix")
    leftovers = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(INCOMPLETE_SUFFIXES))
    if leftovers:
        raise FileNotFoundError(f"model folder {folder} looks half-written (found {', '.join(leftovers)}); "
                                "wait for the save to finish or save it again")
    if not (folder / "config.json").is_file():
        fix = (f"a checkpoint's model is its hf/ folder: set {key}={folder / 'hf'}"
               if (folder / "hf" / "config.json").is_file() else f"point {key} at a Hugging Face model folder")
        raise FileNotFoundError(f"model folder {folder} has no config.json; {fix}")
    weights = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not weights:
        raise FileNotFoundError(f"model folder {folder} has config.json but no weights (expected one of "
                                f"{', '.join(WEIGHT_FILES)}); the save may have been cut off")
    for index_name in (name for name in weights if name.endswith(".index.json")):
        shards = set(json.loads((folder / index_name).read_text())["weight_map"].values())
        missing = sorted(shard for shard in shards if not (folder / shard).is_file())
        if missing:
            raise FileNotFoundError(f"model folder {folder} is half-written: {index_name} lists {len(missing)} "
                                    f"missing shard(s), first {missing[0]}")
    for file in sorted(folder.glob("*.safetensors")):
        described = _safetensors_size(file)
        if described is not None and described != file.stat().st_size:
            found = (f"{file.name}'s header is cut off or unreadable" if described < 0 else
                     f"{file.name} holds {file.stat().st_size} bytes where its header describes {described}")
            raise FileNotFoundError(f"model folder {folder} is half-written: {found}; copy or download it again, or "
                                    "save the model again")


def _safetensors_size(file: Path) -> int | None:
    """The bytes a safetensors file's header says it holds (8 + header + the end of its last tensor); -1 for a header
    cut off or unreadable; None for a file that cannot be opened."""
    try:
        with file.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return -1
            length = int.from_bytes(head, "little")
            header = handle.read(length) if length <= file.stat().st_size else b""
    except OSError:
        return None
    try:
        tensors = json.loads(header)
        ends = [entry["data_offsets"][1] for name, entry in tensors.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return -1
    return 8 + length + max(ends, default=0)


def mismatched_weight_shapes(path: str | Path, trust_remote_code: bool = False) -> str | None:
    """What the safetensors headers of the local folder at ``path`` say of weights whose shapes differ from those of
    the model its config.json builds (``meta_model``), read before any weight is: the first one's name and two shapes,
    and how many more differ, in a few words; None where all fit, or nothing can be compared (a folder of ``.bin``
    weights, a quantized one, a model not built here). A weight is matched by its name, with or without the model's
    ``base_model_prefix`` (a causal LM's folder read for its body, or a body's folder for its causal LM)."""
    folder = Path(path).expanduser()
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("quantization_config"):  # packed weights of other shapes
        return None
    stored: dict[str, list[int]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        stored.update(_safetensors_shapes(file))
    if not stored:
        return None
    model = meta_model(str(folder), trust_remote_code)
    if model is None:
        return None
    built = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    differ = []
    for name, shape in stored.items():
        candidates = [name] + ([name.removeprefix(prefix), prefix + name] if prefix else [])
        match = next((candidate for candidate in candidates if candidate in built), None)
        if match is not None and built[match] != shape:
            differ.append((name, shape, built[match]))
    if not differ:
        return None
    name, shape, expected = differ[0]
    more = f", and {len(differ) - 1} more tensors" if len(differ) > 1 else ""
    return f"{name} is {shape} in the weights, {expected} in the model config.json builds{more}"


def _safetensors_shapes(file: Path) -> dict[str, list[int]]:
    """The shape of each tensor a safetensors file's header describes; {} for a file or header that cannot be read
    (``check_model_folder`` refuses those)."""
    try:
        with file.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if length > file.stat().st_size:
                return {}
            tensors = json.loads(handle.read(length))
        return {name: [int(size) for size in entry["shape"]] for name, entry in tensors.items()
                if name != "__metadata__"}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def float32_parameter_names(model: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """Names of ``model``'s parameters that transformers keeps in float32 when it loads the model in ``dtype``
    (``export.kept_in_float32``): in bfloat16 those its classes name in ``_keep_in_fp32_modules_strict`` (DeepSeek
    V2/V3's router ``gate.weight``), in float16 also those named in ``_keep_in_fp32_modules`` (gpt-oss's norms)."""
    kept = kept_in_float32(model, dtype)
    if kept is None:
        return set()
    return {name for name, _ in model.named_parameters() if kept.search(name)}


ROPE_KEEPS_LENGTH = ("llama3", "longrope", "su", "linear")
"""rope types whose config's ``max_position_embeddings`` is already the extended length (Llama 3.1: llama3, 131072
from an original 8192; Phi-3-mini-128k: longrope, 131072 from 4096; Gemma 3: linear factor 8, 131072): a factor
multiplies nothing. Under ``yarn`` the context is ``original_max_position_embeddings`` times the factor (Qwen2.5-7B-
Instruct: 32768 x 4 = 131072; DeepSeek-V3: 4096 x 40 = 163840, its max_position_embeddings), under ``dynamic`` the
factor stretches ``max_position_embeddings``, and ``default`` (or a type not known here) leaves it as it is."""


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length", "n_ctx")
"""The keys a config.json gives a model's positions under, the first one present read: most families'
max_position_embeddings; GPT-2, GPT-J, CodeGen and GPTBigCode's n_positions; MPT and DBRX's max_seq_len; the others
in the configs of models that ship their own code (ChatGLM's seq_length) or in older files (GPT-2's n_ctx)."""


def context_length(config: dict) -> tuple[int, str]:
    """The positions a model's config.json (a dict; a multimodal model's ``text_config`` is read) says it was trained
    on, and the keys that say so, for a message.

    Reads the first of ``CONTEXT_KEYS`` present and the rope scaling: ``rope_parameters`` as transformers 5 saves it
    (also nested by layer type, as Gemma 3's), else the older ``rope_scaling``. Raises KeyError, TypeError or
    ValueError for a config without a usable one.
    """
    text = config.get("text_config") or config
    key = next((key for key in CONTEXT_KEYS if text.get(key) is not None), CONTEXT_KEYS[0])
    base = int(text[key])
    limit, source = base, key
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    nested = isinstance(rope, dict) and rope and all(isinstance(value, dict) for value in rope.values())
    for scaling in rope.values() if nested else [rope]:  # nested: one dict per layer type
        if not isinstance(scaling, dict):
            continue
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        factor = float(scaling.get("factor") or 1.0)
        if rope_type in ROPE_KEEPS_LENGTH or "long_factor" in scaling or factor <= 1.0:
            continue
        if rope_type == "yarn":
            original = int(scaling.get("original_max_position_embeddings")
                           or text.get("original_max_position_embeddings") or base)
            length, said = int(original * factor), (f"original_max_position_embeddings {original} x yarn factor "
                                                    f"{factor:g}")
        elif rope_type == "dynamic":
            length, said = int(base * factor), f"max_position_embeddings {base} x dynamic factor {factor:g}"
        else:
            continue
        if length > limit:
            limit, source = length, said
    return limit, source


def warn_if_beyond_context(path: str, tokens: int, source: str, model: str | None = None,
                           fix: str | None = None) -> bool:
    """Warn (one line) when a run's longest sequence outruns the positions the model was trained on; refuse it
    (ValueError, one line) when those positions are a learned table (``position_table``), which has no row past them.

    ``tokens``: prompt plus response budget; ``source``: the settings that make it, for the message and its fix;
    ``model``: how the message names the model (default: the model at ``path``); ``fix``: the refusal's fix, where it
    is not lowering ``source`` (``{limit}`` in it is the model's positions).
    Reads the context from a local folder's config.json (``context_length``); returns whether it warned.
    Rotary positions past it still run (there is no table to overflow), which is why transformers only warns deep
    inside ``generate``; a learned table's lookup fails there with an IndexError.
    """
    file = Path(path).expanduser() / "config.json"
    try:
        limit, keys = context_length(json.loads(file.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False  # a hub id, or a config without the field: nothing to compare with
    if tokens <= limit:
        return False
    named = model or f"the model at {path}"
    table = position_table(path, limit)
    if table is not None:
        raise ValueError(f"{source} = {tokens} tokens, more than the {limit} positions of {named} ({keys} in its "
                         f"config.json), whose position embedding is a learned table ({table}) with no row past them; "
                         + (fix.format(limit=limit) if fix else f"lower {source} to {limit} or fewer"))
    logger.warning("%s = %d tokens, more than the %d positions %s was trained on (%s in its config.json); what it "
                   "computes past them is unreliable: shorten them or use a model with a longer context", source,
                   tokens, limit, named, keys)
    return True


def position_table(path: str, limit: int) -> str | None:
    """Where the model at ``path`` keeps its positions in a learned table of ``limit`` rows (OPT's and BART's
    have 2 rows more, an offset): that embedding's name and rows (GPT-2's ``transformer.wpe: 64 rows``), found in
    its ``meta_model``; None when its positions are computed (rotary, ALiBi) or it cannot be built so (its own
    code, a config transformers does not read)."""
    model = meta_model(path)
    if model is None:
        return None
    token_embedding = model.get_input_embeddings()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and module is not token_embedding \
                and limit <= module.num_embeddings <= limit + 2:
            return f"{name}: {module.num_embeddings} rows"
    return None


def meta_model(path: str, trust_remote_code: bool = False) -> PreTrainedModel | None:
    """The model ``load_causal_lm`` builds from the config at ``path`` (``causal_lm_class``), on the meta device:
    its modules and shapes, no weight read or allocated. None where transformers cannot build it here (the load
    then says why, in its own words)."""
    try:
        config = read_model_config(path, trust_remote_code)
        model_class = causal_lm_class(config)
        with torch.device("meta"):
            if hasattr(model_class, "from_config"):  # an auto class
                return model_class.from_config(config, trust_remote_code=trust_remote_code)
            return model_class._from_config(config)  # ``named_class``'s
    except Exception:  # noqa: BLE001 (not built here: the run's own load says what is wrong)
        return None


def dynamic_rope_length(config: dict) -> int | None:
    """A config.json's (a dict) ``max_position_embeddings`` when its rotary scaling is dynamic NTK (any layer type's),
    the length past which the frequencies depend on the sequence's whole length; else None."""
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        return None
    nested = [value for value in rope.values() if isinstance(value, dict)]
    if not any("dynamic" in str(each.get("rope_type") or each.get("type")) for each in (nested or [rope])):
        return None
    return int(text["max_position_embeddings"])


def warn_if_rollout_parts_from_training(path: str, tokens: int, source: str) -> bool:
    """Warn (one line) when an RL run's sequences can pass the length past which a dynamic-NTK model's frequencies
    follow the sequence's whole length: training scores each sequence at its final length's frequencies, while each
    token was sampled (by transformers' ``generate``, the only engine that runs it) at the length it had then, so the
    rollout's and the training's log-probs part past that length. Returns whether it warned."""
    file = Path(path).expanduser() / "config.json"
    try:
        length = dynamic_rope_length(json.loads(file.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    if length is None or tokens <= length:
        return False
    logger.warning("%s = %d tokens, past the %d (max_position_embeddings) after which the model at %s rescales its "
                   "rotary frequencies by the whole sequence's length (dynamic NTK): the rollout samples each token "
                   "at the length it had, training scores it at the final length, so their log-probs part there "
                   "(training/rollout_probs_diff_*); keep sequences within %d or correct for it "
                   "(algorithm.rollout_correction)", source, tokens, length, path, length)
    return True


@contextmanager
def hub_errors_explained(path: str, key: str | None = None) -> Iterator[None]:
    """Turn a failed hub download for a path that is not a local folder into one line (naming ``key``, the setting
    that gave the path, when given)."""
    try:
        yield
    except OSError as error:
        if Path(path).exists():
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise OSError(f"{path!r} is not a local folder and could not be loaded from the hub ({first_line}); "
                      f"check {key or 'the path'}, or download the model first") from error


class HeldLoadReport(logging.Filter):
    """Holds back transformers' weight-loading report (the ``LOAD REPORT`` table it logs as a warning) of the
    ``from_pretrained`` calls made inside ``with``, so the caller can log one line of its own for a report it expected
    (a new head) and ``release()`` any other."""

    LOGGER = "transformers.modeling_utils"

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.records.append(record)
            return False
        return True

    def __enter__(self) -> HeldLoadReport:
        logging.getLogger(self.LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc_info) -> None:
        logging.getLogger(self.LOGGER).removeFilter(self)

    def release(self) -> None:
        """Log the held reports as transformers would have."""
        target = logging.getLogger(self.LOGGER)
        for record in self.records:
            target.handle(record)
        self.records.clear()


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute activations in backward; non-reentrant, so frozen inputs need no requires_grad trick."""
    kwargs = {"use_reentrant": False}
    # transformers renamed the method; the old name warns from 5.x on but is the only one in 4.x
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointing_enabled(model: torch.nn.Module) -> bool:
    """Whether ``model`` recomputes its activations in backward (transformers' ``is_activation_checkpointing``; the
    old name, the only one in 4.x, warns from 5.25 on)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def read_model_config(path: str, trust_remote_code: bool = False, key: str = "model.path"):
    """The model's config through transformers; a model transformers cannot load is refused in one line naming
    ``key``, the setting that gave ``path`` (a config.json value it refuses too: ``unreadable_config``).

    That is the one refusal of a causal LM: every architecture transformers loads trains (the
    families of ``models.architectures`` on the fast path, any other through its own modules).
    """
    import transformers
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError:
        raise
    except Exception as error:  # noqa: BLE001 (a KeyError, ValueError, TypeError or a hub validator's own error)
        model_type = _declared_model_type(path)
        if not trust_remote_code and "trust_remote_code" in str(error):  # its config.json maps to code it ships
            raise ValueError(f"{key}={path} is a {model_type!r} model whose code ships with it (auto_map in its "
                             f"config.json), which transformers runs only when trusted; set "
                             f"{key.rpartition('.')[0]}.trust_remote_code=true if you trust that code") from None
        unknown = model_type is not None and ("does not recognize" in str(error) or model_type in str(error))
        if not unknown:
            raise unreadable_config(path, key, error) from error
        raise ValueError(f"{key}={path} is a {model_type!r} model, which transformers "
                         f"{transformers.__version__} cannot load; upgrade transformers, or set "
                         f"{key.rpartition('.')[0]}.trust_remote_code=true if the model folder ships its own code"
                         ) from None


def check_causal_lm_config(config, path: str, key: str = "model.path") -> None:
    """Refuse, in one line naming ``key``, a config of a model type transformers has no causal LM of (an
    encoder-decoder such as T5, an encoder such as RoBERTa without its decoder flag): AutoModelForCausalLM cannot
    load it. Vision-language models, folders with code of their own and text configs ``named_class`` finds pass."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if (is_vision_language(config) or getattr(config, "auto_map", None) or type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
            or named_class(config) is not None):
        return
    kind = ", an encoder-decoder" if getattr(config, "is_encoder_decoder", False) else ""
    raise ValueError(f"{key}={path} is a {getattr(config, 'model_type', None)!r} model ({type(config).__name__}{kind}), "
                     "which transformers has no causal LM class for (AutoModelForCausalLM cannot load it); reinforge "
                     f"trains causal LMs: point {key} at a causal LM's folder (...ForCausalLM)")


def check_loads_as_causal_lm(path: str, trust_remote_code: bool = False, key: str = "model.path") -> None:
    """``check_causal_lm_config`` on the config.json of the local model folder ``path``, before its weights load (a
    hub id, or a folder without config.json, is left to the load)."""
    if not is_local_path(path) or not (Path(path).expanduser() / "config.json").is_file():
        return
    check_causal_lm_config(read_model_config(path, trust_remote_code, key), path, key)


def unreadable_config(path: str, key: str, error: BaseException) -> BaseException:
    """A local folder whose config.json transformers refuses (a value of the wrong type, a key its config class
    rejects): one line naming the setting, the file and transformers' reason; ``error`` itself otherwise."""
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        return error
    cause = error
    while cause.__cause__ is not None:  # the validator's own words (huggingface_hub wraps them)
        cause = cause.__cause__
    outer, inner = (" ".join(str(found).split()) for found in (error, cause))
    reason = outer if inner in outer else f"{outer}: {inner}" if outer else inner or type(error).__name__
    return ValueError(f"{key}={path}: transformers cannot read its config.json ({reason}); fix that value in "
                      f"{config_file}, or set {key} to another model")


def _declared_model_type(path: str) -> str | None:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    try:
        return json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def sdpa_or_eager(model_class: type | None, attn_implementation: str, config=None) -> str:
    """``attn_implementation``, except ``sdpa`` becomes ``eager`` for a model class that cannot run SDPA (Gemma 2,
    whose soft-cap it cannot, MPT, Mamba), or whose ``config`` holds a sub-model that cannot (a multimodal wrapper's
    language model: PaliGemma 2's Gemma 2, which transformers otherwise refuses to build)."""
    if attn_implementation != "sdpa":
        return attn_implementation
    if any(getattr(cls, "_supports_sdpa", True) is False for cls in (model_class, *sub_model_classes(config))):
        return "eager"
    return attn_implementation


def sub_model_classes(config) -> list[type]:
    """transformers' base model class of each sub-config of ``config`` (a multimodal wrapper's text and vision
    configs) that has one; [] for a config without sub-configs or None."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    classes = []
    for name in getattr(config, "sub_configs", None) or {}:
        sub_config = getattr(config, name, None)
        model_class = MODEL_MAPPING.get(type(sub_config), None) if sub_config is not None else None
        if isinstance(model_class, type):
            classes.append(model_class)
    return classes


def attention_for(path: str, trust_remote_code: bool, attn_implementation: str, mapping=None) -> str:
    """``sdpa_or_eager`` for transformers' class of the model at ``path`` in ``mapping`` (the causal LMs by default;
    the bodies for a critic)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = read_model_config(path, trust_remote_code)
    model_class = (MODEL_FOR_CAUSAL_LM_MAPPING if mapping is None else mapping).get(type(config), None)
    if model_class is None and mapping is None:
        model_class = named_class(config)
    return sdpa_or_eager(model_class, attn_implementation, config)


def load_causal_lm(path: str, *, dtype: torch.dtype, device: torch.device | str, trust_remote_code: bool = False,
                   attn_implementation: str = "sdpa", gradient_checkpointing: bool = False) -> PreTrainedModel:
    """An AutoModelForCausalLM (a vision-language model's AutoModelForImageTextToText) from a local folder or hub id,
    in ``dtype`` on ``device``, use_cache off.

    ``attn_implementation="sdpa"`` becomes ``eager`` for a model class that cannot run SDPA (Gemma 2).

    On an accelerator the weights go straight from the (memory-mapped) files to the device, one
    tensor at a time, cast on the way: host memory never holds the whole model (loading a 7B model
    in float32 through the CPU first took 30 GB of host RAM, a second copy while moving it).
    """
    from reinforge.models.random_weights import build_random_causal_lm, random_weights_seed

    random = is_local_path(path) and random_weights_seed(path) is not None  # built on the device, no weight files
    if is_local_path(path) and not random:
        check_model_folder(path)
        path = str(Path(path).expanduser())
    device = torch.device(device)
    placement = {"device_map": {"": device}} if device.type != "cpu" else {}
    with hub_errors_explained(path):
        # Gemma 2: SDPA cannot soft-cap; the RL workers then set their own
        attn_implementation = attention_for(path, trust_remote_code, attn_implementation)
        if random:
            model = build_random_causal_lm(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                           attn_implementation=attn_implementation)
        else:
            config = read_model_config(path, trust_remote_code)
            check_causal_lm_config(config, path)
            model_class = causal_lm_class(config)  # a VLM: the tower and the LM
            try:
                with HeldLoadReport() as report:
                    model, loading = model_class.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                                attn_implementation=attn_implementation, **placement,
                                                                output_loading_info=True, **NO_HUB_KERNELS)
            except (ImportError, ValueError) as error:
                if _attention_refused(error, attn_implementation):  # an unknown name, or its kernels not installed
                    raise ValueError(f"model.attn_implementation={attn_implementation}: transformers cannot load "
                                     f"{path} with it here ({' '.join(str(error).split())}); set "
                                     "model.attn_implementation to sdpa or eager, or install what it needs"
                                     ) from None
                if not isinstance(error, ImportError):
                    raise
                # a package its modules need (Gemma 3n's vision tower: timm), in one line
                raise ImportError(f"model.path={path} is a {config.model_type!r} model, which transformers cannot "
                                  f"build here: {' '.join(str(error).split())}") from error
            except RuntimeError as error:
                mismatch = _mismatched_weights(report)
                if mismatch is None or "ignore_mismatched_sizes" not in str(error):
                    report.release()
                    raise
                raise ValueError(f"model.path={path}: its weights do not fit its config.json ({mismatch}); fix "
                                 "config.json's sizes to the weights', or point model.path at the folder they came "
                                 "with") from None
            head = _new_output_layer(model, loading.get("missing_keys") or ())
            if head is not None:
                raise ValueError(f"model.path={path} holds no weights for {head}, the output layer of the causal LM "
                                 f"{type(model).__name__} (its config.json names {_declared_architecture(path)}), "
                                 "so it would sample from a new, random one; point model.path at the causal LM's "
                                 "folder (...ForCausalLM), whose weights hold its output layer")
            report.release()
    model.to(device)
    model.config.use_cache = False
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model


def _new_output_layer(model: torch.nn.Module, missing_keys) -> str | None:
    """The name of ``model``'s output layer weight where the checkpoint held none (transformers drew it at random: a
    headless base model's folder, as AutoModel saves it); None where it was loaded, or is the tied embedding."""
    output = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    weight = getattr(output, "weight", None)
    if weight is None:
        return None
    names = [name for name, parameter in model.named_parameters() if parameter is weight]
    return names[0] if names and names[0] in set(missing_keys) else None


def _declared_architecture(path: str) -> str:
    try:
        architectures = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        architectures = []
    return ", ".join(str(name) for name in architectures) or "no architectures"


def _attention_refused(error: BaseException, attn_implementation: str) -> bool:
    """Whether transformers refused to load a model because of ``attn_implementation`` (not sdpa or eager): a name it
    does not know, or one whose kernels are not installed ("FlashAttention2 has been toggled on, but ...")."""
    text = str(error)
    return attn_implementation not in ("sdpa", "eager") and (
        f'attn_implementation="{attn_implementation}"' in text or "has been toggled on" in text)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MISMATCH_ROW = re.compile(r"^\s*(\S[^|]*?)\s*\|\s*MISMATCH\s*\|.*?ckpt:\s*torch\.Size\((\[[^\]]*\])\)\s*vs\s*"
                           r"model:\s*torch\.Size\((\[[^\]]*\])\)")


def _mismatched_weights(report: HeldLoadReport) -> str | None:
    """What a held load report says of weights whose shapes differ from those the config builds, in a few words
    (how many, the first one's name and shapes); None where it names none."""
    rows = [match for record in report.records for line in _ANSI.sub("", record.getMessage()).splitlines()
            if (match := _MISMATCH_ROW.match(line))]
    if not rows:
        return None
    name, stored, built = rows[0].groups()
    more = f", and {len(rows) - 1} more tensors" if len(rows) > 1 else ""
    return f"{name} is {stored} in the weights, {built} in the model config.json builds{more}"


def tokens_read_otherwise(tokenizer: PreTrainedTokenizerBase, other: PreTrainedTokenizerBase) -> list[str]:
    """The tokens of ``tokenizer`` that have another id, or none, in ``other`` (a second tokenizer), sorted: where a
    model of ``other``'s reads ``tokenizer``'s ids as other tokens."""
    other_vocab = other.get_vocab()
    return sorted(token for token, index in tokenizer.get_vocab().items() if other_vocab.get(token) != index)


def tokens_its_tokenizer_moves(path: str, tokenizer: PreTrainedTokenizerBase,
                               trust_remote_code: bool = False) -> list[str]:
    """``tokens_read_otherwise`` of ``tokenizer`` and the tokenizer saved in the local folder ``path``: the tokens a
    model of that folder would read as others; [] where the folder (or a hub id) holds no tokenizer of its own."""
    if not is_local_path(path) or not any((Path(path).expanduser() / name).is_file() for name in TOKENIZER_FILES):
        return []
    return tokens_read_otherwise(tokenizer, load_tokenizer(str(Path(path).expanduser()),
                                                           trust_remote_code=trust_remote_code))


def vocab_rows(path: str, trust_remote_code: bool = False, key: str = "model.path") -> int | None:
    """The rows of the token embedding of the model at ``path`` (its text config's vocab_size); None where unsaid."""
    config = read_model_config(path, trust_remote_code, key)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(config, "vocab_size", None)
    return rows if isinstance(rows, int) else None


def load_tokenizer(path: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """An AutoTokenizer padding on the left, with a pad token (its EOS token if it has none); the folders a run saves
    keep the pad token and padding side it had (``AS_LOADED``)."""
    if is_local_path(path):
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder {folder} does not exist; check model.tokenizer_path "
                                    "(or model.path when that is unset)")
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise FileNotFoundError(f"tokenizer folder {folder} has no tokenizer files (expected one of "
                                    f"{', '.join(TOKENIZER_FILES)}); set model.tokenizer_path to the folder that has them")
        path = str(folder)
    with hub_errors_explained(path):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    setattr(tokenizer, AS_LOADED, {"pad_token": tokenizer.pad_token, "padding_side": tokenizer.padding_side})
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer {path} has neither a pad token nor an EOS token; add a pad token to its "
                             "tokenizer_config.json")
        logger.info("tokenizer %s has no pad token; padding with its EOS token %r", path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer
