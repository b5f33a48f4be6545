"""The reference policy: a frozen copy of the starting model, for KL terms only.

Sharded with FSDP2 like the actor. With ``ref.offload`` its weights stay on the CPU and each
layer's are copied to the device just before that layer runs, so the reference costs almost
no device memory between calls.
"""

from __future__ import annotations

import torch

from reinforge.config.schema import Config
from reinforge.controller import Dispatch, Worker, register
from reinforge.engine.device import resolve_device
from reinforge.engine.forward import response_log_probs
from reinforge.engine.fsdp import reshard, shard_model
from reinforge.engine.fused import prepare_for_training
from reinforge.engine.micro_batches import iter_balanced_micro_batches, rows_in_batch_order
from reinforge.models import load_causal_lm
from reinforge.protocol import Batch


class ReferenceWorker(Worker):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.device = resolve_device(config.trainer.device)
        self.model = load_causal_lm(config.model.path, dtype=torch.float32,
                                    device="cpu" if config.ref.offload else self.device,
                                    trust_remote_code=config.model.trust_remote_code,
                                    attn_implementation=config.model.attn_implementation)
        self.model.eval().requires_grad_(False)
        prepare_for_training(self.model, self.device, config.model.fused_kernels,
                             config.model.compile_layers, config.model.packed_attention_layout)
        shard_model(self.model, self.device, config.model.dtype, offload=config.ref.offload)
        self.max_tokens = config.ref.max_tokens_per_micro_batch or config.actor.max_tokens_per_micro_batch

    @register(dispatch=Dispatch.DP_COMPUTE)
    @torch.no_grad()
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """ref_log_probs (B, R) of the response tokens under the frozen reference policy."""
        temperature = batch.meta.get("temperature", 1.0)
        pieces, log_probs = [], []
        for micro in iter_balanced_micro_batches(batch, self.max_tokens, share_prompts=self.config.model.share_prompts):
            pieces.append(micro)
            log_probs.append(response_log_probs(self.model, micro.to(self.device), temperature)[0])
        reshard(self.model)
        return Batch.from_dict(tensors={"ref_log_probs": rows_in_batch_order(pieces, log_probs, len(batch),
                                                                             batch["responses"].shape[1])})
