"""The hybrid actor-rollout worker: one policy that generates, scores its own tokens, and trains.

The policy is sharded with FSDP2 (``engine.fsdp``; a group of one on a single device). The
rollout side (``workers.rollout_side``: the rollout engine, how the weights reach it, and
generation) generates under no_grad with the engine awake; training runs with the engine asleep
and the parameters sharded. With ``rollout_only`` the worker is the generating worker of
trainer.separate_rollout: the rollout side alone, on a model that only ``load_rollout_weights`` changes.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from pathlib import Path

import torch

from reinforge.algorithms import ADVANTAGE_ESTIMATORS
from reinforge.config.schema import Config
from reinforge.controller import Dispatch, Worker, register
from reinforge.engine.device import compute_dtype, peak_memory_gb, resolve_device
from reinforge.engine.forward import ScoringPass, response_log_probs, routed_token_weights
from reinforge.engine.fsdp import decoder_layers, shard_model
from reinforge.engine.fused import prepare_for_training
from reinforge.engine.image_embeddings import ImageEmbeddingCache, images_of_step
from reinforge.engine.lora import add_lora, lora_scaling
from reinforge.engine.memory_plan import GiB
from reinforge.engine.moe import (
    pooled_routing_metrics,
    prepare_moe_training,
    trained_aux_loss_coef,
    without_router_logits_output,
)
from reinforge.engine.optim import build_optimizer, build_scheduler
from reinforge.engine.recompute import checkpoint_decoder_layers
from reinforge.engine.train_step import FORWARD_ONLY, ModelUpdate, UpdateSettings
from reinforge.models import load_causal_lm, load_tokenizer
from reinforge.models.dropout import disable_dropout, dropout_line
from reinforge.models.vision import freeze_vision_tower, is_vision_language, run_processor
from reinforge.protocol import Batch
from reinforge.rollout.base import RolloutEngine, SamplingParams
from reinforge.rollout.mismatch import rollout_mismatch_metrics
from reinforge.workers.actor_loss import actor_loss, no_grad_rows
from reinforge.workers.checkpointing import load_training_state, save_sharded_hf_folder, save_training_state
from reinforge.workers.memory_settings import apply_memory_plan, cap_device_memory
from reinforge.workers.rollout_side import RolloutSide, full_weights_on_cpu, rollout_copy_of, seed_for

logger = logging.getLogger(__name__)

__all__ = ["ActorRolloutWorker", "seed_for"]  # seed_for: the off-policy modes seed their requests as generate does


class ActorRolloutWorker(Worker):
    def __init__(self, config: Config, total_training_steps: int, rollout_only: bool = False):
        """``rollout_only``: the generating worker of trainer.separate_rollout (role rollout): the model in the
        compute dtype, no optimizer; its weights arrive by ``load_rollout_weights``."""
        super().__init__()
        self.config = config
        self.device = resolve_device(config.trainer.device)
        apply_memory_plan(config)  # settings still auto (a worker process of its own); a no-op after the trainer's
        cap_device_memory(config, self.device)
        self.tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path,
                                        trust_remote_code=config.model.trust_remote_code)
        if config.data.chat_template:  # saved with every checkpoint's hf/: the model is served in the format it learned
            self.tokenizer.chat_template = config.data.chat_template
        self.processor = run_processor(config.model, config.data)
        """A vision-language model's processor (None for text models), saved with every checkpoint's hf/."""
        if rollout_only:
            self.model = load_causal_lm(config.model.path, dtype=compute_dtype(self.device, config.model.dtype),
                                        device=self.device, trust_remote_code=config.model.trust_remote_code,
                                        attn_implementation=config.model.attn_implementation).eval()
            self.model.requires_grad_(False)
            without_router_logits_output(self.model)
            self.peft_model, self.model_class = None, type(self.model)
            self.rollout_side = RolloutSide.on_rollout_copy(config, self.device, self.tokenizer, self.model)
            return
        offload = config.actor.param_offload
        lora = config.model.lora
        # with LoRA the base is frozen: kept in the compute dtype, only the adapters get float32 masters
        self.model = load_causal_lm(config.model.path,
                                    dtype=compute_dtype(self.device, config.model.dtype) if lora.rank else torch.float32,
                                    device=self.device, trust_remote_code=config.model.trust_remote_code,
                                    attn_implementation=config.model.attn_implementation)
        if dropped := disable_dropout(self.model):
            logger.info(dropout_line(self.model, dropped))
        # off-policy modes: the rollout's own copy, refreshed only by sync_rollout_weights
        rollout_copy = (rollout_copy_of(self.model, compute_dtype(self.device, config.model.dtype))
                        if config.trainer.mode != "sync" and not config.trainer.separate_rollout else None)
        self.router_recorder, moe_line = prepare_moe_training(self.model)  # hooks in place before compiling
        if moe_line:
            logger.info(moe_line)
        self.router_aux_loss_coef = trained_aux_loss_coef(
            self.model, self.router_recorder, config.actor.router_aux_loss_coef, "actor.router_aux_loss_coef")
        freeze_vision_tower(self.model, config.actor.freeze_vision_tower)  # a VLM's encoder; no-op for text models
        prepare_for_training(self.model, self.device)
        checkpointed = config.model.gradient_checkpointing
        checkpoint_decoder_layers(self.model, len(decoder_layers(self.model)) if checkpointed is True else int(checkpointed))
        self.model_class = type(self.model)
        self.max_logits_bytes = int(config.actor.logits_buffer_gib * GiB)  # the same in scoring and training passes
        self.peft_model = None
        """The PeftModel around self.model when model.lora.rank > 0 (engine.lora); self.model is adapted in place."""
        if lora.rank:
            self.peft_model = add_lora(self.model, lora, base_model_path=config.model.path, seed=config.trainer.seed)
            for parameter in self.model.parameters():
                if parameter.requires_grad:
                    parameter.data = parameter.data.float()
        self.rollout_side = (  # before sharding: the engine checks the model class
            RolloutSide.on_training_model(config, self.device, self.tokenizer, self.model, self.peft_model)
            if rollout_copy is None else RolloutSide.on_rollout_copy(config, self.device, self.tokenizer, rollout_copy))
        shard_model(self.model, self.device, config.model.dtype, offload=offload)
        self.model.train()
        self.image_embeddings = (ImageEmbeddingCache(self.model, self.device)
                                 if is_vision_language(self.model.config) else None)
        """A vision-language model's frozen-tower image embeddings, encoded once per step (None for text models)."""
        num_mini_batches = config.data.train_batch_size // (config.actor.mini_batch_size or config.data.train_batch_size)
        self.update_settings = UpdateSettings(
            num_mini_batches=num_mini_batches, epochs=config.actor.ppo_epochs,
            max_tokens_per_micro_batch=config.actor.max_tokens_per_micro_batch,
            grad_clip=config.actor.grad_clip, shuffle=config.actor.shuffle, seed=config.trainer.seed,
            keep_gathered=config.actor.keep_gathered is True)
        self.optimizer = build_optimizer(self.model, config.actor.optim,
                                         offload=config.actor.optimizer_offload and not config.actor.param_offload)
        self.scheduler = build_scheduler(self.optimizer, total_training_steps * num_mini_batches * config.actor.ppo_epochs,
                                         config.actor.optim)

    # ---- rollout ------------------------------------------------------------------
    @property
    def rollout_engine(self) -> RolloutEngine:
        """The engine that generates (``rollout.hf`` or ``rollout.native``), not the training engine of ``engine/``."""
        return self.rollout_side.rollout_engine

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate(self, batch: Batch, sampling: SamplingParams, seed: int = 0) -> Batch:
        """Sample one response per row. Rows sharing a uid form one request with n samples.

        ``sampling``: the parameters of one sample (its n is ignored); each request's seed comes
        from ``seed`` and its uid. With ``request_seed`` and ``sample_index`` columns every row is its own
        request, seeded as given (partial samples), with an optional ``max_tokens`` column capping its length.
        Adds prompts, responses, response_mask, input_ids/attention_mask/position_ids of the
        whole sequence, and rollout_log_probs.
        """
        return self.rollout_side.generate(batch, sampling, seed)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self) -> None:
        """Off-policy modes: copy the current parameters into the rollout's weights (a new policy version)."""
        self.rollout_side.copy_weights_from(self.model, self._lora_scale())

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def rollout_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full parameters in the compute dtype, on the CPU, from rank 0 (None elsewhere), for
        a separate rollout worker's ``load_rollout_weights``."""
        return full_weights_on_cpu(self.model, compute_dtype(self.device, self.config.model.dtype), self.rank,
                                   self._lora_scale())

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def rollout_copy_weights(self) -> dict[str, torch.Tensor] | None:
        """Off-policy modes: the rollout copy's own weights (the last synced version, not the trainer's current ones),
        on the CPU, from rank 0 (None elsewhere); ``load_rollout_weights`` puts them back."""
        model = self.rollout_side.rollout_model
        if model is None or self.rank != 0:
            return None
        return {name: parameter.detach().to("cpu", copy=True) for name, parameter in model.named_parameters()}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_rollout_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The separate rollout worker takes a new policy version (from the actor's ``rollout_weights``)."""
        self.rollout_side.load_weights(weights)

    def _lora_scale(self) -> float | None:
        return lora_scaling(self.config.model.lora) if self.peft_model is not None else None

    # ---- scoring ------------------------------------------------------------------
    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """old_log_probs and entropy (B, R) under the current parameters, at the rollout temperature.

        Also sum_pi_squared (B, R), sum_v pi(v)^2 per position, when algorithm.adv_estimator needs it.
        """
        with_sum_pi_squared = ADVANTAGE_ESTIMATORS[self.config.algorithm.adv_estimator].needs_sum_pi_squared
        self._prepare_images(batch)
        with ScoringPass(self.model, batch, self.config.actor.max_tokens_per_micro_batch, self.device) as scoring:
            for micro in scoring:
                scoring.add(*response_log_probs(self.model, micro, self.config.rollout.temperature, with_entropy=True,
                                                max_logits_bytes=self.max_logits_bytes,
                                                with_sum_pi_squared=with_sum_pi_squared,
                                                image_embeddings=self.image_embeddings))
        log_probs, entropy, *sum_pi_squared = scoring.outputs()
        output = Batch.from_dict(tensors={"old_log_probs": log_probs, "entropy": entropy})
        if with_sum_pi_squared:
            output["sum_pi_squared"] = sum_pi_squared[0]
        if "rollout_log_probs" in batch:
            output.meta["mismatch_metrics"] = rollout_mismatch_metrics(
                log_probs, batch["rollout_log_probs"], batch["response_mask"])
        return output

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """ref_log_probs (B, R) with LoRA: the base model is the actor with its adapters disabled (no second copy)."""
        if self.peft_model is None:
            raise RuntimeError("compute_ref_log_prob on the actor needs model.lora.rank > 0; without LoRA the "
                               "reference policy is its own worker (workers.reference)")
        self._prepare_images(batch)  # the adapters leave a frozen tower alone: its embeddings are the base model's
        with (self.peft_model.disable_adapter(),
              ScoringPass(self.model, batch, self.config.actor.max_tokens_per_micro_batch, self.device) as scoring):
            for micro in scoring:
                scoring.add(response_log_probs(self.model, micro, self.config.rollout.temperature,
                                               max_logits_bytes=self.max_logits_bytes,
                                               image_embeddings=self.image_embeddings)[0])
        (log_probs,) = scoring.outputs()
        return Batch.from_dict(tensors={"ref_log_probs": log_probs})

    def _prepare_images(self, batch: Batch) -> None:
        """A frozen tower encodes the batch's images not encoded yet this step (``engine.image_embeddings``); they
        stay for the step's update."""
        if self.image_embeddings is not None:
            self.image_embeddings.prepare(batch)

    # ---- training -----------------------------------------------------------------
    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """Policy-gradient update over the batch; returns ``actor/*`` metrics. The step's image embeddings
        (``engine.image_embeddings``) are dropped after it."""
        on_policy = "old_log_probs" not in batch and "proximal_alpha" not in batch
        compared: list[tuple[torch.Tensor, ...]] = []  # every micro-batch's (training, rollout, mask) log-probs
        settings = replace(self.update_settings, seed=self.update_settings.seed + self.scheduler.last_epoch)
        update = ModelUpdate(self.model, self.optimizer, self.scheduler, settings, self.device)
        recorder = self.router_recorder
        routed = None  # (layers, experts) slots of the whole update on this rank
        with images_of_step(self.image_embeddings, batch):
            for micro, counts in update.micro_batches(batch, no_grad_rows(self.config, batch,
                                                                          self.router_aux_loss_coef)):
                forward_only = micro.meta.get(FORWARD_ONLY, False)
                with torch.no_grad() if forward_only else contextlib.nullcontext():
                    with recorder.recording_forward() if recorder else contextlib.nullcontext():
                        log_probs, entropy = response_log_probs(self.model, micro, self.config.rollout.temperature,
                                                                with_entropy=True,
                                                                max_logits_bytes=self.max_logits_bytes,
                                                                image_embeddings=self.image_embeddings)
                    router = (recorder.take(with_grad=bool(self.router_aux_loss_coef) and not forward_only,
                                            token_weights=routed_token_weights(self.model, micro))
                              if recorder else None)
                    if router is not None:
                        slots = router.expert_counts.detach()
                        routed = slots if routed is None else routed + slots
                    loss, metrics = actor_loss(self.config, micro, counts, log_probs, entropy, on_policy, router,
                                               self.router_aux_loss_coef)
                if on_policy and "rollout_log_probs" in micro:
                    # compared after the update: reading it back here would stall the device mid-update
                    compared.append((log_probs.detach(), micro["rollout_log_probs"], micro["response_mask"]))
                if forward_only:  # every advantage of these rows is 0: their loss has no gradient
                    update.record(metrics)
                else:
                    update.backward(loss, metrics)
        result = update.metrics("actor")
        if recorder is not None and routed is not None:  # every rank ran at least one micro-batch: all reach it
            result |= pooled_routing_metrics(routed, "actor")
        if compared:  # over every response token of the rank's rows, forward-only ones included
            training, rollout = (torch.cat([pair[side].float().cpu()[pair[2].bool().cpu()] for pair in compared])
                                 for side in (0, 1))
            result |= rollout_mismatch_metrics(training, rollout, torch.ones_like(training, dtype=torch.bool))
        return result | peak_memory_gb(self.device)

    # ---- state ----------------------------------------------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str) -> None:
        """Collective: every rank gathers its shards; rank 0 writes actor_state.pt and hf/."""
        save_training_state(Path(folder), self.model, self.optimizer, self.scheduler)
        save_sharded_hf_folder(self.model, self.model_class, self.processor or self.tokenizer, Path(folder) / "hf",
                               dtype=compute_dtype(self.device, self.config.model.dtype),
                               lora=self.config.model.lora if self.peft_model is not None else None,
                               base_model_path=self.config.model.path, optimizer=self.optimizer)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        load_training_state(Path(folder), self.model, self.optimizer, self.scheduler, self.device)

