"""Running many trajectories at once: one asyncio task per row, over one engine.

``AgentRunner.run`` starts every row's loop together. Each loop awaits the engine for its
turns and its tools for their results; while one trajectory waits for a tool, the others
keep the engine busy. Two clients connect the loops to an engine:

- ``AsyncEngineClient`` (the native engine's ``generate_async``): each turn joins the engine's
  running batch as soon as it is submitted (continuous batching across trajectories);
- ``BatchingClient`` (any engine with a batch ``generate``, such as ``hf``): the turns submitted
  while the previous call ran are generated together in the next call, so the hf backend
  works too, at the pace of its slowest turn per call.

A turn whose caller stops waiting (cancelled: a timeout, a client of ``reinforge serve`` that hung up) is aborted on
the native engine wherever it stands. On the hf backend a cancelled turn is dropped if its call has not started; a call
under way stops at its next token once none of its turns is waited for (every caller cancelled, or the event loop
shutting down: a server's Ctrl-C), and the others' turns run to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from reinforge.agent.loop import AgentContext, AgentLoopOutput, TokenClient, agent_name_of, get_agent_loop
from reinforge.config.schema import MultiTurnConfig
from reinforge.rollout.base import Completion, GenerationRequest, SamplingParams

if TYPE_CHECKING:
    from reinforge.protocol import Batch


class AsyncEngineClient:
    """Turns of all trajectories join one continuously batched engine (``engine.generate_async``)."""

    def __init__(self, engine: Any):
        self.engine = engine

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str,
                       multi_modal_inputs: dict[str, Any] | None = None) -> Completion:
        request = GenerationRequest(prompt_ids, sampling, request_id, multi_modal_inputs=multi_modal_inputs)
        return (await self.engine.generate_async(request))[0]

    async def generate_streamed(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str,
                                on_token: Callable[[int, float, list[tuple[int, float]] | None], None]) -> Completion:
        """``generate``, calling ``on_token(token_id, log_prob, top_log_probs)`` on the event loop as each token is
        sampled (``top_log_probs``: its alternatives when ``sampling.num_top_log_probs`` asks, else None)."""
        request = GenerationRequest(prompt_ids, sampling, request_id)
        return (await self.engine.generate_async(request, lambda _, *token: on_token(*token)))[0]


class BatchingClient:
    """Turns submitted while a call runs are generated together by the next ``engine.generate`` call.

    ``call_context`` wraps each call (in its worker thread), e.g. the device's autocast. The calls
    ask for the batch's longest budget and cut each completion to its own, so requests that differ
    only in their remaining budget share a call (seeded sampling makes the cut sample the same).

    Requests may come from one event loop after another (``asyncio.run`` per call, a server's loop stopped and a new
    one started): each loop's requests are batched by a flusher task of that loop (a task of a loop that stopped
    never runs again), and the calls take a lock, so a stopped loop's call ends before another starts.

    A request whose caller is cancelled before its call starts is left out of it. A call under way is interrupted
    when no one waits for it any more, its callers all cancelled or its flusher cancelled (the loop shutting down),
    on an engine whose ``generate`` takes ``interrupted`` (the hf backend's): it ends at its next token, so a server
    that stops leaves no thread generating. On another engine it runs to its end.
    """

    def __init__(self, engine: Any, call_context: Callable[[], Any] = contextlib.nullcontext):
        self.engine = engine
        self.call_context = call_context
        self._interruptible = "interrupted" in inspect.signature(engine.generate).parameters
        self._pending: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self._calling = threading.Lock()
        self.num_calls = 0

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str,
                       multi_modal_inputs: dict[str, Any] | None = None) -> Completion:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request = GenerationRequest(prompt_ids, sampling, request_id, multi_modal_inputs=multi_modal_inputs)
        self._pending.append((request, future))
        if self._flusher is None or self._flusher.done() or self._flusher.get_loop() is not loop:
            self._flusher = loop.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while any(future.get_loop() is loop for _, future in self._pending):
            for _ in range(4):  # let every trajectory that is ready submit its turn before the call starts
                await asyncio.sleep(0)
            batch = [(request, future) for request, future in self._pending if future.get_loop() is loop
                     and not future.done()]  # done before its call: its caller was cancelled, no one waits
            self._pending = [(request, future) for request, future in self._pending  # a closed loop's: no one waits
                             if future.get_loop() is not loop and not future.get_loop().is_closed()]
            if not batch:
                continue
            interrupted = threading.Event()

            def interrupt_if_unwaited(_: asyncio.Future, batch=batch, interrupted=interrupted) -> None:
                if all(future.done() for _, future in batch):
                    interrupted.set()

            for _, future in batch:
                future.add_done_callback(interrupt_if_unwaited)
            try:
                results = await asyncio.to_thread(self._generate, [request for request, _ in batch], interrupted)
            except Exception as error:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            except BaseException:  # cancelled, or its loop closed: the batch's callers wait no more
                interrupted.set()
                for _, future in batch:
                    if not future.get_loop().is_closed():
                        future.cancel()
                raise
            for (_, future), completion in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(completion)

    def _generate(self, requests: list[GenerationRequest], interrupted: threading.Event) -> list[Completion]:
        longest = max(request.sampling.max_tokens for request in requests)
        shared = [dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, max_tokens=longest))
                  for request in requests]
        with self._calling, self.call_context():
            if self._interruptible:
                samples = self.engine.generate(shared, interrupted=interrupted)
            else:
                samples = self.engine.generate(shared)
            self.num_calls += 1
        completions = []
        for request, (completion, *_) in zip(requests, samples, strict=True):
            limit = request.sampling.max_tokens
            if len(completion.token_ids) > limit:
                top = completion.top_log_probs
                completion = Completion(completion.token_ids[:limit], completion.log_probs[:limit], "length",
                                        top[:limit] if top is not None else None)
            completions.append(completion)
        return completions


class AgentRunner:
    """Builds each row's loop and runs them all concurrently; ``metrics`` summarises the last run."""

    def __init__(self, tokenizer: Any, config: MultiTurnConfig, tools: dict[str, Any] | None = None,
                 chat_template: str | None = None, processor: Any = None):
        """processor: a vision-language model's (tools may then return images; see ``tool_images.py``)."""
        self.tokenizer = tokenizer
        self.processor = processor
        self.config = config
        self.tools = dict(tools or {})
        self.chat_template = chat_template
        self._renderer = None

    def run(self, rows: list[dict[str, Any]], samplings: list[SamplingParams],
            client: TokenClient) -> list[AgentLoopOutput]:
        """Every row's trajectory, in row order. A row needs ``prompt_ids``; ``agent_name`` picks its loop."""
        return asyncio.run(self.run_async(rows, samplings, client))

    async def run_async(self, rows: list[dict[str, Any]], samplings: list[SamplingParams],
                        client: TokenClient) -> list[AgentLoopOutput]:
        context = AgentContext(self.tokenizer, client, self.config, self.tools, self.chat_template, self._renderer,
                               self.processor)
        tasks = []
        for row, sampling in zip(rows, samplings, strict=True):
            loop = get_agent_loop(agent_name_of(row.get("agent_name")))(context)
            tasks.append(asyncio.ensure_future(loop.run(sampling, **row)))
        try:
            outputs = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        finally:
            self._renderer = context.renderer
        return list(outputs)


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"{prefix}/min": min(values), f"{prefix}/max": max(values), f"{prefix}/mean": sum(values) / len(values)}


