"""``reinforge rm``: a Bradley-Terry reward model trained on chosen/rejected pairs.

The model is transformers' ``AutoModelForSequenceClassification`` with one label, loaded from ``model.path``:
a causal LM gets a new ``score`` head (seeded by ``trainer.seed``), a classification model keeps its own. Its
reward for a sequence is the head at the sequence's last token (EOS included), where the reward-model worker
of ``reinforge train`` reads it. Both completions of a pair go through one packed forward that computes their
prompt once. The loss is ``algorithms.preference_losses.bradley_terry_loss`` (margins from the data's
``margin`` column, centring by ``rm.center_rewards_coefficient``), averaged over the step's pairs.

Metrics (TRL's RewardTrainer's names): ``accuracy`` (the share of pairs whose chosen completion scores higher),
``margin`` (the mean r_chosen - r_rejected), ``min_reward``, ``mean_reward``, ``max_reward`` and
``num_tokens`` (tokens put through the model so far), with ``eval_`` before each on the validation pairs, and
``train/loss``, ``train/lr``, ``train/grad_norm``. Every checkpoint's ``hf/`` folder is a standard
sequence-classification folder (``num_labels=1``, ``pad_token_id`` set) that ``reward.reward_model.model_path``
loads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification

from reinforge.algorithms.preference_losses import bradley_terry_loss
from reinforge.config.preference_schema import RMConfig
from reinforge.engine.attention import use_varlen_attention
from reinforge.engine.device import autocast_context
from reinforge.engine.forward import last_token_scores
from reinforge.engine.train_step import ModelUpdate
from reinforge.models.loading import check_model_folder, hub_errors_explained, is_local_path
from reinforge.protocol import Batch
from reinforge.trainer.preference.pairs import PreferenceRun, pair_micro_batches


def load_reward_model_for_training(path: str, *, pad_token_id: int, trust_remote_code: bool = False,
                                   attn_implementation: str = "sdpa",
                                   device: torch.device | str = "cpu") -> nn.Module:
    """A one-label sequence classifier from ``path`` (a causal LM gets a new score head), in float32, with the
    tokenizer's pad id in its config (transformers' own forward pools the last token that is not padding)."""
    if is_local_path(path):
        check_model_folder(path)
    with hub_errors_explained(path):
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32, trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation)
    if not isinstance(getattr(model, "score", None), nn.Linear):
        raise ValueError(f"model.path={path} loads as {type(model).__name__}, whose head is not a linear layer named "
                         "'score'; reinforge rm trains transformers' sequence-classification classes")
    model.config.pad_token_id = pad_token_id
    model.config.use_cache = False
    return model.to(device)


class RewardModelTrainer(PreferenceRun):
    config: RMConfig

    def __init__(self, config: RMConfig):
        self.num_tokens = 0.0
        super().__init__(config)

    def load_model(self) -> nn.Module:
        model_config = self.config.model
        model = load_reward_model_for_training(model_config.path, pad_token_id=self.pad_token_id,
                                               trust_remote_code=model_config.trust_remote_code,
                                               attn_implementation=model_config.attn_implementation,
                                               device=self.device)
        if model_config.gradient_checkpointing not in ("auto", False, 0):
            from reinforge.models.loading import enable_gradient_checkpointing

            enable_gradient_checkpointing(model)
        use_varlen_attention(model)  # packed rows: attention stays within each sequence
        return model

    def _pair_rewards(self, micro: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """(chosen rewards, rejected rewards, pair weights), each (pairs,)."""
        with autocast_context(self.device, self.config.model.dtype):
            rewards = last_token_scores(self.model, micro).squeeze(-1)
        return rewards[0::2], rewards[1::2], micro["pair_weight"][0::2]

    def train_step(self, batch: Batch) -> dict[str, float]:
        update = ModelUpdate(self.model, self.optimizer, self.scheduler, self.update_settings, self.device,
                             split=pair_micro_batches)
        chosen_parts, rejected_parts = [], []
        coefficient = self.config.rm.center_rewards_coefficient
        for micro, counts in update.micro_batches(batch):
            chosen, rejected, weights = self._pair_rewards(micro)
            losses = bradley_terry_loss(chosen, rejected, micro["margin"][0::2], coefficient)
            loss = (losses * weights).sum() / (counts.num_sequences / 2)
            update.backward(loss, {"preference_loss": loss})
            real = weights > 0
            chosen_parts.append(chosen.detach()[real].cpu())
            rejected_parts.append(rejected.detach()[real].cpu())
        metrics = update.metrics("train")
        self.num_tokens += float(batch["attention_mask"].sum())
        return {**reward_metrics(torch.cat(chosen_parts), torch.cat(rejected_parts)), "num_tokens": self.num_tokens,
                "train/loss": metrics["train/preference_loss"], "train/lr": metrics["train/lr"],
                "train/grad_norm": metrics["train/grad_norm"], "timing_s/step": update.seconds,
                "perf/tokens_per_s": metrics["perf/update_tokens_per_s/train"]}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """The reward metrics and the loss on the validation pairs, ``eval_`` before each name."""
        if self.val_loader is None:
            return {}
        self.model.eval()
        chosen_parts, rejected_parts, losses = [], [], []
        coefficient = self.config.rm.center_rewards_coefficient
        for batch in self.val_loader.batches_of_one_pass():
            for micro in self.micro_batches(batch):
                chosen, rejected, weights = self._pair_rewards(micro)
                real = weights > 0
                chosen_parts.append(chosen[real].cpu())
                rejected_parts.append(rejected[real].cpu())
                losses.append(bradley_terry_loss(chosen, rejected, micro["margin"][0::2], coefficient)[real].cpu())
        self.model.train()
        metrics = reward_metrics(torch.cat(chosen_parts), torch.cat(rejected_parts))
        metrics["loss"] = float(torch.cat(losses).mean())
        return {f"eval_{key}": value for key, value in metrics.items()}

    def checkpoint_extras(self) -> dict[str, float]:
        return {"num_tokens": self.num_tokens}

    def load_checkpoint_state(self, folder, state) -> None:
        super().load_checkpoint_state(folder, state)
        self.num_tokens = float(state.get("num_tokens", 0.0))


def reward_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, float]:
    """TRL's reward metrics over pairs: accuracy, margin and the min, mean and max of every reward."""
    both = torch.cat([chosen, rejected])
    return {"accuracy": float((chosen > rejected).float().mean()), "margin": float((chosen - rejected).mean()),
            "min_reward": float(both.min()), "mean_reward": float(both.mean()), "max_reward": float(both.max())}
