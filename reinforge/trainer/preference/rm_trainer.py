"""``reinforge rm``: a Bradley-Terry reward model trained on chosen/rejected pairs.

The model is transformers' ``AutoModelForSequenceClassification`` with one label, loaded from ``model.path``: a
causal LM gets a new ``score`` head (seeded by ``trainer.seed``), a sequence classifier keeps its own, and a token
classifier (``AutoModelForTokenClassification``, verl's reward models) stays one, with its head's bias. Its reward
for a sequence is the head at the sequence's last token (EOS included), where the reward-model worker of ``reinforge
train`` reads it. As transformers' sequence classifier reads it, that token is the last one that is not the pad
token: a completion ending in it (an EOS, where the tokenizer has no pad token of its own and pads with its EOS) is
read at the token before, so the exported folder scores as training did (``without_trailing_padding``; one line says
how many); a token classifier's is read at the last token, padding or not. Both completions of a pair go through one
packed forward that computes their prompt once. The model is made ready as DPO's policy is (``preference.models``:
float32 master weights, FSDP2 computing in ``model.dtype`` with the backbone and the head as root units, fused
kernels and compiled decoder layers on CUDA, ``model.gradient_checkpointing``; ``model.lora`` trains adapters and
the whole score head, the base frozen in the compute dtype), on one device or on every rank of a torchrun group
(``preference.ranks``). The loss is ``algorithms.preference_losses.bradley_terry_loss`` (margins from the data's
``margin`` column, centring by ``rm.center_rewards_coefficient``), averaged over the step's pairs.

Metrics (TRL's RewardTrainer's names): ``accuracy`` (the share of pairs whose chosen completion scores higher),
``margin`` (the mean r_chosen - r_rejected), ``min_reward``, ``mean_reward``, ``max_reward`` and ``num_tokens``
(tokens put through the model so far), with ``eval_`` before each on the validation pairs, and ``train/loss``,
``train/lr``, ``train/grad_norm``; a mixture of experts logs its routers' load-balancing loss,
``train/moe/aux_loss`` (transformers' ``output_router_logits`` loss over the pairs' padded rows), which joins the
loss times ``trainer.router_aux_loss_coef`` (by default the model config's ``router_aux_loss_coef`` where its
``output_router_logits`` asks; TRL's RewardTrainer adds none, and ``reinforge.api.RewardConfig`` passes 0), beside
the step's ``train/moe/load_imbalance`` and ``train/moe/unused_experts``. Every checkpoint's ``hf/`` folder is a
standard sequence-classification folder (a token-classification one for a token classifier; ``num_labels=1``,
``pad_token_id`` set; with LoRA the adapters merged in) that ``reward.reward_model.model_path`` loads, and
``reinforge export`` writes the same from the trainer state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

from reinforge.algorithms.preference_losses import bradley_terry_loss
from reinforge.config.preference_schema import RMConfig
from reinforge.data.preference_dataset import PreferenceDataset, PreferencePair
from reinforge.engine.device import compute_dtype
from reinforge.engine.forward import last_token_scores
from reinforge.engine.moe import pooled_routing_metrics, prepare_moe_training, trained_aux_loss_coef
from reinforge.models.loading import (
    NO_HUB_KERNELS,
    HeldLoadReport,
    check_model_folder,
    hub_errors_explained,
    is_local_path,
    read_model_config,
    sdpa_or_eager,
)
from reinforge.models.reward_model import (
    check_score_head,
    classifier_auto_class,
    set_classifier_pad_token_id,
    without_trailing_padding,
)
from reinforge.protocol import Batch
from reinforge.trainer.preference.models import load_dtype, prepare_trained_model
from reinforge.trainer.preference.pairs import PreferenceRun
from reinforge.trainer.preference.ranks import PairValues
from reinforge.workers.checkpointing import save_sharded_hf_folder, save_training_state

logger = logging.getLogger(__name__)

NEW_HEAD = {"score.weight", "score.bias"}
"""The keys a causal LM's folder lacks for a classifier: its new score head."""


