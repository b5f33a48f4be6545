"""trainer.mode=async: the trainer's side of fully asynchronous training.

The ``Rollouter`` thread streams finished, scored prompt groups; each training step takes
``data.train_batch_size`` of them (in admission order), adds the decoupled-PPO pieces when any
token is stale (``decoupled.py``) and runs the trainer's step (``TrainerCalls.train_on_batch``). Every
``trainer.trigger_sync_steps`` updates the rollout's weights are synced and the version grows;
samples in flight then continue under the new weights (partial rollouts with
``rollout.segment_tokens``). With the hybrid worker both sides share the device by turns
(``DeviceTurns``); with ``trainer.separate_rollout`` the rollouter's segments run during the
updates and only a sync waits for the segment in progress.

Each step logs the rollouter's work since the step before: its generating time and rate (``timing_s/gen``,
``rollout/tokens_per_s``) and the engine's own ``rollout/*`` counts and phases over those segments
(``counters.combine_spans``: counts add up, peaks take the largest).

Checkpoints hold every admitted group not yet trained on, with its tokens, log-probs and
versions, so a resumed run loses none and repeats none. A checkpoint written between two syncs
(trainer.trigger_sync_steps > 1) also holds the rollout's weights, those of its version
(``ROLLOUT_WEIGHTS_FILE``): the resumed rollout samples with them, not with the trainer's newer ones.
Validation between two syncs samples with the trainer's current weights (``current_weights``), as
the checkpoint saved with it holds them; the rollout's version comes back after it. Which groups each step trained on is
written to ``async_groups.jsonl`` in the run folder, a line per step written as ``metrics.jsonl``'s are (synced,
cut back to the checkpoint's step on resume, atomically, a half-written line dropped).

With ``trainer.async_deterministic`` a sync waits until the rollouter waits for it, at a point
of its work fixed by ``hold_ahead`` (``Rollouter.hold_at``): the same seed then gives the same
groups, versions, metrics and weights. Otherwise, at max_staleness >= 1, how many segments run
before a sync depends on the threads' timing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from reinforge.config.schema import Config
from reinforge.protocol import Batch
from reinforge.rollout.native.counters import combine_spans
from reinforge.tracking.jsonl import append_json_line, truncate_after_step
from reinforge.trainer.dynamic_sampling import combine_reward_metrics, concat_generated
from reinforge.trainer.modes.decoupled import is_fresh, prepare_stale_batch
from reinforge.trainer.modes.device_turns import DeviceTurns
from reinforge.trainer.modes.rollouter import Rollouter
from reinforge.trainer.modes.staleness import StalenessBound, in_flight_limit, staleness_metrics
from reinforge.trainer.modes.trainer_calls import TrainerCalls
from reinforge.trainer.seeds import step_seed
from reinforge.workers.rollout_side import seed_for

GROUPS_FILE = "async_groups.jsonl"
ROLLOUT_WEIGHTS_FILE = "rollout_weights.pt"
"""In a checkpoint written between two syncs: the rollout's weights, those of its version."""


