"""``reinforge dpo``: Direct Preference Optimization of a causal LM on chosen/rejected pairs.

A pair's two completions go through one packed forward that computes their prompt once (``engine.packing``);
each completion's log-prob is the sum over its tokens (the mean for ``ipo``). The reference model's log-probs
are computed once, before the first step, in one scoring pass over the training and validation pairs, and
stored in the run folder (``reference_logps.pt``, keyed by the pairs' token ids, the reference model and the
dtype). A resumed run reads them back; should that file be missing, they are scored again by the reference
model loaded from ``dpo.reference_path`` (``model.path`` when unset), never by the resumed policy. Without a
separate reference, the scoring pass of a fresh run uses the policy itself before its first step: the same
weights, so no second model is held in memory.

Metrics (TRL's DPOTrainer's names): ``rewards/chosen`` and ``rewards/rejected`` (the mean implicit reward
beta * (logp - logp_ref)), ``rewards/accuracies`` (the share of pairs whose chosen reward is higher),
``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``num_tokens``, with ``eval_`` before each on the
validation pairs, and ``train/loss``, ``train/lr``, ``train/grad_norm``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from reinforge.algorithms.preference_losses import dpo_loss
from reinforge.config.preference_schema import DPOConfig
from reinforge.data.preference_dataset import PairLoader
from reinforge.engine.attention import use_varlen_attention
from reinforge.engine.device import autocast_context
from reinforge.engine.forward import response_log_probs
from reinforge.engine.train_step import ModelUpdate
from reinforge.models import load_causal_lm
from reinforge.protocol import Batch
from reinforge.trainer.preference.pairs import PreferenceRun, pair_micro_batches

logger = logging.getLogger(__name__)

REFERENCE_FILE = "reference_logps.pt"


class DPOTrainer(PreferenceRun):
    config: DPOConfig
    need_prompt = True

    def __init__(self, config: DPOConfig):
        self.num_tokens = 0.0
        self.reference: dict[str, Tensor] = {}
        super().__init__(config)

    def load_model(self) -> nn.Module:
        model = self.config.model
        return load_causal_lm(model.path, dtype=torch.float32, device=self.device,
                              trust_remote_code=model.trust_remote_code, attn_implementation=model.attn_implementation,
                              gradient_checkpointing=model.gradient_checkpointing not in ("auto", False, 0))

    # ---- the reference pass ----------------------------------------------------------
    def _reference_key(self) -> dict[str, str]:
        return {"train": self.train_set.fingerprint(),
                "val": self.val_set.fingerprint() if self.val_set is not None else "",
                "reference": self.config.dpo.reference_path or self.config.model.path,
                "dtype": self.config.model.dtype, "loss_type": self.config.dpo.loss_type}

    def before_training(self) -> None:
        """Read the stored reference log-probs, or score them (the policy is the reference before step 1)."""
        path = self.run_dir / REFERENCE_FILE
        key = self._reference_key()
        if path.is_file():
            stored = torch.load(path, map_location="cpu", weights_only=True)
            if stored.get("key") == key:
                self.reference = {split: stored[split] for split in ("train", "val") if split in stored}
                logger.info("reference log-probs read from %s", path)
                return
            logger.warning("%s belongs to other pairs or another reference model; scoring them again", path)
        untrained = self.step == 0 and self.config.dpo.reference_path in (None, self.config.model.path)
        model = self.model if untrained else self._load_reference()
        loaders = {"train": PairLoader(self.train_set.pairs, self.config.data.batch_size, self.pad_token_id,
                                       shuffle=False)}
        if self.val_loader is not None:
            loaders["val"] = self.val_loader
        self.reference = {split: self.sequence_logps_of(model, loader) for split, loader in loaders.items()}
        if model is not self.model:
            del model
        staging = path.with_name(path.name + ".tmp")
        torch.save({"key": key, **self.reference}, staging)
        os.replace(staging, path)
        logger.info("reference log-probs of %d pairs stored in %s", len(self.train_set), path)

    def _load_reference(self) -> nn.Module:
        model = self.config.model
        reference = load_causal_lm(self.config.dpo.reference_path or model.path, dtype=torch.float32,
                                   device=self.device, trust_remote_code=model.trust_remote_code,
                                   attn_implementation=model.attn_implementation)
        use_varlen_attention(reference)
        return reference

    @torch.no_grad()
    def sequence_logps_of(self, model: nn.Module, loader: PairLoader) -> Tensor:
        """(pairs, 2): the log-prob of each pair's chosen and rejected completion under ``model``."""
        out = torch.zeros(len(loader.pairs), 2)
        was_training = model.training
        model.eval()
        for batch in loader.batches_of_one_pass():
            for micro in self.micro_batches(batch):
                logps = self._sequence_logps(model, micro)
                real = micro["pair_weight"] > 0
                rows = micro["pair_index"][real].cpu()
                sides = torch.arange(len(micro), device=real.device)[real].cpu() % 2
                out[rows, sides] = logps[real].cpu()
        model.train(was_training)
        return out

    def _sequence_logps(self, model: nn.Module, micro: Batch) -> Tensor:
        """(rows,): each completion's summed log-prob (per-token mean for ipo)."""
        with autocast_context(self.device, self.config.model.dtype):
            log_probs, _ = response_log_probs(model, micro)
        mask = micro["response_mask"]
        logps = (log_probs * mask).sum(-1)
        return logps / mask.sum(-1).clamp(min=1) if self.config.dpo.loss_type == "ipo" else logps

    # ---- the step ---------------------------------------------------------------------
    def _pair_terms(self, micro: Batch, split: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(per-pair loss, chosen rewards, rejected rewards, policy log-probs (pairs, 2), pair weights)."""
        logps = self._sequence_logps(self.model, micro)
        reference = self.reference[split][micro["pair_index"][0::2].cpu()].to(logps.device)
        loss, chosen_rewards, rejected_rewards = dpo_loss(
            logps[0::2], logps[1::2], reference[:, 0], reference[:, 1], beta=self.config.dpo.beta,
            loss_type=self.config.dpo.loss_type, label_smoothing=self.config.dpo.label_smoothing)
        return loss, chosen_rewards, rejected_rewards, logps.detach().view(-1, 2), micro["pair_weight"][0::2]

    def train_step(self, batch: Batch) -> dict[str, float]:
        update = ModelUpdate(self.model, self.optimizer, self.scheduler, self.update_settings, self.device,
                             split=pair_micro_batches)
        tally = PairTally()
        for micro, counts in update.micro_batches(batch):
            loss, chosen_rewards, rejected_rewards, logps, weights = self._pair_terms(micro, "train")
            total = (loss * weights).sum() / (counts.num_sequences / 2)
            update.backward(total, {"preference_loss": total})
            tally.add(weights > 0, chosen_rewards, rejected_rewards, logps)
        metrics = update.metrics("train")
        self.num_tokens += float(batch["attention_mask"].sum())
        return {**tally.metrics(), "num_tokens": self.num_tokens, "train/loss": metrics["train/preference_loss"],
                "train/lr": metrics["train/lr"], "train/grad_norm": metrics["train/grad_norm"],
                "timing_s/step": update.seconds, "perf/tokens_per_s": metrics["perf/update_tokens_per_s/train"]}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        self.model.eval()
        tally, losses = PairTally(), []
        for batch in self.val_loader.batches_of_one_pass():
            for micro in self.micro_batches(batch):
                loss, chosen_rewards, rejected_rewards, logps, weights = self._pair_terms(micro, "val")
                tally.add(weights > 0, chosen_rewards, rejected_rewards, logps)
                losses.append(loss[weights > 0].cpu())
        self.model.train()
        metrics = tally.metrics() | {"loss": float(torch.cat(losses).mean())}
        return {f"eval_{key}": value for key, value in metrics.items()}

    def checkpoint_extras(self) -> dict[str, float]:
        return {"num_tokens": self.num_tokens}

    def load_checkpoint_state(self, folder: Path, state) -> None:
        super().load_checkpoint_state(folder, state)
        self.num_tokens = float(state.get("num_tokens", 0.0))


class PairTally:
    """DPO's per-pair metrics gathered over micro-batches: TRL's names, means over the real pairs."""

    def __init__(self) -> None:
        self.parts: dict[str, list[Tensor]] = {"chosen": [], "rejected": [], "logp_chosen": [], "logp_rejected": []}

    def add(self, real: Tensor, chosen_rewards: Tensor, rejected_rewards: Tensor, logps: Tensor) -> None:
        for key, values in (("chosen", chosen_rewards), ("rejected", rejected_rewards),
                            ("logp_chosen", logps[:, 0]), ("logp_rejected", logps[:, 1])):
            self.parts[key].append(values.detach()[real].float().cpu())

    def metrics(self) -> dict[str, float]:
        chosen, rejected = torch.cat(self.parts["chosen"]), torch.cat(self.parts["rejected"])
        return {"rewards/chosen": float(chosen.mean()), "rewards/rejected": float(rejected.mean()),
                "rewards/accuracies": float((chosen > rejected).float().mean()),
                "rewards/margins": float((chosen - rejected).mean()),
                "logps/chosen": float(torch.cat(self.parts["logp_chosen"]).mean()),
                "logps/rejected": float(torch.cat(self.parts["logp_rejected"]).mean())}
