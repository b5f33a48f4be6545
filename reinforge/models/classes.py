"""The transformers class that loads a causal LM's config."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from reinforge.models.vision import is_vision_language


def causal_lm_class(config) -> type:
    """The class that loads the causal LM of ``config``: AutoModelForImageTextToText for a vision-language model,
    else ``named_class``'s or AutoModelForCausalLM."""
    if is_vision_language(config):
        return AutoModelForImageTextToText
    return named_class(config) or AutoModelForCausalLM


def named_class(config) -> type | None:
    """For a text config outside transformers' causal-LM table and without code of its own, the transformers class
    its ``architectures`` names for that config class (the text model of a multimodal family, saved with its text
    config, as Emu3's ``emu3_text_model``, which the auto table does not list); None for every other config, which
    an auto class loads, and for an encoder-decoder's (T5's ``T5ForConditionalGeneration``), which writes no text
    as a causal LM: its decoder reads an encoder's output."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if (is_vision_language(config) or type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or getattr(config, "auto_map", None)
            or getattr(config, "is_encoder_decoder", False)):
        return None
    for name in getattr(config, "architectures", None) or ():
        named = getattr(transformers, name, None)
        if isinstance(named, type) and getattr(named, "config_class", None) is type(config):
            return named
    return None
