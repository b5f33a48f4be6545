"""The async rollouter's hand-over and resume: a scoring call's reward metrics are counted once however many
groups it scored, and checkpointed groups keep their samples, so settings that reshape them are refused in one
line instead of silently regrouping rows (rollout.n) or failing deep in a step."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from reinforge.protocol import Batch
from reinforge.rollout.base import SamplingParams
from reinforge.trainer.modes.device_turns import DeviceTurns
from reinforge.trainer.modes.partial import PartialSample, PromptGroup
from reinforge.trainer.modes.rollouter import Rollouter
from reinforge.trainer.modes.staleness import StalenessBound


def rollouter(n: int, max_tokens: int) -> Rollouter:
    def unused(*args: object) -> Batch:
        raise AssertionError("not called")

    return Rollouter(next_prompts=unused, generate=unused, score=unused, seed_of=lambda position, uid: position,
                     bound=StalenessBound(1, 2), sampling=SamplingParams(max_tokens=max_tokens), n=n,
                     segment_tokens=2, batch_size=2, pad_token_id=0, turns=DeviceTurns())


def saved_state(n: int, tokens: int) -> dict:
    """A checkpoint's rollouter state: one group of ``n`` samples, each ``tokens`` long (finished when 4)."""
    def group(position: int) -> PromptGroup:
        return PromptGroup(position, [5, 6], {"uid": f"p{position}"}, position,
                           [PartialSample(index, [9] * tokens, [-1.0] * tokens, [0] * tokens, finished=tokens >= 4)
                            for index in range(n)])
    source = rollouter(n, 8)
    source.active, source.admitted, source.drawn = [group(0), group(1)], 2, 2
    return source.state_dict()


def test_resume_with_the_same_settings_restores_every_group():
    restored = rollouter(4, 8)
    restored.load_state_dict(saved_state(4, 4))
    assert [len(group.samples) for group in restored.active] == [4, 4]


def test_a_changed_rollout_n_is_refused_instead_of_regrouping_rows():
    with pytest.raises(ValueError, match=r"^rollout.n=2 but the checkpoint's admitted prompt groups have 4 samples "
                                         r"each .*resume with rollout.n=4, or start a new run"):
        rollouter(2, 8).load_state_dict(saved_state(4, 4))


def test_a_lowered_max_response_length_is_refused_when_samples_are_longer():
    with pytest.raises(ValueError, match=r"^data.max_response_length=3 but the checkpoint's admitted prompt groups "
                                         r"have responses of 4 tokens already"):
        rollouter(4, 3).load_state_dict(saved_state(4, 4))
    rollouter(4, 3).load_state_dict(saved_state(4, 2))  # shorter samples continue under the lower limit


def test_handover_after_resume_keeps_each_groups_rows_together():
    restored = rollouter(4, 8)
    restored.score = lambda rows: Batch.from_dict(tensors={"token_level_scores": torch.zeros_like(
        rows["response_mask"])})
    restored.load_state_dict(saved_state(4, 4))
    restored._hand_over_finished()
    assert [set(rows["uid"]) for _, rows in restored.ready] == [{"p0"}, {"p1"}]


def test_a_scoring_calls_reward_metrics_are_counted_once_over_its_groups():
    """The trainer sums its groups' reward metrics; no group carries the whole scoring call's counts."""
    def score(rows: Batch) -> Batch:
        penalties = [-1.0 if index % 4 == 0 else 0.0 for index in range(len(rows))]  # one sample of each group
        scored = Batch.from_dict(tensors={"token_level_scores": torch.zeros_like(rows["response_mask"])},
                                 non_tensors={"reward_overlong_penalty": penalties})
        scored.meta["reward_metrics"] = {"reward/errors": 3.0, "reward/overlong/count": 2.0,
                                         "reward/overlong/fraction": 0.25, "reward_model/score/mean": 0.5}
        return scored

    restored = rollouter(4, 8)
    restored.score = score
    restored.load_state_dict(saved_state(4, 4))
    restored._hand_over_finished()
    metrics = [rows.meta["reward_metrics"] for _, rows in restored.ready]
    assert sum(group["reward/errors"] for group in metrics) == 3.0
    assert [group["reward/overlong/count"] for group in metrics] == [1.0, 1.0]
    assert [group["reward/overlong/fraction"] for group in metrics] == [0.25, 0.25]
    assert [group["reward_model/score/mean"] for group in metrics] == [0.5, 0.5]  # the call's, weighed by the trainer


def test_resume_hands_the_ready_groups_over_first_in_the_order_they_finished():
    """The trainer takes the first ready groups: a resumed run must take those the interrupted one would have."""
    def group(position: int, finished: bool) -> PromptGroup:
        return PromptGroup(position, [5, 6], {"uid": f"p{position}"}, position,
                           [PartialSample(index, [9] * 4, [-1.0] * 4, [0] * 4, finished=finished) for index in range(4)])

    def score(rows: Batch) -> Batch:
        return Batch.from_dict(tensors={"token_level_scores": torch.zeros_like(rows["response_mask"])})

    source = rollouter(4, 8)
    source.score = score
    source.active, source.admitted, source.drawn = [group(0, False), group(1, False), group(2, False),
                                                    group(3, True)], 4, 4
    source._hand_over_finished()  # the last group finished first
    for group_ in source.active[:2]:
        for sample in group_.samples:
            sample.finished = True
    source._hand_over_finished()
    assert [group.position for group, _ in source.ready] == [3, 0, 1]
    restored = rollouter(4, 8)
    restored.score = score
    restored.load_state_dict(source.state_dict())
    restored._hand_over_restored()  # the first turn, before its segment
    restored._hand_over_finished()
    assert [group.position for group, _ in restored.ready] == [3, 0, 1]
    assert [group.position for group in restored.active] == [2]
    assert [group.position for group, _ in restored.take(2)] == [0, 3]


def test_stop_abandons_a_turn_that_does_not_end_within_its_wait():
    """After Ctrl-C the trainer stops the rollouter with a short wait: a turn under way (a long generation) is
    abandoned instead of waited for, and its thread is one the stop's exit does not wait on."""
    entered, release = threading.Event(), threading.Event()

    def next_prompts() -> Batch:
        entered.set()
        release.wait(10)
        raise RuntimeError("the turn ended after the stop")

    stopped = rollouter(2, 8)
    stopped.next_prompts = next_prompts
    stopped.start()
    thread = stopped._thread
    assert entered.wait(10) and thread.name.startswith("reinforge-")
    start = time.monotonic()
    assert stopped.stop(wait_s=0.05)
    assert time.monotonic() - start < 5 and thread.is_alive()
    release.set()
    thread.join(10)
    assert not stopped.ready and not stopped.stop(wait_s=0.05)  # nothing left to stop
