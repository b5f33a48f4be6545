"""``tool_agent``: generate, run the tool calls, append their results, repeat.

States: GENERATING -> PROCESSING_TOOLS -> GENERATING ... -> TERMINATED. After each assistant
turn the loop stops when the response budget is spent, at ``max_assistant_turns`` or
``max_user_turns``, or when the turn holds no tool call. Otherwise it runs the first
``max_parallel_calls`` calls concurrently; the calls past that are answered with a message
saying they were not run and counted in ``tool_calls_cut`` (verl drops them silently). A
malformed call, an unknown tool, arguments the tool cannot take (``BaseTool.arguments_problem``) or a tool
that raises becomes a tool message explaining the problem, with reward 0; the loop goes on. Tool output is cut to ``max_tool_response_length``
tokens (verl cuts characters). One ``max_tokens`` budget covers all sampled and tool tokens of
the trajectory; a tool turn that would overflow it ends the trajectory (``tool_overflow``). A tool may return
images to a vision-language model: its turn's image tokens count in the budget, and its images join the
trajectory's (``tool_images.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from enum import Enum, auto
from typing import Any

from reinforge.agent.loop import AgentContext, AgentLoop, AgentLoopOutput, register_agent_loop
from reinforge.agent.tool_images import encode_with_images, merged_images, tool_message
from reinforge.agent.tool_parsers import ToolCall, get_tool_parser
from reinforge.agent.tools import BaseTool, ToolResult, ToolUnavailable, as_tool_result
from reinforge.agent.turn_tokens import ToolTurnRenderer, truncate_tokens
from reinforge.rollout.base import SamplingParams
from reinforge.rollout.noise import sample_seed


class AgentState(Enum):
    GENERATING = auto()
    PROCESSING_TOOLS = auto()
    TERMINATED = auto()


logger = logging.getLogger(__name__)

TRUNCATION_NOTE = "...(truncated)..."
REPLACEMENT_CHARACTER = "\ufffd"
"""What a tokenizer decodes a cut multi-byte character to."""


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoop):
    uses_tools = True

    def __init__(self, context: AgentContext):
        super().__init__(context)
        self.parser = get_tool_parser(context.config.format)
        if context.renderer is None:  # built once per context: it renders the template's fixed parts up front
            context.renderer = ToolTurnRenderer(context.tokenizer, context.chat_template)
        self.renderer = context.renderer

    async def run(self, sampling: SamplingParams, **row: Any) -> AgentLoopOutput:
        client = self.context.client
        prompt_ids = list(row["prompt_ids"])
        budget = sampling.max_tokens
        tools_kwargs = (row.get("extra_info") or {}).get("tools_kwargs") or {}
        trajectory = _Trajectory(prompt_ids, row.get("multi_modal_inputs") or None)
        instances: dict[str, asyncio.Future] = {}
        state, turn = AgentState.GENERATING, 0
        calls: list[ToolCall] = []
        closing: list[int] = []
        try:
            while state is not AgentState.TERMINATED:
                if state is AgentState.GENERATING:
                    remaining = budget - len(trajectory.response_ids)
                    turn_sampling = dataclasses.replace(
                        sampling, max_tokens=remaining, n=1,
                        seed=None if sampling.seed is None else sample_seed(sampling.seed, turn),
                        stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids, *self.renderer.stop_ids))))
                    start = time.perf_counter()
                    images = {"multi_modal_inputs": trajectory.images} if trajectory.images else {}
                    completion = await client.generate(prompt_ids + trajectory.response_ids, turn_sampling,
                                                       f"{row.get('request_id', '')}/{turn}", **images)
                    trajectory.metrics["generate_sequences"] += time.perf_counter() - start
                    trajectory.append(completion.token_ids, completion.log_probs, sampled=True)
                    # so the stream stays the template's before the tool turn
                    closing = self.renderer.closing_ids(completion.token_ids, completion.finish_reason)
                    trajectory.assistant_turns += 1
                    turn += 1
                    calls = self.parser.parse(self._turn_text(completion))
                    state, trajectory.finish_reason = self._after_generation(trajectory, calls, budget,
                                                                             completion.finish_reason)
                else:
                    start = time.perf_counter()
                    results = await self._run_calls(calls, tools_kwargs, instances, trajectory)
                    trajectory.metrics["tool_calls"] += time.perf_counter() - start
                    increment, turn_images, messages = self._tool_turn(results, [
                        call_id(call, trajectory.user_turns, index) for index, call in enumerate(calls)],
                        trajectory.tool_turns)
                    increment = closing + increment
                    if len(trajectory.response_ids) + len(increment) >= budget:
                        trajectory.metrics["tool_overflow"] = 1.0
                        state, trajectory.finish_reason = AgentState.TERMINATED, "tool_overflow"
                        continue
                    trajectory.append(increment, [0.0] * len(increment), sampled=False)
                    trajectory.tool_turns.append(messages)
                    trajectory.images = merged_images(trajectory.images, turn_images)
                    trajectory.user_turns += 1
                    state = AgentState.GENERATING
        finally:
            for name, future in instances.items():
                if not future.done():  # a create that outlasted its call's timeout: its instance ends once it exists
                    future.add_done_callback(functools.partial(_release_when_created, self.context.tools[name], name))
            created = [(name, future.result()) for name, future in instances.items()
                       if future.done() and not future.cancelled() and future.exception() is None]
            # a release that never returns must not hold the trajectory (and the rollout) for ever: it gets the
            # tool timeout, as a call does, and is cancelled past it
            timeout = self.context.config.tool_timeout_s
            released = await asyncio.gather(*(asyncio.wait_for(_no_exit(self.context.tools[name].release(instance)),
                                                                timeout) for name, instance in created),
                                            return_exceptions=True)
            for (name, _), error in zip(created, released, strict=True):
                if isinstance(error, TimeoutError):
                    logger.warning("tool %r: release did not return within %s s; cancelled", name, timeout)
                elif isinstance(error, Exception):  # the trajectory stands; a leaking tool should still be seen
                    logger.warning("tool %r: release failed: %s: %s", name, type(error).__name__, error)
        return trajectory.output()

    def _turn_text(self, completion: Any) -> str:
        """The text of a sampled turn without the special token that ended it (Llama 3's JSON call is the whole turn:
        the ``<|eot_id|>`` after it is not part of the call). A stop token that is no special token (Qwen's
        ``</tool_call>`` as a rollout stop token) stays: it may close a call."""
        token_ids = list(completion.token_ids)
        if (completion.finish_reason == "stop" and token_ids
                and token_ids[-1] in getattr(self.context.tokenizer, "all_special_ids", ())):
            token_ids = token_ids[:-1]
        return self.context.tokenizer.decode(token_ids)

    def _tool_turn(self, results: list[ToolResult], call_ids: list[str],
                   earlier: list[list[dict]]) -> tuple[list[int], dict | None, list[dict]]:
        """The tool turn's token ids (after the end-of-turn token), when its results hold images their pixels, and
        its tool messages. earlier: the tool messages of the trajectory's earlier tool turns."""
        images = [image for result in results for image in result.images]
        messages = [tool_message(result.text, result.images, identifier)
                    for result, identifier in zip(results, call_ids, strict=True)]
        if not images:
            return self.renderer.increment(messages, earlier), None, messages
        if self.context.processor is None:
            raise ValueError("a tool returned an image, but this model takes no images: it has no image processor "
                             "reinforge uses (a text model, or an image-text model reinforge trains on text alone, "
                             "such as Gemma 3 or Llava); return text from the tool, or train Qwen2-VL, Qwen2.5-VL or "
                             "Qwen3-VL")
        return (*encode_with_images(self.context.processor, self.renderer.increment_text(messages, earlier), images),
                messages)

    def _after_generation(self, trajectory: _Trajectory, calls: list[ToolCall], budget: int,
                          finish_reason: str) -> tuple[AgentState, str]:
        config = self.context.config
        if not calls:  # an answer that ends with its stop token on the budget's last token is still an answer
            return AgentState.TERMINATED, finish_reason
        if len(trajectory.response_ids) >= budget:
            return AgentState.TERMINATED, "length"
        if config.max_assistant_turns is not None and trajectory.assistant_turns >= config.max_assistant_turns:
            return AgentState.TERMINATED, "max_turns"
        if config.max_user_turns is not None and trajectory.user_turns >= config.max_user_turns:
            return AgentState.TERMINATED, "max_turns"
        return AgentState.PROCESSING_TOOLS, finish_reason

    async def _run_calls(self, calls: list[ToolCall], tools_kwargs: dict[str, Any], instances: dict[str, asyncio.Future],
                         trajectory: _Trajectory) -> list[ToolResult]:
        limit = self.context.config.max_parallel_calls
        run, cut = calls[:limit], calls[limit:]
        results = list(await asyncio.gather(*(self._call(call, tools_kwargs, instances) for call in run)))
        results += [ToolResult(f"Not run: at most {limit} tool call(s) per turn are executed.", 0.0) for _ in cut]
        metrics = trajectory.metrics
        metrics["num_tool_calls"] += len(run)
        metrics["tool_calls_cut"] += len(cut)
        truncated = []
        for call, result in zip(calls, results, strict=True):
            raised, service_error = result.metrics.get("tool_raised", 0.0), result.metrics.get("service_error", 0.0)
            if result.metrics.get("tool_error") or service_error:
                metrics["tool_errors"] += 1
            metrics["tool_raised"] += raised
            metrics["tool_service_errors"] += float(bool(service_error) and not raised)
            for key, value in result.metrics.items():  # the tool's own metrics, summed per tool and key
                if key not in ("tool_error", "tool_raised", "service_error"):
                    metrics[f"tool/{call.name}/{key}"] = metrics.get(f"tool/{call.name}/{key}", 0.0) + value
            if result.reward is not None:
                trajectory.tool_rewards.append(float(result.reward))
            text, was_cut = self._truncate(valid_text(result.text))
            metrics["tool_response_truncated"] += was_cut
            truncated.append(result._replace(text=text))
        return truncated

    async def _call(self, call: ToolCall, tools_kwargs: dict[str, Any],
                    instances: dict[str, asyncio.Future]) -> ToolResult:
        tools: dict[str, BaseTool] = self.context.tools
        if call.error is not None:
            return ToolResult(call.error, 0.0, {"tool_error": 1.0})
        tool = tools.get(call.name)
        if tool is None:
            return ToolResult(f"Unknown tool {call.name!r}. Available tools: {', '.join(sorted(tools))}.", 0.0,
                              {"tool_error": 1.0})
        kwargs = tools_kwargs.get(call.name) or {}
        try:
            problem = tool.arguments_problem(call.arguments, kwargs.get("execute_kwargs") or {})
        except Exception as error:  # a bug in the tool's own check: a failed call, not a failed rollout
            return _raised(call.name, error)
        if problem is not None:  # the model's mistake, not the tool's failure: it did not reach the tool
            return ToolResult(f"Invalid arguments for tool {call.name!r}: {problem}.", 0.0, {"tool_error": 1.0})
        timeout = self.context.config.tool_timeout_s
        # asyncio.timeout, not wait_for: the tool runs in this task, so its SystemExit is caught below (in a task of
        # its own it would end the event loop), and its own TimeoutError is told apart from ours (scope.expired)
        scope = asyncio.timeout(timeout)
        try:
            async with scope:
                previous = instances.get(call.name)
                if previous is None or (previous.done() and (previous.cancelled() or previous.exception() is not None)):
                    # one create per tool and trajectory, even when calls of the same tool run in parallel
                    instances[call.name] = asyncio.ensure_future(
                        _no_exit(tool.create(**(kwargs.get("create_kwargs") or {}))))
                instance = await asyncio.shield(instances[call.name])
                result = as_tool_result(await tool.execute(instance, call.arguments,
                                                           **(kwargs.get("execute_kwargs") or {})))
            if result.reward is not None and not math.isfinite(result.reward):
                raise ValueError(f"the tool returned a non-finite reward {result.reward}")
        except ToolUnavailable:
            raise  # the tool's service is gone: the rollout stops rather than train on error messages
        except TimeoutError as error:
            if not scope.expired():  # the tool's own timeout (a socket's, say): an error like any other
                return _raised(call.name, error)
            return ToolResult(f"Tool {call.name!r} did not answer within {timeout} s.", 0.0,
                              {"tool_error": 1.0, "tool_raised": 1.0})
        except SystemExit as error:
            return _raised(call.name, RuntimeError(f"the tool called exit({error.code})"))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the trajectory is being cancelled
            # the tool's own: a request of its library cancelled inside it, not the trajectory's task
            return _raised(call.name, RuntimeError("the tool raised CancelledError (something it awaited was cancelled)"))
        except Exception as error:
            return _raised(call.name, error)
        return result

    def _truncate(self, text: str) -> tuple[str, bool]:
        """The tool output cut to ``max_tool_response_length`` tokens on the configured side (the middle side's
        note counts in them; a limit too small for it keeps the start), with no half character left where it was cut.

        Only the characters that can hold the kept tokens are tokenized (a token stands for at most
        ``renderer.max_token_chars`` of them): a tokenizer takes seconds over a long run of text without spaces,
        and the event loop, every trajectory's, waits meanwhile."""
        config = self.context.config
        limit, side = config.max_tool_response_length, config.tool_response_truncate_side
        note = len(self.renderer.encode(TRUNCATION_NOTE))
        if side == "middle" and limit < note + 2:
            side = "right"
        reach = (limit + 8) * self.renderer.max_token_chars  # more characters than limit tokens can stand for
        if side == "right" and len(text) > reach:
            tokens = self.renderer.encode(text[:reach])
        elif side == "left" and len(text) > reach:
            tokens = self.renderer.encode(text[-reach:])
        elif side == "middle" and len(text) > 2 * reach:
            tokens = self.renderer.encode(text[:reach]) + self.renderer.encode(text[-reach:])
        else:
            tokens = self.renderer.encode(text)
        if len(tokens) <= limit:
            return text, False
        decode = self.context.tokenizer.decode
        if side == "middle":
            limit -= note
            kept, _ = truncate_tokens(tokens, limit, side)
            head = (limit + 1) // 2
            return (decode(kept[:head]).rstrip(REPLACEMENT_CHARACTER) + TRUNCATION_NOTE
                    + decode(kept[head:]).lstrip(REPLACEMENT_CHARACTER)), True
        kept, _ = truncate_tokens(tokens, limit, side)
        cut = decode(kept)
        return (cut.rstrip(REPLACEMENT_CHARACTER) if side == "right" else cut.lstrip(REPLACEMENT_CHARACTER)), True


