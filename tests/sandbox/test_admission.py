"""Token bucket and slot pool, on a hand-driven clock and threads."""

from __future__ import annotations

import threading

import pytest

from reinforge.sandbox.admission import QueueFull, QueueTimeout, SlotPool, TokenBucket


def test_token_bucket_admits_a_burst_then_refills_at_its_rate():
    now = [100.0]
    bucket = TokenBucket(rate=2.0, capacity=3, clock=lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)  # one token takes 1/rate seconds
    now[0] += 0.25
    assert bucket.take() == pytest.approx(0.25)  # half a token there: a refusal takes nothing
    now[0] += 0.25
    assert bucket.take() == 0.0
    now[0] += 60.0  # a long quiet spell fills the bucket only to its capacity
    assert [bucket.take() for _ in range(4)][-1] == pytest.approx(0.5)


def _held_slot_and_one_waiter(pool: SlotPool) -> tuple[list[int], threading.Thread]:
    """``pool``'s slot 0 held, and a thread queued for a slot (what it got lands in the list)."""
    assert pool.acquire(timeout_s=1) == 0
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout_s=5)))
    waiter.start()
    while pool.stats()["queued"] != 1:
        threading.Event().wait(0.01)
    return got, waiter


def test_slot_pool_queues_up_to_its_bound_and_then_refuses():
    pool = SlotPool(num_slots=1, max_queued=1)
    got, waiter = _held_slot_and_one_waiter(pool)
    with pytest.raises(QueueFull):
        pool.acquire(timeout_s=5)
    pool.release(0)
    waiter.join()
    assert got == [0] and pool.stats() == {"free_slots": 0, "queued": 0}
    with pytest.raises(QueueTimeout):
        pool.acquire(timeout_s=0.05)


def test_slots_are_distinct_while_held():
    pool = SlotPool(num_slots=3, max_queued=0)
    assert sorted(pool.acquire(timeout_s=1) for _ in range(3)) == [0, 1, 2]


def test_a_freed_slot_goes_to_the_longest_waiting_request_not_a_newcomer():
    """A request that arrived as a slot was freed, before the waiter woke, took it: under load queued requests
    were passed over again and again until their queue wait ran out (503) while later ones ran."""
    pool = SlotPool(num_slots=1, max_queued=4)
    got, waiter = _held_slot_and_one_waiter(pool)
    with pool._condition:  # the newcomer arrives before the waiter can wake
        pool.release(0)
        with pytest.raises(QueueTimeout):
            pool.acquire(timeout_s=0.2)
    waiter.join()
    assert got == [0] and pool.stats() == {"free_slots": 0, "queued": 0}
