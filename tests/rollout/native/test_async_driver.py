"""The async driver over a stand-in engine: requests from an event loop, steps in a worker thread."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from reinforge.rollout.base import Completion, GenerationRequest, SamplingParams
from reinforge.rollout.native import collector
from reinforge.rollout.native.async_driver import AsyncDriver


class CountingEngine:
    """Completes one request per step with its prompt reversed; a step of a prompt holding ``fail_on`` raises."""

    def __init__(self, fail_on: int | None = None):
        self.fail_on = fail_on
        self.gate = threading.Event()
        """Steps wait for it (set from the start unless a test holds them)."""
        self.gate.set()
        self.pending: list[tuple[GenerationRequest, object, object]] = []
        self.lock = threading.Lock()
        self.step_threads: set[threading.Thread] = set()
        self.gc_enabled_in_steps: set[bool] = set()
        self.spans: list[str] = []
        self.aborted: list[GenerationRequest] = []

    def submit(self, request, on_done, on_error):
        entry = (request, on_done, on_error)
        with self.lock:
            self.pending.append(entry)
        return entry

    def abort(self, entry) -> None:
        with self.lock:
            if entry in self.pending:
                self.pending.remove(entry)
                self.aborted.append(entry[0])

    def step(self) -> bool:
        self.gate.wait()
        self.step_threads.add(threading.current_thread())
        self.gc_enabled_in_steps.add(gc.isenabled())
        with self.lock:
            if not self.pending:
                return False
            request, on_done, _ = self.pending[0]  # held until done, as the engine holds its admitted requests
        if self.fail_on in request.prompt_token_ids:
            raise RuntimeError("the step failed")
        with self.lock:
            self.pending.pop(0)
        on_done([Completion(request.prompt_token_ids[::-1], [0.0] * len(request.prompt_token_ids), "stop")])
        return True

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.pending)

    def fail_pending(self, error: BaseException) -> None:
        with self.lock:
            taken, self.pending = self.pending, []
        for _, _, on_error in taken:
            on_error(error)

    def measure(self):
        self.spans.append("start")
        return lambda: self.spans.append("end")

    def driver(self) -> AsyncDriver:
        return AsyncDriver(self.submit, self.step, self.has_work, self.fail_pending, self.measure, self.abort)


def run(main):
    """asyncio.run, then a garbage collection here: a failed driver task logs its error when collected, which at an
    arbitrary later point (inside an import's compile) trips CPython 3.11's AST recursion check."""
    result = asyncio.run(main())
    gc.collect()
    return result


def pause_let_go() -> bool:
    """Whether every pause of the garbage collector is let go within seconds (an engine an earlier test served
    through may still be ending its last step on its thread)."""
    deadline = time.monotonic() + 30
    while collector.holders() and time.monotonic() < deadline:
        time.sleep(0.01)
    return collector.holders() == 0


def request(*tokens: int) -> GenerationRequest:
    return GenerationRequest(list(tokens), SamplingParams(max_tokens=1))


def test_concurrent_requests_each_get_their_completions_from_steps_off_the_event_loop():
    engine = CountingEngine()
    driver = engine.driver()

    async def main():
        return await asyncio.gather(*(driver.generate(request(index, index + 1)) for index in range(5)))

    results = run(main)
    assert [result[0].token_ids for result in results] == [[index + 1, index] for index in range(5)]
    assert threading.main_thread() not in engine.step_threads
    assert engine.gc_enabled_in_steps == {False} and pause_let_go()  # paused while stepping, then let go
    assert engine.spans == ["start", "end"]  # one driver served all five: one metrics span


def test_a_failed_step_fails_every_pending_request_and_a_later_request_starts_a_new_driver():
    engine = CountingEngine(fail_on=99)
    driver = engine.driver()

    async def main():
        results = await asyncio.gather(driver.generate(request(99)), driver.generate(request(1, 2)),
                                       return_exceptions=True)
        later = await driver.generate(request(3, 4))
        return results, later

    (first, second), later = run(main)
    assert isinstance(first, RuntimeError) and isinstance(second, RuntimeError)  # the second never ran: failed too
    assert later[0].token_ids == [4, 3]
    assert engine.spans == ["start", "end", "start", "end"]


def test_a_request_submitted_while_the_driver_runs_joins_it():
    engine = CountingEngine()
    engine.gate.clear()
    driver = engine.driver()

    async def main():
        first = asyncio.ensure_future(driver.generate(request(1)))
        await asyncio.sleep(0.01)  # the driver's thread waits in its first step
        asyncio.get_running_loop().call_soon(engine.gate.set)  # once the second request is submitted
        second = await driver.generate(request(2))
        return await first, second

    first, second = run(main)
    assert first[0].token_ids == [1] and second[0].token_ids == [2]
    assert engine.spans == ["start", "end"]  # one driver served both


@pytest.mark.parametrize("fail_on", [None, 7])
def test_the_metrics_span_ends_however_the_driver_stops(fail_on):
    engine = CountingEngine(fail_on=fail_on)
    driver = engine.driver()

    async def main():
        return await asyncio.gather(driver.generate(request(7)), return_exceptions=True)

    run(main)
    assert engine.spans == ["start", "end"]


def test_a_request_from_a_new_event_loop_is_served_after_the_last_loop_stopped_with_its_driver_pending():
    """A server's loop stopped right after its last reply: its driver task never ends. The next loop's request gets
    a driver of its own, which steps only once the stopped loop's thread is out of its step."""
    engine = CountingEngine()
    stepped_out, held, released = threading.Event(), threading.Event(), threading.Event()
    step = engine.step

    def step_then_hold() -> bool:
        if held.is_set():  # the first request's next step waits: the loop stops meanwhile
            released.wait()
        stepped = step()
        if stepped:
            held.set()
        else:
            stepped_out.set()
        return stepped

    engine.step = step_then_hold
    driver = engine.driver()
    served = asyncio.new_event_loop()
    thread = threading.Thread(target=served.run_forever, daemon=True)
    thread.start()
    try:
        first = asyncio.run_coroutine_threadsafe(driver.generate(request(1)), served).result(10)
        served.call_soon_threadsafe(served.stop)
        thread.join(10)
        released.set()
        assert stepped_out.wait(10)  # the stopped loop's thread found nothing left; its task stays pending
        assert pause_let_go()  # the collector is not left paused until some later request comes

        async def main():
            return await asyncio.wait_for(driver.generate(request(2)), 10)

        second = run(main)
    finally:
        served.close()
    assert first[0].token_ids == [1] and second[0].token_ids == [2]
    assert pause_let_go()  # though the first driver's task never ended: its thread took the pause, and ended


def test_a_completion_for_a_closed_event_loop_is_dropped_and_the_step_delivers_the_others():
    """A loop closed while its request was in the engine (``asyncio.run`` per call, after a timeout): the step that
    finishes that request must not raise on the closed loop, or the requests it finishes beside it never hear back."""
    engine = CountingEngine()
    engine.gate.clear()
    waiting = threading.Event()
    step = engine.step

    def step_all() -> bool:  # one step finishes every pending request, as a decode step finishes several
        waiting.set()
        engine.gate.wait()
        with engine.lock:
            taken, engine.pending = engine.pending, []
        for request_, on_done, _ in taken:
            on_done([Completion(request_.prompt_token_ids[::-1], [0.0] * len(request_.prompt_token_ids), "stop")])
        return bool(taken) or step()

    engine.step = step_all
    driver = engine.driver()
    closed = asyncio.new_event_loop()
    thread = threading.Thread(target=closed.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(driver.generate(request(1)), closed)
    assert waiting.wait(10)  # the closed loop's driver thread is in its step, holding request 1
    closed.call_soon_threadsafe(closed.stop)
    thread.join(10)
    closed.close()

    async def main():
        later = asyncio.ensure_future(driver.generate(request(2)))
        await asyncio.sleep(0)
        engine.gate.set()  # the old thread's step finishes requests 1 and 2 together
        return await asyncio.wait_for(later, 5)

    assert run(main)[0].token_ids == [2]


@pytest.mark.parametrize("cancel", ["task", "timeout"])
def test_a_cancelled_request_is_aborted_and_the_others_are_served(cancel):
    """A caller that stops waiting (its task cancelled, a wait_for timeout) takes its request out of the engine."""
    engine = CountingEngine()
    engine.gate.clear()
    driver = engine.driver()

    async def main():
        first = asyncio.ensure_future(driver.generate(request(1)))
        second = asyncio.ensure_future(driver.generate(request(2)))
        if cancel == "task":
            await asyncio.sleep(0)  # both submitted; the steps wait at the gate
            second.cancel()
        else:
            second = asyncio.ensure_future(asyncio.wait_for(second, 0.001))
        await asyncio.gather(second, return_exceptions=True)
        engine.gate.set()
        return await first, second

    first, second = run(main)
    assert first[0].token_ids == [1]
    assert [aborted.prompt_token_ids for aborted in engine.aborted] == [[2]] and not engine.pending
    assert second.cancelled() if cancel == "task" else isinstance(second.exception(), TimeoutError)
