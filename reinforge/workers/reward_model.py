"""The reward-model worker: a classification model (num_labels=1) scoring each response at its last token.

A role like the reference policy: sharded with FSDP2 on the actor's devices (or on a pool of its
own), frozen, in the compute dtype. With ``reward.reward_model.offload`` its weights wait on the
host between calls, page-locked (``engine.host_weights``), and are copied to the device for each
scoring call, so the rollout and the update have the device without them.

Each sample becomes one reward-model sequence (``RewardInputs``):
- with ``input_tokenizer=null``, the policy's own prompt and response ids exactly as sampled (verl's null);
- when the reward model reads text as the policy does (same vocabulary and chat template), the policy's own prompt
  and response ids, and after a chat response that ends its turn what the template writes after the turn (ChatML's
  newline): the whole conversation's rendering, which ``reinforge rm`` trains on, transformers' and TRL's scoring
  read, and verl's re-rendering (its default) gives;
- otherwise the response is re-rendered, as verl does: decoded with the policy's tokenizer (special tokens
  kept, the EOS string removed, and so are the special tokens it ends with: the end-of-turn token the rollout
  stopped at is not the tokenizer's EOS for every template, Gemma's ``<end_of_turn>``), appended as the
  assistant turn to the row's raw prompt messages, rendered with the reward model's chat template without a
  generation prompt, and tokenized without special tokens (the template writes them); a plain-text prompt is
  followed by the text and, where the response finished, the reward model's EOS (as ``reinforge rm``'s and
  TRL's plain pairs end), tokenized with the special tokens the reward model's tokenizer adds (its BOS).
Sequences longer than ``max_length`` are cut on the right (counted). The samples of one prompt
keep their common leading tokens as a shared prompt, so the packed forward computes it once;
the score is the head's output at the sequence's last token, placed on the policy response's
last token (``rm_scores``, as ``token_level_scores``). A sequence classifier's sequence ends at its last token that
is not the model's pad token, where transformers' class reads the score (and ``reinforge rm`` trained it): a response
ending in an EOS that is also the pad token is read at the token before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from reinforge.config.schema import Config
from reinforge.controller import Dispatch, Worker, register
from reinforge.data.chat_template import after_end_of_turn_ids, apply_chat_template, chat_template_text
from reinforge.engine.device import compute_dtype, resolve_device
from reinforge.engine.forward import ScoringPass, last_token_scores
from reinforge.engine.fsdp import shard_model
from reinforge.engine.fused import prepare_for_training
from reinforge.engine.host_weights import HostWeights
from reinforge.models import load_tokenizer
from reinforge.models.loading import is_local_path, tokens_read_otherwise
from reinforge.models.reward_model import (
    classifier_pad_token_id,
    load_reward_model,
    score_head,
    without_trailing_padding,
)
from reinforge.protocol import Batch
from reinforge.reward.manager import place_on_last_token
from reinforge.workers.memory_settings import apply_memory_plan


def reads_like_policy(rm_tokenizer: Any, policy_tokenizer: Any, policy_template: str | None) -> bool:
    """Whether the reward model tokenizes and templates text as the policy does (its ids can be read as they are)."""
    return (rm_tokenizer.get_vocab() == policy_tokenizer.get_vocab()
            and chat_template_text(rm_tokenizer) == policy_template)


def check_reads_policy_ids(rm_tokenizer: Any, policy_tokenizer: Any, rm_path: str) -> None:
    """With input_tokenizer=null the reward model reads the policy's token ids: each must mean the same token to it."""
    moved = tokens_read_otherwise(policy_tokenizer, rm_tokenizer)
    if moved:
        raise ValueError(f"reward.reward_model.input_tokenizer=null has the reward model read the policy's token ids, "
                         f"but {len(moved)} of the policy's {len(policy_tokenizer.get_vocab())} tokens (first "
                         f"{moved[0]!r}) have another id or none in the tokenizer of {rm_path}; set "
                         "reward.reward_model.input_tokenizer=auto to re-render the responses in the reward model's "
                         "chat template")


