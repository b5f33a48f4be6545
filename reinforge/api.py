"""reinforge from Python: trainers that take what a script or a notebook has in hand, named as in TRL.

    from reinforge import GRPOConfig, GRPOTrainer

    def correct(completions, answer, **kwargs):
        return [float(text.strip() == expected) for text, expected in zip(completions, answer)]

    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=[correct, short], train_dataset=frame,
                          args=GRPOConfig(output_dir="runs/api", learning_rate=1e-6, reward_weights=[1.0, 0.2]))
    trainer.train()

A trainer runs in this process, on the same code as ``reinforge train``/``sft``: the run folder, its checks
before any model loads, checkpoints and resume are the CLI's. What it is given becomes what the CLI would read:

- ``model``: a path or hub id, or a loaded transformers model (saved into ``<output_dir>/initial_model``, with
  ``processing_class``, the tokenizer, or the one its ``name_or_path`` names);
- ``train_dataset``/``eval_dataset``: a ``datasets.Dataset``, a pandas frame, a list of dicts (written into
  ``<output_dir>/data`` as parquet), or files (parquet, JSONL, ``save_to_disk`` folders). Rows follow TRL's
  columns: ``prompt`` (a string, fed as it is unless ``data.apply_chat_template`` asks for the template, or chat
  messages), any other column reaching the reward functions by name; a ``ground_truth`` column becomes verl's
  ``reward_model.ground_truth``, which the built-in scorers and a function's ``ground_truth`` argument read;
- ``reward_funcs``: one function or a list (TRL's kind, called once per batch, or verl's), weighted by
  ``reward_weights``; a ``.py`` path with ``:function`` loads one from a file, any other string is a reward
  model (``reward.reward_model``, its weighted score added); none: each row's ``data_source`` picks a built-in
  scorer;
- ``peft_config``: a peft ``LoraConfig``, as ``model.lora`` (rank, alpha, dropout, target modules);
- ``args``: a ``GRPOConfig``/``SFTConfig`` (TRL's names where the meaning is the same, plus ``overrides``:
  reinforge's own keys, ``{"rollout.top_p": 0.9}``), or a reinforge ``Config``; ``**overrides`` on the
  trainer are reinforge keys with ``__`` for the dots (``reward__num_workers=0``).

Nothing here needs an ``if __name__ == "__main__":`` guard: the scorer processes never import the main module,
and reward functions reach them by value (cloudpickle); ``reward.num_workers=0`` scores in this process.
"""

from __future__ import annotations

import difflib
import logging
import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Override = tuple[str, Callable[[Any, dict[str, Any]], dict[str, Any]]]


def _to(*keys: str) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    return lambda value, settings: dict.fromkeys(keys, value)


def _loss_type(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    modes = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
             "dr_grpo": "seq-mean-token-sum-norm"}
    if value not in modes:
        raise ValueError(f"loss_type={value!r}: reinforge takes {', '.join(modes)} (actor.loss_agg_mode); other "
                         "losses are actor.policy_loss.loss_mode, set through overrides")
    return {"actor.loss_agg_mode": modes[value]}


