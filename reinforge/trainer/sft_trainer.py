"""The SFT trainer: next-token loss on the assistant's tokens of chat conversations.

Each step takes ``data.batch_size`` conversations (or packed rows), splits them into
micro-batches by ``trainer.max_tokens_per_micro_batch`` and takes one optimizer step on the
token-mean loss over every trained token of the batch (the engine's ``ModelUpdate``, shared
with RL). The run folder is an RL run's: ``config.yaml``, ``metrics.jsonl`` and atomic
``checkpoints/step_N/`` with ``actor_state.pt``, ``trainer_state.pt`` and an ``hf/`` folder;
a run resumes from its latest checkpoint by default.

A mixture of experts trains as the RL actor does (``engine.moe``): the routers' load-balancing loss of each
micro-batch (transformers' aux loss over its unpadded tokens, which a packed row's conversations give as their
padded rows would), weighted by the micro-batch's share of the trained tokens as the token-mean loss is, joins the
loss times ``trainer.router_aux_loss_coef``: by default the model config's where its ``output_router_logits`` asks
(``declared``: whatever it says, as TRL's SFTTrainer takes it). It is logged as ``train/moe/aux_loss`` either way,
beside the whole step's ``train/moe/load_imbalance`` and ``train/moe/unused_experts``; ``train/loss`` stays the
token-mean loss alone.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from reinforge.algorithms import LossNormalizer, aggregate_loss, log_probs_from_logits
from reinforge.config import config_to_dict
from reinforge.config.sft_schema import SFTConfig
from reinforge.data.chat_template import get_pad_token_id
from reinforge.data.loader_state import check_loader_resumes
from reinforge.data.sft_dataset import SFTDataset, SFTLoader, pack_examples
from reinforge.engine.device import autocast_context, compute_dtype, resolve_device
from reinforge.engine.micro_batches import split_by_token_budget
from reinforge.engine.moe import pooled_routing_metrics, prepare_moe_training, trained_aux_loss_coef
from reinforge.engine.optim import build_optimizer, build_scheduler
from reinforge.engine.train_step import ModelUpdate, UpdateSettings, padded_micro_batches
from reinforge.models import load_causal_lm, load_tokenizer, save_hf_folder
from reinforge.models.signatures import takes_position_ids
from reinforge.models.vision import (
    image_token_mask,
    image_tokens_as_text,
    is_vision_language,
    why_no_images,
)
from reinforge.protocol import MULTI_MODAL_KEY, Batch
from reinforge.tracking import Tracker
from reinforge.trainer.preflight import preflight_sft
from reinforge.trainer.run_loop import SupervisedRun
from reinforge.workers.checkpointing import load_training_state, save_training_state

logger = logging.getLogger(__name__)

RESUME_REFUSES = ("model.path", "model.tokenizer_path", "data.train_files", "data.messages_key", "data.text_key",
                  "data.chat_template", "data.loss_on", "data.batch_size", "data.packing", "data.max_length",
                  "data.truncation", "data.image_key", "data.min_pixels", "data.max_pixels", "data.shuffle", "data.seed",
                  "data.max_train_samples", "trainer.seed")
"""Settings a resumed SFT run may not change: the checkpoint's weights or data order would not fit them (the pixel
bounds set each image's tokens, so the rows' lengths, their batches, and what the model was trained to see)."""


def token_log_probs(model: torch.nn.Module, micro: Batch) -> Tensor:
    """Log-prob (B, R) of each response token, each conversation read as if alone (``forward_log_probs``)."""
    return forward_log_probs(model, micro)[0]


def forward_log_probs(model: torch.nn.Module, micro: Batch) -> tuple[Tensor, Tensor]:
    """Log-prob (B, R) of each response token, and the weight (tokens,) of each token the forward ran, in its order
    (1 a conversation's token, 0 padding: the routers' statistics of a mixture of experts count the former).

    A packed micro-batch runs as it is where the model keeps a packed row's conversations apart by their restarting
    position ids alone (``reads_packed_rows``); otherwise, and for padded rows, each conversation runs as a row of
    its own, its tokens first and its padding after them, so that a model that numbers positions itself (BART's
    decoders) or carries a state along the row (RWKV, Mamba) reads it as it would alone. A vision-language model
    gets the rows' images and computes its multimodal positions itself."""
    responses = micro["responses"]
    if is_vision_language(model.config):
        inputs, text_tokens = vision_inputs(model, micro)
        # Without an attention mask, transformers reads sequence boundaries from restarting position ids.
        attention_mask = None if micro.meta.get("packed") else micro["attention_mask"]
        with image_tokens_as_text(model, micro["input_ids"], text_tokens) as input_ids:
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **inputs).logits
        return (log_probs_from_logits(logits[:, -responses.shape[1] - 1:-1].float(), responses),
                micro["attention_mask"].reshape(-1).float())
    if micro.meta.get("packed") and reads_packed_rows(model):
        logits = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"], use_cache=False).logits
        return (log_probs_from_logits(logits[:, -responses.shape[1] - 1:-1].float(), responses),
                micro["attention_mask"].reshape(-1).float())
    return _each_conversation_alone(model, micro)