_late_releases: set[asyncio.Task] = set()
"""Releases of instances created after their trajectory ended, held until they finish (the loop keeps weak
references to its tasks)."""


def _release_when_created(tool: BaseTool, name: str, created: asyncio.Future) -> None:
    """Release the instance of a create that returned after its trajectory ended (its call timed out and nothing
    waited for it), so that no instance outlives the trajectory that asked for it."""
    if created.cancelled() or created.exception() is not None:
        return
    task = created.get_loop().create_task(_no_exit(tool.release(created.result())))
    _late_releases.add(task)

    def done(task: asyncio.Task) -> None:
        _late_releases.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("tool %r: release failed: %s: %s", name, type(task.exception()).__name__, task.exception())

    task.add_done_callback(done)


def valid_text(text: str) -> str:
    """``text`` with each lone surrogate (a tool's ``surrogateescape`` output, a ``\\ud800`` the model wrote in its
    call's JSON and an error message repeats) as U+FFFD, which a tokenizer can encode (it refuses the text otherwise,
    and the rollout would stop); a split surrogate pair becomes its character."""
    if text.isascii():
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _raised(name: str, error: BaseException) -> ToolResult:
    return ToolResult(f"Error running tool {name!r}: {type(error).__name__}: {error}", 0.0,
                      {"tool_error": 1.0, "tool_raised": 1.0})


