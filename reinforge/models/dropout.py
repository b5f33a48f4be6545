"""Dropout in a loaded model: where it is on, and switching it off.

A checkpoint's config may ask for dropout (GPT-2's ``resid_pdrop``, OPT's ``dropout``, a fine-tune's
``attention_dropout``). Its modules then drop activations in training mode through ``nn.Dropout`` modules, float
attributes handed to ``nn.functional.dropout`` (OPT's layers) or the attention function's ``dropout`` argument
(read from the module's ``attention_dropout``). RL compares the training forward's log-probs with the rollout's
(the policy ratio, the mismatch metrics), and the rollout never drops, so the RL workers switch it all off; so do
``reinforge rm`` and ``dpo``, as TRL's reward and DPO trainers do by default. A module that draws at random in
training mode without a rate (PhiMoE's router samples its experts) is kept in eval mode instead.
"""

from __future__ import annotations

import functools

from torch import nn

from reinforge.models.architectures import config_and_text_config

RATE_WORDS = ("dropout", "pdrop", "jitter", "layerdrop")
"""A config key or module attribute holding a dropout rate has one of these in its name (Mixtral's
``router_jitter_noise`` / its MoE block's ``jitter_noise`` multiplies the MoE input by noise in training mode only;
OPT's ``layerdrop``, BART's ``decoder_layerdrop`` skip whole decoder layers at random in training mode)."""


NOT_RATES = {"Phimoe": ("router_jitter_noise",)}
"""Keys a family's config or modules (by class-name prefix) name like a rate that are not one: PhiMoE's router reads
``router_jitter_noise`` as the threshold below the top score past which it masks experts, in eval mode as in
training; set to 0 it routes otherwise (its noise in training mode is ``input_jitter_noise``)."""


SAMPLED_IN_TRAINING = {"PhimoeTopKRouter": "samples its experts in training mode"}
"""Module classes that draw at random in training mode with no rate to set to 0: PhiMoE's router picks each token's
experts by Gumbel sampling over its masked scores in training mode (SparseMixer) where eval mode takes the top ones,
so a training forward would route otherwise than the rollout that sampled the tokens. ``disable_dropout`` keeps such
modules in eval mode for good; their gradients (through the chosen experts' softmax weights) still flow."""


def _stay_in_eval_mode(module: nn.Module, mode: bool = True) -> nn.Module:
    """A pinned module's ``train``: eval mode whatever ``mode`` asks (``model.train()`` reaches it through its
    parents). A ``functools.partial`` of this module-level function, so the model still pickles and deep-copies."""
    return nn.Module.train(module, False)


def _samples_in_training(module: nn.Module) -> str | None:
    """What ``module`` draws at random in training mode (``SAMPLED_IN_TRAINING``), None when nothing or pinned."""
    pinned = module.__dict__.get("train")
    if isinstance(pinned, functools.partial) and pinned.func is _stay_in_eval_mode:
        return None
    return SAMPLED_IN_TRAINING.get(type(module).__name__)


def _is_rate(name: str, value) -> bool:
    return (any(word in name for word in RATE_WORDS) and isinstance(value, float)
            and not isinstance(value, bool) and value > 0)


def _not_rates(owner) -> tuple[str, ...]:
    name = type(owner).__name__
    return next((keys for prefix, keys in NOT_RATES.items() if name.startswith(prefix)), ())


def _configs(model: nn.Module) -> list:
    """The model's config and its text config, once each (a vision-language model has both)."""
    config = getattr(model, "config", None)
    return [] if config is None else config_and_text_config(config)


def _rates(owner) -> list[tuple[str, float]]:
    """The dropout rates above 0 among an object's public attributes (a config's keys, a module's floats)."""
    kept = _not_rates(owner)
    return [(key, value) for key, value in vars(owner).items()
            if not key.startswith("_") and key not in kept and _is_rate(key, value)]


def active_dropout(model: nn.Module) -> list[str]:
    """Each place ``model`` drops activations in training mode: config keys, modules' rates, dropout modules."""
    found = [f"config.{key}={value}" for config in _configs(model) for key, value in _rates(config)]
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            found.append(f"{name or 'model'} (p={module.p})")
        found += [f"{name}.{key}={value}" for key, value in _rates(module)]
        if sampled := _samples_in_training(module):
            found.append(f"{name} ({sampled})")
    return found


ORIGINAL_RATES = "_reinforge_config_dropout"
"""Set on a model by ``disable_dropout``: {id(config): {key: rate}} of the config rates it set to 0."""


def restore_config_dropout(model: nn.Module, config) -> None:
    """Put the rates ``disable_dropout`` zeroed back into ``config``, a deep copy of ``model.config`` about to be
    saved (hf/ and export keep the checkpoint's own dropout settings for later fine-tuning)."""
    originals = getattr(model, ORIGINAL_RATES, {})
    pairs = [(config, model.config)]
    if hasattr(config, "get_text_config"):
        pairs.append((config.get_text_config(), model.config.get_text_config()))
    for copied, live in pairs:
        for key, value in originals.get(id(live), {}).items():
            setattr(copied, key, value)


def disable_dropout(model: nn.Module) -> list[str]:
    """Set every dropout rate of ``model`` (config, modules, dropout modules) to 0 and keep the modules that sample
    in training mode (``SAMPLED_IN_TRAINING``) in eval mode; returns what was on (``active_dropout``'s list, config
    keys first), empty when nothing was."""
    found = active_dropout(model)
    originals = getattr(model, ORIGINAL_RATES, {})
    for config in _configs(model):
        originals.setdefault(id(config), dict(_rates(config)))
    if any(originals.values()):
        object.__setattr__(model, ORIGINAL_RATES, originals)  # not a module attribute torch tracks
    for owner in [*_configs(model), *model.modules()]:
        if isinstance(owner, nn.Dropout):
            owner.p = 0.0
        for key, _ in _rates(owner):
            setattr(owner, key, 0.0)
        if isinstance(owner, nn.Module) and _samples_in_training(owner):
            owner.train = functools.partial(_stay_in_eval_mode, owner)
            owner.train()
    return found


RL_REASON = ("RL", "the policy ratio compares training log-probs with the rollout's, which never drops")
PREFERENCE_REASON = ("rm and dpo", "as TRL's reward and DPO trainers do by default (disable_dropout=True); DPO "
                                   "compares the policy's log-probs with the reference's, scored without dropout")


def dropout_line(model: nn.Module, found: list[str], reason: tuple[str, str] = RL_REASON) -> str:
    """The one line a worker or trainer logs when it switched dropout off; ``reason``: (for what, why)."""
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    sampled = [each for each in found if each.endswith(tuple(f"({what})" for what in SAMPLED_IN_TRAINING.values()))]
    what = ("drops activations" if not sampled else "samples at random" if len(sampled) == len(found)
            else "drops activations and samples at random")
    return f"dropout off for {reason[0]}: {model_type} {what} in training mode ({shown}); {reason[1]}"
