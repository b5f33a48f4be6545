"""DPO's reference log-probs in the run folder (``reference_logps.pt``): read back only when they are this run's, and
written so that no reader ever sees part of a file.

The file holds each split's (pairs, 2) log-probs of the chosen and rejected completions and the key they were
scored under: a hash of each split's token ids, the reference model, the dtype the forward computed in and the loss
type (``ipo`` scores a completion's mean), and the metrics of the pass that scored them (a run that starts over at
step 0 and reads the file back logs them with its first step, as the run that scored them did). ``read_reference`` gives them back only when the key is the run's and
every split has a row per pair. A file that cannot be read (cut short, not a reinforge file) or that was scored
for other pairs, another reference, dtype or loss is never used: one warning line names the file and what differs,
and the trainer scores them again. That costs one forward pass and loses nothing: the reference is the initial
policy (or ``dpo.reference_path``), so scoring again gives what the file would have held, had it been the run's.
``save_reference`` writes a temporary file beside it, syncs it to the disk and renames it over the old one: a kill
or a full disk leaves the previous file or none, never part of one.
"""

from __future__ import annotations

import errno
import logging
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from reinforge.atomic_files import replaced_atomically
from reinforge.tracking.jsonl import write_failure

logger = logging.getLogger(__name__)

REFERENCE_FILE = "reference_logps.pt"

KEY_DESCRIPTIONS = {"train": "other training pairs", "val": "other validation pairs"}
"""How a differing hash of a split's token ids reads in the warning (other key fields show both values)."""


def reference_mismatch(stored: Any, key: dict[str, str], num_pairs: dict[str, int]) -> str | None:
    """None when ``stored`` (a loaded file) holds the log-probs of this run: its ``key`` and a (pairs, 2) tensor for
    each split of ``num_pairs``; else what differs, as the end of a sentence about the file."""
    if not isinstance(stored, dict) or not isinstance(stored.get("key"), dict):
        return "is not a file of reference log-probs written by reinforge dpo"
    stored_key = stored["key"]
    differences = [KEY_DESCRIPTIONS.get(name) or f"{name} {stored_key.get(name)!r} (this run: {value!r})"
                   for name, value in key.items() if stored_key.get(name) != value]
    if differences:
        return "holds the reference log-probs of " + ", ".join(differences)
    for split, count in num_pairs.items():
        values = stored.get(split)
        if not isinstance(values, Tensor) or values.shape != (count, 2) or not values.is_floating_point():
            shape = tuple(values.shape) if isinstance(values, Tensor) else None
            return f"holds {shape} {split} log-probs where the run's {count} {split} pairs need ({count}, 2)"
    return None


def read_reference(path: Path, key: dict[str, str], num_pairs: dict[str, int]
                   ) -> tuple[dict[str, Tensor], dict[str, float]] | None:
    """Each split's (pairs, 2) reference log-probs stored at ``path`` and the metrics of the pass that scored them,
    or None when there is no file or it is not this run's (``key``, ``num_pairs`` by split; one warning line then
    says why)."""
    if not path.is_file():
        return None
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        if isinstance(error, OSError) and error.errno != errno.EINVAL:  # EINVAL: a seek past a file cut short
            raise  # a file this user may not read: the error names it, and scoring again would not help
        problem = "cannot be read (cut short, or not written by torch.save)"
    else:
        problem = reference_mismatch(stored, key, num_pairs)
    if problem is None:
        metrics = stored.get("metrics")
        return ({split: stored[split] for split in num_pairs},
                {name: float(value) for name, value in metrics.items()} if isinstance(metrics, dict) else {})
    logger.warning("%s %s; the reference log-probs are scored again and the file replaced", path, problem)
    return None


def save_reference(path: Path, key: dict[str, str], values: dict[str, Tensor], metrics: dict[str, float]) -> None:
    """Store ``values`` (each split's (pairs, 2) log-probs) and ``metrics`` (the pass's) under ``key`` at ``path``,
    atomically: a temporary file, synced, renamed over ``path``. A failed write removes the temporary file and
    raises one line naming ``path``."""
    try:
        with replaced_atomically(path) as staging, open(staging, "wb") as handle:  # a Python file: OSError on a full disk
            torch.save({"key": key, **values, "metrics": metrics}, handle)
    except OSError as error:
        raise write_failure(path, error, "the reference log-probs") from None
