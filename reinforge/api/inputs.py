"""What a Python caller hands a trainer, turned into what the CLI reads: a loaded model saved as a folder, rows
written as parquet, a peft LoraConfig as model.lora, reward_funcs as function objects (or a reward model's settings).

The model and rows land under ``<output_dir>/inputs``, where an earlier start of the same run (one that is resumed) may
have written them already: the same model or rows are kept as they are; different ones go beside them (``train-2.parquet``,
``initial_model-2``), so what the earlier start trained on is never overwritten, and the run's settings then name
another path (a resume refuses changed data or model by name, as the run folder does).
"""

from __future__ import annotations

import filecmp
import itertools
import json
import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def keep_beside_earlier(partial: Path, final: Path, same: Callable[[Path, Path], bool], what: str) -> Path:
    """Move the just-written ``partial`` to ``final``; where an earlier start left something else there, to the first
    free ``final-2``, ``final-3``... (an earlier copy equal to it is kept and ``partial`` removed). Returns where it is."""
    stem, suffix = (final.stem, final.suffix) if final.suffix else (final.name, "")
    for number in itertools.count(1):
        candidate = final if number == 1 else final.with_name(f"{stem}-{number}{suffix}")
        if not candidate.exists():
            partial.rename(candidate)
            if number > 1:
                logger.warning("%s holds %s that an earlier start of this run wrote, which differ from the ones given "
                               "now; kept it, and wrote these to %s", final, what, candidate)
            return candidate
        if same(candidate, partial):
            (shutil.rmtree if partial.is_dir() else Path.unlink)(partial)
            return candidate
    raise AssertionError("unreachable")


def _same_folder(first: Path, second: Path) -> bool:
    """Whether two folders hold the same files with the same bytes."""
    names = sorted(path.relative_to(first).as_posix() for path in first.rglob("*") if path.is_file())
    if names != sorted(path.relative_to(second).as_posix() for path in second.rglob("*") if path.is_file()):
        return False
    matched, _, _ = filecmp.cmpfiles(first, second, names, shallow=False)
    return len(matched) == len(names)


def _same_table(first: Path, second: Path) -> bool:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(first).equals(pq.read_table(second))
    except (OSError, pa.ArrowInvalid):  # an unreadable earlier file is kept, not compared
        return False


TRAINED_MARK = "reinforge_trained_from"
"""The attribute a trainer sets on a model object it gave the trained weights to: (the run's initial model folder,
the weights' fingerprint), so that the same object handed to a trainer of that run again resumes it."""


def mark_trained(model: Any, initial_model: str) -> None:
    """Record on ``model``, which now holds a run's trained weights, the folder that run started from."""
    setattr(model, TRAINED_MARK, (initial_model, weights_fingerprint(model)))


def weights_fingerprint(model: Any) -> tuple[float, ...]:
    """Each parameter's sum, in float64 (no copy of the weights): tells weights changed since they were recorded."""
    import torch

    with torch.no_grad():
        return tuple(float(parameter.sum(dtype=torch.float64)) for parameter in model.parameters())


def save_model_if_loaded(model: Any, processing_class: Any, folder: Path) -> str:
    """A path or hub id as it is; a loaded model (and its tokenizer) saved into ``folder``, whose path is returned.
    A model that a trainer of this run trained and left unchanged since (``mark_trained``) gives the run's initial
    folder back: its weights are the run's latest checkpoint's, which the run resumes from."""
    if isinstance(model, str | Path):
        return str(model)
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model must be a path, a hub id or a loaded transformers model; got a {type(model).__name__}")
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):  # its save_pretrained writes adapters only
        raise ValueError(f"the model is a peft {type(model).__name__}; pass the model it wraps "
                         "(model.get_base_model() before get_peft_model) and its LoraConfig as peft_config, as "
                         "TRL takes them")
    trained_from = getattr(model, TRAINED_MARK, None)
    if (trained_from is not None and Path(trained_from[0]).parent == folder.parent
            and Path(trained_from[0]).is_dir() and trained_from[1] == weights_fingerprint(model)):
        return trained_from[0]
    frozen = [name for name, parameter in model.named_parameters() if not parameter.requires_grad]
    if frozen and len(frozen) < len(list(model.parameters())):
        # a TRL (transformers Trainer) run keeps them frozen; the saved folder forgets requires_grad and reinforge
        # would train them
        shown = ", ".join(frozen[:3]) + (f" and {len(frozen) - 3} more" if len(frozen) > 3 else "")
        raise ValueError(f"the model was given with {len(frozen)} parameter{'s' if len(frozen) != 1 else ''} frozen "
                         f"(requires_grad=False: {shown}); "
                         "reinforge trains a saved copy of the model, which would train them too: pass the model "
                         "unfrozen, or train adapters (peft_config)")
    tokenizer = processing_class
    if tokenizer is None:
        tokenizer = _own_tokenizer(model, "the model was given loaded, without a name_or_path to load its tokenizer "
                                          "from; pass processing_class=tokenizer")
    return _save_model_folder(model, tokenizer, folder)