def _each_conversation_alone(model: torch.nn.Module, micro: Batch) -> tuple[Tensor, Tensor]:
    """``forward_log_probs`` with one right-padded row a conversation (each starts at position id 0)."""
    input_ids, attended = micro["input_ids"], micro["attention_mask"].bool()
    rows, width = input_ids.shape
    flat = attended.reshape(-1).nonzero().squeeze(1)  # a conversation's tokens are consecutive in a row
    starts = micro["position_ids"].reshape(-1)[flat] == 0
    conversation = starts.cumsum(0) - 1
    first = flat[starts]
    within = flat - first[conversation]
    lengths = torch.bincount(conversation, minlength=len(first))
    columns = torch.arange(int(lengths.max()), device=input_ids.device)
    mask = (columns < lengths[:, None]).long()
    ids = torch.zeros(mask.shape, dtype=input_ids.dtype, device=input_ids.device)
    ids[conversation, within] = input_ids.reshape(-1)[flat]
    positions = {"position_ids": (columns * mask)} if takes_position_ids(model) else {}
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False, **positions).logits
    alone = log_probs_from_logits(logits[:, :-1].float(), ids[:, 1:])
    predicted = within > 0  # a conversation's first token is predicted by nothing
    log_probs = alone.new_zeros(rows * width)
    log_probs[flat[predicted]] = alone[conversation[predicted], within[predicted] - 1]
    return log_probs.view(rows, width)[:, width - micro["responses"].shape[1]:], mask.reshape(-1).float()


READS_PACKED_ROWS = "_reinforge_reads_packed_rows"
"""The attribute a model keeps its answer of ``reads_packed_rows`` in."""


def reads_packed_rows(model: torch.nn.Module) -> bool:
    """Whether ``model``, given a packed row's restarting position ids and no attention mask, gives each sequence the
    logits it gives it alone: transformers' masks keep them apart for most attention models, but a model that
    numbers positions itself (BART's decoders), carries a state along the row (RWKV, Mamba) or builds its masks
    otherwise reads across them. Probed once, in float32 without dropout, with two sequences of three tokens; the
    answer is kept on the model."""
    known = getattr(model, READS_PACKED_ROWS, None)
    if known is not None:
        return known
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = (torch.arange(6, device=device) * 7 + 3) % vocab
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]], device=device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            packed = model(input_ids=ids[None], position_ids=positions, use_cache=False).logits[0, 3:].float()
            alone = model(input_ids=ids[None, 3:], position_ids=positions[:, 3:], use_cache=False).logits[0].float()
        known = bool(torch.allclose(packed.log_softmax(-1), alone.log_softmax(-1), rtol=0, atol=1e-4))
    except Exception:  # noqa: BLE001 (a model that takes no packed row: each conversation alone)
        known = False
    finally:
        model.train(training)
    setattr(model, READS_PACKED_ROWS, known)
    return known


