"""The rollouter of the async mode: a thread that admits prompt groups under the staleness bound,
generates them segment by segment and hands finished, scored groups to the trainer.

Every turn on the device it (1) admits groups while ``StalenessBound.capacity`` allows, drawing
prompt batches from the loader as needed, (2) runs one segment for every unfinished sample
(``partial.run_segment``) with the weights of the current version, and (3) scores the groups
that finished and appends them to ``ready``. When nothing is admitted and nothing runs it waits
for the next weight sync (``set_version``): that wait is its idle time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from reinforge.protocol import Batch
from reinforge.rollout.base import SamplingParams
from reinforge.trainer.dynamic_sampling import concat_generated
from reinforge.trainer.modes.device_turns import DeviceTurns
from reinforge.trainer.modes.partial import PromptGroup, group_batch, groups_from_prompts, run_segment
from reinforge.trainer.modes.staleness import StalenessBound


class Rollouter:
    def __init__(self, *, next_prompts: Callable[[], Batch], generate: Callable[[Batch, SamplingParams], Batch],
                 score: Callable[[Batch], Batch], seed_of: Callable[[int, str], int], bound: StalenessBound,
                 sampling: SamplingParams, n: int, segment_tokens: int, batch_size: int, pad_token_id: int,
                 turns: DeviceTurns):
        self.next_prompts, self.generate, self.score, self.seed_of = next_prompts, generate, score, seed_of
        self.bound, self.sampling, self.n, self.segment_tokens = bound, sampling, n, segment_tokens
        self.batch_size, self.pad_token_id, self.turns = batch_size, pad_token_id, turns
        self.condition = threading.Condition()
        self.version = 0
        self.admitted = 0
        """Groups admitted so far (running, ready or consumed): the bound's accepted + running."""
        self.drawn = 0
        """Prompt groups drawn from the loader (admitted or waiting)."""
        self.waiting: list[PromptGroup] = []
        self.active: list[PromptGroup] = []
        self.ready: list[tuple[PromptGroup, Batch]] = []
        self.idle_s = 0.0
        self.tokens = 0
        self.admission_log: list[tuple[int, int, int]] = []
        """(admitted after this admission, version, limit) at every admission, for auditing the bound."""
        self._error: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- the thread ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollouter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self.condition:
            self._stopping = True
            self.condition.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        try:
            while not self._stopping:
                with self.turns.rollouter():
                    if self._stopping:
                        return
                    self._admit()
                    self.tokens += run_segment(self.generate, self.active, self.sampling, self.segment_tokens,
                                               self.version, self.pad_token_id)
                    self._hand_over_finished()
                    busy = bool(self.active)
                if not busy:
                    self._wait_for_capacity()
        except BaseException as error:  # raised again in the trainer's thread
            with self.condition:
                self._error = error
                self.condition.notify_all()

    def _admit(self) -> None:
        while self.bound.capacity(self.admitted, self.version) > 0:
            if not self.waiting:
                prompts = self.next_prompts()
                self.waiting = groups_from_prompts(prompts, self.drawn, self.n, self.seed_of)
                self.drawn += len(prompts)
            with self.condition:
                self.active.append(self.waiting.pop(0))
                self.admitted += 1
                limit = self.bound.limit(self.version)
                self.admission_log.append((self.admitted, self.version, limit))

    def _hand_over_finished(self) -> None:
        finished = [group for group in self.active if group.finished]
        if not finished:
            return
        response_length = self.sampling.max_tokens
        rows = concat_generated([group_batch(group, response_length, self.pad_token_id) for group in finished],
                                self.pad_token_id)
        scored = rows | self.score(rows)
        call_metrics = scored.meta.get("reward_metrics", {})
        with self.condition:
            for index, group in enumerate(finished):
                self.active.remove(group)
                group_rows = scored.index(slice(index * self.n, (index + 1) * self.n))
                group_rows.meta["reward_metrics"] = group_reward_metrics(call_metrics, group_rows, first=index == 0)
                self.ready.append((group, group_rows))
            self.condition.notify_all()

    def _wait_for_capacity(self) -> None:
        start = time.perf_counter()
        with self.condition:
            self.condition.wait_for(lambda: self._stopping or self.bound.capacity(self.admitted, self.version) > 0)
        self.idle_s += time.perf_counter() - start

    # ---- the trainer's side ----------------------------------------------------------------
    def take(self, num_groups: int) -> list[tuple[PromptGroup, Batch]]:
        """The first ``num_groups`` ready groups (waits for them), in admission order."""
        with self.condition:
            self.condition.wait_for(lambda: self._error is not None or len(self.ready) >= num_groups)
            if self._error is not None:
                raise RuntimeError(f"the rollouter failed: {self._error}") from self._error
            taken, self.ready = self.ready[:num_groups], self.ready[num_groups:]
        return sorted(taken, key=lambda item: item[0].position)

    def set_version(self, version: int) -> None:
        """A weight sync happened: samples in flight continue under the new weights; admission may resume."""
        with self.condition:
            self.version = version
            self.condition.notify_all()

    def state_dict(self) -> dict[str, Any]:
        """Everything admitted and not yet consumed, with its tokens; call while the rollouter is between turns."""
        with self.condition:
            return {"version": self.version, "admitted": self.admitted, "drawn": self.drawn,
                    "waiting": [group.state_dict() for group in self.waiting],
                    "active": [group.state_dict() for group in self.active] +
                              [group.state_dict() for group, _ in self.ready]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; finished groups among ``active`` are scored again on the first turn.

        The restored groups keep the samples they were admitted with: a checkpoint whose groups have
        another number of samples (rollout.n changed) or longer ones (data.max_response_length lowered)
        cannot be continued, as ``_hand_over_finished`` cuts the scored rows into groups of ``n``.
        """
        for group in [*state["waiting"], *state["active"]]:
            if len(group["samples"]) != self.n:
                raise ValueError(f"rollout.n={self.n} but the checkpoint's admitted prompt groups have "
                                 f"{len(group['samples'])} samples each (trainer.mode=async continues them); resume "
                                 f"with rollout.n={len(group['samples'])}, or start a new run (trainer.resume=never)")
            longest = max((len(sample["tokens"]) for sample in group["samples"]), default=0)
            if longest > self.sampling.max_tokens:
                raise ValueError(f"data.max_response_length={self.sampling.max_tokens} but the checkpoint's "
                                 f"admitted prompt groups have responses of {longest} tokens already "
                                 "(trainer.mode=async continues them); resume with the checkpoint's "
                                 "data.max_response_length, or start a new run (trainer.resume=never)")
        self.version, self.admitted, self.drawn = state["version"], state["admitted"], state["drawn"]
        self.waiting = [PromptGroup.from_state(group) for group in state["waiting"]]
        self.active = sorted((PromptGroup.from_state(group) for group in state["active"]),
                             key=lambda group: group.position)
        self.ready = []


def group_reward_metrics(call_metrics: dict[str, float], rows: Batch, first: bool) -> dict[str, float]:
    """One group's share of the reward metrics of the scoring call that scored it with other groups.

    The trainer sums its groups' metrics, so the call's counts must not ride on every group: the
    overlong count is the group's own (from its ``reward_overlong_penalty`` column), the other counts
    (reward/errors, reward/timeouts) go with the call's first group, and the overlong fraction is
    the group's (``AsyncMode.next_batch`` recomputes it over the batch).
    """
    metrics = {key: (value if first else 0.0) for key, value in call_metrics.items()}
    if "reward/overlong/count" in call_metrics and "reward_overlong_penalty" in rows:
        count = float(sum(float(value) < 0 for value in rows["reward_overlong_penalty"]))
        metrics |= {"reward/overlong/count": count, "reward/overlong/fraction": count / max(len(rows), 1)}
    return metrics
