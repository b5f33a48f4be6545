"""External agents as agent loops: any OpenAI-client agent, trained through the endpoint.

``register_openai_agent(name, agent)`` registers an agent loop under ``name``, which a row selects by its
``agent_name`` as it selects ``tool_agent``. ``agent`` is either

- an async callable ``agent(base_url, row) -> reward or final answer``: it talks to the policy with any OpenAI client
  pointed at ``base_url`` (``/t/<trajectory_id>/v1`` on an endpoint the rollout starts on the engine, on 127.0.0.1);
- or a command (a list of arguments): it runs with ``OPENAI_BASE_URL`` (and a dummy ``OPENAI_API_KEY``) set and the
  row as JSON on its stdin; the last line it prints is its reward (a number) or final answer.

A number returned is the trajectory's reward (``reward_score``); anything else is kept as ``final_answer`` and the
reward manager scores the trajectory. The trajectory is assembled from the endpoint's records (``trajectories.py``),
within ``rollout.multi_turn``'s budgets; ``timeout_s`` bounds the agent's wall time (its trajectory then ends with
the calls made so far, finish reason ``timeout``). An agent that raises before the endpoint ended its trajectory
stops the rollout with its error: a broken agent must not train on what it left.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import itertools
import json
import logging
import math
import numbers
import os
import shlex
import shutil
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from reinforge.agent.checks import images_refused_by
from reinforge.agent.loop import AGENT_LOOPS, AgentContext, AgentLoop, AgentLoopOutput, register_agent_loop
from reinforge.agent.tool_config import import_object
from reinforge.config.schema import MultiTurnConfig
from reinforge.protocol import MULTI_MODAL_KEY
from reinforge.rollout.base import SamplingParams
from reinforge.serve.app import OpenAIEndpoint
from reinforge.serve.chat import ChatCodec
from reinforge.serve.service import GenerationService
from reinforge.serve.trajectories import TrajectorySession, jsonable

OpenAIAgent = Callable[[str, dict[str, Any]], Awaitable[Any]]
HTTP_CLIENT_LOGGERS = ("httpx", "httpx2", "openai")
ROW_KEYS_NOT_SENT = ("prompt_ids",)

_trajectory_numbers = itertools.count()
logger = logging.getLogger(__name__)

BLOCKED_LOOP_S = 10.0
"""Seconds an agent may hold the event loop before ``LoopWatch`` says so."""
BLOCKING_FIX = ("an agent shares the event loop the endpoint answers on, so a blocking call in it (openai.OpenAI "
                "instead of openai.AsyncOpenAI, a framework's sync invoke, time.sleep, requests) waits on an answer "
                "that cannot come and its timeout cannot end it; await the async client, or run blocking work "
                "in asyncio.to_thread")


class LoopWatch:
    """Watches, from a thread, the event loop the agents and their endpoint share: an agent that holds it past
    ``BLOCKED_LOOP_S`` (a sync OpenAI client waits on an endpoint that the held loop cannot run) is named in one
    error line while it holds it, and its error, if it raises, says so."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.beat = time.monotonic()
        self.agents: dict[asyncio.Task, str] = {}
        self.blocked: dict[asyncio.Task, float] = {}
        """Per agent's task: the longest time it held the loop, where past ``BLOCKED_LOOP_S``."""
        self._stopped = threading.Event()
        self._heartbeat = loop.create_task(self._beat())
        threading.Thread(target=self._watch, name="reinforge-agent-loop-watch", daemon=True).start()

    watches: dict[asyncio.AbstractEventLoop, LoopWatch] = {}

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopWatch:
        if loop not in cls.watches:
            cls.watches[loop] = cls(loop)
        return cls.watches[loop]

    def leave(self, task: asyncio.Task) -> float:
        """``task``'s agent is done: the longest it held the loop past ``BLOCKED_LOOP_S`` (0 if never). The watch
        stops with the loop's last agent."""
        self.agents.pop(task, None)
        held = self.blocked.pop(task, 0.0)
        if not self.agents:
            self._stopped.set()
            self._heartbeat.cancel()
            LoopWatch.watches.pop(self.loop, None)
        return held

    async def _beat(self) -> None:
        while True:
            self.beat = time.monotonic()
            await asyncio.sleep(0.1)

    def _watch(self) -> None:
        told = running = None
        since = time.monotonic()
        while not self._stopped.wait(0.1) and not self.loop.is_closed():
            try:
                task, now = asyncio.current_task(self.loop), time.monotonic()
            except Exception:  # this Python cannot tell another thread's loop's task: nothing to watch
                return
            if task is not running:
                running, since = task, now
            # held: the loop made no round and one task ran all along (many agents' short steps in one round are not
            # one agent holding it)
            held = min(now - self.beat, now - since)
            name = self.agents.get(task) if task is not None and held > BLOCKED_LOOP_S else None
            if name is None:
                told = None
                continue
            self.blocked[task] = max(self.blocked.get(task, 0.0), held)
            if told is not task:
                told = task
                logger.error("agent %r has held the event loop for %.0f s: %s", name, held, BLOCKING_FIX)


