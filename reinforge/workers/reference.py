"""The reference policy: a frozen copy of the starting model, for KL terms only."""

from __future__ import annotations

import torch

from reinforge.config.schema import Config
from reinforge.controller import Dispatch, Worker, register
from reinforge.engine.device import autocast_context, resolve_device
from reinforge.engine.forward import response_log_probs
from reinforge.engine.micro_batches import split_by_token_budget
from reinforge.models import load_causal_lm
from reinforge.protocol import Batch


class ReferenceWorker(Worker):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.device = resolve_device(config.trainer.device)
        self.model = load_causal_lm(config.model.path, dtype=torch.float32, device=self.device,
                                    trust_remote_code=config.model.trust_remote_code,
                                    attn_implementation=config.model.attn_implementation)
        self.model.eval().requires_grad_(False)
        self.max_tokens = config.ref.max_tokens_per_micro_batch or config.actor.max_tokens_per_micro_batch

    @register(dispatch=Dispatch.DP_COMPUTE)
    @torch.no_grad()
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """ref_log_probs (B, R) of the response tokens under the frozen reference policy."""
        temperature = batch.meta.get("temperature", 1.0)
        width = batch["responses"].shape[1]
        pieces = []
        for micro in split_by_token_budget(batch, self.max_tokens):
            with autocast_context(self.device, self.config.model.dtype):
                log_probs, _ = response_log_probs(self.model, micro.to(self.device), temperature)
            pieces.append(torch.nn.functional.pad(log_probs.cpu(), (0, width - log_probs.shape[1])))
        return Batch.from_dict(tensors={"ref_log_probs": torch.cat(pieces)})