def load_reward_model_for_training(path: str, *, pad_token_id: int, trust_remote_code: bool = False,
                                   attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32,
                                   device: torch.device | str = "cpu") -> nn.Module:
    """A one-label classifier from ``path`` in ``dtype`` (``trained_head_class``: a token classifier stays one, its
    score head's bias with it; a causal LM gets a new score head), with the tokenizer's pad id in its config
    (transformers' sequence classifier pools the last token that is not padding)."""
    model_class = trained_head_class(path, trust_remote_code)
    if is_local_path(path):
        attn_implementation = _classifier_attention(path, trust_remote_code, attn_implementation, model_class)
    with hub_errors_explained(path), HeldLoadReport() as report:
        model, loading = model_class.from_pretrained(path, num_labels=1, dtype=dtype,
                                                     trust_remote_code=trust_remote_code,
                                                     attn_implementation=attn_implementation, output_loading_info=True,
                                                     **NO_HUB_KERNELS)
    if set(loading["missing_keys"]) <= NEW_HEAD and not loading["mismatched_keys"] \
            and all(key.startswith("lm_head.") for key in loading["unexpected_keys"]):
        report.records.clear()  # a causal LM under a new head, as expected: one line of ours instead of the table
        if loading["missing_keys"]:
            logger.info("model.path=%s has no score head (a causal LM): %s starts with a new one of one output, drawn "
                        "from trainer.seed", path, type(model).__name__)
    report.release()
    if not isinstance(getattr(model, "score", None), nn.Linear):
        raise ValueError(f"model.path={path} loads as {type(model).__name__}, whose head is not a linear layer named "
                         "'score'; reinforge rm trains transformers' sequence- and token-classification classes")
    model.score.float()  # a new head starts in float32 (its master weights), whatever the backbone's dtype
    set_classifier_pad_token_id(model.config, pad_token_id)  # a vision-language classifier pools by its text config's
    model.config.use_cache = False
    return model.to(device)


def trained_head_class(path: str, trust_remote_code: bool = False) -> type:
    """The Auto class ``reinforge rm`` loads ``path`` with: ``AutoModelForTokenClassification`` for a token classifier
    (verl's reward models, whose score head has a bias that the sequence classifier's lacks), else
    ``AutoModelForSequenceClassification`` (a sequence classifier, or a causal LM under a new head)."""
    if is_local_path(path):
        check_model_folder(path)
    with hub_errors_explained(path):
        config = read_model_config(path, trust_remote_code)
    return classifier_auto_class(config) or AutoModelForSequenceClassification