def raise_open_file_limit() -> None:
    """Lift this process's soft limit of open files to its hard limit: each trajectory's connection takes two (the
    agent's end and the endpoint's), and a desktop's 1,024 ran out at about 500 trajectories, each of them failing to
    connect."""
    try:
        import resource
    except ImportError:  # not on this system
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class _SharedEndpoint:
    """One endpoint per agent context (a rollout's trajectories share it), closed when its last trajectory ends,
    or, when every trajectory is cancelled while it starts, stopped there (closed if it got to listen)."""

    endpoints: dict[int, tuple[AgentContext, asyncio.Task, int]] = {}
    """By ``id(context)``; each entry holds its context, so no other object can take that id while it lives."""

    @classmethod
    async def acquire(cls, context: AgentContext) -> OpenAIEndpoint:
        key = id(context)
        if key not in cls.endpoints:
            cls.endpoints[key] = (context, asyncio.ensure_future(cls._start(context)), 0)
        _, task, users = cls.endpoints[key]
        cls.endpoints[key] = (context, task, users + 1)
        try:
            return await asyncio.shield(task)
        except BaseException:
            await cls.release(context)
            raise

    @classmethod
    async def release(cls, context: AgentContext) -> None:
        key = id(context)
        _, task, users = cls.endpoints[key]
        if users > 1:
            cls.endpoints[key] = (context, task, users - 1)
            return
        del cls.endpoints[key]
        if not task.done():  # every trajectory was cancelled while it started: no one will close it later
            task.cancel()
            await asyncio.wait([task])
        if not task.cancelled() and task.exception() is None:
            await task.result().close()

    @staticmethod
    async def _start(context: AgentContext) -> OpenAIEndpoint:
        raise_open_file_limit()
        for name in HTTP_CLIENT_LOGGERS:  # a line per request at INFO would bury the run's own lines
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        if context.renderer is None:
            from reinforge.agent.turn_tokens import ToolTurnRenderer

            context.renderer = ToolTurnRenderer(context.tokenizer, context.chat_template)
        codec = ChatCodec(context.tokenizer, context.chat_template, context.config.format)
        service = GenerationService(context.client, context.tokenizer, "policy", codec=codec,
                                    max_model_len=1 << 30)
        endpoint = OpenAIEndpoint(service, max_concurrency=1 << 20)
        try:
            await endpoint.start()
        except BaseException:  # cancelled (see ``release``) or failed partway: nothing may be left listening
            await endpoint.close()
            raise
        return endpoint


