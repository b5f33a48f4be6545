"""BatchingClient over a stand-in batch engine: requests from one event loop after another."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading

import pytest

from reinforge.agent.runner import BatchingClient
from reinforge.rollout.base import Completion, GenerationInterrupted, SamplingParams


class GatedEngine:
    """``generate`` answers each prompt reversed; a call waits for ``gate``; ``calling`` counts calls under way."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.lock = threading.Lock()
        self.calling = 0
        self.most_calling = 0
        self.calls: list[list[str]] = []

    def generate(self, requests):
        with self.lock:
            self.calls.append([request.request_id for request in requests])
            self.calling += 1
            self.most_calling = max(self.most_calling, self.calling)
        self.entered.set()
        self.gate.wait()
        with self.lock:
            self.calling -= 1
        return [[Completion(request.prompt_token_ids[::-1], [0.0] * len(request.prompt_token_ids), "stop")]
                for request in requests]


def test_a_request_from_a_new_event_loop_is_served_after_the_last_loop_stopped_with_its_call_under_way():
    """A server's loop stopped during an engine call: its flusher task never runs again. The next loop's request gets
    a flusher of its own; its call waits for the stopped loop's call to end, and the stopped loop's request stays
    out of the new loop's batch."""
    engine = GatedEngine()
    engine.gate.clear()
    client = BatchingClient(engine)
    stopped = asyncio.new_event_loop()
    thread = threading.Thread(target=stopped.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(client.generate([1, 2], SamplingParams(max_tokens=2), "first"), stopped)
    assert engine.entered.wait(10)
    stopped.call_soon_threadsafe(stopped.stop)
    thread.join(10)
    stopped.close()

    async def main():
        later = asyncio.ensure_future(client.generate([3, 4], SamplingParams(max_tokens=2), "second"))
        await asyncio.sleep(0.05)  # the new loop's call waits for the stopped loop's
        engine.gate.set()
        return await asyncio.wait_for(later, 5)

    assert asyncio.run(main()).token_ids == [4, 3]
    assert engine.most_calling == 1  # never two calls at once on one engine
    unraised, hook = [], sys.unraisablehook
    sys.unraisablehook = unraised.append
    try:
        gc.collect()  # the stopped loop's flusher is closed: it leaves its requests to the closed loop, raising nothing
    finally:
        sys.unraisablehook = hook
    assert [entry.exc_value for entry in unraised] == []


def test_a_cancelled_request_is_left_out_of_the_calls_that_have_not_started():
    """A request cancelled before its call starts is never generated."""
    engine = GatedEngine()
    engine.gate.clear()
    client = BatchingClient(engine)

    async def main():
        first = asyncio.ensure_future(client.generate([1, 2], SamplingParams(max_tokens=2), "first"))
        await asyncio.to_thread(engine.entered.wait, 10)  # the first call is under way
        waiting = [asyncio.ensure_future(client.generate([index], SamplingParams(max_tokens=2), name))
                   for index, name in enumerate(["cancelled", "second", "timed out"])]
        await asyncio.sleep(0)
        waiting[0].cancel()
        timed_out = asyncio.ensure_future(asyncio.wait_for(waiting[2], 0.001))
        await asyncio.gather(waiting[0], timed_out, return_exceptions=True)
        engine.gate.set()
        return await first, await waiting[1], waiting[0].cancelled(), timed_out.exception()

    first, second, cancelled, timed_out = asyncio.run(main())
    assert first.token_ids == [2, 1] and second.token_ids == [1] and cancelled and isinstance(timed_out, TimeoutError)
    assert engine.calls == [["first"], ["second"]]


class InterruptibleEngine:
    """``generate`` waits until its call is interrupted (or ``gate`` opens) and notes which ended how."""

    def __init__(self):
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.interrupted_calls: list[list[str]] = []

    def generate(self, requests, interrupted=None):
        self.entered.set()
        while not self.gate.is_set():
            if interrupted.wait(0.01):
                self.interrupted_calls.append([request.request_id for request in requests])
                raise GenerationInterrupted("interrupted")
        return [[Completion([1], [0.0], "stop")] for _ in requests]


@pytest.mark.parametrize("cancelled", [["first"], ["first", "second"]])
def test_a_call_under_way_is_interrupted_once_none_of_its_callers_waits(cancelled):
    """Both requests share a call: cancelling one leaves it running for the other; cancelling both interrupts it."""
    engine = InterruptibleEngine()
    client = BatchingClient(engine)

    async def main():
        requests = {name: asyncio.ensure_future(client.generate([index], SamplingParams(max_tokens=2), name))
                    for index, name in enumerate(["first", "second"])}
        await asyncio.to_thread(engine.entered.wait, 10)
        for name in cancelled:
            requests[name].cancel()
        await asyncio.sleep(0.2)
        engine.gate.set()
        return await asyncio.gather(*requests.values(), return_exceptions=True)

    results = asyncio.run(main())
    assert [isinstance(result, asyncio.CancelledError) for result in results] == [True, len(cancelled) == 2]
    assert engine.interrupted_calls == ([["first", "second"]] if len(cancelled) == 2 else [])


def test_a_loop_that_shuts_down_interrupts_its_call_under_way():
    """The loop's shutdown (a server's Ctrl-C) cancels the flusher: its call ends rather than run on in a thread."""
    engine = InterruptibleEngine()
    client = BatchingClient(engine)
    threading.Timer(5, engine.gate.set).start()  # an uninterrupted call ends after 5 s

    async def main():
        asyncio.ensure_future(client.generate([1], SamplingParams(max_tokens=2), "left"))
        await asyncio.to_thread(engine.entered.wait, 10)

    asyncio.run(main())  # returns once its executor's threads end: the call's too
    assert engine.interrupted_calls == [["left"]]