class AsyncMode:
    def __init__(self, config: Config, calls: TrainerCalls):
        self.config, self.calls = config, calls
        self.batch_size = config.data.train_batch_size
        self.turns = DeviceTurns()
        self.rollouter = Rollouter(
            next_prompts=calls.next_prompts,
            generate=lambda batch, params: calls.generate(batch, params, 0).result(),
            score=calls.score, seed_of=lambda position, uid: request_seed(config, position, uid),
            bound=StalenessBound(config.trainer.max_staleness, config.trainer.trigger_sync_steps * self.batch_size,
                                 in_flight_limit(config)),
            sampling=calls.sampling, n=config.rollout.n,
            segment_tokens=config.rollout.segment_tokens or config.data.max_response_length,
            batch_size=self.batch_size, pad_token_id=calls.pad_token_id, turns=self.turns,
            hold_ahead=hold_ahead(config))
        self.updates = 0
        self._last_step_end = time.perf_counter()
        self._idle_mark = 0.0
        self._tokens_mark = 0

    def start(self) -> None:
        truncate_after_step(self.calls.run_dir / GROUPS_FILE, self.calls.trained_steps())  # a killed try's later lines
        self._last_step_end = time.perf_counter()
        self.rollouter.start()

    def stop(self, wait_s: float | None = None) -> bool:
        """Stop the rollouter within ``wait_s`` seconds (None: no limit); True when its turn under way was abandoned
        (``Rollouter.stop``)."""
        return self.rollouter.stop(wait_s)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The rollouter is between turns (its state and the loader's are consistent) while this holds."""
        with self.turns.trainer():
            yield

    def next_batch(self) -> Batch:
        start = time.perf_counter()
        taken = self.rollouter.take(self.batch_size)
        waited = time.perf_counter() - start
        batch = concat_generated([rows for _, rows in taken], self.calls.pad_token_id)
        # counts add up, a score's mean is weighted by the groups' samples (rollouter.group_reward_metrics)
        reward_metrics = combine_reward_metrics([(rows.meta.get("reward_metrics", {}), len(rows)) for _, rows in taken])
        if "reward/overlong/count" in reward_metrics:
            reward_metrics["reward/overlong/fraction"] = reward_metrics["reward/overlong/count"] / max(len(batch), 1)
        batch.meta = {"reward_metrics": reward_metrics, "wait_s": waited,
                      "positions": [group.position for group, _ in taken]}
        return batch

    def train(self, batch: Batch) -> dict[str, float]:
        """One update on a batch from ``next_batch``; syncs the rollout's weights every trigger_sync_steps."""
        trigger = self.config.trainer.trigger_sync_steps
        step_start = time.perf_counter()
        timing = {"wait": batch.meta.pop("wait_s")}
        positions = batch.meta.pop("positions")
        metrics: dict[str, float] = {}
        # the hybrid worker takes turns with the rollouter for the update; a separate rollout worker generates
        # meanwhile and only waits for the sync (the version read here changes in this thread alone)
        with contextlib.nullcontext() if self.config.trainer.separate_rollout else self.turns.trainer():
            version = self.rollouter.version
            metrics |= staleness_metrics(batch["token_versions"], batch["response_mask"], version)
            if not is_fresh(batch, version, self.updates % trigger):
                batch = prepare_stale_batch(self.config, batch, self.calls.compute_log_prob,
                                            self.updates, metrics, trigger_sync_steps=trigger)
            metrics |= self.calls.train_on_batch(batch, timing, metrics, step_start)
            self.updates += 1
        if self.updates % trigger == 0:
            if self.rollouter.hold_ahead is not None:  # at the same point of the rollouter's work in every run
                self.rollouter.wait_until_parked()
            with self.turns.trainer():  # between the rollouter's segments: each is sampled by one version
                self.calls.sync_rollout_weights()
                self.rollouter.set_version(version + 1)
        now = time.perf_counter()
        window = max(now - self._last_step_end, 1e-9)
        idle = self.rollouter.idle_s - self._idle_mark
        tokens = float(self.rollouter.tokens - self._tokens_mark)
        busy = max(window - idle, 0.0)  # the rollouter's generating time since the last step ended
        metrics |= combine_spans(self.rollouter.take_spans())  # the engine's counts over the segments since then
        metrics |= {"async/version": float(self.rollouter.version), "async/admitted": float(self.rollouter.admitted),
                    "async/ready_groups": float(len(self.rollouter.ready)),
                    "async/trainer_idle_fraction": min(1.0, timing["wait"] / window),
                    "async/rollouter_idle_fraction": min(1.0, idle / window),
                    "async/rollout_tokens": tokens,
                    # the names the sync trainer logs its generation under, over the same window
                    "timing_s/gen": busy, "rollout/tokens_per_s": tokens / max(busy, 1e-9)}
        self._last_step_end, self._idle_mark, self._tokens_mark = now, self.rollouter.idle_s, self.rollouter.tokens
        self._record(positions, batch)
        return metrics

    def rollout_lags(self) -> bool:
        """Whether the trainer updated the weights since the last sync: the rollout samples with older ones."""
        return self.updates % self.config.trainer.trigger_sync_steps != 0

    @contextmanager
    def current_weights(self) -> Iterator[None]:
        """The rollout generates with the trainer's current weights while this holds (validation); then with those
        of its version again. The rollouter waits meanwhile, so none of its samples sees them."""
        calls = self.calls
        if not self.rollout_lags() or calls.rollout_copy_weights is None or calls.load_rollout_weights is None:
            yield
            return
        with self.turns.trainer():
            saved = _first(calls.rollout_copy_weights())
            calls.sync_rollout_weights()
            try:
                yield
            finally:
                calls.load_rollout_weights(saved)

    def write_checkpoint(self, folder: Path) -> None:
        """Between two syncs: the rollout's weights (its version's) into ``folder``, for ``read_checkpoint``."""
        if self.rollout_lags() and self.calls.rollout_copy_weights is not None:
            torch.save(_first(self.calls.rollout_copy_weights()), folder / ROLLOUT_WEIGHTS_FILE)

    def read_checkpoint(self, folder: Path) -> None:
        """The rollout takes back the weights of its version, where the checkpoint holds them (the trainer has
        synced the restored weights into it before)."""
        path = folder / ROLLOUT_WEIGHTS_FILE
        if path.is_file() and self.calls.load_rollout_weights is not None:
            self.calls.load_rollout_weights(torch.load(path, weights_only=True))

    def _record(self, positions: list[int], batch: Batch) -> None:
        uids = list(dict.fromkeys(str(uid) for uid in batch["uid"]))
        with open(self.calls.run_dir / GROUPS_FILE, "a", encoding="utf-8") as file:
            append_json_line(file, {"step": self.calls.trained_steps() + 1, "positions": positions, "uids": uids})

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "rollouter": self.rollouter.state_dict()}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        self.updates = state["updates"]
        self.rollouter.load_state_dict(state["rollouter"])


def _first(weights: Any) -> Any:
    """A group call's result on rank 0 (a list per rank on the local and Ray backends)."""
    return weights[0] if isinstance(weights, list) else weights


def hold_ahead(config: Config) -> int | None:
    """trainer.async_deterministic: the groups the rollouter hands over beyond those of the updates before a sync,
    then waits for it. A separate rollout worker readies the next update's batch meanwhile (generation overlaps
    the update); the hybrid worker stops where the trainer needs the device anyway, and the groups still running
    continue under the new weights."""
    if not config.trainer.async_deterministic:
        return None
    return config.data.train_batch_size if config.trainer.separate_rollout else 0


def request_seed(config: Config, position: int, uid: str) -> int:
    """The seed sync mode gives the request of prompt ``uid``, the ``position``-th prompt drawn."""
    step = position // config.data.train_batch_size
    return seed_for(step_seed(config.trainer.seed, step), uid)