class OpenAIAgentLoop(AgentLoop):
    """Runs one row's external agent against its own trajectory URL and returns the recorded trajectory."""

    agent: OpenAIAgent | Sequence[str]
    timeout_s: float | None = None
    agent_name = ""
    takes_images = False

    async def run(self, sampling: SamplingParams, **row: Any) -> AgentLoopOutput:
        if row.get(MULTI_MODAL_KEY):
            raise ValueError(images_refused_by(f"row {str(row.get('request_id', '')).rpartition('/')[0]!r} (uid)",
                                               self.agent_name))
        endpoint = await _SharedEndpoint.acquire(self.context)
        session = TrajectorySession(sampling, self.context.config, str(row.get("request_id", "")),
                                    getattr(getattr(self.context.client, "engine", None), "max_model_len", None))
        trajectory_id = f"{next(_trajectory_numbers)}-{os.getpid()}"
        base_url = endpoint.open_trajectory(trajectory_id, session)
        result: Any = None
        start = time.perf_counter()
        task = asyncio.current_task()
        watch = LoopWatch.of(asyncio.get_running_loop()) if task is not None and callable(self.agent) else None
        if watch is not None:
            watch.agents[task] = self.agent_name
        try:
            scope = asyncio.timeout(self.timeout_s)
            try:
                async with scope:
                    result = await self._run_agent(base_url, self._agent_row(row))
            except Exception as error:
                # its time is up (the agent's own TimeoutError is an error like any other)
                if isinstance(error, TimeoutError) and scope.expired():
                    session.ended = session.ended or "timeout"
                    if not session.records:
                        raise RuntimeError(f"agent {self.agent_name!r} made no chat call in its {self.timeout_s:g} s "
                                           "(rollout.multi_turn.openai_agent_timeout_s), so there is no trajectory "
                                           "to train; check that it calls the base_url it is given, or raise the "
                                           "timeout") from None
                else:
                    held = watch.blocked.get(task, 0.0) if watch is not None else 0.0  # it leaves below
                    if session.ended is None:
                        blocked = f" after holding the event loop for {held:.0f} s ({BLOCKING_FIX})" if held else ""
                        raise RuntimeError(f"agent {self.agent_name!r} raised {type(error).__name__}: "
                                           f"{' '.join(str(error).split())}{blocked}") from error
        finally:
            if watch is not None:
                watch.leave(task)
            endpoint.close_trajectory(trajectory_id)
            await _SharedEndpoint.release(self.context)
        if not session.records and session.ended_why:
            raise RuntimeError(f"agent {self.agent_name!r}: its first call was refused, so there is no trajectory to "
                               f"train: {session.ended_why}; keep its first prompt within data.max_prompt_length")
        if not session.records:
            raise RuntimeError(f"agent {self.agent_name!r} made no chat call through its base_url, so there is no "
                               "trajectory to train; point the agent's OpenAI client at the base_url it is given")
        output = session.output()
        output.metrics["agent_seconds"] = time.perf_counter() - start
        if isinstance(result, numbers.Real) and not isinstance(result, bool):  # numpy's scalars too
            output.reward_score = float(result)
            if not math.isfinite(output.reward_score):
                raise RuntimeError(f"agent {self.agent_name!r} returned the reward {output.reward_score}, which would "
                                   "make the group's advantages NaN; return a finite number, or a final answer (not a "
                                   "number) for the reward manager to score")
        elif result is not None:
            output.extra["final_answer"] = result
        return output

    def _agent_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row as the agent gets it: its columns, and under ``tools`` the OpenAI schemas of the run's tool config
        (the tools its prompt was rendered with), which the agent sends with its calls."""
        agent_row = {key: value for key, value in row.items() if key not in ROW_KEYS_NOT_SENT}
        if self.context.tools:
            agent_row["tools"] = [tool.schema for tool in self.context.tools.values()]
        return agent_row

    async def _run_agent(self, base_url: str, row: dict[str, Any]) -> Any:
        if callable(self.agent):
            return await self.agent(base_url, row)
        return await run_agent_command(list(self.agent), base_url, row)


AFTER_EXIT_GRACE_S = 1.0
"""How long the output of an agent command that has exited is still read: a process it left running in the
background that holds the command's stdout open (``server &``) is then killed with the rest of its group, rather than
waited for."""


async def run_agent_command(command: list[str], base_url: str, row: dict[str, Any]) -> Any:
    """Run an agent command with OPENAI_BASE_URL set and the row on stdin; its last printed line, as a number if
    it reads as one. The command runs in a process group of its own, killed whole when the command has exited (a
    process it left behind, holding its output open, is not waited for) or is cancelled (its timeout: ``cmd:bash
    run.sh`` or ``cmd:uv run agent.py`` would leave the agent itself running)."""
    environment = dict(os.environ, OPENAI_BASE_URL=base_url, OPENAI_API_KEY=os.environ.get("OPENAI_API_KEY", "none"))
    process = await asyncio.create_subprocess_exec(*command, stdin=asyncio.subprocess.PIPE,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                   env=environment, start_new_session=True)
    stdout, stderr = bytearray(), bytearray()
    readers = [asyncio.ensure_future(_read_into(process.stdout, stdout)),
               asyncio.ensure_future(_read_into(process.stderr, stderr))]
    try:
        await _feed(process.stdin, json.dumps(jsonable(row)).encode())
        await _exited(process)
        await asyncio.wait(readers, timeout=AFTER_EXIT_GRACE_S)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # the group outlives its leader: killed whether or not it exited
        # the killed processes' ends of the pipes close: read them to their end (bounded: a process that left the
        # group may hold them)
        await asyncio.wait(readers, timeout=AFTER_EXIT_GRACE_S)
        if process.returncode is None:
            await _exited(process)
        for reader in readers:
            reader.cancel()
    if process.returncode != 0:
        last = (stderr.decode(errors="replace").strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"agent command {command[0]!r} exited with {process.returncode}: {last}")
    lines = [line for line in stdout.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return None
    try:
        return float(lines[-1])
    except ValueError:
        return lines[-1].strip()


EXIT_POLL_S = 0.25
"""How often ``_exited`` looks whether a command has exited while its output stays open."""


async def _exited(process: asyncio.subprocess.Process) -> None:
    """Until the command itself has exited. ``process.wait()`` alone also waits for its stdout and stderr to close,
    which a process it left running in the background holds open."""
    waiting = asyncio.ensure_future(process.wait())
    try:
        while process.returncode is None and not waiting.done():
            await asyncio.wait([waiting], timeout=EXIT_POLL_S)
    finally:
        waiting.cancel()


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    """Write ``data`` to a command's stdin and close it; a command that exits without reading all of it is fine."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stdin.write(data)
        await stdin.drain()
    stdin.close()