def _classifier_attention(path: str, trust_remote_code: bool, attn_implementation: str, model_class: type) -> str:
    """The attention implementation the classifier of the model at ``path`` runs (``model_class``, an Auto class;
    ``sdpa`` becomes ``eager`` for a class without SDPA, MPT's); a family without such a class, or a classifier of
    several labels, is refused in one line, before any weight loads."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
        MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING,
    )

    config = read_model_config(path, trust_remote_code)
    heads = [name for name in getattr(config, "architectures", None) or []
             if name.endswith(("ForSequenceClassification", "ForTokenClassification"))]
    if heads and config.num_labels != 1:
        raise ValueError(f"model.path={path} is a {heads[0]} with num_labels={config.num_labels}; reinforge rm trains a "
                         "head of one label, so start from the causal LM it was made from, or from a classifier with "
                         "num_labels=1")
    if trust_remote_code and getattr(config, "auto_map", None):
        return attn_implementation  # the folder's own code decides
    token = model_class is AutoModelForTokenClassification
    mapping = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING if token else MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
    classifier = mapping.get(type(config), None)
    if classifier is None:
        raise ValueError(f"model.path={path} is a {config.model_type!r} model, for which transformers has no "
                         f"{'token' if token else 'sequence'}-classification class ({model_class.__name__}); "
                         "reinforge rm trains a one-label head on that class, so start from a model of a family that "
                         "has one (Llama, Qwen2/3, Mistral, Gemma, Phi-3, GPT-2, ...)")
    check_score_head(model_class, config, "model.path", path, "start from a decoder (a causal LM of Llama, Qwen, "
                     "Mistral, Gemma, Phi-3, GPT-2, ...) or from its one-label classifier")
    return sdpa_or_eager(classifier, attn_implementation, config)


class RewardModelTrainer(PreferenceRun):
    config: RMConfig

    def __init__(self, config: RMConfig):
        self.num_tokens = 0.0
        self.peft_model: nn.Module | None = None
        super().__init__(config)

    def _dataset(self, files: list[str], split: str, max_samples: int | None) -> PreferenceDataset:
        dataset = super()._dataset(files, split, max_samples)
        model = self.config.model
        if trained_head_class(model.path, model.trust_remote_code) is AutoModelForTokenClassification:
            return dataset  # a token classifier's reward is its head at the last token, padding or not (the worker's)
        dataset.pairs, num_cut = read_where_the_classifier_reads(dataset.pairs, self.pad_token_id)
        if num_cut:
            logger.info("%s data: %d completions end in the pad token %r, which transformers' sequence classifier "
                        "skips; their rewards are read at the token before, as the exported folder reads them (a "
                        "tokenizer with a pad token of its own reads them at their last token)", split, num_cut,
                        self.tokenizer.convert_ids_to_tokens(self.pad_token_id))
        return dataset

    def load_model(self) -> nn.Module:
        model_config = self.config.model
        model = load_reward_model_for_training(model_config.path, pad_token_id=self.pad_token_id,
                                               trust_remote_code=model_config.trust_remote_code,
                                               attn_implementation=model_config.attn_implementation,
                                               dtype=load_dtype(model_config, self.device), device=self.device)
        self.model_class = type(model)  # before sharding wraps the class
        self.router_recorder, moe_line = prepare_moe_training(model)  # hooks in place before compiling
        if moe_line:
            logger.info(moe_line)
        self.router_aux_loss_coef = trained_aux_loss_coef(
            model, self.router_recorder, self.config.trainer.router_aux_loss_coef, "trainer.router_aux_loss_coef")
        # the packed forward calls the backbone and the head apart (engine.forward.last_token_scores)
        self.peft_model = prepare_trained_model(model, model_config, self.device, seed=self.config.trainer.seed,
                                                head="score", roots=[model.base_model, model.score],
                                                keep_gathered=self.memory_plan.keep_gathered)
        return model

    def write_checkpoint(self, folder: Path) -> None:
        """actor_state.pt and hf/, a folder of the trained classifier's class (with LoRA: the adapters merged in, the
        score head as trained, and adapter/ beside it with the adapters alone)."""
        save_training_state(folder, self.model, self.optimizer, self.scheduler)
        save_sharded_hf_folder(self.model, self.model_class, self.tokenizer, folder / "hf",
                               dtype=compute_dtype(self.device, self.config.model.dtype),
                               lora=self.config.model.lora if self.peft_model is not None else None,
                               base_model_path=self.config.model.path)

    def _pair_rewards(self, micro: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """(chosen rewards, rejected rewards, pair weights), each (pairs,)."""
        rewards = last_token_scores(self.model, micro).squeeze(-1)  # the FSDP units compute in model.dtype
        return rewards[0::2], rewards[1::2], micro["pair_weight"][0::2]

    def train_step(self, batch: Batch) -> dict[str, float]:
        update, micro_batches = self.update(batch)
        tally = PairValues()
        coefficient = self.config.rm.center_rewards_coefficient
        recorder = self.router_recorder
        routed = None  # (layers, experts) slots of the whole step
        for micro, counts in micro_batches:
            with recorder.recording_forward() if recorder else contextlib.nullcontext():
                chosen, rejected, weights = self._pair_rewards(micro)
            losses = bradley_terry_loss(chosen, rejected, micro["margin"][0::2], coefficient)
            loss = (losses * weights).sum() / (counts.num_sequences / 2)
            step_metrics = {"preference_loss": loss}
            loss, routed = self.with_router_loss(loss, step_metrics, self.model.base_model, micro,
                                                 weights.sum() / (counts.num_sequences / 2), routed)
            update.backward(loss, step_metrics)
            tally.add(weights > 0, chosen=chosen, rejected=rejected)
        metrics = update.metrics("train")
        self.num_tokens += float(batch["attention_mask"].sum())
        values = tally.gathered()
        return {**reward_metrics(values["chosen"], values["rejected"]), "num_tokens": self.num_tokens,
                **({"train/moe/aux_loss": metrics["train/moe/aux_loss"], **pooled_routing_metrics(routed, "train")}
                   if routed is not None else {}),
                "train/loss": metrics["train/preference_loss"], "train/lr": metrics["train/lr"],
                "train/grad_norm": metrics["train/grad_norm"], "timing_s/step": update.seconds,
                "perf/tokens_per_s": metrics["perf/update_tokens_per_s/train"]}

    def validate(self) -> dict[str, float]:
        """The reward metrics and the loss on the validation pairs, ``eval_`` before each name, from rewards scored
        by the training forward (``score_pairs``: the training graphs, no compile of its own)."""
        if self.val_loader is None:
            return {}
        rewards = self.score_pairs(self.model, self.val_loader, _row_rewards)
        margins = torch.tensor([pair.margin for pair in self.val_loader.pairs], dtype=torch.float32)
        losses = bradley_terry_loss(rewards[:, 0], rewards[:, 1], margins, self.config.rm.center_rewards_coefficient)
        metrics = reward_metrics(rewards[:, 0], rewards[:, 1])
        metrics["loss"] = float(losses.mean())
        return {f"eval_{key}": value for key, value in metrics.items()}

    def checkpoint_extras(self) -> dict[str, float]:
        return {"num_tokens": self.num_tokens}

    def load_checkpoint_state(self, folder, state) -> None:
        super().load_checkpoint_state(folder, state)
        self.num_tokens = float(state.get("num_tokens", 0.0))


def read_where_the_classifier_reads(pairs: Sequence[PreferencePair], pad_token_id: int
                                    ) -> tuple[list[PreferencePair], int]:
    """``pairs`` with each completion's trailing pad tokens dropped, and how many completions had some: the last
    token left is the one transformers' sequence classifier reads its score at (a pair without a prompt keeps a
    token of each completion)."""
    out, num_cut = [], 0
    for pair in pairs:
        keep = 0 if pair.prompt_ids else 1
        chosen = without_trailing_padding(pair.chosen_ids, pad_token_id, keep)
        rejected = without_trailing_padding(pair.rejected_ids, pad_token_id, keep)
        num_cut += (chosen is not pair.chosen_ids) + (rejected is not pair.rejected_ids)
        out.append(pair if chosen is pair.chosen_ids and rejected is pair.rejected_ids
                   else dataclasses.replace(pair, chosen_ids=chosen, rejected_ids=rejected))
    return out, num_cut


def _row_rewards(model: nn.Module, micro: Batch) -> Tensor:
    """(rows,): the reward of each row, at its last token."""
    return last_token_scores(model, micro).squeeze(-1)


def reward_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, float]:
    """TRL's reward metrics over pairs: accuracy, margin and the min, mean and max of every reward."""
    both = torch.cat([chosen, rejected])
    return {"accuracy": float((chosen > rejected).float().mean()), "margin": float((chosen - rejected).mean()),
            "min_reward": float(both.min()), "mean_reward": float(both.mean()), "max_reward": float(both.max())}
