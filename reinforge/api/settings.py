"""TRL's setting names (``GRPOConfig``, ``SFTConfig``, ``DPOConfig``, ``RewardConfig``) and how they become reinforge's
config: each name maps onto the keys that mean the same, ``overrides`` adds reinforge's own keys, and
``load_settings`` builds the checked config from them."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Mapping, Sequence
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
    names = [] if value is None else [value] if isinstance(value, str) else list(value)
    if "all" in names:
        raise ValueError("report_to='all': reinforge does not look for installed integrations; name the loggers "
                         "(report_to=['wandb', 'tensorboard', 'mlflow'])")
    names = [name for name in names if name not in ("none", "console", "jsonl")]
    return {"trainer.loggers": ["console", *names]}  # metrics.jsonl is written whatever the list says


def _epochs(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if float(value) != int(value) or value < 1:
        raise ValueError(f"num_train_epochs={value}: reinforge runs whole passes over the data (1, 2, ...); for part "
                         "of one, set max_steps")
    return {"trainer.total_epochs": int(value)}


def _keep_last(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value is None:
        raise ValueError("save_total_limit=None: reinforge keeps the last trainer.keep_last checkpoints (2 unless "
                         "set), never all of them; give the number to keep")
    return {"trainer.keep_last": value}


def _max_steps(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    return {"trainer.total_steps": None if value is None or int(value) < 0 else int(value)}


def _use_cpu(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    return {"trainer.device": "cpu"} if value else {}


def _logged_every_step(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value not in (None, 1):
        logger.warning("logging_steps=%s: reinforge logs every step's metrics (metrics.jsonl, the loggers); the "
                       "setting changes nothing", value)
    return {}


def _trained_tokens(name: str) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    """completion_only_loss, assistant_only_loss: True (or None) is what reinforge's SFT does; False is refused."""

    def check(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
        if value is False:
            raise ValueError(f"{name}=False: reinforge's SFT trains on the completion (the assistant's turns) only, "
                             "never on the prompt; remove the setting, or give each row as one plain 'text'")
        return {}
    return check


def _schedule(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value not in ("constant", "cosine", "constant_with_warmup"):
        raise ValueError(f"lr_scheduler_type={value!r}: reinforge's schedules are constant and cosine (after "
                         "warmup_steps or warmup_ratio of linear warmup)")
    return {"optim.schedule": "constant" if value == "constant_with_warmup" else value}


RUN_SETTINGS: dict[str, Override] = {
    "max_steps": ("trainer.total_steps", _max_steps),
    "num_train_epochs": ("trainer.total_epochs", _epochs),
    "save_steps": ("trainer.save_every", _to("trainer.save_every")),
    "save_total_limit": ("trainer.keep_last", _keep_last),
    "eval_steps": ("trainer.test_every", lambda value, settings: {} if value is None else {"trainer.test_every": value}),
    "seed": ("trainer.seed, data.seed", _to("trainer.seed", "data.seed")),
    "logging_steps": ("(every step)", _logged_every_step),
    "report_to": ("trainer.loggers", _report_to),
    "use_cpu": ("trainer.device", _use_cpu),
}
"""The run's length, checkpoints, seed, logging and device: the same TRL names in every trainer's config."""

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
    "max_prompt_length": ("data.max_prompt_length (longer prompts cut on the left)", lambda value, settings: {
        "data.max_prompt_length": value, "data.filter_overlong_prompts": False, "data.truncation": "left"}),
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
    "reward_weights": ("reward.weights", lambda value, settings: {} if value is None else {
        "reward.weights": [float(weight) for weight in value]}),
    **RUN_SETTINGS,
    "per_device_train_batch_size": ("data.train_batch_size (with num_generations)", lambda value, settings: {}),
    "gradient_accumulation_steps": ("data.train_batch_size (with num_generations)", lambda value, settings: {}),
    "gradient_checkpointing": ("model.gradient_checkpointing", _to("model.gradient_checkpointing")),
}

"""TRL's GRPOConfig names that mean here what they mean there -> (reinforge keys, for messages; the mapping)."""

TRL_PER_DEVICE_TRAIN_BATCH_SIZE = 8
"""TRL's default per_device_train_batch_size: what gradient_accumulation_steps multiplies when only it is given."""

SFT_SETTINGS: dict[str, Override] = {
    "output_dir": ("trainer.output_dir", _to("trainer.output_dir")),
    "learning_rate": ("optim.lr", _to("optim.lr")),
    "weight_decay": ("optim.weight_decay", _to("optim.weight_decay")),
    "warmup_steps": ("optim.warmup_steps", _to("optim.warmup_steps")),
    "warmup_ratio": ("optim.warmup_ratio", _to("optim.warmup_ratio")),
    "lr_scheduler_type": ("optim.schedule", lambda value, settings: {
        "optim." + key.removeprefix("optim."): item for key, item in _schedule(value, settings).items()}),
    "max_grad_norm": ("trainer.grad_clip", _to("trainer.grad_clip")),
    "max_length": ("data.max_length (longer conversations cut on the right)", lambda value, settings: {
        "data.max_length": value, "data.truncation": "right"}),
    "packing": ("data.packing", _to("data.packing")),
    "completion_only_loss": ("(always: the loss is on completions)", _trained_tokens("completion_only_loss")),
    "assistant_only_loss": ("(always: the loss is on assistant turns)", _trained_tokens("assistant_only_loss")),
    **RUN_SETTINGS,
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
            try:
                mapped |= self.SETTINGS[name][1](value, self.settings)
            except TypeError as error:  # None or another type where the mapping does arithmetic on a number
                raise ValueError(f"{name}={value!r} is not a value {type(self).__name__} can use ({error})") from None
        return mapped | _overrides_dict(self.overrides)


class GRPOConfig(_TrainingArguments):
    """A GRPO run's settings under TRL's names (``GRPO_SETTINGS``): learning_rate, num_generations,
    max_completion_length, per_device_train_batch_size (completions per step, with gradient_accumulation_steps),
    beta, epsilon, loss_type, num_iterations, temperature, output_dir, max_steps, save_steps, seed, reward_weights...
    """

    SETTINGS = GRPO_SETTINGS

    def to_overrides(self) -> dict[str, Any]:
        mapped = super().to_overrides()
        completions = _rows_per_step(self.settings)
        if completions is not None and "data.train_batch_size" not in _overrides_dict(self.overrides):
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
        rows = _rows_per_step(self.settings)
        if rows is not None and "data.batch_size" not in _overrides_dict(self.overrides):
            mapped["data.batch_size"] = rows
        return mapped


def _rows_per_step(settings: Mapping[str, Any]) -> int | None:
    """per_device_train_batch_size x gradient_accumulation_steps (TRL's default of the first when only the second is
    given); None when neither is."""
    per_device = settings.get("per_device_train_batch_size")
    accumulation = settings.get("gradient_accumulation_steps")
    if per_device is None and accumulation is None:
        return None
    return int(per_device if per_device is not None else TRL_PER_DEVICE_TRAIN_BATCH_SIZE) * int(accumulation or 1)


PREFERENCE_SETTINGS: dict[str, Override] = {
    **{name: SFT_SETTINGS[name] for name in SFT_SETTINGS
       if name not in ("packing", "completion_only_loss", "assistant_only_loss")},
    "per_device_train_batch_size": ("data.batch_size (pairs, with gradient_accumulation_steps)",
                                    lambda value, settings: {}),
    "max_length": ("data.max_length (longer pairs dropped, counted in the log)", _to("data.max_length")),
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


def load_settings(schema: type, base: Mapping[str, Any] | None, settings: Mapping[str, Any], source: str) -> Any:
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


def keyword_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``reward__num_workers=0`` (a Python keyword) -> ``reward.num_workers``."""
    return {key.replace("__", "."): value for key, value in overrides.items()}