async def _read_into(stream: asyncio.StreamReader, into: bytearray) -> None:
    while chunk := await stream.read(1 << 16):
        into.extend(chunk)


def register_configured_agents(config: MultiTurnConfig) -> None:
    """Register ``rollout.multi_turn.openai_agents`` (agent_name -> 'file.py:function', 'package.module.function' or
    'cmd:COMMAND ARGS'); a name already registered with the same agent is left as it is."""
    if config.openai_agents and importlib.util.find_spec("aiohttp") is None:
        raise ValueError(f"rollout.multi_turn.openai_agents ({', '.join(config.openai_agents)}) run through an HTTP "
                         "endpoint, which needs aiohttp; pip install 'reinforge[serve]'")
    for name, spec in config.openai_agents.items():
        where = f"rollout.multi_turn.openai_agents.{name}"
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"{where}={spec!r}; give 'file.py:function', 'package.module.function' or 'cmd:COMMAND'")
        if spec.startswith("cmd:"):
            agent: Any = tuple(shlex.split(spec[4:]))
            if not agent:
                raise ValueError(f"{where}={spec!r} names no command; write cmd: followed by the command line")
            if shutil.which(agent[0]) is None:  # found here, before the model loads, not at the first rollout
                raise ValueError(f"{where}={spec!r}: {agent[0]!r} is neither a command on PATH nor an executable "
                                 "file; fix the command's name, or give its path (a script needs its executable bit, "
                                 "or its interpreter first: cmd:python agent.py)")
        else:
            agent = import_object(spec, where)
            if not (inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__)):
                raise ValueError(f"{where}: {spec!r} is not an async function; define it as "
                                 "`async def agent(base_url, row)`")
        existing = AGENT_LOOPS.get(name)
        if existing is not None:
            if issubclass(existing, OpenAIAgentLoop) and existing.agent == agent \
                    and existing.timeout_s == config.openai_agent_timeout_s:
                continue
            raise ValueError(f"{where}: agent_name {name!r} is already a registered agent loop; pick another name")
        register_openai_agent(name, agent, timeout_s=config.openai_agent_timeout_s)


def register_openai_agent(name: str, agent: OpenAIAgent | Sequence[str], *,
                          timeout_s: float | None = None) -> type[AgentLoop]:
    """Register ``agent`` (an async callable or a command) as the agent loop ``name``; see the module docstring."""
    if isinstance(agent, str):
        raise TypeError(f"agent command {agent!r} is a string; give its arguments as a list, e.g. {agent.split()!r}")
    if not callable(agent) and not (isinstance(agent, Sequence) and agent and all(isinstance(part, str)
                                                                                  for part in agent)):
        raise TypeError(f"agent {agent!r} is neither an async callable agent(base_url, row) nor a command list")
    loop_class = type(f"OpenAIAgent_{name}", (OpenAIAgentLoop,),
                      {"agent": staticmethod(agent) if callable(agent) else tuple(agent), "timeout_s": timeout_s,
                       "agent_name": name})
    return register_agent_loop(name)(loop_class)