def _own_tokenizer(model: Any, missing: str) -> Any:
    """The tokenizer of the folder or hub id a loaded model came from; ``missing`` is the error without one."""
    source = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    if not source:
        raise ValueError(missing)
    from reinforge.models import load_tokenizer

    return load_tokenizer(source)


def _save_model_folder(model: Any, tokenizer: Any, folder: Path) -> str:
    source = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if source:  # given a tokenizer (or none), a vision-language model keeps the processor of the folder it came from
        from reinforge.models.export import copy_processor_files

        copy_processor_files(source, partial)
    return str(keep_beside_earlier(partial, folder, _same_folder, "a model"))


def save_tokenizer_if_given(model: Any, processing_class: Any, folder: Path) -> str | None:
    """The tokenizer given beside a model path or hub id, saved into ``folder`` (its path returned, for
    model.tokenizer_path); None without one, or with a loaded model (whose folder holds it)."""
    if processing_class is None or not isinstance(model, str | Path):
        return None
    if not hasattr(processing_class, "save_pretrained"):
        raise TypeError(f"processing_class must be a transformers tokenizer or processor; got a "
                        f"{type(processing_class).__name__}")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    processing_class.save_pretrained(partial)
    return str(keep_beside_earlier(partial, folder, _same_folder, "a tokenizer"))


def write_dataset(dataset: Any, folder: Path, name: str) -> list[str]:
    """Files as they are; a datasets.Dataset, pandas frame or list of dicts written to ``folder/name.parquet`` (or
    beside other rows an earlier start wrote there: ``keep_beside_earlier``)."""
    if dataset is None:
        return []
    if isinstance(dataset, str | Path):
        return [str(dataset)]
    if isinstance(dataset, Sequence) and dataset and all(isinstance(item, str | Path) for item in dataset):
        return [str(item) for item in dataset]
    rows = _rows_of(dataset, name)
    if not rows:
        raise ValueError(f"{name}_dataset has no rows")
    for row in rows:
        if "ground_truth" in row and "reward_model" not in row:  # verl's place for it, read by every scorer
            row["reward_model"] = {"ground_truth": row.pop("ground_truth")}
    # every row gets every column (None where it has none): parquet would keep only the first row's columns
    columns = list(dict.fromkeys(key for row in rows for key in row))
    rows = [{column: row.get(column) for column in columns} for row in rows]
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.parquet"
    partial = path.with_name(path.name + ".partial")
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise ValueError(f"{name}_dataset cannot be stored as parquet: {_mixed_column(rows, columns, error)}") from error
    pq.write_table(table, partial)
    return [str(keep_beside_earlier(partial, path, _same_table, f"{name}_dataset rows"))]


def _mixed_column(rows: list[dict[str, Any]], columns: list[str], error: Exception) -> str:
    """Which column holds values of more than one type, and of which (a string prompt in one row, chat messages in
    another), for the refusal; pyarrow's own error where no single column is to blame."""
    import pyarrow as pa

    for column in columns:
        try:
            pa.array([row[column] for row in rows])
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            kinds: dict[str, int] = {}
            for index, row in enumerate(rows):
                if row[column] is not None:
                    kinds.setdefault(type(row[column]).__name__, index)
            shown = " and ".join(f"{kind} (row {index})" for kind, index in kinds.items())
            hint = " (a prompt is a string or chat messages, not both)" if column == "prompt" else ""
            return f"column {column!r} holds values of types {shown}; give the column one type in every row{hint}"
    return f"{error}; give each column one type in every row"


