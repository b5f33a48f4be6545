"""The critic: an HF model with a scalar value head, trained with the clipped value loss."""

from __future__ import annotations

from pathlib import Path

import torch

from reinforge.algorithms import compute_value_loss
from reinforge.config.schema import Config
from reinforge.controller import Dispatch, Worker, register
from reinforge.engine.device import autocast_context, resolve_device
from reinforge.engine.forward import response_values
from reinforge.engine.micro_batches import split_by_token_budget
from reinforge.engine.optim import build_optimizer, build_scheduler
from reinforge.engine.train_step import UpdateSettings, run_update
from reinforge.models import ValueModel
from reinforge.protocol import Batch
from reinforge.workers.checkpointing import load_training_state, save_training_state


class CriticWorker(Worker):
    def __init__(self, config: Config, total_training_steps: int):
        super().__init__()
        self.config = config
        critic = config.critic
        self.device = resolve_device(config.trainer.device)
        self.model = ValueModel.from_pretrained(critic.model_path or config.model.path, dtype=torch.float32,
                                                device=self.device)
        self.model.train()
        num_mini_batches = config.data.train_batch_size // (config.actor.mini_batch_size or config.data.train_batch_size)
        epochs = critic.ppo_epochs or config.actor.ppo_epochs
        self.max_tokens = critic.max_tokens_per_micro_batch or config.actor.max_tokens_per_micro_batch
        self.update_settings = UpdateSettings(num_mini_batches=num_mini_batches, epochs=epochs,
                                              max_tokens_per_micro_batch=self.max_tokens, grad_clip=critic.grad_clip,
                                              shuffle=config.actor.shuffle, seed=config.trainer.seed)
        self.optimizer = build_optimizer(self.model, critic.optim)
        self.scheduler = build_scheduler(self.optimizer, total_training_steps * num_mini_batches * epochs, critic.optim)

    @register(dispatch=Dispatch.DP_COMPUTE)
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """values (B, R): the critic's estimate before each response token."""
        width = batch["responses"].shape[1]
        pieces = []
        self.model.eval()
        for micro in split_by_token_budget(batch, self.max_tokens):
            with autocast_context(self.device, self.config.model.dtype):
                values = response_values(self.model, micro.to(self.device))
            pieces.append(torch.nn.functional.pad(values.cpu(), (0, width - values.shape[1])))
        self.model.train()
        return Batch.from_dict(tensors={"values": torch.cat(pieces)})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        critic = self.config.critic

        def loss_fn(micro: Batch, normalizer) -> tuple[torch.Tensor, dict[str, float]]:
            with autocast_context(self.device, self.config.model.dtype):
                values = response_values(self.model, micro)
            loss, clipfrac = compute_value_loss(values, micro["values"], micro["returns"], micro["response_mask"],
                                                critic.cliprange_value, critic.loss_agg_mode, normalizer)
            mask = micro["response_mask"]
            vpred_mean = float((values.detach() * mask).sum() / mask.sum().clamp(min=1))
            return loss, {"vf_loss": float(loss.detach()), "vf_clipfrac": float(clipfrac), "vpred_mean": vpred_mean}

        metrics = run_update(self.model, self.optimizer, self.scheduler, batch, loss_fn, self.update_settings, self.device)
        return {f"critic/{key}": value for key, value in metrics.items()}

    @register(dispatch=Dispatch.RANK_ZERO)
    def save_checkpoint(self, folder: str) -> None:
        save_training_state(Path(folder), self.model, self.optimizer, self.scheduler, prefix="critic")

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        load_training_state(Path(folder), self.model, self.optimizer, self.scheduler, self.device, prefix="critic")
