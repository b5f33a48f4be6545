"""TRL's setting names (``GRPOConfig``, ``SFTConfig``, ``DPOConfig``, ``RewardConfig``) and how they become reinforge's
config: each name maps onto the keys that mean the same, ``overrides`` adds reinforge's own keys, and
``load_settings`` builds the checked config from them."""

from __future__ import annotations

import difflib
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from reinforge.api.inert_settings import (
    NO_COUNTERPART,
    UNUSED_BY_DPO,
    UNUSED_BY_EVERY_TRAINER,
    UNUSED_BY_GRPO,
    UNUSED_BY_PREFERENCE_TRAINERS,
    UNUSED_BY_SFT,
)
from reinforge.config.schema import DECLARED_ROUTER_AUX_LOSS

logger = logging.getLogger(__name__)


Override = tuple[str, Callable[[Any, dict[str, Any]], dict[str, Any]]]


def _to(*keys: str) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    return lambda value, settings: dict.fromkeys(keys, value)


LOSS_AGGREGATIONS = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
                     "dr_grpo": "seq-mean-token-sum-norm", "cispo": "token-mean", "sapo": "seq-mean-token-mean",
                     "luspo": "seq-mean-token-sum"}
"""TRL's loss_type -> actor.loss_agg_mode: how its per-token losses are averaged."""


def _loss_type(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_type={value!r}: reinforge takes {', '.join(LOSS_AGGREGATIONS)}; other losses are "
                         "actor.policy_loss.loss_mode, set through overrides")
    mapped: dict[str, Any] = {"actor.loss_agg_mode": LOSS_AGGREGATIONS[value]}
    if value in ("cispo", "sapo"):
        if settings.get("importance_sampling_level", "token") != "token":
            raise ValueError(f"loss_type={value!r} with importance_sampling_level="
                             f"{settings['importance_sampling_level']!r}: reinforge's {value} weighs each token by "
                             "its own ratio; remove importance_sampling_level")
        mapped["actor.policy_loss.loss_mode"] = value
    if value == "cispo":  # TRL's epsilon_high is the weight's upper bound itself (5.0 in ScaleRL), and none below
        bound = settings.get("epsilon_high")
        bound = float(settings.get("epsilon", 0.2) if bound is None else bound)
        if bound <= 1.0:
            raise ValueError(f"loss_type='cispo' caps the importance weight at epsilon_high={bound}, below 1, where "
                             "every token's weight is cut; set epsilon_high above 1 (5.0 is usual)")
        mapped |= {"actor.policy_loss.clip_ratio_low": 1.0, "actor.policy_loss.clip_ratio_high": bound - 1.0}
    return mapped


