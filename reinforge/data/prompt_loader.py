"""Batches of prompts for the trainer: seeded, resumable order and collation into a ``Batch``.

The order of an epoch is a permutation drawn from ``(seed, epoch)`` alone, so a run resumed
from ``state_dict()`` (epoch and position within it) sees exactly the batches the first run
would have seen next, without replaying the data. Training drops the last incomplete batch
(every step has ``train_batch_size`` prompts) and runs epoch after epoch; validation goes over
every prompt once, in file order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from reinforge.config.schema import DataConfig
from reinforge.data.loader_state import data_digest, warn_if_contents_changed
from reinforge.data.rl_dataset import PromptExample, RLDataset
from reinforge.protocol import MULTI_MODAL_KEY, Batch


def epoch_order(num_rows: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Row positions in the order epoch ``epoch`` visits them: a permutation drawn from (seed, epoch) alone."""
    if not shuffle:
        return np.arange(num_rows)
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def collate_prompts(examples: Sequence[PromptExample], pad_token_id: int, uids: Sequence[str],
                    image_inputs: Sequence[dict[str, Any]] | None = None) -> Batch:
    """Prompts left-padded to the longest one, with their reward inputs.

    tensors: ``input_ids`` (B, P) int64 padded on the left with ``pad_token_id``,
    ``attention_mask`` (B, P) int64 (1 on prompt tokens).
    non_tensors: ``data_source``, ``ground_truth``, ``extra_info`` (dict), ``columns`` (dict of
    the row's other columns, for the reward function), ``raw_prompt`` (messages or string),
    ``index`` (row number in the files), ``uid`` (one per prompt), ``agent_name`` when any
    row names an agent loop (and meta ``AGENT_LOOPS`` when one is not ``single_turn``), and ``multi_modal_inputs`` (each row's pixel values and image grids,
    ``data.multimodal``) when ``image_inputs`` are given.
    """
    longest = max(len(example.prompt_ids) for example in examples)
    input_ids = torch.full((len(examples), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example.prompt_ids)
        if length:
            input_ids[row, longest - length:] = torch.tensor(example.prompt_ids, dtype=torch.long)
            attention_mask[row, longest - length:] = 1
    non_tensors = {}
    if any(example.agent_name for example in examples):
        non_tensors["agent_name"] = [example.agent_name for example in examples]
    if image_inputs is not None:
        non_tensors[MULTI_MODAL_KEY] = list(image_inputs)
    batch = Batch.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask},
        non_tensors=non_tensors | {
            "data_source": [example.data_source for example in examples],
            "ground_truth": [example.ground_truth for example in examples],
            "extra_info": [example.extra_info for example in examples],
            "columns": [example.columns for example in examples],
            "raw_prompt": [example.raw_prompt for example in examples],
            "index": [example.index for example in examples],
            "uid": list(uids),
        },
    )
    if any(example.agent_name not in (None, "", "single_turn") for example in examples):
        batch.meta[AGENT_LOOPS] = True  # every member's share goes through the agent loops, its single-turn rows too
    return batch


AGENT_LOOPS = "agent_loops"
"""The meta key of a prompt batch any row of which names a multi-turn agent loop: split over several members, each
share takes the agent path (and returns its columns), whatever rows it drew."""


