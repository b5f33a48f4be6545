"""What the reward-model and DPO trainers share: pair micro-batches, preflight, and the run around the step.

``pair_micro_batches`` cuts a batch of pairs into token-budget micro-batches that never split a pair (both
completions must be in one forward for the pair's loss) and packs each with shared prompts, so a pair costs
its prompt once plus its two completions; a step's pairs go into the fewest micro-batches the budget allows,
spread longest first so their sizes are even. ``PreferenceRun`` is the SFT trainer's run (``run_loop.SupervisedRun``:
one run folder, atomic checkpoints, exact resume, metrics.jsonl) with pairs for data, on one process or every
rank of a group (``ranks.py``: rank 0 holds the run folder, each rank trains on its share of the pairs); a
subclass loads its model (``models.py``) and writes ``train_step`` and ``validate``. Before the model loads, the
memory plan (``memory_plan.py``) sets the micro-batch budget and recompute left ``auto``; ``score_pairs`` scores
pairs with the training forward (DPO's reference pass, both trainers' validation).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from reinforge.config import config_to_dict
from reinforge.config.errors import ConfigError
from reinforge.config.preference_schema import DPOConfig, RMConfig, validate_preference_config
from reinforge.data.chat_template import get_pad_token_id
from reinforge.data.files import expand_data_files, read_rows
from reinforge.data.loader_state import check_loader_resumes
from reinforge.data.preference_dataset import PairLoader, PreferenceDataset, PreferenceKeys, check_preference_rows
from reinforge.engine.device import compute_dtype, resolve_device
from reinforge.engine.distributed import all_reduce, barrier, init_distributed
from reinforge.engine.forward import routed_token_weights
from reinforge.engine.fsdp import reshard
from reinforge.engine.lora import check_target_modules, require_peft
from reinforge.engine.micro_batches import _fewest_bins, _longest_first, trim_padding
from reinforge.engine.moe import RouterRecorder
from reinforge.engine.optim import LR_SCHEDULES, build_optimizer, build_scheduler
from reinforge.engine.packing import PLAN_KEY, attach_plan
from reinforge.engine.train_step import MiniBatchCounts, ModelUpdate, UpdateSettings
from reinforge.models import load_tokenizer, save_hf_folder, warn_if_beyond_context
from reinforge.models.dropout import active_dropout
from reinforge.protocol import Batch
from reinforge.tracking import Tracker
from reinforge.trainer.checkpoint import CheckpointManager, load_trainer_state
from reinforge.trainer.preference.memory_plan import PreferencePlan, apply_preference_plan
from reinforge.trainer.preference.ranks import SilentTracker, gather_from_ranks, rank_share
from reinforge.trainer.preflight import (
    check_checkpoint_room,
    check_devices,
    check_loggers,
    check_router_aux_loss_has_experts,
    require_logger_packages,
    require_model_and_data,
)
from reinforge.trainer.run_loop import SupervisedRun
from reinforge.workers.checkpointing import load_training_state, save_training_state

logger = logging.getLogger(__name__)

PairScore = Callable[[torch.nn.Module, Batch], Tensor]
"""(model, micro-batch on the device) -> a value per row (rows,): a completion's log-prob, a reward."""

RESUME_REFUSES = ("model.path", "model.tokenizer_path", "data.train_files", "data.prompt_key", "data.chosen_key",
                  "data.rejected_key", "data.margin_key", "data.chat_template", "data.batch_size", "data.max_length",
                  "data.truncation", "data.shuffle", "data.seed", "data.max_train_samples", "trainer.seed",
                  "dpo.reference_path", "model.lora.rank", "model.lora.target_modules")
"""Settings a resumed rm or dpo run may not change: the checkpoint's weights or data order would not fit them."""