class RewardInputs:
    """The reward model's input rows for a batch of the policy's samples.

    ``policy_tokenizer`` None: the policy's ids are read as they are (no re-rendering), with ``after_turn`` (the
    template's end-of-turn id, the ids it writes after it) added after a chat response ending in that token.
    ``classifier_pad_token_id``: a sequence classifier's pad token (its text config's), whose trailing tokens each sequence
    drops (the class reads its score before them).
    """

    def __init__(self, rm_tokenizer: Any, policy_tokenizer: Any | None, max_length: int,
                 classifier_pad_token_id: int | None = None,
                 after_turn: tuple[int, Sequence[int]] | None = None):
        self.rm_tokenizer, self.policy_tokenizer, self.max_length = rm_tokenizer, policy_tokenizer, max_length
        self.after_turn = after_turn
        self.pad_token_id = rm_tokenizer.pad_token_id if rm_tokenizer.pad_token_id is not None else 0
        self.classifier_pad_token_id = classifier_pad_token_id
        self.policy_special_ids = set() if policy_tokenizer is None else special_token_ids(policy_tokenizer)

    def sequences(self, batch: Batch) -> tuple[list[list[int]], list[bool]]:
        """Each sample's token ids for the reward model, cut to max_length, and whether it was cut."""
        prompt_width = batch["prompts"].shape[1]
        attention = batch["attention_mask"].bool()
        raw_prompts = batch.non_tensors.get("raw_prompt", [None] * len(batch))
        sequences, truncated = [], []
        for row in range(len(batch)):
            response = batch["input_ids"][row, prompt_width:][attention[row, prompt_width:]].tolist()
            if self.policy_tokenizer is None:
                ids = batch["input_ids"][row, :prompt_width][attention[row, :prompt_width]].tolist() + response
                if (self.after_turn is not None and response and response[-1] == self.after_turn[0]
                        and raw_prompts[row] is not None and not isinstance(raw_prompts[row], str)):
                    ids += self.after_turn[1]
            else:
                ids = self.rendered(batch.non_tensors["raw_prompt"][row], response)
            truncated.append(len(ids) > self.max_length)
            sequences.append(without_trailing_padding(ids[:self.max_length], self.classifier_pad_token_id, keep=2))
        return sequences, truncated

    def rendered(self, raw_prompt: Any, response_ids: list[int]) -> list[int]:
        """The prompt with the response as its assistant turn, in the reward model's chat template, as its ids."""
        end = len(response_ids)
        while end and response_ids[end - 1] in self.policy_special_ids:  # where it stopped: the template closes the turn
            end -= 1
        text = self.policy_tokenizer.decode(response_ids[:end], skip_special_tokens=False)
        eos = self.policy_tokenizer.eos_token
        if eos:
            text = text.replace(eos, "")
        if isinstance(raw_prompt, str):  # no template writes its special tokens (a BOS): its tokenizer adds them,
            finished = end < len(response_ids)  # and a finished answer ends in its EOS, as rm's plain pairs end
            rm_eos = self.rm_tokenizer.eos_token if finished and self.rm_tokenizer.eos_token else ""
            return list(self.rm_tokenizer(raw_prompt + text + rm_eos)["input_ids"])
        messages = [dict(message) for message in raw_prompt] + [{"role": "assistant", "content": text}]
        full = apply_chat_template(self.rm_tokenizer, messages, add_generation_prompt=False, tokenize=False)
        return list(self.rm_tokenizer(full, add_special_tokens=False)["input_ids"])

    def build(self, batch: Batch) -> tuple[Batch, Tensor]:
        """(the reward model's rows in the rollout layout, (B,) bool: cut to max_length)."""
        sequences, truncated = self.sequences(batch)
        groups = batch.non_tensors.get("uid")
        return layout(sequences, groups, self.pad_token_id), torch.tensor(truncated)


def special_token_ids(tokenizer: Any) -> set[int]:
    """The ids of ``tokenizer``'s special tokens: its named ones (EOS, pad...) and the added tokens marked special."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {*getattr(tokenizer, "all_special_ids", ()),
            *(token_id for token_id, token in decoder.items() if getattr(token, "special", False))}


def _common_prefix(sequences: Sequence[list[int]]) -> int:
    first, length = sequences[0], min(len(sequence) for sequence in sequences)
    for position in range(length):
        if any(sequence[position] != first[position] for sequence in sequences[1:]):
            return position
    return length


def layout(sequences: list[list[int]], groups: Sequence[Any] | None, pad_token_id: int) -> Batch:
    """Sequences in the rollout layout ``[left-padded prompt | right-padded response]``.

    The samples of one group (the same ``uid``) share as prompt their common leading tokens, all but the last
    token of the shortest, so every sequence keeps one response token at least; the packed forward then
    computes that prompt once. Each sequence needs two tokens at least.
    """
    short = [row for row, sequence in enumerate(sequences) if len(sequence) < 2]
    if short:
        raise ValueError(f"sample {short[0]} gives the reward model {len(sequences[short[0]])} token(s); it needs "
                         "two at least (raise reward.reward_model.max_length)")
    members: dict[Any, list[int]] = {}
    for row in range(len(sequences)):
        members.setdefault(groups[row] if groups is not None else row, []).append(row)
    prompt_lengths = [0] * len(sequences)
    for rows in members.values():
        shared = min(_common_prefix([sequences[row] for row in rows]),
                     min(len(sequences[row]) for row in rows) - 1)
        for row in rows:
            prompt_lengths[row] = shared
    for row, length in enumerate(prompt_lengths):
        prompt_lengths[row] = max(length, 1)
    prompt_width = max(prompt_lengths)
    response_width = max(len(sequence) - length for sequence, length in zip(sequences, prompt_lengths, strict=True))
    prompts = torch.full((len(sequences), prompt_width), pad_token_id, dtype=torch.long)
    responses = torch.full((len(sequences), response_width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompts)
    response_mask = torch.zeros_like(responses)
    for row, (sequence, length) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        rest = len(sequence) - length
        prompts[row, prompt_width - length:] = torch.tensor(sequence[:length])
        prompt_mask[row, prompt_width - length:] = 1
        responses[row, :rest] = torch.tensor(sequence[length:])
        response_mask[row, :rest] = 1
    return Batch.from_dict(tensors={"prompts": prompts, "responses": responses,
                                    "input_ids": torch.cat([prompts, responses], dim=1),
                                    "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
                                    "response_mask": response_mask})


def reads_before_padding(model: torch.nn.Module) -> bool:
    """Whether transformers' own forward of ``model`` reads its score at the last token that is not padding (a
    sequence classifier's does; a token classifier scores every token, and the worker reads the last)."""
    return isinstance(model, PreTrainedModel) and type(model).__name__.endswith("ForSequenceClassification")


