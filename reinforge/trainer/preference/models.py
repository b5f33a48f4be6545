"""The trained model of ``reinforge dpo`` and ``reinforge rm``, made ready for training as the RL actor is.

After loading (float32 master weights; with ``model.lora`` the frozen base in the compute dtype), a checkpoint's
dropout is switched off (one line names it), as TRL's trainers do by default (``disable_dropout=True``): DPO's
reference log-probs are scored without it, and the loss compares the policy's with them. ``prepare_for_training`` routes attention through the packed varlen path and, on CUDA, swaps in the fused
kernels and compiles the decoder layers; ``model.gradient_checkpointing`` (true, or a number of layers)
recomputes their activations; ``model.lora`` injects adapters (they train in float32, with the whole ``head``
of a classification model: a reward model's ``score``); FSDP2 then shards one decoder layer per unit and each
of ``roots`` (the model, or a reward model's backbone and head, which the packed forward calls apart),
computing in ``model.dtype``, on one device or N.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from reinforge.config.schema import ModelConfig
from reinforge.engine.device import compute_dtype
from reinforge.engine.fsdp import decoder_layers, shard_model
from reinforge.engine.fused import prepare_for_training
from reinforge.engine.lora import add_lora
from reinforge.engine.recompute import checkpoint_decoder_layers
from reinforge.models.dropout import PREFERENCE_REASON, disable_dropout, dropout_line
from reinforge.models.vision import freeze_vision_tower

logger = logging.getLogger(__name__)


def load_dtype(model: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype the trained model loads in: float32 master weights, or with adapters the compute dtype (the frozen
    base keeps no float32 copy)."""
    return compute_dtype(device, model.dtype) if model.lora.rank else torch.float32


def prepare_trained_model(model: nn.Module, config: ModelConfig, device: torch.device, *, seed: int,
                          head: str | None = None, roots: Sequence[nn.Module] | None = None,
                          keep_gathered: bool = False) -> nn.Module | None:
    """Make the loaded ``model`` ready to train, in place (see the module's docstring); returns the PeftModel
    around it with ``model.lora``, else None. ``keep_gathered``: each layer's gathered parameters stay from its
    forward to its backward (the memory plan's choice on one device)."""
    # the preference trainers read text only: a vision-language model's tower gets no gradient, so it is frozen, as
    # the RL actor's is (actor.freeze_vision_tower); unfrozen, LoRA put adapters on its attention (SigLIP's q/k/v_proj)
    # that the optimizer held and the adapter folder shipped, and that never changed
    freeze_vision_tower(model)
    if dropped := disable_dropout(model):
        logger.info(dropout_line(model, dropped, PREFERENCE_REASON))
    prepare_for_training(model, device)
    setting = config.gradient_checkpointing
    checkpoint_decoder_layers(model, len(decoder_layers(model)) if setting is True
                              else 0 if setting in ("auto", False) else int(setting))
    peft_model = None
    if config.lora.rank:
        peft_model = add_lora(model, config.lora, base_model_path=config.path, seed=seed, head=head)
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.float()
    shard_model(model, device, config.dtype, roots=roots, reshard_after_forward=not keep_gathered)
    return peft_model