def agent_metrics(outputs: list[AgentLoopOutput]) -> dict[str, float]:
    """A rollout's agent metrics, with verl's names where it has them.

    num_turns/{min,max,mean}; timing_s/agent_loop/{generate_sequences,tool_calls}/{min,max,mean} and
    timing_s/agent_loop/slowest/* (the trajectory that took longest); agent/num_tool_calls/{min,max,mean}
    per trajectory, and the rollout's totals of tool errors, calls cut by max_parallel_calls, truncated
    tool responses, trajectories ended by a tool turn overflowing the budget, or by the budget itself;
    agent/num_segments/{min,max,mean} over the trajectories of external (OpenAI-client) agents, which report their
    segments (1 where the agent never rewrote its history); and agent/tool/<tool>/<name>, the rollout's total of each
    metric the tools returned.
    """
    if not outputs:
        return {}
    metrics = _stats("num_turns", [float(output.num_turns) for output in outputs])
    for name in ("generate_sequences", "tool_calls"):
        metrics |= _stats(f"timing_s/agent_loop/{name}", [output.metrics.get(name, 0.0) for output in outputs])
    slowest = max(outputs, key=lambda output: output.metrics.get("generate_sequences", 0.0)
                  + output.metrics.get("tool_calls", 0.0))
    metrics |= {"timing_s/agent_loop/slowest/generate_sequences": slowest.metrics.get("generate_sequences", 0.0),
                "timing_s/agent_loop/slowest/tool_calls": slowest.metrics.get("tool_calls", 0.0),
                "timing_s/agent_loop/slowest/prompt_length": float(len(slowest.prompt_ids)),
                "timing_s/agent_loop/slowest/response_length": float(len(slowest.response_ids))}
    metrics |= _stats("agent/num_tool_calls", [output.metrics.get("num_tool_calls", 0.0) for output in outputs])
    for name in ("tool_errors", "tool_raised", "tool_service_errors", "tool_calls_cut", "tool_response_truncated",
                 "tool_overflow"):
        metrics[f"agent/{name}"] = sum(output.metrics.get(name, 0.0) for output in outputs)
    metrics["agent/budget_spent"] = float(sum(output.finish_reason == "length" for output in outputs))
    metrics |= _stats("agent/num_segments", [output.metrics["num_segments"] for output in outputs
                                             if "num_segments" in output.metrics])
    for name in sorted({key for output in outputs for key in output.metrics if key.startswith("tool/")}):
        metrics[f"agent/{name}"] = sum(output.metrics.get(name, 0.0) for output in outputs)
    return metrics


