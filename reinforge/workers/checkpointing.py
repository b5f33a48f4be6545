"""Saving and loading a worker's training state: parameters, optimizer, LR schedule.

Files are written into the checkpoint's temporary folder; the trainer makes the folder
visible atomically (see reinforge.trainer.checkpoint), so these writes need no renames. For a
model sharded with FSDP both calls are collective: every rank gathers (or loads) the full
state, only rank 0 writes, and every rank reads the same file back, so a checkpoint does not
depend on the number of ranks that wrote it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from reinforge.config.schema import LoraConfig
from reinforge.engine.distributed import barrier, rank
from reinforge.engine.fsdp import (
    fsdp_units,
    full_model_state,
    full_trained_state,
    full_training_state,
    load_full_training_state,
)
from reinforge.engine.lora import (
    adapter_state,
    lora_scaling,
    merge_lora_weights,
    transposed_layers,
    write_adapter_folder,
)
from reinforge.engine.offload import HostOffloadedAdamW
from reinforge.models import save_hf_folder
from reinforge.models.dropout import restore_config_dropout
from reinforge.models.export import build_as_loaded, cast_state, dtypes_of_built


def save_training_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler, prefix: str = "actor") -> None:
    if fsdp_units(model) or isinstance(optimizer, HostOffloadedAdamW):
        state = full_training_state(model, optimizer)
    else:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({**state, "scheduler": scheduler.state_dict()}, folder / f"{prefix}_state.pt")
    barrier()


def load_training_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler, device: torch.device,
                        prefix: str = "actor") -> None:
    configured = _hyperparameters(optimizer, scheduler)
    path = folder / f"{prefix}_state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {folder} has no {path.name}; it was not written by this trainer "
                                "or is incomplete; pass another trainer.resume path or trainer.resume=never")
    if fsdp_units(model) or isinstance(optimizer, HostOffloadedAdamW):
        state = torch.load(path, map_location="cpu", weights_only=True)
        load_full_training_state(model, optimizer, state)
    else:
        state = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _reapply(optimizer, scheduler, configured)


_HYPERPARAMETERS = ("weight_decay", "betas", "eps")


def _hyperparameters(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict:
    """What this run's config set: base learning rates and AdamW's other settings, per parameter group."""
    return {"base_lrs": list(scheduler.base_lrs),
            "groups": [{key: group[key] for key in _HYPERPARAMETERS if key in group} for group in optimizer.param_groups]}


def _reapply(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
             configured: dict) -> None:
    """After loading a checkpoint's optimizer and schedule, use this run's settings (a resume may change them).

    The loaded state keeps the moments and the step count; the learning rate follows this run's
    ``lr`` through the schedule at the restored step.
    """
    scheduler.base_lrs = list(configured["base_lrs"])
    factors = [lam(scheduler.last_epoch) for lam in scheduler.lr_lambdas] if hasattr(scheduler, "lr_lambdas") else None
    for index, (group, settings) in enumerate(zip(optimizer.param_groups, configured["groups"], strict=True)):
        group.update(settings)
        group["initial_lr"] = configured["base_lrs"][index]
        if factors is not None:
            group["lr"] = configured["base_lrs"][index] * factors[index]
    if factors is not None:
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


def save_sharded_hf_folder(model: nn.Module, model_class: type[nn.Module], tokenizer, out_dir: Path, *,
                           dtype: torch.dtype, lora: LoraConfig | None = None, base_model_path: str = "",
                           optimizer: torch.optim.Optimizer | None = None) -> None:
    """The HF folder of an FSDP-sharded causal LM or classifier: gathered collectively, written by rank 0.

    The weights are written in ``dtype``, the run's compute dtype: the float32 master weights rounded as the
    rollout and the forward passes round them (what a model keeps in float32, DeepSeek's routers, stays float32;
    ``models.export.dtypes_as_loaded``). The resume state (``save_training_state``) keeps the float32 masters.
    With ``lora`` (a LoRA actor) the folder holds the merged weights, and ``adapter/`` next to it
    the adapters alone in peft's format. An offloaded optimizer that trains every parameter lends
    its host master copy (no second float32 copy of the model in host memory: 28 GiB for 7B).
    """
    trains_all = all(parameter.requires_grad for parameter in model.parameters())
    if isinstance(optimizer, HostOffloadedAdamW) and trains_all:
        state = full_trained_state(model, optimizer)
    else:
        state = full_model_state(model)
    if rank() == 0:
        if lora is not None:
            write_adapter_folder(out_dir.parent / "adapter", adapter_state(state), lora, base_model_path,
                                 state)
            merge_lora_weights(state, lora_scaling(lora), transposed_layers(model))
        # built eagerly: a model that picks its attention classes by name at construction (GIT) knows no
        # reinforge_varlen, and the folder is for inference anyway; built once, it also says what stays float32
        config = copy.deepcopy(model.config)
        restore_config_dropout(model, config)
        plain = build_as_loaded(model_class, config, dtype)
        cast_state(state, dtypes_of_built(plain, dtype), dtype)  # before the folder is written: no float32 copy
        plain.load_state_dict(state, assign=True, strict=False)
        plain.tie_weights()
        if getattr(model, "generation_config", None) is not None:  # a classifier (a reward model) has none
            plain.generation_config = model.generation_config
        save_hf_folder(plain, tokenizer, out_dir, dtype=dtype, processor_files_from=base_model_path or None,
                       cast=False)
    barrier()