def _epsilon_high(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value is None or settings.get("loss_type") == "cispo":  # cispo's bound: its loss_type mapping sets it
        return {}
    return {"actor.policy_loss.clip_ratio_high": value}


def _importance_sampling_level(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value == "token":
        return {}
    if value == "sequence":
        return {"actor.policy_loss.loss_mode": "gspo"}
    raise ValueError(f"importance_sampling_level={value!r}: it is 'token' or 'sequence' (GSPO)")


GENERATION_KEYS = {"temperature": "rollout.temperature", "top_p": "rollout.top_p", "top_k": "rollout.top_k",
                   "min_p": "rollout.min_p", "max_new_tokens": "data.max_response_length",
                   "max_tokens": "data.max_response_length", "stop_token_ids": "rollout.stop_token_ids"}
"""generation_kwargs (transformers' GenerationConfig, vLLM's SamplingParams) reinforge's engine applies."""


def _generation_kwargs(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, str):  # TRL's command line passes it as JSON
        value = json.loads(value)
    mapped: dict[str, Any] = {}
    for key, item in (value or {}).items():
        if key == "do_sample" and item:
            continue
        if key == "repetition_penalty" and item == 1.0:
            continue
        if key not in GENERATION_KEYS:
            raise ValueError(f"generation_kwargs[{key!r}]={item!r}: reinforge's engine takes "
                             f"{', '.join(GENERATION_KEYS)} there; remove it")
        if key == "top_k" and item in (None, 0):
            item = -1
        mapped[GENERATION_KEYS[key]] = item
    return mapped


def _router_aux_loss_coef(key: str) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    """TRL's router_aux_loss_coef onto ``key``: None (its default) takes the model config's declared coefficient for
    any mixture of experts, whatever its output_router_logits says (``declared``); a number is the weight."""
    return lambda value, settings: {key: DECLARED_ROUTER_AUX_LOSS if value is None else float(value)}


def _entropy_coef(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """TRL's entropy bonus is the mean entropy over the tokens whatever the loss_type; reinforge's is aggregated as the
    loss is (actor.loss_agg_mode), which is that mean only for the loss types averaged over tokens."""
    loss_type = settings.get("loss_type") or "dapo"  # TRL's default
    aggregation = LOSS_AGGREGATIONS.get(loss_type, "token-mean")
    if value and aggregation != "token-mean":
        raise ValueError(f"entropy_coef={value} with loss_type={loss_type!r}: TRL's entropy bonus is the mean entropy "
                         f"over tokens, while reinforge aggregates it as the loss ({aggregation}); use a loss_type "
                         "averaged over tokens (dapo, bnpo, cispo), or remove entropy_coef and take reinforge's "
                         f"bonus with overrides={{'actor.entropy_coeff': {value}}}")
    return {"actor.entropy_coeff": value}


def _beta(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    beta = float(value)
    if beta == 0.0:
        return {"actor.use_kl_loss": False}
    if settings.get("use_bias_correction_kl") is None:
        logger.warning("beta=%s: TRL weighs each token's KL by its importance ratio (use_bias_correction_kl=True, its "
                       "default), which changes the KL's gradient; reinforge's KL loss is not weighted. Set "
                       "use_bias_correction_kl=False to train so knowingly", value)
    return {"actor.use_kl_loss": True, "actor.kl_loss_coef": beta, "actor.kl_loss_type": "k3"}


def _bias_correction_kl(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """TRL's KL term times the importance ratio: nothing to do without a KL term (beta=0) or when turned off."""
    beta = settings.get("beta")
    if value and beta not in (None, 0, 0.0):
        raise ValueError(f"use_bias_correction_kl=True with beta={beta}: reinforge's KL loss is not weighted by the "
                         "importance ratio; set use_bias_correction_kl=False (the plain k3 KL, as TRL's with it off), "
                         "or beta=0.0")
    return {}


def _weights(value: Any) -> list[float]:
    """reward_weights as a list of numbers, one per reward function; anything else is one line."""
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise ValueError(f"reward_weights={value!r}: give a list of numbers, one per reward function, in "
                         "reward_funcs' order (e.g. [1.0, 0.5])")
    weights = []
    for weight in value:
        try:
            weights.append(float(weight))
        except (TypeError, ValueError):
            raise ValueError(f"reward_weights={list(value)!r}: {weight!r} is not a number; give a list of numbers, "
                             "one per reward function, in reward_funcs' order") from None
    return weights


TRL_ADVANTAGE_EPSILON = 1e-4
"""What TRL's GRPOTrainer adds to a group's std before dividing by it (reinforge's own default is verl's 1e-6)."""

GRPO_EPSILON_READERS = ("grpo", "gdpo", "grpo_passk")
"""The estimators that read algorithm.grpo_epsilon."""


def _scale_rewards(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value in (True, "group"):
        return {"algorithm.norm_adv_by_std": True, "algorithm.grpo_epsilon": TRL_ADVANTAGE_EPSILON}
    if value in (False, "none"):
        return {"algorithm.norm_adv_by_std": False}
    raise ValueError(f"scale_rewards={value!r}: reinforge scales advantages by the group's std (group, true) or not "
                     "at all (none, false)")


def _report_to(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    names = [] if value is None else [value] if isinstance(value, str) else list(value)
    if "all" in names:
        raise ValueError("report_to='all': reinforge does not look for installed integrations; name the loggers "
                         "(report_to=['wandb', 'tensorboard', 'mlflow'])")
    names = [name for name in names if name not in ("none", "console", "jsonl", "plots")]
    # metrics.jsonl is written whatever the list says; the run folder's charts as every run draws them
    return {"trainer.loggers": ["console", *names, "plots"]}


def _epochs(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if (settings.get("max_steps") or -1) > 0:  # as in TRL, max_steps decides the length
        return {}
    if float(value) != int(value) or value < 1:
        raise ValueError(f"num_train_epochs={value}: reinforge runs whole passes over the data (1, 2, ...); for part "
                         "of one, set max_steps")
    return {"trainer.total_epochs": int(value)}


def _keep_last(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value is None:
        raise ValueError("save_total_limit=None: reinforge keeps the last trainer.keep_last checkpoints (2 unless "
                         "set), never all of them; give the number to keep")
    return {"trainer.keep_last": value}


def _save_strategy(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value not in ("no", "steps"):
        raise ValueError(f"save_strategy={value!r}: reinforge checkpoints every save_steps steps and at the end; set "
                         "save_strategy='steps' with save_steps, or 'no' (the end only)")
    return _save_every(value, settings)


def _save_every(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """trainer.save_every from save_strategy and save_steps together (both map here, in either order): 'no' saves
    the end only (save_model() exports it), whatever save_steps says; a save_steps below 1 is TRL's fraction of the
    run's steps, set on the trainer once it knows them (``step_intervals``)."""
    if settings.get("save_strategy") == "no":
        return {"trainer.save_every": 0}
    steps = settings.get("save_steps")
    if steps is None or 0 < float(steps) < 1:
        return {}
    if float(steps) != int(steps) or steps < 0:
        raise ValueError(f"save_steps={steps}: give a whole number of steps, or a fraction of the run's steps below 1")
    return {"trainer.save_every": int(steps)}


EVAL_STRATEGIES = ("no", "steps", "epoch")
"""TRL's eval_strategy values: never evaluate the eval_dataset, every eval_steps steps, at each epoch's end."""

TRL_LOGGING_STEPS = 10
"""TRL's default logging_steps: the evaluation interval of eval_strategy='steps' without eval_steps, as in TRL."""


def _eval_strategy(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """'no' maps onto nothing: the eval_dataset is not given to the run at all (``evaluates``); 'epoch' is set on the
    trainer once its data is read (``evaluation_interval``); 'steps' evaluates every eval_steps steps, or every
    logging_steps steps without them, as TRL does."""
    if value not in EVAL_STRATEGIES:
        raise ValueError(f"eval_strategy={value!r}: it is one of {', '.join(EVAL_STRATEGIES)} (TRL's: never evaluate, "
                         "every eval_steps steps, at each epoch's end); reinforge also evaluates at the end")
    return _test_every(value, settings)


def _eval_spacing(settings: Mapping[str, Any]) -> tuple[str, Any] | None:
    """(name, value) of TRL's setting that spaces the evaluations in steps (below 1: a fraction of the run's steps):
    eval_steps, else TRL's logging_steps under eval_strategy='steps' (eval_steps 0 counts as unset, as in TRL); None
    under 'no' and 'epoch', or with neither set."""
    strategy = settings.get("eval_strategy")
    if strategy in ("no", "epoch"):
        return None
    if settings.get("eval_steps"):
        return "eval_steps", settings["eval_steps"]
    if strategy == "steps":
        return "logging_steps", settings.get("logging_steps") or TRL_LOGGING_STEPS
    return None


def _test_every(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """trainer.test_every from eval_strategy and eval_steps together (both map here, in either order); a fraction
    is set on the trainer once it knows its steps (``evaluation_interval``)."""
    spacing = _eval_spacing(settings)
    if spacing is None or 0 < float(spacing[1]) < 1:
        return {}
    name, steps = spacing
    if float(steps) != int(steps) or steps < 1:
        raise ValueError(f"{name}={steps}: give a whole number of steps, or a fraction of the run's steps below 1")
    return {"trainer.test_every": int(steps)}


def evaluates(settings: Mapping[str, Any]) -> bool:
    """Whether a run of TRL's ``settings`` evaluates its eval_dataset: not under eval_strategy='no' (never)."""
    return settings.get("eval_strategy") != "no"


def step_intervals(settings: Mapping[str, Any], steps_per_epoch: int, total_steps: int) -> dict[str, int]:
    """The intervals in steps (``test_every``, ``save_every``: the keys of ``run_steps``) that TRL's ``settings`` ask
    for where they depend on the run's data: one epoch's ``steps_per_epoch`` for eval_strategy='epoch', a fraction
    of ``total_steps`` for eval_steps or save_steps below 1. The others are the config's trainer.test_every and
    trainer.save_every."""
    intervals = {}
    if settings.get("eval_strategy") == "epoch":
        intervals["test_every"] = max(1, steps_per_epoch)
    spacing = _eval_spacing(settings)
    if spacing is not None and 0 < float(spacing[1]) < 1:
        intervals["test_every"] = max(1, math.ceil(total_steps * float(spacing[1])))
    save_steps = settings.get("save_steps")
    if settings.get("save_strategy") != "no" and save_steps is not None and 0 < float(save_steps) < 1:
        intervals["save_every"] = max(1, math.ceil(total_steps * float(save_steps)))
    return intervals


def _max_steps(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    return {"trainer.total_steps": None if value is None or int(value) < 0 else int(value)}


def _use_cpu(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    return {"trainer.device": "cpu"} if value else {}


def _logged_every_step(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value not in (None, 1) and (_eval_spacing(settings) or ("",))[0] != "logging_steps":
        logger.warning("logging_steps=%s: reinforge logs every step's metrics (metrics.jsonl, the loggers); the "
                       "setting changes nothing", value)
    return {}


SCHEDULES = {"linear": "linear", "constant": "constant", "constant_with_warmup": "constant", "cosine": "cosine",
             "cosine_with_min_lr": "cosine"}
"""TRL's (transformers') lr_scheduler_type -> optim.schedule: the ones reinforge has. linear is TRL's default."""


def _schedule(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if value not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type={value!r}: reinforge's schedules are linear, constant, cosine and "
                         "cosine_with_min_lr (after warmup_steps or warmup_ratio of linear warmup); choose one of them")
    mapped = {"optim.schedule": SCHEDULES[value]}
    options = dict(settings.get("lr_scheduler_kwargs") or {})
    if value == "cosine_with_min_lr":
        if set(options) != {"min_lr_rate"}:
            raise ValueError(f"lr_scheduler_kwargs={options!r}: lr_scheduler_type='cosine_with_min_lr' takes "
                             "min_lr_rate (the floor as a fraction of learning_rate), e.g. {'min_lr_rate': 0.1}")
        mapped["optim.min_lr_ratio"] = float(options["min_lr_rate"])
    elif options:
        raise ValueError(f"lr_scheduler_kwargs={options!r}: reinforge's {value} schedule takes no arguments; remove "
                         "them, or set lr_scheduler_type='cosine_with_min_lr'")
    return mapped


def _warmup_steps(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 takes a warmup_steps below 1 as the fraction of the run's steps (its warmup_ratio)."""
    if 0 < float(value) < 1:
        return {"optim.warmup_ratio": float(value)}
    if float(value) != int(value):
        raise ValueError(f"warmup_steps={value}: give a whole number of steps, or a fraction of the run below 1")
    return {"optim.warmup_steps": int(value)}


def _betas(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    first, second = settings.get("adam_beta1"), settings.get("adam_beta2")
    return {"optim.betas": [float(0.9 if first is None else first), float(0.999 if second is None else second)]}


def _optimizer_settings(prefix: str) -> dict[str, Override]:
    """learning_rate, weight_decay, warmup, schedule and AdamW's settings, onto the optimizer section at ``prefix``
    (actor.optim, optim)."""
    def under(mapping: Callable[[Any, dict[str, Any]], dict[str, Any]]) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
        return lambda value, settings: {prefix + key.removeprefix("optim"): item
                                        for key, item in mapping(value, settings).items()}

    return {
        "learning_rate": (f"{prefix}.lr", _to(f"{prefix}.lr")),
        "weight_decay": (f"{prefix}.weight_decay", _to(f"{prefix}.weight_decay")),
        "warmup_steps": (f"{prefix}.warmup_steps (below 1: warmup_ratio)", under(_warmup_steps)),
        "warmup_ratio": (f"{prefix}.warmup_ratio", _to(f"{prefix}.warmup_ratio")),
        "lr_scheduler_type": (f"{prefix}.schedule", under(_schedule)),
        # lr_scheduler_kwargs is read by the lr_scheduler_type mapping
        "lr_scheduler_kwargs": (f"{prefix}.min_lr_ratio (min_lr_rate)", lambda value, settings: {}),
        "adam_beta1": (f"{prefix}.betas", under(_betas)),
        "adam_beta2": (f"{prefix}.betas", under(_betas)),
        "adam_epsilon": (f"{prefix}.eps", _to(f"{prefix}.eps")),
    }


def _precision(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """bf16, fp16: TRL's mixed precision; reinforge keeps float32 weights and computes in model.dtype (auto: bfloat16
    on a GPU)."""
    if settings.get("bf16") and settings.get("fp16"):
        raise ValueError("bf16=True and fp16=True: choose one precision")
    if settings.get("fp16"):
        return {"model.dtype": "float16"}
    if settings.get("bf16") is False:
        return {"model.dtype": "float32"}
    return {}


MODEL_INIT_KEYS = {"dtype": "model.dtype", "torch_dtype": "model.dtype", "attn_implementation":
                   "model.attn_implementation", "trust_remote_code": "model.trust_remote_code"}
"""model_init_kwargs reinforge applies when it loads the model."""


def _model_init_kwargs(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, str):  # TRL's command line passes it as JSON
        value = json.loads(value)
    mapped: dict[str, Any] = {}
    for key, item in (value or {}).items():
        if key in ("device_map", "low_cpu_mem_usage", "use_cache"):  # where and how the weights load: reinforge's
            continue
        if key not in MODEL_INIT_KEYS:
            raise ValueError(f"model_init_kwargs[{key!r}]: reinforge loads the model with "
                             f"{', '.join(MODEL_INIT_KEYS)} only; remove it")
        if key in ("dtype", "torch_dtype"):
            item = str(item).removeprefix("torch.")
        mapped[MODEL_INIT_KEYS[key]] = item
    return mapped


RUN_SETTINGS: dict[str, Override] = {
    "max_steps": ("trainer.total_steps", _max_steps),
    "num_train_epochs": ("trainer.total_epochs", _epochs),
    "save_steps": ("trainer.save_every", _save_every),
    "save_strategy": ("trainer.save_every", _save_strategy),
    "save_total_limit": ("trainer.keep_last", _keep_last),
    "eval_steps": ("trainer.test_every", _test_every),
    "eval_strategy": ("trainer.test_every", _eval_strategy),
    "eval_on_start": ("trainer.val_before_train", lambda value, settings: {
        "trainer.val_before_train": value} if evaluates(settings) else {}),
    "seed": ("trainer.seed, data.seed", _to("trainer.seed", "data.seed")),
    "data_seed": ("data.seed", lambda value, settings: {} if value is None else {"data.seed": value}),
    "logging_steps": ("(every step)", _logged_every_step),
    "report_to": ("trainer.loggers", _report_to),
    "run_name": ("trainer.experiment_name", lambda value, settings: {} if value is None else {
        "trainer.experiment_name": value}),
    "use_cpu": ("trainer.device", _use_cpu),
    "bf16": ("model.dtype", _precision),
    "fp16": ("model.dtype", _precision),
    "model_init_kwargs": ("model.dtype, model.attn_implementation, model.trust_remote_code", _model_init_kwargs),
    "trust_remote_code": ("model.trust_remote_code", _to("model.trust_remote_code")),
    "gradient_checkpointing": ("model.gradient_checkpointing", _to("model.gradient_checkpointing")),
}
"""The run's length, checkpoints, seed, logging, device and precision: the same TRL names in every trainer's
config."""

GRPO_SETTINGS: dict[str, Override] = {
    **UNUSED_BY_EVERY_TRAINER,
    **UNUSED_BY_GRPO,
    "output_dir": ("trainer.output_dir", _to("trainer.output_dir")),
    **_optimizer_settings("actor.optim"),
    "max_grad_norm": ("actor.grad_clip", _to("actor.grad_clip")),
    "num_generations": ("rollout.n", _to("rollout.n")),
    "max_prompt_length": ("data.max_prompt_length (longer prompts cut on the left)", lambda value, settings: {
        "data.max_prompt_length": value, "data.filter_overlong_prompts": False, "data.truncation": "left"}),
    "max_completion_length": ("data.max_response_length", _to("data.max_response_length")),
    "temperature": ("rollout.temperature", _to("rollout.temperature")),
    "top_p": ("rollout.top_p", _to("rollout.top_p")),
    "top_k": ("rollout.top_k", lambda value, settings: {"rollout.top_k": -1 if value in (None, 0) else value}),
    "min_p": ("rollout.min_p", lambda value, settings: {"rollout.min_p": float(value or 0.0)}),
    "generation_kwargs": ("rollout.temperature, top_p, top_k, min_p, stop_token_ids; data.max_response_length",
                          _generation_kwargs),
    "shuffle_dataset": ("data.shuffle", _to("data.shuffle")),
    "beta": ("actor.use_kl_loss, actor.kl_loss_coef (k3)", _beta),
    "use_bias_correction_kl": ("(only False, or with beta=0)", _bias_correction_kl),
    "epsilon": ("actor.policy_loss.clip_ratio", _to("actor.policy_loss.clip_ratio")),
    "epsilon_high": ("actor.policy_loss.clip_ratio_high", _epsilon_high),
    "delta": ("actor.policy_loss.clip_ratio_c (the dual clip)", lambda value, settings: {
        "actor.policy_loss.clip_ratio_c": math.inf if value is None else float(value)}),  # None: no bound, as TRL
    "loss_type": ("actor.loss_agg_mode, actor.policy_loss.loss_mode", _loss_type),
    "importance_sampling_level": ("actor.policy_loss.loss_mode (sequence: gspo)", _importance_sampling_level),
    "sapo_temperature_pos": ("actor.policy_loss.tau_pos", _to("actor.policy_loss.tau_pos")),
    "sapo_temperature_neg": ("actor.policy_loss.tau_neg", _to("actor.policy_loss.tau_neg")),
    "entropy_coef": ("actor.entropy_coeff (with a loss_type averaged over tokens)", _entropy_coef),
    "router_aux_loss_coef": ("actor.router_aux_loss_coef (None: declared)",
                             _router_aux_loss_coef("actor.router_aux_loss_coef")),
    "scale_rewards": ("algorithm.norm_adv_by_std", _scale_rewards),
    "num_iterations": ("actor.ppo_epochs", _to("actor.ppo_epochs")),
    "reward_weights": ("reward.weights", lambda value, settings: {} if value is None else {
        "reward.weights": _weights(value)}),
    "num_completions_to_print": ("trainer.num_logged_samples", lambda value, settings: {} if value is None else {
        "trainer.num_logged_samples": value}),
    **RUN_SETTINGS,
    "per_device_train_batch_size": ("data.train_batch_size (with num_generations)", lambda value, settings: {}),
    "gradient_accumulation_steps": ("actor.mini_batch_size (with num_generations)", lambda value, settings: {}),
    "steps_per_generation": ("data.train_batch_size (with num_generations)", lambda value, settings: {}),
    "generation_batch_size": ("data.train_batch_size (with num_generations)", lambda value, settings: {}),
}
"""TRL's GRPOConfig names -> (reinforge keys, for messages; the mapping)."""

APPLIED_LAST = ("generation_kwargs",)
"""Settings mapped after the others, so that their keys win (TRL's generation_kwargs override temperature, top_p...)."""

TRL_PER_DEVICE_TRAIN_BATCH_SIZE = 8
"""TRL's default per_device_train_batch_size: what gradient_accumulation_steps multiplies when only it is given."""

def _token_limit(value: Any, unit: str, longer: str) -> Any:
    """TRL's max_length of a ``unit`` (a row, a pair); None (TRL: no limit) is refused, since reinforge sizes its
    micro-batches by the limit. ``longer``: what becomes of a longer one, for the message."""
    if value is None:
        raise ValueError(f"max_length=None: reinforge needs a limit on a {unit}'s tokens to size its micro-batches "
                         f"(a longer {unit} {longer}); give one above your longest {unit} (TRL's default is 1024)")
    return value


def _dataset_kwargs(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """TRL's dataset_kwargs: only skip_prepare_dataset=False, reinforge tokenizes every row itself."""
    if isinstance(value, str):
        value = json.loads(value)
    if value and (set(value) != {"skip_prepare_dataset"} or value["skip_prepare_dataset"]):
        raise ValueError(f"dataset_kwargs={value!r}: reinforge tokenizes the rows itself (messages, prompt/completion "
                         "or text); remove it and give the rows untokenized")
    return {}


def _chat_template_path(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """TRL's chat_template_path: a Jinja file, or a tokenizer (folder or hub id) whose chat template the run uses."""
    if value is None:
        return {}
    from pathlib import Path

    path = Path(value).expanduser()
    if path.is_file():
        return {"data.chat_template": path.read_text()}
    from reinforge.models.loading import is_local_path, load_tokenizer

    if is_local_path(str(value)) and not path.is_dir():
        raise ValueError(f"chat_template_path={value!r} does not exist; give a Jinja file or a tokenizer folder")
    template = getattr(load_tokenizer(str(value)), "chat_template", None)
    if not isinstance(template, str) or not template:
        raise ValueError(f"chat_template_path={value!r} is a tokenizer without a chat template; give a Jinja file or "
                         "a tokenizer that has one")
    return {"data.chat_template": template}


SFT_DATA_SETTINGS: dict[str, Override] = {
    **UNUSED_BY_SFT,
    "max_length": ("data.max_length (longer conversations cut on the right)", lambda value, settings: {
        "data.max_length": _token_limit(value, "row", "is cut at its end"), "data.truncation": "right"}),
    "packing": ("data.packing", _to("data.packing")),
    # the two decide data.loss_on with the rows' format, which SFTTrainer reads (sft_loss_on)
    "completion_only_loss": ("data.loss_on (prompt/completion rows)", lambda value, settings: {}),
    "assistant_only_loss": ("data.loss_on", lambda value, settings: {}),
    "dataset_text_field": ("data.text_key", _to("data.text_key")),
    "dataset_kwargs": ("(only skip_prepare_dataset=False)", _dataset_kwargs),
    "chat_template_path": ("data.chat_template", _chat_template_path),
}
"""TRL's SFTConfig names of the rows and their loss, which DPOConfig and RewardConfig do not take from it."""

MOE_LOSS_SETTING: dict[str, Override] = {
    "router_aux_loss_coef": ("trainer.router_aux_loss_coef (None: declared)",
                             _router_aux_loss_coef("trainer.router_aux_loss_coef")),
}
"""TRL's SFTConfig's and DPOConfig's router_aux_loss_coef (RewardConfig has none: TRL's RewardTrainer adds no aux
loss)."""

SFT_SETTINGS: dict[str, Override] = {
    **UNUSED_BY_EVERY_TRAINER,
    **MOE_LOSS_SETTING,
    "output_dir": ("trainer.output_dir", _to("trainer.output_dir")),
    **_optimizer_settings("optim"),
    "max_grad_norm": ("trainer.grad_clip", _to("trainer.grad_clip")),
    **SFT_DATA_SETTINGS,
    **RUN_SETTINGS,
    "per_device_train_batch_size": ("data.batch_size (with gradient_accumulation_steps)", lambda value, settings: {}),
    "gradient_accumulation_steps": ("data.batch_size (with per_device_train_batch_size)", lambda value, settings: {}),
    "per_device_eval_batch_size": ("data.val_batch_size", lambda value, settings: {
        "data.val_batch_size": value} if evaluates(settings) else {}),
}


class _TrainingArguments:
    """Settings under TRL's names, checked by name when made; ``overrides`` holds reinforge's own keys."""

    SETTINGS: dict[str, Override] = {}
    TRL_DEFAULTS: dict[str, Any] = {}
    """TRL's defaults where reinforge's own would make another run: applied where the setting is not given."""

    def __init__(self, overrides: Mapping[str, Any] | Sequence[str] | None = None, **settings: Any) -> None:
        for name in settings:
            if name not in self.SETTINGS and name in NO_COUNTERPART:
                raise TypeError(f"{type(self).__name__}({name}=...): TRL's {name} has no counterpart here, "
                                f"{NO_COUNTERPART[name]}; remove it")
            if name not in self.SETTINGS:
                close = difflib.get_close_matches(name, list(self.SETTINGS), n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                raise TypeError(f"{type(self).__name__} has no setting {name!r}; {hint}it takes TRL's names "
                                f"(the {len(self.SETTINGS)} of sorted({type(self).__name__}.SETTINGS)), and reinforge's "
                                "own keys as overrides={'rollout.top_p': 0.9}")
        self.settings = dict(settings)
        self.overrides = overrides

    def __getattr__(self, name: str) -> Any:
        if name in type(self).SETTINGS:
            return self.__dict__.get("settings", {}).get(name, self.TRL_DEFAULTS.get(name))
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        """``args.max_steps = 10`` after the config is made (as scripts do to a TRL config) sets the setting."""
        if name in ("settings", "overrides"):
            object.__setattr__(self, name, value)
        elif name in type(self).SETTINGS:
            self.settings[name] = value
        else:
            close = difflib.get_close_matches(name, list(type(self).SETTINGS), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise AttributeError(f"{type(self).__name__} has no setting {name!r}; {hint}it takes TRL's names, and "
                                 "reinforge's own keys as overrides={'rollout.top_p': 0.9}")

    def __repr__(self) -> str:
        shown = ", ".join(f"{key}={value!r}" for key, value in self.settings.items())
        return f"{type(self).__name__}({shown}{', overrides=' + repr(self.overrides) if self.overrides else ''})"

    def with_defaults(self) -> dict[str, Any]:
        """The settings given, over TRL's defaults (``TRL_DEFAULTS``)."""
        return self.TRL_DEFAULTS | self.settings

    def to_overrides(self) -> dict[str, Any]:
        """reinforge's keys -> values: TRL's names (given, or TRL's defaults) mapped, then ``overrides`` (which
        win)."""
        settings = self.with_defaults()
        mapped: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name, value in sorted(settings.items(), key=lambda item: item[0] in APPLIED_LAST):
            try:
                keys = self.SETTINGS[name][1](value, settings)
            except TypeError as error:  # None or another type where the mapping does arithmetic on a number
                raise ValueError(f"{name}={value!r} is not a value {type(self).__name__} can use ({error})") from None
            mapped |= keys
            sources |= dict.fromkeys(keys, self._given(name))
        object.__setattr__(self, "_sources", sources)
        return mapped | _overrides_dict(self.overrides)

    def _given(self, *names: str) -> str:
        """``name=value`` of TRL's settings, for a message; a setting not given is TRL's default."""
        return ", ".join(f"{name}={self.with_defaults().get(name)!r}"
                         + ("" if name in self.settings else " (TRL's default)") for name in names)

    def setting_sources(self) -> dict[str, str]:
        """reinforge's key -> the TRL settings (``name=value``) it was made from, as the last ``to_overrides``
        mapped them (``overrides`` excluded: they are reinforge's keys already)."""
        given = _overrides_dict(self.overrides)
        return {key: source for key, source in self.__dict__.get("_sources", {}).items() if key not in given}


class GRPOConfig(_TrainingArguments):
    """A GRPO run's settings under TRL's names (``GRPO_SETTINGS``): learning_rate, num_generations,
    max_completion_length, per_device_train_batch_size (completions per optimizer step, with
    gradient_accumulation_steps; steps_per_generation for several a generation), beta, epsilon, loss_type,
    num_iterations, temperature, output_dir, max_steps (optimizer steps, as in TRL), save_steps, seed,
    reward_weights...; TRL's defaults where a setting is not given (``TRL_DEFAULTS``)."""

    SETTINGS = GRPO_SETTINGS
    TRL_DEFAULTS = {"max_completion_length": 512, "per_device_train_batch_size": TRL_PER_DEVICE_TRAIN_BATCH_SIZE,
                    "num_train_epochs": 3, "weight_decay": 0.0, "seed": 42, "lr_scheduler_type": "linear",
                    "delta": None, "eval_on_start": False, "router_aux_loss_coef": None, "scale_rewards": "group"}

    def to_overrides(self) -> dict[str, Any]:
        mapped = super().to_overrides()
        settings, given = self.with_defaults(), _overrides_dict(self.overrides)
        if mapped.get("algorithm.adv_estimator", "grpo") not in GRPO_EPSILON_READERS and \
                "algorithm.grpo_epsilon" not in given:  # another estimator, which reads no std's epsilon
            mapped.pop("algorithm.grpo_epsilon", None)
            self._sources.pop("algorithm.grpo_epsilon", None)
        if "data.train_batch_size" in given:
            return mapped
        generations = int(settings.get("num_generations") or mapped.get("rollout.n") or 8)
        batches, updates = _generation_batches(settings, generations)
        mapped |= batches
        self._sources.update(dict.fromkeys(batches, self._given(
            "per_device_train_batch_size", *(name for name in ("gradient_accumulation_steps", "steps_per_generation",
                                                               "generation_batch_size") if name in self.settings),
            "num_generations")))
        updates *= int(mapped.get("actor.ppo_epochs", 1))
        for name, key in (("max_steps", "trainer.total_steps"), ("save_steps", "trainer.save_every"),
                          ("eval_steps", "trainer.test_every")):
            if updates > 1 and mapped.get(key) and key not in given:
                mapped[key] = _in_generations(name, mapped[key], updates)
        return mapped


def _generation_batches(settings: Mapping[str, Any], generations: int) -> tuple[dict[str, Any], int]:
    """data.train_batch_size (prompts a generation) and actor.mini_batch_size (prompts an optimizer step) from TRL's
    per_device_train_batch_size, gradient_accumulation_steps and steps_per_generation (or generation_batch_size);
    with the optimizer steps one generation makes (before num_iterations)."""
    per_device = int(settings.get("per_device_train_batch_size") or TRL_PER_DEVICE_TRAIN_BATCH_SIZE)
    accumulation = int(settings.get("gradient_accumulation_steps") or 1)
    steps_per_generation, generation_batch = settings.get("steps_per_generation"), settings.get("generation_batch_size")
    if steps_per_generation is not None and generation_batch is not None:
        raise ValueError(f"steps_per_generation={steps_per_generation} and generation_batch_size={generation_batch}: "
                         "set one of them, as in TRL")
    if generation_batch is not None:
        if generation_batch % per_device:
            raise ValueError(f"generation_batch_size={generation_batch} is not a multiple of "
                             f"per_device_train_batch_size={per_device}; make it one")
        steps_per_generation = generation_batch // per_device
    steps_per_generation = int(steps_per_generation or accumulation)
    completions = per_device * steps_per_generation
    if completions % generations:
        factor = "gradient_accumulation_steps" if steps_per_generation == accumulation else "steps_per_generation"
        raise ValueError(f"per_device_train_batch_size x {factor} = {completions} completions a step is not a "
                         f"multiple of num_generations={generations}; make it one (each prompt is answered "
                         "num_generations times)")
    batches: dict[str, Any] = {"data.train_batch_size": completions // generations}
    if steps_per_generation == accumulation:
        return batches, 1
    update = per_device * accumulation
    if steps_per_generation % accumulation or update % generations:
        raise ValueError(f"steps_per_generation={steps_per_generation} with gradient_accumulation_steps={accumulation}: "
                         "reinforge's optimizer steps take whole prompt groups of one generation; make "
                         "steps_per_generation a multiple of gradient_accumulation_steps, and "
                         f"per_device_train_batch_size x gradient_accumulation_steps = {update} a multiple of "
                         f"num_generations={generations}")
    return batches | {"actor.mini_batch_size": update // generations}, steps_per_generation // accumulation


def _in_generations(name: str, optimizer_steps: int, updates: int) -> int:
    """TRL's count of optimizer steps as reinforge's steps, each a generation that makes ``updates`` of them."""
    steps = max(1, math.ceil(optimizer_steps / updates))
    if optimizer_steps % updates and name == "max_steps":
        logger.warning("%s=%d counts optimizer steps, as in TRL; each reinforge step generates once and makes %d "
                       "(num_iterations x steps_per_generation / gradient_accumulation_steps), so it is %d steps (%d "
                       "optimizer steps)", name, optimizer_steps, updates, steps, steps * updates)
    return steps


class SFTConfig(_TrainingArguments):
    """An SFT run's settings under TRL's names (``SFT_SETTINGS``): learning_rate, max_length, packing,
    per_device_train_batch_size (with gradient_accumulation_steps), output_dir, max_steps, save_steps, seed...;
    TRL's defaults where a setting is not given (``TRL_DEFAULTS``)."""

    SETTINGS = SFT_SETTINGS
    TRL_DEFAULTS = {"learning_rate": 2e-5, "per_device_train_batch_size": TRL_PER_DEVICE_TRAIN_BATCH_SIZE,
                    "num_train_epochs": 3, "weight_decay": 0.0, "warmup_ratio": 0.0, "seed": 42, "max_length": 1024,
                    "lr_scheduler_type": "linear", "eval_on_start": False, "router_aux_loss_coef": None}

    def to_overrides(self) -> dict[str, Any]:
        mapped = super().to_overrides()
        rows = _rows_per_step(self.with_defaults())
        if rows is not None and "data.batch_size" not in _overrides_dict(self.overrides):
            mapped["data.batch_size"] = rows
            self._sources["data.batch_size"] = self._given(
                "per_device_train_batch_size", *(["gradient_accumulation_steps"]
                                                 if "gradient_accumulation_steps" in self.settings else []))
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
    **{name: SFT_SETTINGS[name] for name in SFT_SETTINGS if name not in SFT_DATA_SETTINGS | MOE_LOSS_SETTING},
    **UNUSED_BY_PREFERENCE_TRAINERS,
    "per_device_train_batch_size": ("data.batch_size (pairs, with gradient_accumulation_steps)",
                                    lambda value, settings: {}),
    "max_length": ("data.max_length (longer pairs dropped, counted in the log)", lambda value, settings: {
        "data.max_length": _token_limit(value, "pair", "is dropped, counted in the log")}),
}


def _dpo_loss_type(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """TRL's loss_type, a name or a list of names (mixed by loss_weights): reinforge trains one loss."""
    if isinstance(value, list | tuple):
        if len(value) != 1:
            raise ValueError(f"loss_type={list(value)!r}: reinforge dpo trains one loss, not a weighted mix; give one "
                             "of sigmoid, ipo, hinge, robust")
        value = value[0]
    return {"dpo.loss_type": value}


DPO_SETTINGS: dict[str, Override] = {
    **PREFERENCE_SETTINGS,
    **UNUSED_BY_DPO,
    **MOE_LOSS_SETTING,
    "beta": ("dpo.beta", _to("dpo.beta")),
    "loss_type": ("dpo.loss_type (one loss: a name, or TRL's list of one)", _dpo_loss_type),
    "label_smoothing": ("dpo.label_smoothing", _to("dpo.label_smoothing")),
}


REWARD_SETTINGS: dict[str, Override] = {
    **PREFERENCE_SETTINGS,
    "center_rewards_coefficient": ("rm.center_rewards_coefficient", lambda value, settings: {
        "rm.center_rewards_coefficient": float(value or 0.0)}),
}


class DPOConfig(SFTConfig):
    """A DPO run's settings under TRL's names (``DPO_SETTINGS``): beta, loss_type, label_smoothing, learning_rate,
    max_length, per_device_train_batch_size (pairs, with gradient_accumulation_steps), output_dir, max_steps...;
    TRL's defaults where a setting is not given."""

    SETTINGS = DPO_SETTINGS
    TRL_DEFAULTS = {"learning_rate": 1e-6, "per_device_train_batch_size": TRL_PER_DEVICE_TRAIN_BATCH_SIZE,
                    "num_train_epochs": 3, "weight_decay": 0.0, "warmup_ratio": 0.0, "seed": 42,
                    "lr_scheduler_type": "linear", "eval_on_start": False, "router_aux_loss_coef": None}


class RewardConfig(SFTConfig):
    """A reward model's training settings under TRL's names (``REWARD_SETTINGS``): center_rewards_coefficient,
    learning_rate, max_length, per_device_train_batch_size, output_dir, max_steps...; TRL's defaults where a setting is
    not given."""

    SETTINGS = REWARD_SETTINGS
    TRL_DEFAULTS = {name: value for name, value in DPOConfig.TRL_DEFAULTS.items() if name in REWARD_SETTINGS} | {
        "learning_rate": 1e-4}

    def to_overrides(self) -> dict[str, Any]:
        """TRL's RewardTrainer adds no load-balancing loss (its config has no router_aux_loss_coef): neither does
        this one's run, unless overrides set trainer.router_aux_loss_coef."""
        return {"trainer.router_aux_loss_coef": 0.0} | super().to_overrides()


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
