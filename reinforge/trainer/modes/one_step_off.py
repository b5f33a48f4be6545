"""trainer.mode=one_step_off: batch k+1 is generated with the weights before update k, overlapping it.

Each step submits the generation of the next batch (``generate.async_call``) before it scores
and trains on the current one, then syncs the rollout's weights. The rollout has its own copy
of the weights (refreshed only by ``sync_rollout_weights``), so whatever order the device runs
the two calls in, batch k+1 comes from the weights before update k: one version stale, trained
with the decoupled PPO loss (``decoupled.py``). With the hybrid worker the generation and the
update queue on the same worker and run one after the other, and what overlaps is the
controller's work (scoring, advantages, logging); with ``trainer.separate_rollout`` a second
worker group generates, on its own thread (local backend, sharing the device) or its own pool
(Ray), so generation k+1 and update k run at the same time. The first batch is on-policy.

A checkpoint holds the batch generated ahead (the next step's, by the weights before the last update:
its tokens, log-probs and version), so a resumed run trains the same stale batch as an uninterrupted run,
and its metrics and weights are the uninterrupted run's. A checkpoint written before it held the batch
holds the prompts alone; those are generated again, with the restored weights.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from reinforge.config.schema import Config
from reinforge.controller.worker_group import GroupFuture
from reinforge.protocol import Batch, samples_of
from reinforge.trainer.modes.decoupled import is_fresh, prepare_stale_batch
from reinforge.trainer.modes.staleness import staleness_metrics
from reinforge.trainer.modes.trainer_calls import TrainerCalls
from reinforge.trainer.seeds import step_seed
from reinforge.trainer.validation import without_prompt_tensors


class OneStepOffMode:
    def __init__(self, config: Config, calls: TrainerCalls):
        self.config, self.calls = config, calls
        self.version = 0
        """Weight syncs so far: the version the next submitted generation samples with."""
        self.drawn = 0
        """Prompt batches drawn from the loader (each one's seed is that of the sync step of its index)."""
        self._pending: tuple[Batch, GroupFuture | Future, int, float] | None = None

    def start(self) -> None:
        pass

    def stop(self, wait_s: float | None = None) -> bool:
        """Let the generation ahead end before the groups shut down, within ``wait_s`` seconds (None: its call's own
        deadline); True when it did not, and is abandoned (its batch is never used). Its error is not raised here:
        ``next_batch`` raises it to the run, and raised again from the trainer's close it would skip the groups'
        shutdown."""
        if self._pending is None:
            return False
        pending, self._pending = self._pending[1], None
        with contextlib.suppress(Exception):  # a failed generation, or one still running after wait_s
            if wait_s is None:
                pending.result()
            else:
                pending.result(wait_s)
        return not pending.done()

    @contextmanager
    def paused(self) -> Iterator[None]:
        yield

    def _submit(self, prompts: Batch) -> None:
        batch = samples_of(prompts, self.config.rollout.n)
        seed = step_seed(self.config.trainer.seed, self.drawn)
        self.drawn += 1
        future = self.calls.generate(batch, self.calls.sampling, seed)
        self._pending = (batch, future, self.version, time.perf_counter())

    def next_batch(self) -> Batch:
        if self._pending is None:
            self._submit(self.calls.next_prompts())
        assert self._pending is not None
        batch, future, version, _ = self._pending
        start = time.perf_counter()
        generated = without_prompt_tensors(batch) | future.result()
        waited = time.perf_counter() - start
        self._submit(self.calls.next_prompts())  # batch k+1, with the weights before update k
        generated["token_versions"] = torch.where(generated["response_mask"].bool(), version, -1).long()
        start_reward = time.perf_counter()
        generated = generated | self.calls.score(generated)
        generated.meta |= {"timing": {"gen": waited, "reward": time.perf_counter() - start_reward}}
        return generated

    def train(self, batch: Batch) -> dict[str, float]:
        step_start = time.perf_counter()
        timing = batch.meta.pop("timing")
        metrics = staleness_metrics(batch["token_versions"], batch["response_mask"], self.version)
        if not is_fresh(batch, self.version, 0):
            batch = prepare_stale_batch(self.config, batch, self.calls.compute_log_prob,
                                        self.version, metrics, trigger_sync_steps=1)  # a sync after every update
        metrics |= self.calls.train_on_batch(batch, timing, metrics, step_start)
        self.calls.sync_rollout_weights()
        self.version += 1
        metrics["async/version"] = float(self.version)
        return metrics

    @contextmanager
    def current_weights(self) -> Iterator[None]:
        """The rollout has the trainer's current weights after every step (a sync follows each update)."""
        yield

    def write_checkpoint(self, folder: Path) -> None:
        """Nothing beyond ``state_dict``: the rollout's weights are the trainer's (synced after every update)."""

    def read_checkpoint(self, folder: Path) -> None:
        """Nothing beyond ``load_state_dict`` (see ``write_checkpoint``)."""

    def state_dict(self) -> dict[str, Any]:
        """The version, the batches drawn and the batch generated ahead, with its samples (the generation ran
        before the update and the sync that precede a checkpoint, so waiting for it costs nothing)."""
        pending = None
        if self._pending is not None:
            batch, future, version, _ = self._pending
            pending = {"batch": batch, "generated": future.result().to("cpu"), "version": version}
        return {"version": self.version, "drawn": self.drawn, "pending": pending}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        self.version, self.drawn = state["version"], state["drawn"]
        pending = state.get("pending")
        if pending is not None:
            width = pending["generated"]["responses"].shape[1]
            if width > self.calls.sampling.max_tokens:
                raise ValueError(f"data.max_response_length={self.calls.sampling.max_tokens} but the checkpoint's "
                                 f"batch generated ahead has responses of up to {width} tokens (trainer.mode="
                                 "one_step_off trains it next); resume with the checkpoint's data.max_response_length, "
                                 "or start a new run (trainer.resume=never)")
            generated: Future = Future()
            generated.set_result(pending["generated"])
            self._pending = (pending["batch"], generated, pending["version"], time.perf_counter())
        elif state.get("pending_prompts") is not None:  # an earlier checkpoint: the prompts alone, generated again
            self._submit(state["pending_prompts"])