class RewardModelWorker(Worker):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        settings = config.reward.reward_model
        self.device = resolve_device(config.trainer.device)
        apply_memory_plan(config)  # a no-op when the trainer or this process planned already
        self.model = load_reward_model(settings.model_path, dtype=compute_dtype(self.device, config.model.dtype),
                                       device=self.device, trust_remote_code=settings.trust_remote_code)
        prepare_for_training(self.model, self.device)
        shard_model(self.model, self.device, config.model.dtype, roots=[self.model.base_model, score_head(self.model)])
        self.host_weights = None
        if settings.offload and self.device.type != "cpu":  # on the CPU the device is the host already
            self.host_weights = HostWeights(self.model)
            self.host_weights.release()
        self.max_tokens = int(settings.max_tokens_per_micro_batch or config.actor.max_tokens_per_micro_batch)
        self.inputs = build_reward_inputs(config)
        if reads_before_padding(self.model):
            self.inputs.classifier_pad_token_id = classifier_pad_token_id(self.model.config)

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        if self.host_weights is None:
            yield
            return
        self.host_weights.restore()
        try:
            yield
        finally:
            self.host_weights.release()

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_rm_score(self, batch: Batch) -> Batch:
        """rm_scores (B, R): each sample's reward-model score on its last response token; rm_truncated (B,):
        whether its reward-model input was cut to max_length."""
        inputs, truncated = self.inputs.build(batch)
        with self._on_device(), ScoringPass(self.model, inputs, self.max_tokens, self.device) as scoring:
            for micro in scoring:
                scoring.add(last_token_scores(self.model, micro))
        (scores,) = scoring.outputs()
        rm_scores = place_on_last_token(scores[:, 0], batch["response_mask"].cpu())
        return Batch.from_dict(tensors={"rm_scores": rm_scores, "rm_truncated": truncated})


def build_reward_inputs(config: Config) -> RewardInputs:
    """``RewardInputs`` for the run: the reward model's tokenizer, the policy's where the two read text differently
    (and reward.reward_model.input_tokenizer is not null), and the length limit."""
    settings, model = config.reward.reward_model, config.model
    rm_tokenizer = load_tokenizer(settings.model_path, trust_remote_code=settings.trust_remote_code)
    policy_tokenizer, after_turn = None, None
    if settings.input_tokenizer is not None:
        path = settings.input_tokenizer if settings.input_tokenizer != "auto" else (model.tokenizer_path or model.path)
        if settings.input_tokenizer != "auto" and is_local_path(path) and not Path(path).expanduser().is_dir():
            raise FileNotFoundError(f"reward.reward_model.input_tokenizer={path} is not a folder; give the policy's "
                                    "tokenizer folder, auto (the policy's) or null (never re-render responses)")
        policy_tokenizer = load_tokenizer(path, trust_remote_code=model.trust_remote_code)
        template = chat_template_text(policy_tokenizer, config.data.chat_template)
        same_vocabulary = rm_tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        if reads_like_policy(rm_tokenizer, policy_tokenizer, template) or (
                same_vocabulary and not rm_tokenizer.chat_template):  # no template of its own: it reads the policy's
            after_turn = after_end_of_turn_ids(policy_tokenizer, template)
            policy_tokenizer = None
        elif not rm_tokenizer.chat_template:
            raise ValueError(f"reward.reward_model.model_path={settings.model_path} has a tokenizer of its own but no "
                             "chat template to re-render the responses in; add its chat template to the folder's "
                             "tokenizer_config.json, or use a reward model with the policy's tokenizer")
    else:
        policy_tokenizer = load_tokenizer(model.tokenizer_path or model.path, trust_remote_code=model.trust_remote_code)
        check_reads_policy_ids(rm_tokenizer, policy_tokenizer, settings.model_path)
        policy_tokenizer = None  # null: the policy's ids exactly as sampled, read at their last token (verl's null)
    # unset: room for the longest sample, and for what the template writes after a turn it ended
    max_length = settings.max_length or (config.data.max_prompt_length + config.data.max_response_length
                                         + (len(after_turn[1]) if after_turn else 0))
    return RewardInputs(rm_tokenizer, policy_tokenizer, max_length, after_turn=after_turn)