def vision_inputs(model: torch.nn.Module, micro: Batch) -> tuple[dict[str, Tensor], Tensor | None]:
    """A VLM's forward arguments for the padded micro-batch: its rows' pixels and grids, the images' tokens marked
    (``mm_token_type_ids``); and the tokens whose image-token id is text (outside the row's images, e.g. in a
    completion), None where there are none (``models.vision.image_tokens_as_text``)."""
    device = micro["input_ids"].device
    input_ids, attention = micro["input_ids"].cpu(), micro["attention_mask"].cpu().bool()
    row_inputs = micro.non_tensors.get(MULTI_MODAL_KEY)
    row_inputs = [None] * len(input_ids) if row_inputs is None else list(row_inputs)
    is_image = torch.zeros_like(attention)
    for row, images in enumerate(row_inputs):
        grid = images.get("image_grid_thw") if images else None
        try:
            is_image[row, attention[row]] = image_token_mask(model.config, input_ids[row][attention[row]],
                                                             grid.cpu() if grid is not None else None)
        except ValueError as error:
            raise ValueError(f"row {row} of the SFT micro-batch: {error}") from None
    text_tokens = (input_ids == model.config.image_token_id) & ~is_image
    inputs = {"mm_token_type_ids": is_image.int().to(device)}
    rows = [row for row in row_inputs if row]
    if rows:
        inputs |= {"pixel_values": torch.cat([row["pixel_values"] for row in rows]).to(device),
                   "image_grid_thw": torch.cat([row["image_grid_thw"] for row in rows]).to(device)}
    return inputs, text_tokens.to(device) if bool(text_tokens.any()) else None