def pair_micro_batches(batch: Batch, max_tokens: int, mask_key: str) -> Iterator[Batch]:
    """Micro-batches of whole pairs (rows 2i and 2i + 1 together) of at most ``max_tokens`` packed tokens (a
    larger pair goes alone), balanced longest first, the same number on every rank (a rank short of pairs
    gives a copy of its first pair with ``pair_weight`` and ``mask_key`` zero). Each carries its packing plan
    with shared prompts and ``meta['rows']``."""
    attention = batch["attention_mask"]
    lengths = attention.sum(-1).tolist()
    prompt_lengths = attention[:, :batch["prompts"].shape[1]].sum(-1).tolist()
    costs = [lengths[2 * pair] + lengths[2 * pair + 1] - prompt_lengths[2 * pair] for pair in range(len(batch) // 2)]
    num_micro = int(all_reduce([float(_fewest_bins(costs, max_tokens))], torch.device("cpu"), op="max")[0])
    for pairs in _longest_first(costs, num_micro):
        rows = sorted(row for pair in pairs for row in (2 * pair, 2 * pair + 1))
        if rows:
            piece = trim_padding(batch.index(rows))
            piece.meta["rows"] = rows
        else:
            piece = batch.index([0, 1])
            piece[mask_key] = torch.zeros_like(piece[mask_key])
            piece["pair_weight"] = torch.zeros_like(piece["pair_weight"])
            piece.meta["rows"] = [-1]
        yield attach_plan(piece, share_prompts=True)


def preflight_preference(config: RMConfig | DPOConfig) -> None:
    """Every check of an rm or dpo run that can run before a tokenizer or model loads, every data row's too."""
    validate_preference_config(config)
    if config.optim.schedule not in LR_SCHEDULES:
        raise ConfigError(f"optim.schedule={config.optim.schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
    check_loggers(config.trainer.loggers)
    require_model_and_data(config.model.path, config.data.train_files,
                           "path/to/pairs.jsonl (rows with chosen and rejected)")
    check_checkpoint_room(config.model.path, config.trainer.output_dir)
    check_router_aux_loss_has_experts("trainer.router_aux_loss_coef", config.trainer.router_aux_loss_coef, config.model)
    require_logger_packages(config.trainer.loggers)
    check_devices(config)  # type: ignore[arg-type]  # the same trainer.device and backend fields
    data = config.data
    keys = preference_keys(config)
    check_preference_rows(data.train_files, keys, "train", data.max_train_samples)
    if data.val_files:
        check_preference_rows(data.val_files, keys, "val", data.max_val_samples)
    warn_if_beyond_context(config.model.path, data.max_length, "data.max_length")
    if config.model.lora.rank:
        check_target_modules(config.model.lora, config.model.path)  # adapters that would match no layer
        require_peft(config.model.lora)
    if isinstance(config, DPOConfig):
        warn_of_precomputed_reference(data.train_files)
    if isinstance(config, DPOConfig) and config.dpo.label_smoothing and config.dpo.loss_type != "robust":
        logger.warning("dpo.label_smoothing=%g has no effect with dpo.loss_type=%s (only the robust loss reads it, "
                       "as in TRL); set dpo.loss_type=robust or remove dpo.label_smoothing",
                       config.dpo.label_smoothing, config.dpo.loss_type)


PRECOMPUTED_REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
"""TRL's columns of reference log-probs computed before training (precompute_ref_log_probs)."""


def warn_of_precomputed_reference(files: list[str]) -> None:
    """One warning where the pairs carry TRL's precomputed reference log-probs, which TRL's DPOTrainer reads and
    reinforge dpo does not: it scores its own reference."""
    path = expand_data_files(files, "data.train_files")[0]
    first = next(iter(read_rows(path)), {})
    found = [column for column in PRECOMPUTED_REFERENCE_COLUMNS if column in first]
    if found:
        logger.warning("%s has %s, TRL's precomputed reference log-probs; reinforge dpo leaves them aside and scores "
                       "the reference itself (dpo.reference_path, or model.path's starting weights), so the pairs "
                       "compare against that model", path, " and ".join(repr(column) for column in found))


def preference_keys(config: RMConfig | DPOConfig) -> PreferenceKeys:
    data = config.data
    return PreferenceKeys(data.prompt_key, data.chosen_key, data.rejected_key, data.margin_key)


class PreferenceRun(SupervisedRun):
    """The run of ``reinforge rm`` and ``reinforge dpo``; ``load_model`` gives the model to train."""

    config: RMConfig | DPOConfig
    need_prompt = False
    """Refuse pairs without a common beginning (DPO's loss is on the completions that follow a prompt)."""
    on_first_micro_batch: Callable[[Batch], None] | None = None
    """Called once by ``score_pairs`` after its next first micro-batch (DPO times its reference pass's)."""
    _prepared: tuple[Batch, list[Batch]] | None = None
    """The next step's batch and its micro-batches (``prepare_next_step``)."""

    def __init__(self, config: RMConfig | DPOConfig):
        self.config = config
        data, trainer = config.data, config.trainer
        self.run_dir = Path(trainer.output_dir)
        preflight_preference(config)
        self.device = resolve_device(trainer.device)
        self.rank, self.world_size = init_distributed(device_type=self.device.type)
        if self.device.type == "cuda":  # the rank's own device (LOCAL_RANK)
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.manual_seed(trainer.seed)
        np.random.seed(trainer.seed)
        self.tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path,
                                        trust_remote_code=config.model.trust_remote_code)
        if data.chat_template:
            self.tokenizer.chat_template = data.chat_template
        self.pad_token_id = get_pad_token_id(self.tokenizer)
        self.train_set = self._dataset(data.train_files, "train", data.max_train_samples)
        self.train_loader = PairLoader(self.train_set.pairs, data.batch_size, self.pad_token_id, shuffle=data.shuffle,
                                       seed=data.seed)
        self.val_set = self._dataset(data.val_files, "val", data.max_val_samples) if data.val_files else None
        self.val_loader = None if self.val_set is None else PairLoader(self.val_set.pairs, data.val_batch_size,
                                                                        self.pad_token_id, shuffle=False)
        self.total_steps = trainer.total_steps or len(self.train_loader) * trainer.total_epochs
        self.memory_plan = self._plan_memory()
        # after the plan, which sets the settings left auto: config.yaml records them, and a resumed run compares
        # them with the checkpoint's (planned then too), not an auto with the number it became
        self._open_run_folder_on_every_rank(trainer.resume, trainer.keep_last)
        with self.run_folder_released_on_failure():
            check_loader_resumes(self.train_loader, self._resume_state)  # changed data: refused before the model loads
            self.model = self.load_model()
            self.model.train()
            self.optimizer = build_optimizer(self.model, config.optim)
            self.scheduler = build_scheduler(self.optimizer, self.total_steps, config.optim)
            self.update_settings = UpdateSettings(max_tokens_per_micro_batch=trainer.max_tokens_per_micro_batch,
                                                  grad_clip=trainer.grad_clip, seed=trainer.seed,
                                                  mask_key="response_mask", skip_on_device=True,
                                                  keep_gathered=self.memory_plan.keep_gathered)
            self.tracker = (Tracker(self.run_dir, trainer.loggers, config=config_to_dict(config),
                                    project=trainer.project_name, experiment=trainer.experiment_name)
                            if self.rank == 0 else SilentTracker())
            self.step = 0

    def _open_run_folder_on_every_rank(self, resume: str, keep_last: int) -> None:
        """Rank 0 locks the run folder, picks the checkpoint to resume from and writes config.yaml
        (``open_run_folder``); then the other ranks pick the same checkpoint, reading only."""
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                self.open_run_folder(resume, keep_last, RESUME_REFUSES)
            except BaseException as error:
                failure = error
        if self.world_size > 1:
            failed = all_reduce([float(failure is not None)], self.device)[0]
            if failure is None and failed:
                raise RuntimeError(f"rank 0 could not open the run folder {self.run_dir}; its error says why")
        if failure is not None:
            raise failure
        if self.rank != 0:
            self.checkpoints = CheckpointManager(self.run_dir, keep_last)
            self._resume_folder = self.checkpoints.resolve(resume, set_aside=False)
            self._resume_state = None if self._resume_folder is None else load_trainer_state(self._resume_folder)
            self._remove_old_checkpoints = False

    def _dataset(self, files: list[str], split: str, max_samples: int | None) -> PreferenceDataset:
        data = self.config.data
        return PreferenceDataset(files, self.tokenizer, max_length=data.max_length, truncation=data.truncation,
                                 keys=preference_keys(self.config), chat_template=data.chat_template,
                                 max_samples=max_samples, need_prompt=self.need_prompt, name=split)

    def _plan_memory(self) -> PreferencePlan:
        """The micro-batch budget and recompute for this device, model and pairs (``memory_plan.py``), applied to
        the config and logged in one line; a run that cannot fit is refused before the model loads."""
        pairs = [*self.train_set.pairs, *(self.val_set.pairs if self.val_set is not None else [])]
        plan = apply_preference_plan(self.config, pairs, self.device, self.world_size)
        if self.rank == 0:
            logger.info("%s", plan.line)
        return plan

    def load_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def micro_batches(self, batch: Batch) -> Iterator[Batch]:
        """The micro-batches of this rank's share of ``batch`` on the device, without an update (validation,
        scoring); every rank makes the same number."""
        budget = self.config.trainer.max_tokens_per_micro_batch
        for micro in pair_micro_batches(rank_share(batch), budget, "response_mask"):
            yield micro.to(self.device, non_blocking=True)

    def score_pairs(self, model: torch.nn.Module, loader: PairLoader, score: PairScore) -> Tensor:
        """(pairs, 2): ``score(model, micro)`` of each pair's chosen and rejected row, for every pair of ``loader``.

        The pass is the training forward itself, in training mode with grad on, each micro-batch's graph dropped
        as soon as its scores are read: the compiled decoder layers then run the graphs the training step runs
        (a no-grad or eval-mode pass would compile variants of its own, which on a 1.5B model cost more than
        the whole pass), in micro-batches of the training budget. A model with active dropout is scored in eval
        mode instead, so the scores are deterministic. The scores stay on the device until the end of the pass:
        one copy to the host, no wait for the device per micro-batch. ``on_first_micro_batch`` (if set) is
        called once the first micro-batch's scores are queued.
        """
        out = torch.zeros(len(loader.pairs), 2)
        was_training = model.training
        model.train(not active_dropout(model))
        indices, weights, values = [], [], []
        for batch in loader.batches_of_one_pass():
            for micro in self.micro_batches(batch):
                values.append(score(model, micro).detach().float())
                indices.append(micro["pair_index"])
                weights.append(micro["pair_weight"])
                if self.on_first_micro_batch is not None:
                    self.on_first_micro_batch(micro)
                    self.on_first_micro_batch = None
        model.train(was_training)
        reshard(model)
        pair_index, real = torch.cat(indices).cpu(), torch.cat(weights).cpu() > 0
        sides = torch.arange(len(real)) % 2  # rows 2i and 2i + 1 of every micro-batch: chosen, rejected
        gathered = gather_from_ranks({"index": torch.stack([pair_index[real], sides[real]], dim=1),
                                      "value": torch.cat(values).cpu()[real]})
        rows, columns = gathered["index"].T
        out[rows, columns] = gathered["value"]
        return out

    router_recorder: RouterRecorder | None = None
    """A mixture of experts' router recorder (``engine.moe.prepare_moe_training``), set by ``load_model``."""
    router_aux_loss_coef: float = 0.0
    """The weight of its load-balancing loss (``engine.moe.trained_aux_loss_coef``)."""

    def with_router_loss(self, loss: Tensor, step_metrics: dict[str, Tensor], body: torch.nn.Module, micro: Batch,
                         share: Tensor, routed: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``loss`` plus the routers' load-balancing loss of the forward just recorded (over ``body``'s routers, the
        micro-batch's tokens weighed as in a padded forward) times its weight, and ``routed`` plus its expert slots.

        ``share``: the micro-batch's part of the mini-batch's pairs (the shares add up to 1), which weighs its aux
        loss as it weighs the preference loss; logged as ``moe/aux_loss``. A rank's stand-in pair (share 0) adds no
        slots. A dense model: both as they are."""
        recorder = self.router_recorder
        router = (recorder.take(with_grad=bool(self.router_aux_loss_coef),
                                token_weights=routed_token_weights(body, micro)) if recorder else None)
        if router is None:
            return loss, routed
        aux_loss = router.aux_loss * share
        step_metrics["moe/aux_loss"] = aux_loss.detach()
        if self.router_aux_loss_coef:
            loss = loss + self.router_aux_loss_coef * aux_loss
        slots = router.expert_counts.detach() * (share > 0)
        return loss, slots if routed is None else routed + slots

    def prepare_next_step(self) -> None:
        """Build the next step's batch and micro-batches now (packing plans made; on CUDA in page-locked memory, so
        their copies to the device do not wait), while the device runs this step's last backward: that step
        then starts on the device at once. One process only (making them is agreed over the ranks)."""
        if self.world_size > 1 or self.step + 1 >= self.total_steps:
            return
        batch = self.train_loader.peek_batch()
        budget = self.config.trainer.max_tokens_per_micro_batch
        pieces = list(pair_micro_batches(batch, budget, "response_mask"))
        self._prepared = (batch, [page_locked(piece) for piece in pieces] if self.device.type == "cuda" else pieces)

    def update(self, batch: Batch) -> tuple[ModelUpdate, Iterator[tuple[Batch, MiniBatchCounts]]]:
        """One optimizer step over ``batch``: the update and its micro-batches of this rank's share of the pairs,
        each with the counts of the whole batch over every rank (those ``prepare_next_step`` made, if it made
        this batch's)."""
        split: Callable[[Batch, int, str], Iterator[Batch]] = pair_micro_batches
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] is batch:
            pieces = prepared[1]
            split = lambda mini_batch, budget, mask_key: iter(pieces)  # noqa: E731
        update = ModelUpdate(self.model, self.optimizer, self.scheduler, self.update_settings, self.device,
                             split=split)
        return update, self._then_the_next_step(update.micro_batches(rank_share(batch)))

    def _then_the_next_step(self, micro_batches: Iterator[tuple[Batch, MiniBatchCounts]]
                            ) -> Iterator[tuple[Batch, MiniBatchCounts]]:
        """The micro-batches, then ``prepare_next_step`` once the step has queued the last one's backward (the
        device runs it meanwhile)."""
        yield from micro_batches
        self.prepare_next_step()

    # ---- the run ------------------------------------------------------------------------
    def save(self) -> Path:
        """The checkpoint of the current step: rank 0 writes it, every rank takes part in gathering its weights."""
        if self.world_size == 1:
            return super().save()
        if self.rank == 0:
            folder = super().save()
        else:
            folder = self.checkpoints.folder_of(self.step)
            self.write_checkpoint(folder)  # the collective gathers; only rank 0 writes files
        barrier()
        return folder

    def write_checkpoint(self, folder: Path) -> None:
        save_training_state(folder, self.model, self.optimizer, self.scheduler)
        save_hf_folder(self.model, self.tokenizer, folder / "hf",
                       dtype=compute_dtype(self.device, self.config.model.dtype))

    def load_checkpoint_state(self, folder: Path, state: dict[str, Any]) -> None:
        load_training_state(folder, self.model, self.optimizer, self.scheduler, self.device)




def page_locked(piece: Batch) -> Batch:
    """``piece`` with its tensors and its packing plan's in page-locked host memory (CUDA)."""
    locked = Batch({key: value.pin_memory() for key, value in piece.tensors.items()}, dict(piece.non_tensors),
                   dict(piece.meta))
    plan = piece.meta.get(PLAN_KEY)
    if plan is not None:
        locked.meta[PLAN_KEY] = dataclasses.replace(plan, **{
            field.name: getattr(plan, field.name).pin_memory() for field in dataclasses.fields(plan)
            if isinstance(getattr(plan, field.name), Tensor)})
    return locked
