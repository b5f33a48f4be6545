"""Whether a causal LM's own forward applies the final soft-cap its config names.

A composite config (a vision-language model's) names its language model's final soft-cap in its text config, and
whether the wrapper's forward applies it depends on the class and the transformers version (Gemma 3's
``Gemma3ForConditionalGeneration`` leaves it out in transformers 5, its text-only ``Gemma3ForCausalLM`` applies it).
The training passes and the native engine compute the logits themselves, so they ask the model: one forward of six
tokens, its logits against its output projection of its last hidden state, capped and not, asked once per model.
"""

from __future__ import annotations

import torch
from torch import nn

ANSWER = "_reinforge_applies_final_softcap"
"""The model attribute the probe keeps its answer in: asked once, before the model is sharded, and read by the
training passes and the rollout engine built on the same model."""


def final_softcap(model: nn.Module, cap: float | None, multiplier: float = 1.0) -> float | None:
    """``cap``, or None where ``model``'s own forward leaves out the cap its composite config's text config names
    (probed once per model, its answer kept: ``ANSWER``); a config that is its own text config keeps ``cap``."""
    if not names_a_text_config_cap(model.config, cap):
        return cap
    answer = getattr(model, ANSWER, None)
    if answer is None:
        answer = _applies_final_softcap(model, cap, multiplier)
        setattr(model, ANSWER, answer)
    return cap if answer else None


def kept_final_softcap(model: nn.Module, cap: float | None) -> float | None:
    """``final_softcap``'s answer where the model was probed, else ``cap``: no forward (the training passes' hot
    path, after sharding)."""
    return None if getattr(model, ANSWER, None) is False else cap


@torch.no_grad()
def _applies_final_softcap(model: nn.Module, cap: float, multiplier: float) -> bool:
    """True when ``model``'s logits are its output projection (times ``multiplier``) capped at ``cap``, False when
    they are the projection uncapped."""
    weight = model.get_output_embeddings().weight
    input_ids = (torch.arange(3, 9, device=weight.device) % weight.shape[0])[None]
    was_training = model.training
    model.eval()
    try:
        output = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    finally:
        model.train(was_training)
    own = output.logits.float()
    plain = torch.nn.functional.linear(output.hidden_states[-1].to(weight.dtype), weight).float() * multiplier
    capped = torch.tanh(plain / cap) * cap
    return bool((own - capped).abs().max() <= (own - plain).abs().max())


def names_a_text_config_cap(config, cap: float | None) -> bool:
    """Whether the model must be asked: a cap is named and the config is not its own text config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return cap is not None and text is not config