class PromptLoader:
    """Batches of ``batch_size`` prompts from an ``RLDataset``.

    With ``repeat=True`` (training) iteration never ends: it continues from the saved
    position, epoch after epoch; ``len(loader)`` is the number of batches per epoch. With
    ``repeat=False`` (validation) each ``iter()`` is one fresh pass over the data.
    """

    def __init__(self, dataset: RLDataset, batch_size: int, pad_token_id: int, *, shuffle: bool = True,
                 seed: int = 1, drop_last: bool = True, repeat: bool = True,
                 size_key: str = "data.train_batch_size") -> None:
        """``size_key``: the setting ``batch_size`` came from, named when it is refused."""
        if pad_token_id is None:
            raise ValueError("the tokenizer has no pad token id; pass reinforge.data.get_pad_token_id(tokenizer), "
                             "which falls back to the EOS id")
        if batch_size < 1:
            raise ValueError(f"the {dataset.name} batch size is {batch_size}; it must be at least 1")
        if drop_last and batch_size > len(dataset):
            raise ValueError(f"{size_key}={batch_size} is larger than the {len(dataset)} {dataset.name} "
                             "prompts, so no full batch can be formed; lower the batch size or add data")
        self.dataset = dataset
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.repeat = repeat
        self.epoch = 0
        self.position = 0
        """Batches of the current epoch already handed out."""
        self._data_digest: str | None = None
        self._warned_of_changes = False

    @classmethod
    def for_training(cls, dataset: RLDataset, config: DataConfig, pad_token_id: int) -> PromptLoader:
        """Batches of data.gen_batch_size prompts (dynamic sampling), else data.train_batch_size."""
        return cls(dataset, config.gen_batch_size or config.train_batch_size, pad_token_id,
                   shuffle=config.shuffle, seed=config.seed, drop_last=True, repeat=True,
                   size_key="data.gen_batch_size" if config.gen_batch_size else "data.train_batch_size")

    @classmethod
    def for_validation(cls, dataset: RLDataset, config: DataConfig, pad_token_id: int) -> PromptLoader:
        batch_size = config.val_batch_size or len(dataset)
        return cls(dataset, batch_size, pad_token_id, shuffle=False, seed=config.seed, drop_last=False,
                   repeat=False)

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.dataset) // self.batch_size
        return -(-len(self.dataset) // self.batch_size)

    @property
    def batches_drawn(self) -> int:
        """Batches handed out since the first epoch began (``epoch * len(self) + position``): the data used, which
        ends a run whose steps draw a varying number of batches (dynamic sampling) after its epochs."""
        return self.epoch * len(self) + self.position

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset positions in the order epoch ``epoch`` visits them."""
        return epoch_order(len(self.dataset), self.seed, epoch, self.shuffle)

    def __iter__(self) -> Iterator[Batch]:
        if not self.repeat:
            order = self.epoch_order(0)
            for position in range(len(self)):
                yield self._batch(order, position, epoch=0)
            return
        while True:
            order = self.epoch_order(self.epoch)
            while self.position < len(self):
                position = self.position
                self.position += 1
                yield self._batch(order, position, self.epoch)
            self.epoch += 1
            self.position = 0

    def _batch(self, order: np.ndarray, position: int, epoch: int) -> Batch:
        rows = order[position * self.batch_size:(position + 1) * self.batch_size]
        examples = [self.dataset[int(row)] for row in rows]
        uids = [f"{self.dataset.name}-{epoch}-{example.index}" for example in examples]
        images = [self.dataset.image_inputs(example) for example in examples] \
            if any(example.images for example in examples) else None
        return collate_prompts(examples, self.pad_token_id, uids, images)

    def _digest(self) -> str:
        """``data_digest`` of the prompts' token ids and ground truths, made once."""
        if self._data_digest is None:
            examples = [self.dataset[position] for position in range(len(self.dataset))]
            self._data_digest = data_digest((example.prompt_ids for example in examples),
                                            (example.ground_truth for example in examples))
        return self._data_digest

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from, plus what must match for a resume to be exact."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "batch_size": self.batch_size, "num_prompts": len(self.dataset), "data_digest": self._digest()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, current in (("seed", self.seed), ("shuffle", self.shuffle), ("batch_size", self.batch_size),
                             ("num_prompts", len(self.dataset))):
            if key in state and state[key] != current:
                raise ValueError(f"the checkpoint's data loader had {key}={state[key]} but this run has {current}; "
                                 "resuming would not replay the same batches, so restore the data settings "
                                 "or start a new run")
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"the checkpoint's data loader position {state['position']} is outside the "
                             f"{len(self)} batches of an epoch")
        if not self._warned_of_changes:
            self._warned_of_changes = warn_if_contents_changed(state, self._digest(), f"{len(self.dataset)} prompts")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