def agent_mean_rows(metrics: Iterable[str], outputs: list[AgentLoopOutput]) -> dict[str, float]:
    """How many of ``outputs`` each mean of their ``agent_metrics`` is over: every trajectory, except the external
    agents' ``agent/num_segments/mean``, over those that report segments (several workers' means are weighted by
    these counts)."""
    segments = sum("num_segments" in output.metrics for output in outputs)
    return {name: float(segments if name == "agent/num_segments/mean" else len(outputs))
            for name in metrics if name.endswith("/mean")}


AGENT_TOTALS = tuple(f"agent/{name}" for name in ("tool_errors", "tool_raised", "tool_service_errors", "tool_calls_cut",
                                                  "tool_response_truncated", "tool_overflow", "budget_spent"))
"""``agent_metrics``' totals over the rollout's trajectories (with every ``agent/tool/<tool>/<name>``): several
workers' rollouts add them up."""


def agent_totals(metrics: Iterable[str]) -> tuple[str, ...]:
    """The names of ``metrics`` that are totals over a rollout's trajectories (``AGENT_TOTALS``, ``agent/tool/*``)."""
    return tuple(name for name in metrics if name in AGENT_TOTALS or name.startswith("agent/tool/"))


TOOL_FAILURE_STEPS = 3
"""Rollouts in a row in which every tool call that reached a tool failed (raised, timed out, or its service did not
run it) before the run stops."""
TOOL_FAILURE_MIN_CALLS = 8
"""A rollout with fewer such calls says nothing either way (unless every trajectory made one: ``failed_tools``)."""


class ToolFailure(RuntimeError):
    """Every tool call that reached a tool failed, rollout after rollout: the tool is broken, not the model."""


def tool_call_counts(output: AgentLoopOutput) -> tuple[int, int]:
    """(tool calls of one trajectory that reached a tool, those of them that failed for reasons not the model's: raised,
    timed out, or reported by the tool as a ``service_error``). ``num_tool_calls`` counts the calls that ran (not
    those cut by max_parallel_calls); of its ``tool_errors``, malformed calls and unknown tools reached no tool."""
    failed = output.metrics.get("tool_raised", 0.0) + output.metrics.get("tool_service_errors", 0.0)
    reached = output.metrics.get("num_tool_calls", 0.0) - output.metrics.get("tool_errors", 0.0) + failed
    return int(reached), int(failed)


