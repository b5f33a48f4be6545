"""The critic: an HF model with a scalar value head, trained with the clipped value loss.

Sharded like the actor (FSDP2, one unit per decoder layer); the backbone and the value head
are the two root units, since the packed forward calls them one after the other.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from reinforge.algorithms import LossNormalizer, compute_value_loss
from reinforge.config.schema import Config
from reinforge.controller import Dispatch, Worker, register
from reinforge.engine.device import resolve_device
from reinforge.engine.forward import ScoringPass, response_values
from reinforge.engine.fsdp import shard_model
from reinforge.engine.fused import prepare_for_training
from reinforge.engine.optim import build_optimizer, build_scheduler
from reinforge.engine.train_step import ModelUpdate, UpdateSettings
from reinforge.models import ValueModel
from reinforge.models.dropout import disable_dropout, dropout_line
from reinforge.models.vision import freeze_vision_tower
from reinforge.protocol import Batch
from reinforge.workers.checkpointing import load_training_state, save_training_state
from reinforge.workers.memory_settings import apply_memory_plan

logger = logging.getLogger(__name__)


class CriticWorker(Worker):
    def __init__(self, config: Config, total_training_steps: int):
        super().__init__()
        self.config = config
        critic = config.critic
        self.device = resolve_device(config.trainer.device)
        apply_memory_plan(config)  # a no-op when the trainer or this process planned already
        self.model = ValueModel.from_pretrained(critic.model_path or config.model.path, dtype=torch.float32,
                                                device="cpu" if critic.param_offload else self.device,
                                                gradient_checkpointing=bool(config.model.gradient_checkpointing),
                                                trust_remote_code=config.model.trust_remote_code,
                                                key="critic.model_path" if critic.model_path else "model.path")
        if dropped := disable_dropout(self.model.backbone):
            logger.info(dropout_line(self.model.backbone, dropped))
        # the critic reads text only: a vision-language backbone's tower gets no gradient (and an offloaded optimizer's
        # zero-gradient step would decay it), so it is frozen, as the actor's is by default
        freeze_vision_tower(self.model.backbone)
        prepare_for_training(self.model.backbone, self.device)
        shard_model(self.model, self.device, config.model.dtype, offload=critic.param_offload,
                    roots=[self.model.backbone, self.model.value_head])
        self.model.train()
        num_mini_batches = config.data.train_batch_size // (config.actor.mini_batch_size or config.data.train_batch_size)
        epochs = critic.ppo_epochs or config.actor.ppo_epochs
        self.max_tokens = critic.max_tokens_per_micro_batch or config.actor.max_tokens_per_micro_batch
        self.update_settings = UpdateSettings(num_mini_batches=num_mini_batches, epochs=epochs,
                                              max_tokens_per_micro_batch=self.max_tokens, grad_clip=critic.grad_clip,
                                              shuffle=config.actor.shuffle, seed=config.trainer.seed)
        self.optimizer = build_optimizer(self.model, critic.optim,
                                         offload=critic.optimizer_offload and not critic.param_offload)
        self.scheduler = build_scheduler(self.optimizer, total_training_steps * num_mini_batches * epochs, critic.optim)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch:
        """values (B, R): the critic's estimate before each response token."""
        with ScoringPass(self.model, batch, self.max_tokens, self.device) as scoring:
            for micro in scoring:
                scoring.add(response_values(self.model, micro))
        (values,) = scoring.outputs()
        return Batch.from_dict(tensors={"values": values})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        critic = self.config.critic
        update = ModelUpdate(self.model, self.optimizer, self.scheduler, self.update_settings, self.device)
        scale_factor = critic.loss_scale_factor if critic.loss_scale_factor is not None \
            else self.config.actor.loss_scale_factor
        for micro, counts in update.micro_batches(batch):
            values = response_values(self.model, micro)
            mask = micro["response_mask"]
            loss, clipfrac = compute_value_loss(values, micro["values"], micro["returns"], mask, critic.cliprange_value,
                                                critic.loss_agg_mode, LossNormalizer.of_counts(counts, scale_factor))
            vpred_mean = (values.detach() * mask).sum() / mask.sum().clamp(min=1)
            update.backward(loss, {"vf_loss": loss, "vf_clipfrac": clipfrac, "vpred_mean": vpred_mean})
        return update.metrics("critic")

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str) -> None:
        save_training_state(Path(folder), self.model, self.optimizer, self.scheduler, prefix="critic")

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        load_training_state(Path(folder), self.model, self.optimizer, self.scheduler, self.device, prefix="critic")