def _rows_of(dataset: Any, name: str) -> list[dict[str, Any]]:
    if hasattr(dataset, "to_dict") and hasattr(dataset, "columns") and hasattr(dataset, "iloc"):  # pandas
        return [{key: _plain(value) for key, value in row.items()} for row in dataset.to_dict(orient="records")]
    if hasattr(dataset, "to_list") and hasattr(dataset, "column_names"):  # datasets.Dataset
        return [dict(row) for row in dataset.to_list()]
    if isinstance(dataset, Sequence) and all(isinstance(row, Mapping) for row in dataset):
        return [dict(row) for row in dataset]
    splits = list(dataset.keys()) if isinstance(dataset, Mapping) and dataset and all(
        hasattr(split, "column_names") for split in dataset.values()) else []
    hint = f" (a DatasetDict of splits {', '.join(map(repr, splits))}: pass one, e.g. dataset[{splits[0]!r}])" \
        if splits else ""
    raise TypeError(f"{name}_dataset must be a datasets.Dataset, a pandas DataFrame, a list of dicts or data files; "
                    f"got a {type(dataset).__name__}{hint}")


def _plain(value: Any) -> Any:
    """numpy arrays in a pandas frame's cells (lists read from parquet) as lists."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        return _plain(value.tolist())
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def peft_settings(peft_config: Any, model: Any = None) -> dict[str, Any]:
    """A peft ``LoraConfig``'s rank, alpha, dropout and target modules as reinforge's ``model.lora`` keys; no target
    modules means peft's default for the architecture of ``model`` (a path, hub id or loaded model), as in peft."""
    if peft_config is None:
        return {}
    if not int(peft_config.r) > 0:  # model.lora.rank=0 trains every weight; peft refuses such a rank itself
        raise ValueError(f"peft_config.r={peft_config.r}: a LoRA adapter's rank is a positive number such as 16; "
                         "pass peft_config=None to train every weight")
    settings = {"model.lora.rank": int(peft_config.r), "model.lora.alpha": float(peft_config.lora_alpha),
                "model.lora.dropout": float(getattr(peft_config, "lora_dropout", 0.0) or 0.0)}
    unsupported = {"modules_to_save": None, "use_dora": False, "use_rslora": False, "layers_to_transform": None,
                   "exclude_modules": None, "bias": "none", "rank_pattern": {}, "alpha_pattern": {},
                   "init_lora_weights": True, "target_parameters": None, "lora_bias": False,
                   "trainable_token_indices": None, "layer_replication": None, "use_qalora": False,
                   "alora_invocation_tokens": None, "loftq_config": {}}
    ignored = [f"{name}={getattr(peft_config, name)!r}" for name, default in unsupported.items()
               if _set_otherwise(getattr(peft_config, name, default), default)]
    if ignored:  # dropped, they left a part the caller asked to train frozen (modules_to_save) or changed the adapters
        raise ValueError(f"peft_config sets {', '.join(ignored)}, which reinforge's LoRA (model.lora: rank, alpha, "
                         "dropout, target_modules) does not do; remove them")
    targets = getattr(peft_config, "target_modules", None)
    if targets == "all-linear":
        targets = ["all-linear"]
    elif isinstance(targets, str):
        raise ValueError(f"peft_config.target_modules={targets!r}: reinforge takes a list of module names "
                         "(q_proj, v_proj, ...) or 'all-linear', not a pattern")
    elif not targets:
        targets = _peft_default_targets(model)
    settings["model.lora.target_modules"] = sorted(targets)
    return settings


def _set_otherwise(value: Any, default: Any) -> bool:
    """Whether a peft setting differs from its default (an empty value stands for an empty default)."""
    def empty(item: Any) -> bool:
        return item is None or item is False or (isinstance(item, dict | list | tuple | set) and not item)

    return value != default and not (empty(value) and empty(default))