def calls_reaching_tools(counts: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """``tool_call_counts`` of a rollout's trajectories summed: (calls that reached a tool, those that failed)."""
    counts = [(int(reached), int(failed)) for reached, failed in counts]
    return sum(reached for reached, _ in counts), sum(failed for _, failed in counts)


def failed_tools(counts: Iterable[tuple[int, int]]) -> str | None:
    """Why a rollout teaches nothing because its tools failed, in one line, or None when it may be trained.

    counts: ``tool_call_counts`` of each trajectory. A rollout is failed when tool calls reached a tool and each of
    them failed, in every trajectory or in at least ``TOOL_FAILURE_MIN_CALLS`` calls: trained, it would teach the
    model that tools answer with errors, and the optimizer would still apply momentum and weight decay."""
    counts = [(int(reached), int(failed)) for reached, failed in counts]
    total_reached, total_failed = calls_reaching_tools(counts)
    if total_reached == 0 or total_failed < total_reached:
        return None
    if total_reached < TOOL_FAILURE_MIN_CALLS and not all(reached > 0 for reached, _ in counts):
        return None
    return (f"every one of the {total_reached} tool calls of the rollout that reached a tool failed (raised, timed "
            "out, or its service did not run it)")


TOOL_CHECK_BY_CALLER = "tool_check_by_caller"
"""The meta key of a batch sent to a generating group of several members, each of which sees only its share: set
(True), a member leaves ``ToolFailureCheck`` to the caller and names its tools under the same key of its agent output's
meta instead; the caller runs the check once over the gathered batch (``ToolFailureCheck.gathered``)."""


class ToolFailureCheck:
    """Stops a run whose tools fail every call they get, ``TOOL_FAILURE_STEPS`` rollouts in a row (a tool may well
    raise on a model's bad arguments now and then; one that never answers teaches nothing, and the run must not
    go on to exit 0)."""

    def __init__(self, tool_names: list[str]):
        self.tool_names = tool_names
        self.failed_in_a_row = 0

    def __call__(self, outputs: list[AgentLoopOutput]) -> None:
        self.check([tool_call_counts(output) for output in outputs])

    def gathered(self, batch: Batch) -> Batch:
        """``batch``, a generating group's result, without its members' ``TOOL_CHECK_BY_CALLER``; where they left
        the check to the caller, it runs here, once, over the batch's ``tool_call_counts`` (the members' padding
        rows are gone from it). A result without it (one member's, which checked its rows itself) passes as it is."""
        tool_names = batch.meta.pop(TOOL_CHECK_BY_CALLER, None)
        if tool_names is None:
            return batch
        self.tool_names = list(tool_names)
        self.check(batch["tool_call_counts"])
        return batch

    def check(self, counts: Iterable[tuple[int, int]]) -> None:
        """counts: ``tool_call_counts`` of each trajectory of one rollout."""
        reached, failed = calls_reaching_tools(counts)
        if reached < TOOL_FAILURE_MIN_CALLS:
            return
        self.failed_in_a_row = self.failed_in_a_row + 1 if failed == reached else 0
        if self.failed_in_a_row >= TOOL_FAILURE_STEPS:
            raise ToolFailure(f"every one of the {reached} tool calls of the last rollout that reached a tool failed "
                              f"(raised, timed out, or its service did not run it), as in the {self.failed_in_a_row - 1} "
                              f"rollouts before it (tools: {', '.join(self.tool_names)}); the run learns nothing from "
                              "this: fix the tool or its service (the samples show its error messages) or raise its "
                              "time limit (a tool's own call_timeout_s in the tool config, below "
                              "rollout.multi_turn.tool_timeout_s), and run the same command again: it resumes from the "
                              "last checkpoint, before the failed rollouts")