class SFTTrainer(SupervisedRun):
    def __init__(self, config: SFTConfig):
        self.config = config
        data, trainer = config.data, config.trainer
        self.run_dir = Path(trainer.output_dir)
        processor = preflight_sft(config)  # every check that can run before the model loads
        self.open_run_folder(trainer.resume, trainer.keep_last, RESUME_REFUSES)
        with self.run_folder_released_on_failure():
            torch.manual_seed(trainer.seed)
            np.random.seed(trainer.seed)
            self.device = resolve_device(trainer.device)

            self.tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path,
                                            trust_remote_code=config.model.trust_remote_code)
            if data.chat_template:  # saved with every checkpoint's hf/: the model answers in the format it learned
                self.tokenizer.chat_template = data.chat_template
            self.processor = processor  # preflight's, loaded once; None: a text model
            pad_token_id = get_pad_token_id(self.tokenizer)
            self.train_loader = SFTLoader(self._rows(data.train_files, "train", data.max_train_samples),
                                          data.batch_size, pad_token_id, packed=data.packing, shuffle=data.shuffle,
                                          seed=data.seed, processor=self.processor)
            self.val_loader = None
            if data.val_files:
                self.val_loader = SFTLoader(self._rows(data.val_files, "val", data.max_val_samples), data.val_batch_size,
                                            pad_token_id, packed=data.packing, shuffle=False, processor=self.processor)
            self.total_steps = trainer.total_steps or len(self.train_loader) * trainer.total_epochs
            check_loader_resumes(self.train_loader, self._resume_state)  # changed data: refused before the model loads

            self.model = load_causal_lm(config.model.path, dtype=torch.float32, device=self.device,
                                        trust_remote_code=config.model.trust_remote_code,
                                        attn_implementation=config.model.attn_implementation,
                                        # SFT has no memory planner yet: auto means off
                                        gradient_checkpointing=config.model.gradient_checkpointing not in ("auto", False, 0))
            self.model.train()
            self.router_recorder, moe_line = prepare_moe_training(self.model)
            if moe_line:
                logger.info(moe_line)
            self.router_aux_loss_coef = trained_aux_loss_coef(
                self.model, self.router_recorder, trainer.router_aux_loss_coef, "trainer.router_aux_loss_coef")
            self.optimizer = build_optimizer(self.model, config.optim)
            self.scheduler = build_scheduler(self.optimizer, self.total_steps, config.optim)
            self.update_settings = UpdateSettings(max_tokens_per_micro_batch=trainer.max_tokens_per_micro_batch,
                                                  grad_clip=trainer.grad_clip, seed=trainer.seed, mask_key="loss_mask")
            self.tracker = Tracker(self.run_dir, trainer.loggers, config=config_to_dict(config), project=trainer.project_name,
                                   experiment=trainer.experiment_name)
            self.step = 0

    def _rows(self, files: list[str], split: str, max_samples: int | None) -> list:
        data = self.config.data
        dataset = SFTDataset(files, self.tokenizer, max_length=data.max_length, truncation=data.truncation,
                             messages_key=data.messages_key, text_key=data.text_key, chat_template=data.chat_template,
                             max_samples=max_samples, name=split, processor=self.processor,
                             image_key=data.image_key, loss_on=data.loss_on,
                             why_no_images=None if self.processor is not None else
                             why_no_images(self.config.model.path, self.config.model.trust_remote_code))
        return pack_examples(dataset.examples, data.max_length) if data.packing else dataset.examples

    # ---- the step ---------------------------------------------------------------------
    def train_step(self, batch: Batch) -> dict[str, float]:
        update = ModelUpdate(self.model, self.optimizer, self.scheduler, self.update_settings, self.device,
                             split=padded_micro_batches)
        recorder = self.router_recorder
        routed = None  # (layers, experts) slots of the whole step
        for micro, counts in update.micro_batches(batch):
            with (autocast_context(self.device, self.config.model.dtype),
                  recorder.recording_forward() if recorder else contextlib.nullcontext()):
                log_probs, token_weights = forward_log_probs(self.model, micro)
            nll_loss = aggregate_loss(-log_probs, micro["loss_mask"], "token-mean", LossNormalizer.of_counts(counts))
            loss, step_metrics = nll_loss, {"nll_loss": nll_loss}
            router = (recorder.take(with_grad=bool(self.router_aux_loss_coef),
                                    token_weights=token_weights) if recorder else None)
            if router is not None:  # the micro-batch's share of the trained tokens: the shares add up to 1
                aux_loss = router.aux_loss * (micro["loss_mask"].sum() / max(counts.num_tokens, 1.0))
                step_metrics["moe/aux_loss"] = aux_loss.detach()
                if self.router_aux_loss_coef:
                    loss = loss + self.router_aux_loss_coef * aux_loss
                slots = router.expert_counts.detach()
                routed = slots if routed is None else routed + slots
            update.backward(loss, step_metrics)
        metrics = update.metrics("train")
        moe_metrics = {}
        if routed is not None:
            moe_metrics = {"train/moe/aux_loss": metrics["train/moe/aux_loss"], **pooled_routing_metrics(routed, "train")}
        return {"train/loss": metrics["train/nll_loss"], "train/lr": metrics["train/lr"],
                "train/grad_norm": metrics["train/grad_norm"], "train/num_loss_tokens": float(batch["loss_mask"].sum()),
                **moe_metrics, "timing_s/step": update.seconds,
                "perf/tokens_per_s": metrics["perf/update_tokens_per_s/train"]}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Token-mean loss over every trained token of the validation set."""
        if self.val_loader is None:
            return {}
        self.model.eval()
        total_loss, total_tokens = 0.0, 0.0
        budget = self.config.trainer.max_tokens_per_micro_batch
        for batch in self.val_loader.batches_of_one_pass():
            for micro in split_by_token_budget(batch, budget):
                micro = micro.to(self.device)
                with autocast_context(self.device, self.config.model.dtype):
                    log_probs = token_log_probs(self.model, micro)
                total_loss += float(-(log_probs * micro["loss_mask"]).sum())
                total_tokens += float(micro["loss_mask"].sum())
        self.model.train()
        return {"val/loss": total_loss / max(total_tokens, 1.0)}

    # ---- the run ------------------------------------------------------------------------
    def write_checkpoint(self, folder: Path) -> None:
        save_training_state(folder, self.model, self.optimizer, self.scheduler)
        save_hf_folder(self.model, self.processor or self.tokenizer, folder / "hf",
                       dtype=compute_dtype(self.device, self.config.model.dtype),
                       processor_files_from=self.config.model.path)

    def load_checkpoint_state(self, folder: Path, state: dict[str, Any]) -> None:
        load_training_state(folder, self.model, self.optimizer, self.scheduler, self.device)

