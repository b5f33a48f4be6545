"""The reference policy: a frozen copy of the starting model, for KL terms only.

Sharded with FSDP2 like the actor. With ``ref.param_offload`` its weights stay on the CPU and each
layer's are copied to the device just before that layer runs, so the reference costs almost
no device memory between calls.
"""

from __future__ import annotations

from reinforge.config.schema import Config
from reinforge.controller import Dispatch, Worker, register
from reinforge.engine.device import compute_dtype, resolve_device
from reinforge.engine.forward import ScoringPass, response_log_probs
from reinforge.engine.fsdp import shard_model
from reinforge.engine.fused import prepare_for_training
from reinforge.engine.image_embeddings import ImageEmbeddingCache, images_of_step
from reinforge.models import load_causal_lm
from reinforge.models.vision import is_vision_language
from reinforge.protocol import Batch
from reinforge.workers.memory_settings import apply_memory_plan


class ReferenceWorker(Worker):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.device = resolve_device(config.trainer.device)
        apply_memory_plan(config)  # a no-op when the trainer or this process planned already
        # frozen: no float32 master copy, the weights are loaded in the dtype the layers compute in
        self.model = load_causal_lm(config.model.path, dtype=compute_dtype(self.device, config.model.dtype),
                                    device="cpu" if config.ref.param_offload else self.device,
                                    trust_remote_code=config.model.trust_remote_code,
                                    attn_implementation=config.model.attn_implementation)
        self.model.eval().requires_grad_(False)
        prepare_for_training(self.model, self.device)
        shard_model(self.model, self.device, config.model.dtype, offload=config.ref.param_offload)
        self.max_tokens = config.ref.max_tokens_per_micro_batch or config.actor.max_tokens_per_micro_batch
        self.image_embeddings = (ImageEmbeddingCache(self.model, self.device)
                                 if is_vision_language(self.model.config) else None)
        """A vision-language model's image embeddings: its tower runs once per image of a batch."""

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """ref_log_probs (B, R) of the response tokens under the frozen reference policy, at the rollout temperature."""
        with (images_of_step(self.image_embeddings, batch),
              ScoringPass(self.model, batch, self.max_tokens, self.device) as scoring):
            for micro in scoring:
                scoring.add(response_log_probs(self.model, micro, self.config.rollout.temperature,
                                               image_embeddings=self.image_embeddings)[0])
        (log_probs,) = scoring.outputs()
        return Batch.from_dict(tensors={"ref_log_probs": log_probs})
