"""``reinforge dpo``: Direct Preference Optimization of a causal LM on chosen/rejected pairs.

The policy is loaded and sharded as the RL actor is (float32 master weights, FSDP2 computing in
``model.dtype``; on CUDA fused kernels and compiled decoder layers; ``model.gradient_checkpointing`` true or a
number of layers recomputes their activations; ``model.lora`` trains adapters, the base frozen). A pair's two
completions go through one packed forward that computes their prompt once (``engine.packing``); each
completion's log-prob is the sum over its tokens (the mean for ``ipo``). The reference model's log-probs are
computed once, in one pass over the training and validation pairs, and stored in the run folder
(``reference_logps.pt``, keyed by the pairs' token ids, the reference model, the dtype and the loss type:
``reference_logps.py``). That pass is the training forward itself, so the compiled layers compile nothing of their
own for it; its time and pairs are logged, and reported with the first step as ``timing_s/reference_pass`` and
``reference/num_pairs``. It runs before a resumed run's checkpoint loads: in every run it scores the initial policy
(or the model at ``dpo.reference_path``), never the resumed one, with no optimizer state in memory, as the memory
plan counts it. A resumed run reads the file back (one that starts over at step 0 logs the stored pass's metrics with its first
step, so ``metrics.jsonl`` is the uninterrupted run's); one that lacks it, or whose file is cut short or was scored for
other pairs, another reference, dtype or loss (a warning line says which), scores them again and gets what the
first pass gave. Without a separate reference the pass scores the policy itself, before its weights change: no
second model is held in memory. A separate reference must read the policy's token ids as the same tokens: one whose
tokenizer gives them other ids, or whose vocabulary is smaller, is refused in one line before any model loads.

Validation scores its pairs the same way (``PreferenceRun.score_pairs``), so it compiles nothing of its own. The
micro-batch budget and gradient checkpointing are the memory planner's unless set (``memory_plan.py``).

Metrics (TRL's DPOTrainer's names): ``rewards/chosen`` and ``rewards/rejected`` (the mean implicit reward
beta * (logp - logp_ref)), ``rewards/accuracies`` (the share of pairs whose chosen reward is higher),
``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``num_tokens``, with ``eval_`` before each on the
validation pairs, and ``train/loss``, ``train/lr``, ``train/grad_norm``. A mixture of experts adds its routers'
load-balancing loss times ``trainer.router_aux_loss_coef`` (by default the model config's ``router_aux_loss_coef``
where its ``output_router_logits`` asks) and logs ``train/moe/aux_loss``, ``train/moe/load_imbalance`` and
``train/moe/unused_experts``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from reinforge.algorithms.preference_losses import dpo_loss
from reinforge.config.preference_schema import DPOConfig
from reinforge.data.preference_dataset import PairLoader
from reinforge.engine.device import compute_dtype
from reinforge.engine.distributed import all_reduce, barrier
from reinforge.engine.forward import response_log_probs
from reinforge.engine.fsdp import shard_model
from reinforge.engine.fused import prepare_for_training
from reinforge.engine.moe import pooled_routing_metrics, prepare_moe_training, trained_aux_loss_coef
from reinforge.models import load_causal_lm
from reinforge.models.dropout import disable_dropout
from reinforge.models.loading import tokens_its_tokenizer_moves, vocab_rows
from reinforge.protocol import Batch
from reinforge.trainer.preference.models import load_dtype, prepare_trained_model
from reinforge.trainer.preference.pairs import PreferenceRun
from reinforge.trainer.preference.ranks import PairValues
from reinforge.trainer.preference.reference_logps import REFERENCE_FILE, read_reference, save_reference
from reinforge.workers.checkpointing import save_sharded_hf_folder, save_training_state

logger = logging.getLogger(__name__)


class DPOTrainer(PreferenceRun):
    config: DPOConfig
    need_prompt = True

    def __init__(self, config: DPOConfig):
        self.num_tokens = 0.0
        self.peft_model: nn.Module | None = None
        self.reference: dict[str, Tensor] = {}
        self._device_reference: dict[str, Tensor] = {}
        self.reference_metrics: dict[str, float] = {}
        """The reference pass's time and pairs, logged with the first step after it."""
        super().__init__(config)

    def load_model(self) -> nn.Module:
        reference = self.config.dpo.reference_path
        if reference not in (None, self.config.model.path):
            check_reference_reads_policy_ids(reference, self.tokenizer, self.config.model.trust_remote_code)
        model = self._load(self.config.model.path, load_dtype(self.config.model, self.device))
        self.model_class = type(model)  # before sharding wraps the class
        self.router_recorder, moe_line = prepare_moe_training(model)  # hooks in place before compiling
        if moe_line:
            logger.info(moe_line)
        self.router_aux_loss_coef = trained_aux_loss_coef(
            model, self.router_recorder, self.config.trainer.router_aux_loss_coef, "trainer.router_aux_loss_coef")
        self.peft_model = prepare_trained_model(model, self.config.model, self.device,
                                                seed=self.config.trainer.seed,
                                                keep_gathered=self.memory_plan.keep_gathered)
        return model

    def _load(self, path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The causal LM at ``path`` (float32 master weights unless told), made ready and sharded by the caller."""
        model = self.config.model
        return load_causal_lm(path, dtype=dtype, device=self.device, trust_remote_code=model.trust_remote_code,
                              attn_implementation=model.attn_implementation)

    def write_checkpoint(self, folder: Path) -> None:
        """actor_state.pt and hf/ (with LoRA: the merged weights, and adapter/ in peft's format beside it)."""
        save_training_state(folder, self.model, self.optimizer, self.scheduler)
        save_sharded_hf_folder(self.model, self.model_class, self.tokenizer, folder / "hf",
                               dtype=compute_dtype(self.device, self.config.model.dtype),
                               lora=self.config.model.lora if self.peft_model is not None else None,
                               base_model_path=self.config.model.path)

    # ---- the reference pass ----------------------------------------------------------
    def _reference_key(self) -> dict[str, str]:
        return {"train": self.train_set.fingerprint(),
                "val": self.val_set.fingerprint() if self.val_set is not None else "",
                "reference": self.config.dpo.reference_path or self.config.model.path,
                "dtype": str(compute_dtype(self.device, self.config.model.dtype)).removeprefix("torch."),
                "loss_type": self.config.dpo.loss_type}

    def resume(self) -> None:
        """Score the reference log-probs (or read them back), then restore the checkpoint: the reference pass runs
        while the policy holds its initial weights and no optimizer state exists, in a resumed run as in a fresh one."""
        self.score_reference()
        super().resume()

    def score_reference(self) -> None:
        """Read the stored reference log-probs if they are this run's, else score them and store them."""
        path = self.run_dir / REFERENCE_FILE
        key = self._reference_key()
        pairs_per_split = {"train": len(self.train_set.pairs)}
        if self.val_set is not None:
            pairs_per_split["val"] = len(self.val_set.pairs)
        stored = read_reference(path, key, pairs_per_split)
        read_on_every_rank = not all_reduce([float(stored is None)], self.device, op="max")[0]
        if stored is not None and read_on_every_rank:  # else every rank scores them: the pass is collective
            self.reference, pass_metrics = stored
            if self._resume_state is None:  # step 1 is logged again (or for the first time): with the pass, as before
                self.reference_metrics = pass_metrics
            logger.info("reference log-probs read from %s", path)
            return
        separate = self.config.dpo.reference_path not in (None, self.config.model.path)
        model = self._load_reference() if separate else self.model  # not yet trained nor restored: the initial policy
        start, first = time.perf_counter(), []

        def time_first_micro_batch(micro: Batch) -> None:  # timed apart: it compiles (one wait for the device)
            real_pairs = all_reduce([float((micro["pair_weight"] > 0).sum()) / 2], self.device)[0]
            first.append((time.perf_counter() - start, real_pairs))

        self.on_first_micro_batch = time_first_micro_batch
        loaders = {"train": PairLoader(self.train_set.pairs, self.config.data.batch_size, self.pad_token_id,
                                       shuffle=False)}
        if self.val_loader is not None:
            loaders["val"] = self.val_loader
        self.reference = {split: self.score_pairs(model, loader, self._sequence_logps)
                          for split, loader in loaders.items()}
        self.on_first_micro_batch = None
        if model is not self.model:
            del model
        seconds = time.perf_counter() - start
        num_pairs = sum(len(loader.pairs) for loader in loaders.values())
        first_seconds, first_pairs = first[0] if first else (0.0, 0.0)
        # after the first micro-batch, which compiles the layers' graphs (the steps then reuse them)
        steady = ((num_pairs - first_pairs) / (seconds - first_seconds) if num_pairs > first_pairs
                  else num_pairs / max(seconds, 1e-9))  # all in one micro-batch
        self.reference_metrics = {"timing_s/reference_pass": seconds, "reference/num_pairs": float(num_pairs),
                                  "timing_s/reference_first_micro_batch": first_seconds,
                                  "perf/reference_pairs_per_s": steady}
        if self.rank == 0:
            save_reference(path, key, self.reference, self.reference_metrics)
        barrier()
        logger.info("reference log-probs of %d pairs scored in %.2f s (its first micro-batch, compiling, %.2f s; then "
                    "%.1f pairs/s) and stored in %s", num_pairs, seconds, first_seconds, steady, path)

    def _load_reference(self) -> nn.Module:
        """The reference model as the policy is loaded (float32, the packed fast path, sharded), never trained."""
        reference = self._load(self.config.dpo.reference_path or self.config.model.path)
        disable_dropout(reference)
        prepare_for_training(reference, self.device)
        return shard_model(reference, self.device, self.config.model.dtype)

    def _sequence_logps(self, model: nn.Module, micro: Batch) -> Tensor:
        """(rows,): each completion's summed log-prob (per-token mean for ipo)."""
        # in model.dtype (the FSDP units' compute dtype); logits up to the plan's buffer kept for the backward
        log_probs, _ = response_log_probs(model, micro, max_logits_bytes=self.memory_plan.max_logits_bytes)
        mask = micro["response_mask"]
        logps = (log_probs * mask).sum(-1)
        return logps / mask.sum(-1).clamp(min=1) if self.config.dpo.loss_type == "ipo" else logps

    # ---- the step ---------------------------------------------------------------------
    def _reference_on_device(self, split: str) -> Tensor:
        """(pairs, 2) reference log-probs of ``split`` on the device, copied there once."""
        if split not in self._device_reference:
            self._device_reference[split] = self.reference[split].to(self.device)
        return self._device_reference[split]

    def train_step(self, batch: Batch) -> dict[str, float]:
        update, micro_batches = self.update(batch)
        tally = PairValues()
        reference_logps = self._reference_on_device("train")
        loss_settings = self.config.dpo
        recorder = self.router_recorder
        routed = None  # (layers, experts) slots of the whole step
        for micro, counts in micro_batches:
            with recorder.recording_forward() if recorder else contextlib.nullcontext():
                logps = self._sequence_logps(self.model, micro)
            reference = reference_logps[micro["pair_index"][0::2]]  # indexed on the device: no wait for it
            loss, chosen_rewards, rejected_rewards = dpo_loss(
                logps[0::2], logps[1::2], reference[:, 0], reference[:, 1], beta=loss_settings.beta,
                loss_type=loss_settings.loss_type, label_smoothing=loss_settings.label_smoothing)
            weights = micro["pair_weight"][0::2]
            total = (loss * weights).sum() / (counts.num_sequences / 2)
            step_metrics = {"preference_loss": total}
            total, routed = self.with_router_loss(total, step_metrics, self.model, micro,
                                                  weights.sum() / (counts.num_sequences / 2), routed)
            update.backward(total, step_metrics)
            tally.add(weights > 0, chosen=chosen_rewards, rejected=rejected_rewards, logp_chosen=logps[0::2],
                      logp_rejected=logps[1::2])
        metrics = update.metrics("train")
        self.num_tokens += float(batch["attention_mask"].sum())
        reference_metrics, self.reference_metrics = self.reference_metrics, {}
        return {**dpo_metrics(tally.gathered()), "num_tokens": self.num_tokens,
                **({"train/moe/aux_loss": metrics["train/moe/aux_loss"], **pooled_routing_metrics(routed, "train")}
                   if routed is not None else {}),
                "train/loss": metrics["train/preference_loss"], "train/lr": metrics["train/lr"],
                "train/grad_norm": metrics["train/grad_norm"], "timing_s/step": update.seconds,
                "perf/tokens_per_s": metrics["perf/update_tokens_per_s/train"], **reference_metrics}

    def validate(self) -> dict[str, float]:
        """The metrics and the loss on the validation pairs, ``eval_`` before each name, from log-probs scored as
        the reference pass scores them (``score_pairs``: the training graphs, no compile of its own)."""
        if self.val_loader is None:
            return {}
        logps = self.score_pairs(self.model, self.val_loader, self._sequence_logps)
        reference, settings = self.reference["val"], self.config.dpo
        loss, chosen, rejected = dpo_loss(logps[:, 0], logps[:, 1], reference[:, 0], reference[:, 1],
                                          beta=settings.beta, loss_type=settings.loss_type,
                                          label_smoothing=settings.label_smoothing)
        values = {"chosen": chosen, "rejected": rejected, "logp_chosen": logps[:, 0], "logp_rejected": logps[:, 1]}
        metrics = dpo_metrics(values) | {"loss": float(loss.mean())}
        return {f"eval_{key}": value for key, value in metrics.items()}

    def checkpoint_extras(self) -> dict[str, float]:
        return {"num_tokens": self.num_tokens}

    def load_checkpoint_state(self, folder: Path, state) -> None:
        super().load_checkpoint_state(folder, state)
        self.num_tokens = float(state.get("num_tokens", 0.0))


def check_reference_reads_policy_ids(path: str, tokenizer: Any, trust_remote_code: bool = False) -> None:
    """One line, before any model loads, where the reference model at ``path`` would read the policy's token ids as
    other tokens (a tokenizer of its own that gives them other ids) or has no embedding for some of them: DPO
    compares the two models' log-probs of the same ids."""
    policy_vocab = tokenizer.get_vocab()
    moved = tokens_its_tokenizer_moves(path, tokenizer, trust_remote_code)
    if moved:
        raise ValueError(f"dpo.reference_path={path} has a tokenizer of its own, in which {len(moved)} of the "
                         f"policy's {len(policy_vocab)} tokens (first {moved[0]!r}) have another id or none; DPO "
                         "compares both models' log-probs of the same token ids, so give a reference that shares "
                         "the policy's tokenizer (model.path's own starting weights if unset)")
    vocab_size = vocab_rows(path, trust_remote_code, "dpo.reference_path")
    if vocab_size is not None and max(policy_vocab.values()) >= vocab_size:
        raise ValueError(f"dpo.reference_path={path} has vocab_size={vocab_size}, fewer than the policy tokenizer's "
                         f"{max(policy_vocab.values()) + 1} token ids; give a reference that shares the policy's "
                         "tokenizer")


def dpo_metrics(values: dict[str, Tensor]) -> dict[str, float]:
    """TRL's DPO metrics over pairs, from their implicit rewards and log-probs (``PairValues.gathered``)."""
    chosen, rejected = values["chosen"], values["rejected"]
    return {"rewards/chosen": float(chosen.mean()), "rewards/rejected": float(rejected.mean()),
            "rewards/accuracies": float((chosen > rejected).float().mean()),
            "rewards/margins": float((chosen - rejected).mean()),
            "logps/chosen": float(values["logp_chosen"].mean()), "logps/rejected": float(values["logp_rejected"].mean())}
