"""The rollouter of the async mode: a thread that admits prompt groups under the staleness bound,
generates them segment by segment and hands finished, scored groups to the trainer.

Every turn on the device it (1) admits groups while ``StalenessBound.capacity`` allows, drawing
prompt batches from the loader as needed, (2) runs one segment for every unfinished sample
(``partial.run_segment``) with the weights of the current version, and (3) scores the groups
that finished and appends them to ``ready``. When nothing is admitted and nothing runs it waits
for the next weight sync (``set_version``): that wait is its idle time.

By default the rollouter runs as fast as it can, so how many segments it runs before a sync
depends on timing: which weights sample which tokens, and so which groups finish first, vary
from run to run. With ``hold_ahead`` set (deterministic mode) the weights change only at fixed
points of its work: under version v it runs until it has handed over the groups of every update
before the sync to v + 1, plus ``hold_ahead`` more (``hold_at``), or until the bound admits
nothing more, and then waits (parked); the trainer syncs only then (``wait_until_parked``).
Its segments, admissions and hand-overs are then the same in every run with the same seed, and
the trainer takes its groups from the front of one queue.
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
                 turns: DeviceTurns, hold_ahead: int | None = None):
        self.next_prompts, self.score, self.seed_of = next_prompts, score, seed_of
        self._generate = generate
        self.bound, self.sampling, self.n, self.segment_tokens = bound, sampling, n, segment_tokens
        self.batch_size, self.pad_token_id, self.turns = batch_size, pad_token_id, turns
        self.hold_ahead = hold_ahead
        """Deterministic mode: groups handed over beyond those of the updates before a sync, after which the
        rollouter waits for that sync (None: it never waits for one while it has work)."""
        self.condition = threading.Condition()
        self.version = 0
        self.admitted = 0
        """Groups admitted so far (running, ready or consumed): the bound's accepted + running."""
        self.drawn = 0
        """Prompt groups drawn from the loader (admitted or waiting)."""
        self.waiting: list[PromptGroup] = []
        self.active: list[PromptGroup] = []
        self.ready: list[tuple[PromptGroup, Batch]] = []
        self.taken = 0
        """Groups the trainer has taken: with ``ready``, every group handed over so far."""
        self.restored_ready: list[PromptGroup] = []
        """Groups a checkpoint held as ready, in their order: handed over again (scored) on the first turn."""
        self.idle_s = 0.0
        self.tokens = 0
        self.spans: list[dict[str, float]] = []
        """The ``rollout_metrics`` of every segment not yet taken by ``take_spans`` (the engine's counts and the
        generation's phases)."""
        self.admission_log: list[tuple[int, int, int]] = []
        """(admitted after this admission, version, limit) at every admission, for auditing the bound."""
        self._error: BaseException | None = None
        self._stopping = False
        self._parked = False
        self._thread: threading.Thread | None = None

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """One segment's generation; its rollout metrics join ``spans``."""
        output = self._generate(batch, sampling)
        with self.condition:
            self.spans.append(dict(output.meta.get("rollout_metrics", {})))
        return output

    def take_spans(self) -> list[dict[str, float]]:
        """The rollout metrics of the segments since the last call."""
        with self.condition:
            spans, self.spans = self.spans, []
        return spans

    # ---- the thread ----------------------------------------------------------------------
    def start(self) -> None:
        # named reinforge-*: a run that exits while it is still in a call (abandoned by ``stop``) exits at once
        # (stop_signals.exit_after_stop) rather than tear the interpreter down under it
        self._thread = threading.Thread(target=self._run, name="reinforge-rollouter", daemon=True)
        self._thread.start()

    def stop(self, wait_s: float | None = None) -> bool:
        """Stop the thread, waiting at most ``wait_s`` seconds (None: no limit) for its turn under way (a segment's
        generation, a scoring call) to end. True when it did not: its turn is abandoned (the thread, a daemon, hands
        nothing more over and ends once its call returns)."""
        with self.condition:
            self._stopping = True
            self.condition.notify_all()
        if self._thread is None:
            return False
        thread, self._thread = self._thread, None
        thread.join(wait_s)
        return thread.is_alive()

    def _run(self) -> None:
        try:
            with self.turns.rollouter():
                self._hand_over_restored()
            while not self._stopping:
                if self.hold_ahead is not None and self.taken + len(self.ready) >= self.hold_at(self.version):
                    self._wait_for_next_version()
                    continue
                with self.turns.rollouter():
                    if self._stopping:
                        return
                    self._admit()
                    self.tokens += run_segment(self.generate, self.active, self.sampling, self.segment_tokens,
                                               self.version, self.pad_token_id)
                    if self._stopping:  # abandoned by ``stop`` while it generated: nothing more is handed over
                        return
                    self._hand_over_finished()
                    busy = bool(self.active)
                if not busy:
                    self._wait_for_capacity()
        except BaseException as error:  # raised again in the trainer's thread
            with self.condition:
                self._error = error
                self.condition.notify_all()

    def _capacity(self) -> int:
        """Groups the bound admits now. In deterministic mode the cap on groups in flight counts as taken only
        those of the updates before this version, so admissions do not depend on when the trainer takes its
        batches."""
        return self.bound.capacity(self.admitted, self.version, None if self.hold_ahead is not None else self.taken)

    def _admit(self) -> None:
        while self._capacity() > 0:
            if not self.waiting:
                prompts = self.next_prompts()
                self.waiting = groups_from_prompts(prompts, self.drawn, self.n, self.seed_of)
                self.drawn += len(prompts)
            with self.condition:
                self.active.append(self.waiting.pop(0))
                self.admitted += 1
                limit = self.bound.limit(self.version)
                self.admission_log.append((self.admitted, self.version, limit))

    def _hand_over_restored(self) -> None:
        """The groups a checkpoint held as ready, scored again, go first and in their order: the trainer takes
        the groups the interrupted run would have taken."""
        if self.restored_ready:
            self._hand_over(self.restored_ready)
            self.restored_ready = []

    def _hand_over_finished(self) -> None:
        finished = [group for group in self.active if group.finished]
        if finished:
            self._hand_over(finished)

    def _hand_over(self, finished: list[PromptGroup]) -> None:
        """Score the finished groups (one call) and append them to ``ready`` in this order."""
        response_length = self.sampling.max_tokens
        rows = concat_generated([group_batch(group, response_length, self.pad_token_id) for group in finished],
                                self.pad_token_id)
        scored = rows | self.score(rows)
        call_metrics = scored.meta.get("reward_metrics", {})
        with self.condition:
            handed = {id(group) for group in finished}
            self.active = [group for group in self.active if id(group) not in handed]
            for index, group in enumerate(finished):
                group_rows = scored.index(slice(index * self.n, (index + 1) * self.n))
                group_rows.meta["reward_metrics"] = group_reward_metrics(call_metrics, group_rows, first=index == 0)
                self.ready.append((group, group_rows))
            self.condition.notify_all()

    def _wait_for_capacity(self) -> None:
        self._wait(lambda: self._capacity() > 0)

    def _wait_for_next_version(self) -> None:
        version = self.version
        self._wait(lambda: self.version != version)

    def _wait(self, ready_to_go: Callable[[], bool]) -> None:
        """Wait (parked: between turns, doing nothing until a sync) for ``ready_to_go`` or ``stop``."""
        start = time.perf_counter()
        with self.condition:
            self._parked = True
            self.condition.notify_all()
            self.condition.wait_for(lambda: self._stopping or ready_to_go())
            self._parked = False
        self.idle_s += time.perf_counter() - start

    def hold_at(self, version: int) -> int:
        """Deterministic mode: the groups handed over in all after which the rollouter waits for version + 1."""
        assert self.hold_ahead is not None
        return self.bound.groups_per_version * (version + 1) + self.hold_ahead

    # ---- the trainer's side ----------------------------------------------------------------
    def take(self, num_groups: int) -> list[tuple[PromptGroup, Batch]]:
        """The first ``num_groups`` ready groups (waits for them), in admission order."""
        with self.condition:
            self.condition.wait_for(lambda: self._error is not None or len(self.ready) >= num_groups)
            if self._error is not None:
                raise RuntimeError(f"the rollouter failed: {self._error}") from self._error
            taken, self.ready = self.ready[:num_groups], self.ready[num_groups:]
            self.taken += len(taken)
            self.condition.notify_all()  # room for groups in flight (trainer.max_in_flight_groups)
        return sorted(taken, key=lambda item: item[0].position)

    def wait_until_parked(self) -> None:
        """Wait until the rollouter waits for a sync (or has failed or stopped): in deterministic mode the
        trainer syncs only then, so every run changes the weights at the same point of the rollouter's work."""
        with self.condition:
            self.condition.wait_for(lambda: self._parked or self._error is not None or self._stopping
                                    or self._thread is None)

    def set_version(self, version: int) -> None:
        """A weight sync happened: samples in flight continue under the new weights; admission may resume."""
        with self.condition:
            self.version = version
            self._parked = False  # a parked rollouter waits for this alone; the next wait_until_parked waits anew
            self.condition.notify_all()

    def state_dict(self) -> dict[str, Any]:
        """Everything admitted and not yet consumed, with its tokens; call while the rollouter is between turns."""
        with self.condition:
            ready = [group for group, _ in self.ready] + self.restored_ready
            return {"version": self.version, "admitted": self.admitted, "drawn": self.drawn,
                    "waiting": [group.state_dict() for group in self.waiting],
                    "active": [group.state_dict() for group in self.active] + [group.state_dict() for group in ready],
                    "ready_positions": [group.position for group in ready]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; the groups that were ready are scored again on the first turn, in their order.

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
        groups = {group.position: group for group in (PromptGroup.from_state(saved) for saved in state["active"])}
        ready_positions = state.get("ready_positions", [])
        self.restored_ready = [groups.pop(position) for position in ready_positions]
        self.active = sorted(groups.values(), key=lambda group: group.position)  # admission order, as they ran
        self.taken = self.admitted - len(ready_positions) - len(self.active)
        self.ready = []


def group_reward_metrics(call_metrics: dict[str, float], rows: Batch, first: bool) -> dict[str, float]:
    """One group's share of the reward metrics of the scoring call that scored it with other groups.

    The trainer sums its groups' counts, so the call's counts must not ride on every group: the
    overlong count is the group's own (from its ``reward_overlong_penalty`` column), the other counts
    (reward/errors, reward/timeouts) go with the call's first group, and the overlong fraction is
    the group's (``AsyncMode.next_batch`` recomputes it over the batch). A mean (``*/mean``, a reward
    model's or a judge's score) is the call's on every group: the trainer weighs it by their samples.
    """
    metrics = {key: (value if first or key.endswith("/mean") else 0.0) for key, value in call_metrics.items()}
    if "reward/overlong/count" in call_metrics and "reward_overlong_penalty" in rows:
        count = float(sum(float(value) < 0 for value in rows["reward_overlong_penalty"]))
        metrics |= {"reward/overlong/count": count, "reward/overlong/fraction": count / max(len(rows), 1)}
    return metrics
