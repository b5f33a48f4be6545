"""The admission bound under random rollout delays, driven through the real Rollouter thread.

The engine stand-in samples random response lengths and sleeps a random time per segment; the
trainer stand-in takes batches at random moments and syncs every trigger_sync_steps batches.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from reinforge.config import load_config
from reinforge.protocol import Batch
from reinforge.rollout.base import SamplingParams
from reinforge.trainer.modes.device_turns import DeviceTurns
from reinforge.trainer.modes.rollouter import Rollouter
from reinforge.trainer.modes.staleness import StalenessBound, in_flight_limit, staleness_metrics

BATCH, N, RESPONSE, SEGMENT = 3, 2, 12, 3


def prompt_source():
    drawn = iter(range(10**6))

    def next_prompts() -> Batch:
        ids = [next(drawn) for _ in range(BATCH)]
        return Batch.from_dict(tensors={"input_ids": torch.tensor([[5, 6, 7]] * BATCH),
                                        "attention_mask": torch.ones(BATCH, 3, dtype=torch.long)},
                               non_tensors={"uid": [f"p{i}" for i in ids], "ground_truth": ["x"] * BATCH})
    return next_prompts


def slow_random_engine(seed: int):
    rng = random.Random(seed)

    def generate(batch: Batch, sampling: SamplingParams) -> Batch:
        rows, width = len(batch), sampling.max_tokens
        stopped = [rng.random() < 0.2 for _ in range(rows)]  # a sample not stopped fills its segment
        lengths = [rng.randint(1, width) if stop else width for stop in stopped]
        time.sleep(rng.uniform(0, 0.004))
        mask = torch.tensor([[1.0] * length + [0.0] * (width - length) for length in lengths])
        return Batch.from_dict(tensors={"responses": torch.full((rows, width), 9), "response_mask": mask,
                                        "rollout_log_probs": -mask, "finished_by_stop": torch.tensor(stopped)})
    return generate


def score(batch: Batch) -> Batch:
    return Batch.from_dict(tensors={"token_level_scores": torch.zeros_like(batch["response_mask"])})


@pytest.mark.parametrize("max_staleness, trigger", [(0, 1), (1, 1), (2, 3), (0, 2)])
def test_admission_never_exceeds_the_bound_and_every_admitted_group_is_trained_once(max_staleness, trigger):
    bound = StalenessBound(max_staleness, trigger * BATCH)
    rollouter = Rollouter(next_prompts=prompt_source(), generate=slow_random_engine(max_staleness * 10 + trigger),
                          score=score, seed_of=lambda position, uid: position, bound=bound,
                          sampling=SamplingParams(max_tokens=RESPONSE), n=N, segment_tokens=SEGMENT,
                          batch_size=BATCH, pad_token_id=0, turns=DeviceTurns())
    rng = random.Random(1)
    consumed: list[int] = []
    staleness: list[float] = []
    rollouter.start()
    try:
        for update in range(24):
            time.sleep(rng.uniform(0, 0.006))
            taken = rollouter.take(BATCH)
            with rollouter.turns.trainer():
                version = rollouter.version
                for group, rows in taken:
                    consumed.append(group.position)
                    # a group starts no earlier than max_staleness versions before its batch's version
                    assert min(rows["token_versions"][rows["response_mask"].bool()].tolist()) >= (
                        group.position // bound.groups_per_version - max_staleness)
                    metrics = staleness_metrics(rows["token_versions"], rows["response_mask"], version)
                    staleness.append(metrics["async/staleness_max"])
                if (update + 1) % trigger == 0:
                    rollouter.set_version(version + 1)
    finally:
        rollouter.stop()
    assert rollouter.admission_log and all(admitted <= limit for admitted, _, limit in rollouter.admission_log)
    assert all(limit == (max_staleness + version + 1) * trigger * BATCH for _, version, limit in rollouter.admission_log)
    assert len(consumed) == len(set(consumed)) == 24 * BATCH  # nothing twice
    in_flight = {group.position for group in rollouter.active} | {group.position for group, _ in rollouter.ready}
    assert set(consumed) | in_flight == set(range(rollouter.admitted))  # nothing admitted was dropped
    assert not set(consumed) & in_flight
    if max_staleness == 0:  # every token sampled by the version it is trained in (on-policy when trigger is 1)
        assert max(staleness) == 0.0
    else:
        assert max(staleness) >= 1.0
    # whether a sample happens to be in flight at a sync depends on thread timing here; the next test forces it


def test_samples_in_flight_at_a_sync_are_resumed_under_the_new_version():
    """The trainer's sync lands between a sample's first and second segment: the sample keeps its first
    tokens (version 0) and is finished under version 1, through the real Rollouter thread."""
    first_segment_done, go = threading.Event(), threading.Event()
    calls = []

    def gated_engine(batch: Batch, sampling: SamplingParams) -> Batch:
        calls.append(len(batch))
        if len(calls) == 1:  # hold the rollouter's first turn until the trainer is waiting for the device
            first_segment_done.set()
            assert go.wait(30)
        width = sampling.max_tokens
        mask = torch.ones(len(batch), width)
        return Batch.from_dict(tensors={"responses": torch.full((len(batch), width), 9), "response_mask": mask,
                                        "rollout_log_probs": -mask, "finished_by_stop": torch.zeros(len(batch), dtype=torch.bool)})

    bound = StalenessBound(1, BATCH)
    turns = DeviceTurns()
    rollouter = Rollouter(next_prompts=prompt_source(), generate=gated_engine, score=score,
                          seed_of=lambda position, uid: position, bound=bound,
                          sampling=SamplingParams(max_tokens=RESPONSE), n=N, segment_tokens=SEGMENT,
                          batch_size=BATCH, pad_token_id=0, turns=turns)

    def release_once_the_trainer_waits() -> None:
        deadline = time.monotonic() + 30
        while turns._trainer_waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        go.set()

    rollouter.start()
    try:
        assert first_segment_done.wait(30)
        releaser = threading.Thread(target=release_once_the_trainer_waits)
        releaser.start()
        with turns.trainer():  # a waiting trainer goes before the rollouter's next segment
            rollouter.set_version(1)
        releaser.join()
        first = rollouter.take(2 * BATCH)  # the groups admitted under version 0 (the bound allows two versions' worth)
    finally:
        rollouter.stop()
    assert calls[0] == 2 * BATCH * N
    for group, rows in first:
        assert group.position < 2 * BATCH
        assert all(sample.versions == [0] * SEGMENT + [1] * (RESPONSE - SEGMENT) for sample in group.samples)
        metrics = staleness_metrics(rows["token_versions"], rows["response_mask"], version=1)
        assert metrics["async/partial_fraction"] == 1.0 and metrics["async/partial_span_max"] == 1.0


def test_staleness_metrics_are_token_weighted():
    versions = torch.tensor([[3, 3, 3, -1], [1, 2, 3, 3]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]])
    metrics = staleness_metrics(versions, mask, version=3)
    assert metrics["async/staleness_mean"] == pytest.approx((0 + 0 + 0 + 2 + 1 + 0 + 0) / 7)
    assert metrics["async/staleness_max"] == 2.0
    assert metrics["async/partial_fraction"] == 0.5 and metrics["async/partial_span_max"] == 2.0


def test_the_bound_is_as_areal_states_it():
    bound = StalenessBound(max_staleness=2, groups_per_version=4)
    assert bound.limit(0) == 12 and bound.capacity(10, 0) == 2 and bound.capacity(12, 0) == 0
    assert bound.capacity(12, 1) == 4 and bound.capacity(20, 1) == 0


def test_a_fractional_staleness_lets_that_fraction_of_a_versions_groups_start_early():
    bound = StalenessBound(max_staleness=0.5, groups_per_version=8)
    assert [bound.limit(version) for version in range(3)] == [12, 20, 28]  # (version + 1) x 8 + 4
    assert StalenessBound(max_staleness=0.1, groups_per_version=8).limit(0) == 8  # less than a group: none early
    assert StalenessBound(max_staleness=1, groups_per_version=8).limit(0) == 16



@pytest.mark.parametrize("deterministic", [False, True])
def test_a_large_staleness_holds_no_more_groups_in_flight_than_the_cap(deterministic):
    """max_staleness=100 admitted 101 versions' groups at once: every segment ran them all, and the finished ones
    piled up unread."""
    cap = 2 * BATCH
    rows_per_segment: list[int] = []
    generate = slow_random_engine(3)

    def recording_engine(batch: Batch, sampling: SamplingParams) -> Batch:
        rows_per_segment.append(len(batch))
        return generate(batch, sampling)

    rollouter = Rollouter(next_prompts=prompt_source(), generate=recording_engine, score=score,
                          seed_of=lambda position, uid: position, bound=StalenessBound(100, BATCH, max_in_flight=cap),
                          sampling=SamplingParams(max_tokens=RESPONSE), n=N, segment_tokens=SEGMENT,
                          batch_size=BATCH, pad_token_id=0, turns=DeviceTurns(), hold_ahead=0 if deterministic else None)
    in_flight: list[int] = []
    rollouter.start()
    try:
        for update in range(8):
            time.sleep(0.003)
            with rollouter.condition:
                in_flight.append(rollouter.admitted - rollouter.taken)
            rollouter.take(BATCH)
            if deterministic:
                rollouter.wait_until_parked()
            with rollouter.turns.trainer():
                rollouter.set_version(update + 1)
    finally:
        rollouter.stop()
    assert max(in_flight) <= cap and max(rows_per_segment) <= cap * N
    assert rollouter.admitted - rollouter.taken <= cap


def test_the_cap_on_groups_in_flight_defaults_to_the_bound_up_to_two_versions_ahead():
    def limit(*overrides: str) -> int:
        return in_flight_limit(load_config(None, ["trainer.mode=async", "data.train_batch_size=4", *overrides]))

    assert limit("trainer.max_staleness=1") == 8 and limit("trainer.max_staleness=0.5") == 6
    assert limit("trainer.max_staleness=100") == 12 and limit("trainer.max_staleness=100",
                                                                "trainer.trigger_sync_steps=2") == 24
    assert limit("trainer.max_staleness=100", "trainer.max_in_flight_groups=40") == 40
    bound = StalenessBound(max_staleness=100, groups_per_version=4, max_in_flight=8)
    assert bound.capacity(admitted=10, version=0, taken=4) == 2  # 6 in flight
    assert bound.capacity(admitted=10, version=1) == 2  # deterministic: the 4 groups of version 0 count as taken
    assert bound.capacity(admitted=10, version=0) == 0