def _peft_default_targets(model: Any) -> list[str]:
    """peft's target modules for a LoraConfig that names none: its list for the model's architecture."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    model_type = _model_type(model)
    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    if not targets:
        raise ValueError(f"peft_config names no target_modules and peft has no default for "
                         f"{'a ' + model_type if model_type else 'this'} model; name the layers (target_modules=['q_proj', 'v_proj', ...]) or 'all-linear'")
    return list(targets)


def _model_type(model: Any) -> str | None:
    """``config.model_type`` of a loaded model, or of the config.json a path or hub id names; None if unreadable."""
    if hasattr(model, "config"):
        return getattr(model.config, "model_type", None)
    if model is None:
        return None
    file = Path(str(model)).expanduser() / "config.json"
    try:
        if file.is_file():
            return json.loads(file.read_text()).get("model_type")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(model)).model_type
    except (OSError, ValueError):
        return None


def reward_functions_of(reward_funcs: Any, settings: dict[str, Any], folder: Path | None = None,
                        processing_classes: Any = None) -> list[Callable[..., Any]] | None:
    """The function objects of ``reward_funcs`` (one or a list: callables, ``path.py[:function]`` specs, or one reward
    model: its folder, hub id or loaded model, saved into ``folder/reward_model`` with its tokenizer from
    ``processing_classes``, TRL's reward_processing_classes, in the same order); None -> None, and [] is refused.

    A reward model goes into ``settings`` as ``reward.reward_model`` with its weight of ``reward.weights`` as
    ``reward.combine.rm_weight`` (summed with the functions, as TRL sums; alone, its score is the reward).
    """
    if reward_funcs is None:
        return None
    items = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    if not items:
        raise ValueError(f"reward_funcs={reward_funcs!r} names no reward function; give at least one, or leave "
                         "reward_funcs out to score each row by its data_source's built-in scorer")
    tokenizers = _reward_tokenizers(processing_classes, len(items))
    functions: list[Callable[..., Any]] = []
    model_positions = []
    for position, item in enumerate(items):
        if hasattr(item, "save_pretrained") and hasattr(item, "config"):  # a loaded reward model (a callable module)
            if folder is None:
                raise ValueError("reward_funcs holds a loaded model; pass its folder or hub id instead")
            tokenizer = tokenizers[position] or _own_tokenizer(
                item, "reward_funcs holds a loaded reward model without a name_or_path to load its tokenizer from; "
                      "pass it as reward_processing_classes, or save it with its tokenizer and pass the folder")
            items[position] = _save_model_folder(item, tokenizer, folder / "reward_model")
            model_positions.append(position)
            continue
        if callable(item):
            functions.append(item)
            continue
        spec = str(item)
        from reinforge.reward.scorer_calls import load_custom_scorer, parse_custom_function

        if parse_custom_function(spec)[0].endswith(".py"):
            functions.append(load_custom_scorer(spec))
            continue
        given = tokenizers[position]
        if given is not None and str(getattr(given, "name_or_path", "")) != spec:
            raise ValueError(f"reward_processing_classes gives the reward model {spec!r} the tokenizer of "
                             f"{getattr(given, 'name_or_path', '') or 'another folder'!r}; reinforge reads the one "
                             "in the model's folder: save the model with that tokenizer into one folder and pass it")
        model_positions.append(position)
    if model_positions:
        if len(model_positions) > 1:
            names = ", ".join(repr(str(items[position])) for position in model_positions)
            raise ValueError(f"reward_funcs names {len(model_positions)} reward models ({names}); reinforge scores with "
                             "one (reward.reward_model): keep one, or combine them into one function")
        position = model_positions[0]
        weights = settings.get("reward.weights")
        rm_weight = 1.0
        if weights is not None:
            if len(weights) != len(items):
                raise ValueError(f"reward_weights has {len(weights)} weights for {len(items)} reward_funcs; give one "
                                 "per entry, in the same order")
            rm_weight = float(weights[position])
            settings["reward.weights"] = [weight for index, weight in enumerate(weights) if index != position] or None
        settings |= {"reward.reward_model.enable": True, "reward.reward_model.model_path": str(items[position]),
                     "reward.combine.mode": "sum" if functions else "replace", "reward.combine.rm_weight": rm_weight,
                     "reward.combine.rule_weight": 1.0}
    return functions or None


def _reward_tokenizers(processing_classes: Any, count: int) -> list[Any]:
    """TRL's reward_processing_classes, one per reward function (None where not given)."""
    if processing_classes is None:
        return [None] * count
    given = list(processing_classes) if isinstance(processing_classes, list | tuple) else [processing_classes]
    if len(given) != count:
        raise ValueError(f"reward_processing_classes has {len(given)} entries for {count} reward_funcs; give one per "
                         "entry, in the same order (None for a function)")
    return given


def whole_prompts(config: Any) -> dict[str, Any]:
    """The run's train and val prompts (``RLDataset`` by split), tokenized as the run tokenizes them (the chat
    template, a vision-language model's image tokens), and ``config.data.max_prompt_length`` set to the longest's
    tokens: a prompt limit that keeps every prompt whole. The run takes these datasets (``RLTrainer``'s
    ``prompt_sets``) rather than tokenizing every prompt a second time."""
    import dataclasses
    import sys

    from reinforge.data import RLDataset
    from reinforge.models import load_tokenizer
    from reinforge.models.vision import run_processor, why_no_images

    model = config.model
    tokenizer = load_tokenizer(model.tokenizer_path or model.path, trust_remote_code=model.trust_remote_code)
    processor = run_processor(model, config.data)
    why = None if processor is not None else why_no_images(model.path, model.trust_remote_code)
    unbounded = dataclasses.replace(config.data, max_prompt_length=sys.maxsize, filter_overlong_prompts=False)
    splits = ("train", "val") if config.data.val_files else ("train",)
    # tool_schemas=[]: the run's, which reads no tool config here (tools would lengthen the prompts unseen)
    prompt_sets = {split: RLDataset.from_config(unbounded, tokenizer, split, tool_schemas=[], processor=processor,
                                                why_no_images=why) for split in splits}
    config.data.max_prompt_length = max(len(example.prompt_ids) for dataset in prompt_sets.values()
                                        for example in dataset.examples)
    return prompt_sets


def formatted_rows(dataset: Any, formatting_func: Callable[[dict[str, Any]], Any],
                   text_key: str = "text") -> list[dict[str, Any]]:
    """TRL's formatting_func: each row's text, in column ``text_key``, trained on whole (as TRL trains a text row)."""
    rows = []
    for index, row in enumerate(_rows_of(dataset, "train")):
        text = formatting_func(row)
        if isinstance(text, list) and len(text) == 1:  # the batched form of older TRL returns one-item lists
            text = text[0]
        if not isinstance(text, str):
            raise TypeError(f"formatting_func returned a {type(text).__name__} for row {index}; return the row's "
                            "text as one string")
        rows.append({text_key: text})
    return rows


def first_row(dataset: Any) -> Mapping[str, Any] | None:
    """The first row of a dataset given to a trainer (rows in hand, or files); None when it has none."""
    if isinstance(dataset, str | Path) or (isinstance(dataset, Sequence) and dataset
                                           and all(isinstance(item, str | Path) for item in dataset)):
        from reinforge.data.files import expand_data_files, read_rows

        files = expand_data_files([dataset] if isinstance(dataset, str | Path) else list(dataset), "train_dataset")
        rows = read_rows(files[0]) if files else []
        return rows[0] if rows else None
    if hasattr(dataset, "iloc"):  # pandas
        return dataset.iloc[0].to_dict() if len(dataset) else None
    return dict(dataset[0]) if len(dataset) else None


def sft_loss_on(row: Mapping[str, Any] | None, assistant_only_loss: bool | None,
                completion_only_loss: bool | None) -> str | None:
    """data.loss_on of a TRL SFT run on rows like ``row``: a 'messages' row is trained whole unless
    assistant_only_loss=True, a prompt/completion row on its completion unless completion_only_loss=False; None
    where the two train the same ('text' rows)."""
    if row is None:
        return None
    if assistant_only_loss:
        return "assistant"
    if row.get("messages") is not None:
        return "all"
    if row.get("prompt") is not None and row.get("completion") is not None:
        return "all" if completion_only_loss is False else "assistant"
    return None


def as_conversations(dataset: Any) -> Any:
    """TRL's rows as the SFT data reads them: conversational prompt/completion rows keep their two columns (the SFT
    data trains the completion), a string prompt or completion beside them becoming one user or assistant message
    (parquet holds one type per column); other data as it is (plain text prompt/completion or text rows are tokenized
    as text, with no chat template, as in TRL)."""
    if isinstance(dataset, str | Path) or (isinstance(dataset, Sequence) and dataset
                                           and all(isinstance(item, str | Path) for item in dataset)):
        return dataset
    rows = _rows_of(dataset, "train")
    if not any(isinstance(row.get("prompt"), list) or isinstance(row.get("completion"), list) for row in rows):
        return rows
    for row in rows:
        if isinstance(row.get("prompt"), str):
            row["prompt"] = [{"role": "user", "content": row["prompt"]}]
        if isinstance(row.get("completion"), str):
            row["completion"] = [{"role": "assistant", "content": row["completion"]}]
    return rows