async def _no_exit(awaitable: Any) -> Any:
    """``await awaitable`` with a SystemExit turned into an error: in a task of its own it would end the event loop."""
    try:
        return await awaitable
    except SystemExit as error:
        raise RuntimeError(f"the tool called exit({error.code})") from None


class _Trajectory:
    def __init__(self, prompt_ids: list[int], images: dict | None = None):
        self.prompt_ids = prompt_ids
        self.images = images
        """The images so far, the prompt's then the tool turns' (``tool_images.merged_images``)."""
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.log_probs: list[float] = []
        self.assistant_turns = 0
        self.user_turns = 0
        self.tool_rewards: list[float] = []
        self.tool_turns: list[list[dict]] = []
        """The tool messages of each tool turn appended so far."""
        self.finish_reason = "stop"
        self.metrics: dict[str, float] = {"generate_sequences": 0.0, "tool_calls": 0.0, "num_tool_calls": 0.0,
                                          "tool_errors": 0.0, "tool_calls_cut": 0.0, "tool_response_truncated": 0.0,
                                          "tool_overflow": 0.0, "tool_raised": 0.0, "tool_service_errors": 0.0}

    def append(self, token_ids: list[int], log_probs: list[float], sampled: bool) -> None:
        self.response_ids += token_ids
        self.response_mask += [1 if sampled else 0] * len(token_ids)
        self.log_probs += list(log_probs) if sampled else [0.0] * len(token_ids)

    def output(self) -> AgentLoopOutput:
        return AgentLoopOutput(
            prompt_ids=self.prompt_ids, response_ids=self.response_ids, response_mask=self.response_mask,
            response_log_probs=self.log_probs, num_turns=self.user_turns + self.assistant_turns + 1,
            finish_reason=self.finish_reason, metrics=self.metrics, extra={"tool_rewards": self.tool_rewards},
            multi_modal_inputs=self.images)


CALL_ID_CHARS = 9
"""Characters of a generated tool-call id: Mistral's templates accept only 9 alphanumeric ones."""


def call_id(call: ToolCall, tool_turn: int, index: int) -> str:
    """The ``tool_call_id`` of a call's result: the id the model wrote when a template can take it (9 alphanumeric
    characters), else one made from the tool turn and the call's place in it, the same in every run."""
    if call.id is not None and len(call.id) == CALL_ID_CHARS and call.id.isascii() and call.id.isalnum():
        return call.id
    return f"c{tool_turn % 10_000:04d}{index % 10_000:04d}"