def _beta(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    beta = float(value)
    if beta == 0.0:
        return {"actor.use_kl_loss": False}
    return {"actor.use_kl_loss": True, "actor.kl_loss_coef": beta, "actor.kl_loss_type": "k3"}


def _scale_rewards(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value in (True, "group"):
        return {"algorithm.norm_adv_by_std": True}
    if value in (False, "none"):
        return {"algorithm.norm_adv_by_std": False}
    raise ValueError(f"scale_rewards={value!r}: reinforge scales advantages by the group's std (group, true) or not "
                     "at all (none, false)")


def _report_to(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value)
    names = [name for name in names if name not in ("none", "console", "jsonl")]
    return {"trainer.loggers": ["console", *names]}  # metrics.jsonl is written whatever the list says


def _max_steps(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    return {"trainer.total_steps": None if value is None or int(value) < 0 else int(value)}


def _use_cpu(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    return {"trainer.device": "cpu"} if value else {}


def _logged_every_step(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value not in (None, 1):
        logger.warning("logging_steps=%s: reinforge logs every step's metrics (metrics.jsonl, the loggers); the "
                       "setting changes nothing", value)
    return {}


def _schedule(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value not in ("constant", "cosine", "constant_with_warmup"):
        raise ValueError(f"lr_scheduler_type={value!r}: reinforge's schedules are constant and cosine (after "
                         "warmup_steps or warmup_ratio of linear warmup)")
    return {"optim.schedule": "constant" if value == "constant_with_warmup" else value}


GRPO_SETTINGS: dict[str, Override] = {
    "output_dir": ("trainer.output_dir", _to("trainer.output_dir")),
    "learning_rate": ("actor.optim.lr", _to("actor.optim.lr")),
    "weight_decay": ("actor.optim.weight_decay", _to("actor.optim.weight_decay")),
    "warmup_steps": ("actor.optim.warmup_steps", _to("actor.optim.warmup_steps")),
    "warmup_ratio": ("actor.optim.warmup_ratio", _to("actor.optim.warmup_ratio")),
    "lr_scheduler_type": ("actor.optim.schedule", lambda value, settings: {
        "actor." + key: item for key, item in _schedule(value, settings).items()}),
    "max_grad_norm": ("actor.grad_clip", _to("actor.grad_clip")),
    "num_generations": ("rollout.n", _to("rollout.n")),
    "max_prompt_length": ("data.max_prompt_length", _to("data.max_prompt_length")),
    "max_completion_length": ("data.max_response_length", _to("data.max_response_length")),
    "temperature": ("rollout.temperature", _to("rollout.temperature")),
    "top_p": ("rollout.top_p", _to("rollout.top_p")),
    "top_k": ("rollout.top_k", lambda value, settings: {"rollout.top_k": -1 if value in (None, 0) else value}),
    "beta": ("actor.use_kl_loss, actor.kl_loss_coef (k3)", _beta),
    "epsilon": ("actor.policy_loss.clip_ratio", _to("actor.policy_loss.clip_ratio")),
    "epsilon_high": ("actor.policy_loss.clip_ratio_high", _to("actor.policy_loss.clip_ratio_high")),
    "loss_type": ("actor.loss_agg_mode", _loss_type),
    "scale_rewards": ("algorithm.norm_adv_by_std", _scale_rewards),
    "num_iterations": ("actor.ppo_epochs", _to("actor.ppo_epochs")),
    "reward_weights": ("reward.weights", lambda value, settings: {"reward.weights": [float(w) for w in value]}),
    "max_steps": ("trainer.total_steps", _max_steps),
    "num_train_epochs": ("trainer.total_epochs", lambda value, settings: {"trainer.total_epochs": math.ceil(value)}),
    "save_steps": ("trainer.save_every", _to("trainer.save_every")),
    "save_total_limit": ("trainer.keep_last", _to("trainer.keep_last")),
    "eval_steps": ("trainer.test_every", _to("trainer.test_every")),
    "seed": ("trainer.seed, data.seed", _to("trainer.seed", "data.seed")),
    "logging_steps": ("(every step)", _logged_every_step),
    "report_to": ("trainer.loggers", _report_to),
    "use_cpu": ("trainer.device", _use_cpu),
    "per_device_train_batch_size": ("data.train_batch_size (with num_generations)", lambda value, settings: {}),
    "gradient_accumulation_steps": ("data.train_batch_size (with num_generations)", lambda value, settings: {}),
    "gradient_checkpointing": ("model.gradient_checkpointing", _to("model.gradient_checkpointing")),
}
"""TRL's GRPOConfig names that mean here what they mean there -> (reinforge keys, for messages; the mapping)."""

SFT_SETTINGS: dict[str, Override] = {
    "output_dir": ("trainer.output_dir", _to("trainer.output_dir")),
    "learning_rate": ("optim.lr", _to("optim.lr")),
    "weight_decay": ("optim.weight_decay", _to("optim.weight_decay")),
    "warmup_steps": ("optim.warmup_steps", _to("optim.warmup_steps")),
    "warmup_ratio": ("optim.warmup_ratio", _to("optim.warmup_ratio")),
    "lr_scheduler_type": ("optim.schedule", lambda value, settings: {
        "optim." + key.removeprefix("optim."): item for key, item in _schedule(value, settings).items()}),
    "max_grad_norm": ("trainer.grad_clip", _to("trainer.grad_clip")),
    "max_length": ("data.max_length", _to("data.max_length")),
    "packing": ("data.packing", _to("data.packing")),
    "max_steps": ("trainer.total_steps", _max_steps),
    "num_train_epochs": ("trainer.total_epochs", lambda value, settings: {"trainer.total_epochs": math.ceil(value)}),
    "save_steps": ("trainer.save_every", _to("trainer.save_every")),
    "save_total_limit": ("trainer.keep_last", _to("trainer.keep_last")),
    "eval_steps": ("trainer.test_every", _to("trainer.test_every")),
    "seed": ("trainer.seed, data.seed", _to("trainer.seed", "data.seed")),
    "logging_steps": ("(every step)", _logged_every_step),
    "report_to": ("trainer.loggers", _report_to),
    "use_cpu": ("trainer.device", _use_cpu),
    "per_device_train_batch_size": ("data.batch_size (with gradient_accumulation_steps)", lambda value, settings: {}),
    "gradient_accumulation_steps": ("data.batch_size (with per_device_train_batch_size)", lambda value, settings: {}),
    "per_device_eval_batch_size": ("data.val_batch_size", _to("data.val_batch_size")),
    "gradient_checkpointing": ("model.gradient_checkpointing", _to("model.gradient_checkpointing")),
}


class _TrainingArguments:
    """Settings under TRL's names, checked by name when made; ``overrides`` holds reinforge's own keys."""

    SETTINGS: dict[str, Override] = {}

    def __init__(self, overrides: Mapping[str, Any] | Sequence[str] | None = None, **settings: Any) -> None:
        for name in settings:
            if name not in self.SETTINGS:
                close = difflib.get_close_matches(name, list(self.SETTINGS), n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                raise TypeError(f"{type(self).__name__} has no setting {name!r}; {hint}it takes TRL's names "
                                f"{', '.join(sorted(self.SETTINGS))}, and reinforge's own keys as "
                                "overrides={'rollout.top_p': 0.9}")
        self.settings = dict(settings)
        self.overrides = overrides

    def __getattr__(self, name: str) -> Any:
        if name in type(self).SETTINGS:
            return self.__dict__.get("settings", {}).get(name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        shown = ", ".join(f"{key}={value!r}" for key, value in self.settings.items())
        return f"{type(self).__name__}({shown}{', overrides=' + repr(self.overrides) if self.overrides else ''})"

    def to_overrides(self) -> dict[str, Any]:
        """reinforge's keys -> values: TRL's names mapped, then ``overrides`` (which win)."""
        mapped: dict[str, Any] = {}
        for name, value in self.settings.items():
            mapped |= self.SETTINGS[name][1](value, self.settings)
        return mapped | _overrides_dict(self.overrides)


class GRPOConfig(_TrainingArguments):
    """A GRPO run's settings under TRL's names (``GRPO_SETTINGS``): learning_rate, num_generations,
    max_completion_length, per_device_train_batch_size (completions per step, with gradient_accumulation_steps),
    beta, epsilon, loss_type, num_iterations, temperature, output_dir, max_steps, save_steps, seed, reward_weights...
    """

    SETTINGS = GRPO_SETTINGS

    def to_overrides(self) -> dict[str, Any]:
        mapped = super().to_overrides()
        completions = self.settings.get("per_device_train_batch_size")
        if completions is not None and "data.train_batch_size" not in _overrides_dict(self.overrides):
            completions *= self.settings.get("gradient_accumulation_steps") or 1
            generations = int(self.settings.get("num_generations") or mapped.get("rollout.n") or 8)
            if completions % generations:
                raise ValueError(f"per_device_train_batch_size x gradient_accumulation_steps = {completions} "
                                 f"completions a step is not a multiple of num_generations={generations}; make it one "
                                 f"(each prompt is answered num_generations times)")
            mapped["data.train_batch_size"] = completions // generations
        return mapped


class SFTConfig(_TrainingArguments):
    """An SFT run's settings under TRL's names (``SFT_SETTINGS``): learning_rate, max_length, packing,
    per_device_train_batch_size (with gradient_accumulation_steps), output_dir, max_steps, save_steps, seed..."""

    SETTINGS = SFT_SETTINGS

    def to_overrides(self) -> dict[str, Any]:
        mapped = super().to_overrides()
        rows = self.settings.get("per_device_train_batch_size")
        if rows is not None and "data.batch_size" not in _overrides_dict(self.overrides):
            mapped["data.batch_size"] = rows * (self.settings.get("gradient_accumulation_steps") or 1)
        return mapped


PREFERENCE_SETTINGS: dict[str, Override] = {
    **{name: SFT_SETTINGS[name] for name in SFT_SETTINGS if name not in ("packing",)},
    "per_device_train_batch_size": ("data.batch_size (pairs, with gradient_accumulation_steps)",
                                    lambda value, settings: {}),
}

DPO_SETTINGS: dict[str, Override] = {
    **PREFERENCE_SETTINGS,
    "beta": ("dpo.beta", _to("dpo.beta")),
    "loss_type": ("dpo.loss_type", _to("dpo.loss_type")),
    "label_smoothing": ("dpo.label_smoothing", _to("dpo.label_smoothing")),
}

REWARD_SETTINGS: dict[str, Override] = {
    **PREFERENCE_SETTINGS,
    "center_rewards_coefficient": ("rm.center_rewards_coefficient", _to("rm.center_rewards_coefficient")),
}


class DPOConfig(SFTConfig):
    """A DPO run's settings under TRL's names (``DPO_SETTINGS``): beta, loss_type, label_smoothing, learning_rate,
    max_length, per_device_train_batch_size (pairs, with gradient_accumulation_steps), output_dir, max_steps..."""

    SETTINGS = DPO_SETTINGS


class RewardConfig(SFTConfig):
    """A reward model's training settings under TRL's names (``REWARD_SETTINGS``): center_rewards_coefficient,
    learning_rate, max_length, per_device_train_batch_size, output_dir, max_steps..."""

    SETTINGS = REWARD_SETTINGS


def _overrides_dict(overrides: Mapping[str, Any] | Sequence[str] | None) -> dict[str, Any]:
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return dict(overrides)
    if isinstance(overrides, str):
        overrides = [overrides]
    parsed = {}
    for item in overrides:
        key, separator, value = str(item).partition("=")
        if not separator:
            raise ValueError(f"override {item!r} must look like a.b=value")
        parsed[key] = _ParsedText(value)
    return parsed


class _ParsedText(str):
    """An override given as text (``a.b=value``): parsed by the config loader as on the command line."""


def _load(schema: type, base: Mapping[str, Any] | None, settings: Mapping[str, Any], source: str) -> Any:
    """A checked config of ``schema``: its defaults, ``base`` (a whole config's tree), ``settings`` (flat dotted keys,
    named ``source`` in errors); values given as ``a.b=text`` parse as on the command line."""
    from reinforge.config.loader import load_structured

    texts = [f"{key}={value}" for key, value in settings.items() if isinstance(value, _ParsedText)]
    tree = _nested({key: value for key, value in settings.items() if not isinstance(value, _ParsedText)})
    if base is not None:
        tree = _deep_merge(dict(base), tree)
    return load_structured(schema, None, texts, tree=tree, tree_source=source)


def _nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise ValueError(f"setting {key!r} goes inside {section!r}, which is set to a value")
        node[leaf] = value
    return tree


def _deep_merge(base: dict[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), Mapping):
            base[key] = _deep_merge(dict(base[key]), value)
        else:
            base[key] = value
    return base


def _keyword_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``reward__num_workers=0`` (a Python keyword) -> ``reward.num_workers``."""
    return {key.replace("__", "."): value for key, value in overrides.items()}


# ---- what the trainer is given, as files ------------------------------------------------------------------------

def save_model_if_loaded(model: Any, processing_class: Any, folder: Path) -> str:
    """A path or hub id as it is; a loaded model (and its tokenizer) saved into ``folder``, whose path is returned."""
    if isinstance(model, str | Path):
        return str(model)
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model must be a path, a hub id or a loaded transformers model; got a {type(model).__name__}")
    tokenizer = processing_class
    if tokenizer is None:
        source = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
        if not source:
            raise ValueError("the model was given loaded, without a name_or_path to load its tokenizer from; pass "
                             "processing_class=tokenizer")
        from reinforge.models import load_tokenizer

        tokenizer = load_tokenizer(source)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return str(folder)


def write_dataset(dataset: Any, folder: Path, name: str) -> list[str]:
    """Files as they are; a datasets.Dataset, pandas frame or list of dicts written to ``folder/name.parquet``."""
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
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.parquet"
    partial = path.with_name(path.name + ".partial")
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise ValueError(f"{name}_dataset cannot be stored as parquet ({error}); give each column one type in "
                         "every row") from error
    pq.write_table(table, partial)
    partial.replace(path)
    return [str(path)]


def _rows_of(dataset: Any, name: str) -> list[dict[str, Any]]:
    if hasattr(dataset, "to_dict") and hasattr(dataset, "columns") and hasattr(dataset, "iloc"):  # pandas
        return [{key: _plain(value) for key, value in row.items()} for row in dataset.to_dict(orient="records")]
    if hasattr(dataset, "to_list") and hasattr(dataset, "column_names"):  # datasets.Dataset
        return [dict(row) for row in dataset.to_list()]
    if isinstance(dataset, Sequence) and all(isinstance(row, Mapping) for row in dataset):
        return [dict(row) for row in dataset]
    raise TypeError(f"{name}_dataset must be a datasets.Dataset, a pandas DataFrame, a list of dicts or data files; "
                    f"got a {type(dataset).__name__}")


def _plain(value: Any) -> Any:
    """numpy arrays in a pandas frame's cells (lists read from parquet) as lists."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        return _plain(value.tolist())
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def peft_settings(peft_config: Any) -> dict[str, Any]:
    """A peft ``LoraConfig``'s rank, alpha, dropout and target modules as reinforge's ``model.lora`` keys."""
    if peft_config is None:
        return {}
    settings = {"model.lora.rank": int(peft_config.r), "model.lora.alpha": float(peft_config.lora_alpha),
                "model.lora.dropout": float(getattr(peft_config, "lora_dropout", 0.0) or 0.0)}
    targets = getattr(peft_config, "target_modules", None)
    if targets:
        if isinstance(targets, str):
            raise ValueError(f"peft_config.target_modules={targets!r}: reinforge takes a list of module names "
                             "(q_proj, v_proj, ...)")
        settings["model.lora.target_modules"] = sorted(targets)
    return settings


def reward_functions_of(reward_funcs: Any, settings: dict[str, Any]) -> list[Callable[..., Any]] | None:
    """The function objects of ``reward_funcs`` (one or a list: callables, ``path.py[:function]`` specs, or one reward
    model's folder or hub id, as in TRL); None or [] -> None.

    A reward model goes into ``settings`` as ``reward.reward_model`` with its weight of ``reward.weights`` as
    ``reward.combine.rm_weight`` (summed with the functions, as TRL sums; alone, its score is the reward).
    """
    if reward_funcs is None:
        return None
    items = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    functions: list[Callable[..., Any]] = []
    model_positions = []
    for position, item in enumerate(items):
        if callable(item):
            functions.append(item)
            continue
        spec = str(item)
        from reinforge.reward.scorer_calls import load_custom_scorer, parse_custom_function

        if parse_custom_function(spec)[0].endswith(".py"):
            functions.append(load_custom_scorer(spec))
        else:
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


# ---- the trainers -----------------------------------------------------------------------------------------------

class GRPOTrainer:
    """GRPO (or any estimator of ``algorithm.adv_estimator``) on a model, a dataset and reward functions."""

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, peft_config: Any = None,
                 **overrides: Any) -> None:
        from reinforge.config import Config

        if isinstance(args, Config):
            settings = _keyword_overrides(overrides)
            output_dir = Path(settings.get("trainer.output_dir", args.trainer.output_dir))
        else:
            args = args if args is not None else GRPOConfig()
            if not isinstance(args, GRPOConfig):
                raise TypeError(f"args must be a GRPOConfig or a reinforge Config; got a {type(args).__name__}")
            settings = args.to_overrides() | _keyword_overrides(overrides)
            output_dir = Path(settings.setdefault("trainer.output_dir", "runs/grpo"))
        inputs = output_dir / "inputs"
        settings = peft_settings(peft_config) | settings
        self.reward_functions = reward_functions_of(reward_funcs, settings)
        settings["model.path"] = save_model_if_loaded(model, processing_class, inputs / "initial_model")
        if train_dataset is not None:
            settings["data.train_files"] = write_dataset(train_dataset, inputs, "train")
        if eval_dataset is not None:
            settings["data.val_files"] = write_dataset(eval_dataset, inputs, "eval")
        elif not isinstance(args, Config) and "trainer.val_before_train" not in settings:
            settings["trainer.val_before_train"] = False
        from reinforge.config import config_to_dict
        from reinforge.config.validate import validate_config

        self.config = _load(Config, config_to_dict(args) if isinstance(args, Config) else None, settings,
                            "GRPOTrainer's settings")
        validate_config(self.config)
        from reinforge.trainer.rl_trainer import RLTrainer

        self.trainer = RLTrainer(self.config, reward_functions=self.reward_functions)

    def train(self) -> dict[str, float]:
        """Run the training; the last step's metrics."""
        return self.trainer.fit()

    @property
    def output_dir(self) -> Path:
        return Path(self.config.trainer.output_dir)

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """The latest checkpoint as an HF model folder (``<output_dir>/final_model`` unless given), as
        ``reinforge export`` writes it; returns the folder."""
        from reinforge.trainer.export import export_checkpoint

        return export_checkpoint(self.output_dir, Path(output_dir) if output_dir else self.output_dir / "final_model",
                                 force=True)


class _SupervisedTrainer:
    """A trainer on rows of text (SFT, DPO, reward model): TRL's names in, reinforge's config and trainer out."""

    ARGS: type[_TrainingArguments]
    DEFAULT_OUTPUT_DIR: str

    def __init__(self, model: Any, args: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, peft_config: Any = None, **overrides: Any) -> None:
        from reinforge.config import config_to_dict

        schema = self._schema()
        if isinstance(args, schema):
            settings = _keyword_overrides(overrides)
            settings.setdefault("trainer.output_dir", args.trainer.output_dir)
        else:
            args = args if args is not None else self.ARGS()
            if not isinstance(args, self.ARGS):
                raise TypeError(f"args must be a reinforge.{self.ARGS.__name__}; got a {type(args).__name__}")
            settings = args.to_overrides() | _keyword_overrides(overrides)
        output_dir = Path(settings.setdefault("trainer.output_dir", self.DEFAULT_OUTPUT_DIR))
        inputs = output_dir / "inputs"
        settings = peft_settings(peft_config) | settings
        settings["model.path"] = save_model_if_loaded(model, processing_class, inputs / "initial_model")
        if train_dataset is not None:
            settings["data.train_files"] = write_dataset(self._rows(train_dataset), inputs, "train")
        if eval_dataset is not None:
            settings["data.val_files"] = write_dataset(self._rows(eval_dataset), inputs, "eval")
        self.config = _load(schema, config_to_dict(args) if isinstance(args, schema) else None, settings,
                            f"{type(self).__name__}'s settings")
        self._validate(self.config)
        self.trainer = self._trainer(self.config)

    def train(self) -> dict[str, Any]:
        """Run the training; the last step's metrics."""
        return self.trainer.fit()

    @property
    def output_dir(self) -> Path:
        return Path(self.config.trainer.output_dir)

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """The latest checkpoint as an HF model folder (``<output_dir>/final_model`` unless given), as
        ``reinforge export`` writes it; returns the folder."""
        from reinforge.trainer.export import export_checkpoint

        return export_checkpoint(self.output_dir, Path(output_dir) if output_dir else self.output_dir / "final_model",
                                 force=True)

    def _rows(self, dataset: Any) -> Any:
        return dataset

    def _schema(self) -> type:
        raise NotImplementedError

    def _validate(self, config: Any) -> None:
        raise NotImplementedError

    def _trainer(self, config: Any) -> Any:
        raise NotImplementedError


class SFTTrainer(_SupervisedTrainer):
    """Supervised fine-tuning on chat conversations (a ``messages`` column), or on ``prompt``/``completion`` pairs."""

    ARGS = SFTConfig
    DEFAULT_OUTPUT_DIR = "runs/sft"

    def _rows(self, dataset: Any) -> Any:
        return _as_conversations(dataset)

    def _schema(self) -> type:
        from reinforge.config.sft_schema import SFTConfig as Schema

        return Schema

    def _validate(self, config: Any) -> None:
        from reinforge.config.validate import validate_sft_config

        validate_sft_config(config)

    def _trainer(self, config: Any) -> Any:
        from reinforge.trainer.sft_trainer import SFTTrainer as Trainer

        return Trainer(config)


class DPOTrainer(_SupervisedTrainer):
    """Direct Preference Optimization on ``prompt``/``chosen``/``rejected`` rows (``reinforge dpo``)."""

    ARGS = DPOConfig
    DEFAULT_OUTPUT_DIR = "runs/dpo"

    def _schema(self) -> type:
        from reinforge.config.preference_schema import DPOConfig as Schema

        return Schema

    def _validate(self, config: Any) -> None:
        from reinforge.config.preference_schema import validate_preference_config

        validate_preference_config(config)

    def _trainer(self, config: Any) -> Any:
        from reinforge.trainer.preference.dpo_trainer import DPOTrainer as Trainer

        return Trainer(config)


class RewardTrainer(_SupervisedTrainer):
    """A reward model (Bradley-Terry) on ``chosen``/``rejected`` rows (``reinforge rm``), named as TRL's."""

    ARGS = RewardConfig
    DEFAULT_OUTPUT_DIR = "runs/rm"

    def _schema(self) -> type:
        from reinforge.config.preference_schema import RMConfig as Schema

        return Schema

    def _validate(self, config: Any) -> None:
        from reinforge.config.preference_schema import validate_preference_config

        validate_preference_config(config)

    def _trainer(self, config: Any) -> Any:
        from reinforge.trainer.preference.rm_trainer import RewardModelTrainer

        return RewardModelTrainer(config)


def _as_conversations(dataset: Any) -> Any:
    """TRL's prompt/completion rows as one user and one assistant message; other data as it is."""
    if isinstance(dataset, str | Path) or (isinstance(dataset, Sequence) and dataset
                                           and all(isinstance(item, str | Path) for item in dataset)):
        return dataset
    rows = _rows_of(dataset, "train")
    if rows and "messages" not in rows[0] and {"prompt", "completion"} <= set(rows[0]):
        converted = []
        for row in rows:
            prompt, completion = row.pop("prompt"), row.pop("completion")
            prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            completion = ([{"role": "assistant", "content": completion}] if isinstance(completion, str)
                          else list(completion))
            converted.append({"messages": prompt + completion, **row})
        return converted
    return rows
