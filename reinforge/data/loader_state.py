"""A resumed data loader's check that its checkpoint was written over the same data and batch size."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def check_resumed_counts(state: dict[str, Any], count_key: str, count: int, counted: str, batch_size: int) -> None:
    """ValueError when ``state`` (a loader's ``state_dict`` from a checkpoint) counted another number of items under
    ``count_key`` than ``count`` (``counted``: what the checkpoint's data had, e.g. "data had 12 pairs"), or another
    batch size: the same position would then not continue the same epoch. A state without the counts (an older
    checkpoint) passes."""
    if count_key in state and state[count_key] != count:
        raise ValueError(f"the checkpoint's {counted.format(state[count_key])} but this run's has {count}: the data "
                         "files changed since, so resuming would not continue the same epoch; restore them, or start "
                         "a new run (trainer.resume=never)")
    if "batch_size" in state and state["batch_size"] != batch_size:
        raise ValueError(f"the checkpoint's data loader had batch_size={state['batch_size']} but this run has "
                         f"{batch_size}; restore data.batch_size, or start a new run (trainer.resume=never)")


def check_loader_resumes(loader: Any, trainer_state: dict[str, Any] | None) -> None:
    """The refusal of ``loader.load_state_dict`` for the loader state in ``trainer_state`` (a checkpoint's
    trainer_state.pt; None: a fresh run), raised now, before any model loads, rather than when the run resumes;
    the loader is left at the position it had."""
    if trainer_state is None or "loader" not in trainer_state:
        return
    position = loader.state_dict()
    loader.load_state_dict(trainer_state["loader"])
    loader.load_state_dict(position)


def data_digest(token_lists: Iterable[Sequence[int]], others: Iterable[Any] = ()) -> str:
    """A hash of the data's token ids (and of ``others``, e.g. the rows' ground truths, as JSON): equal for the same
    rows in the same order."""
    digest = hashlib.sha256()
    for ids in token_lists:
        digest.update(np.asarray(ids, dtype=np.int64).tobytes())
        digest.update(b"|")
    for other in others:
        digest.update(json.dumps(other, sort_keys=True, default=str).encode())
        digest.update(b"|")
    return digest.hexdigest()


def warn_if_contents_changed(state: dict[str, Any], digest: str, counted: str) -> bool:
    """Warn when ``state`` (a loader's ``state_dict`` from a checkpoint) hashed other data contents than ``digest``,
    though as many items (``counted``, e.g. "200 prompts"); whether it did. A state without the hash (an older
    checkpoint) passes."""
    if state.get("data_digest", digest) == digest:
        return False
    logger.warning("the data files changed since the checkpoint was written (the same %s, other contents): the "
                   "resumed epoch goes on over the changed rows at the same positions; restore the files to continue "
                   "exactly as the checkpoint's run would have, or start a new run (trainer.resume=never)", counted)
    return True
