"""``code_interpreter(code)``: the ReTool recipe's tool, running Python in the code sandbox.

The tool sends the code to a sandbox (``reinforge sandbox serve`` or a SandboxFusion
deployment) through ``SandboxClient`` and shows the model what a terminal would: stdout, then
stderr (a traceback), or a line saying the run was stopped at its time limit. A sandbox that
cannot be reached, after the client's retries, gives a tool message saying so (counted as a
tool error), never an exception or a hang: the client's deadline bounds every call. A server
that refuses for load (429, 503) is retried after its Retry-After for ``retry_budget_s``
seconds, and every tool of the process that calls one sandbox URL shares the client's limit
on requests in flight (``SandboxClient``).

``memory_limit_mb`` defaults to -1, the server's own default (1 GiB on ours). Leave it there for
a SandboxFusion deployment: any limit set there also becomes the program's stack limit, so each
thread asks for a stack that size and none can start (``import numpy`` fails).

Tool config entry (``rollout.multi_turn.tool_config_path``):

```yaml
tools:
  - class_name: reinforge.agent.code_interpreter.CodeInterpreterTool
    config: {sandbox_url: http://127.0.0.1:8080, run_timeout_s: 10}
```
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from reinforge.agent.tools import BaseTool, ToolResult, ToolUnavailable
from reinforge.sandbox import RunCodeResponse, SandboxClient
from reinforge.sandbox.client import DEFAULT_RETRY_BUDGET_S

SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python code and see what it prints (stdout, then stderr). Each call starts a fresh "
                       "interpreter; print every value you want to see.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}
CONFIG_KEYS = ("sandbox_url", "run_timeout_s", "memory_limit_mb", "retry_budget_s", "max_concurrent_calls",
               "call_timeout_s", "max_failures_in_a_row")
DEFAULT_CALL_TIMEOUT_CAP_S = 280.0
"""The default call_timeout_s is at most this (unless the program's run needs longer): below the agent loop's
default ``rollout.multi_turn.tool_timeout_s`` (300), so a slow call ends with the tool's own message (the time limit,
"not run" and why) rather than the loop's "did not answer"."""
VERL_KEYS = ("type",)
"""Keys of verl's tool entries that mean nothing here and are allowed, so a verl config loads."""
_FENCED = re.compile(r"^\s*```(?:python|py)?\s*\n(.*?)\n?```\s*$", re.DOTALL)


def _config_number(config: dict[str, Any], key: str, default: float, kind: type, minimum: float,
                   above: bool = False, minimum_name: str = "") -> Any:
    """``config[key]`` as ``kind`` (int or float), at least ``minimum`` (or above it); ValueError naming key and fix.

    A string, or a value that would make every call fail (a run timeout of 0, no attempt at all), is refused
    here: otherwise training runs on with the model reading nothing but time limits or "not run".
    """
    value = config.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or (kind is int and value != int(value))):
        raise ValueError(f"code_interpreter config {key}={value!r} is not {'an integer' if kind is int else 'a number'}"
                         f"; write a number (default {default})")
    if value < minimum or (above and value == minimum):
        bound = f"{minimum_name} ({minimum})" if minimum_name else minimum
        raise ValueError(f"code_interpreter config {key}={value!r} must be {'above' if above else 'at least'} "
                         f"{bound}; the default is {default}")
    return kind(value)


def strip_code_fence(code: str) -> str:
    """The code inside a Markdown fence (```python ... ```), as models often send it; other code as it is."""
    match = _FENCED.match(code)
    return match.group(1) if match else code


def format_run(response: RunCodeResponse) -> tuple[str, dict[str, float]]:
    """What the model reads for a sandbox response, and the call's metrics."""
    run = response.run_result
    if response.status == "SandboxError" or run is None:
        return f"The code was not run: {response.message or 'the sandbox failed'}", {
            "tool_error": 1.0, "sandbox_error": 1.0, "service_error": 1.0}
    parts = [text for text in (run.stdout, run.stderr) if text]
    if run.status == "TimeLimitExceeded":
        parts.append(f"Time limit exceeded: the code was stopped after {run.execution_time or 0:.1f} s.")
    elif run.return_code not in (0, None) and not run.stderr:
        parts.append(f"The process exited with code {run.return_code}.")
    metrics = {"timeout": float(run.status == "TimeLimitExceeded"), "failed": float(response.status == "Failed")}
    return ("\n".join(part.rstrip("\n") for part in parts) if parts else "(no output)"), metrics


class CodeInterpreterTool(BaseTool):
    """config: sandbox_url (required), run_timeout_s (10), memory_limit_mb (-1: the server's default), retry_budget_s
    (300: seconds a call refused for load, or not connected, is retried; 0: one attempt), max_concurrent_calls (64:
    threads waiting on the sandbox at once, across all trajectories), call_timeout_s (run_timeout_s + 40 +
    retry_budget_s, at most 280 unless run_timeout_s + 40 is more: the most one call takes from ``execute`` to its
    answer, a wait for a free thread included; it must be below ``rollout.multi_turn.tool_timeout_s``, which
    ``load_tools`` checks),
    max_failures_in_a_row (64: calls in a row that reach no sandbox, after their retries, before the tool raises
    ``ToolUnavailable`` and the run stops; 0 never stops, each call then reads "not run"). Any other key, a value
    that is not a number, or one that would fail every call (``call_timeout_s`` not above ``run_timeout_s``) is a
    ValueError naming it; verl's ``type`` key is allowed and means nothing here."""

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        super().__init__(config, schema or SCHEMA)
        url = self.config.get("sandbox_url")
        if not url:
            raise ValueError("the code_interpreter tool needs config.sandbox_url, e.g. http://127.0.0.1:8080 "
                             "(start one with `reinforge sandbox serve`)")
        unknown = sorted(set(self.config) - set(CONFIG_KEYS) - set(VERL_KEYS))
        if unknown:  # a misspelt key would silently leave its default in force
            raise ValueError(f"code_interpreter config has unknown keys {', '.join(unknown)}; the keys are "
                             f"{', '.join(CONFIG_KEYS)}")
        retry_budget_s = _config_number(self.config, "retry_budget_s", DEFAULT_RETRY_BUDGET_S, float, 0.0)
        self.client = SandboxClient(str(url), retry_budget_s=retry_budget_s)
        self.run_timeout_s = _config_number(self.config, "run_timeout_s", 10.0, float, 0.0, above=True)
        self.memory_limit_mb = _config_number(self.config, "memory_limit_mb", -1, int, -1)
        # a call must outlast its program: one stopped at its run timeout would otherwise read "not run" and count
        # as a sandbox failure, and enough of those in a row stop the run
        default_call_timeout_s = max(self.run_timeout_s + 40.0,
                                     min(self.run_timeout_s + 40.0 + retry_budget_s, DEFAULT_CALL_TIMEOUT_CAP_S))
        self.call_timeout_s = _config_number(self.config, "call_timeout_s", default_call_timeout_s,
                                             float, self.run_timeout_s, above=True, minimum_name="run_timeout_s")
        self._executor = ThreadPoolExecutor(_config_number(self.config, "max_concurrent_calls", 64, int, 1),
                                            thread_name_prefix="code-interpreter")
        self.max_failures_in_a_row = _config_number(self.config, "max_failures_in_a_row", 64, int, 0)
        self._failures_in_a_row = 0

    def _call(self, code: str, deadline: float) -> RunCodeResponse:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return RunCodeResponse("SandboxError", f"no answer within {self.call_timeout_s:.1f}s: every one of the "
                                                   "tool's sandbox calls was busy")
        return self.client.run_code(strip_code_fence(code), run_timeout=self.run_timeout_s,
                                    memory_limit_mb=self.memory_limit_mb, timeout_s=remaining)

    def check(self) -> None:
        """One small program through the sandbox (retried for 2 s, 30 s at most): training with a sandbox that does
        not answer would give the model nothing but "not run" messages, every step."""
        probe = SandboxClient(self.client.url, retry_budget_s=2.0)
        response = probe.run_code("print(6 * 7)", run_timeout=5.0, memory_limit_mb=self.memory_limit_mb, timeout_s=30.0)
        if response.status == "SandboxError" or response.run_result is None:
            raise ValueError(f"the code_interpreter tool's sandbox does not work: {response.message}; start one with "
                             "`reinforge sandbox serve` or fix config.sandbox_url in the tool config")

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResult("code_interpreter needs a non-empty 'code' string argument.", 0.0, {"tool_error": 1.0})
        try:  # a lone surrogate the model wrote as a JSON escape (\ud800): the model's mistake, not a sandbox failure
            code.encode("utf-8")
        except UnicodeEncodeError as error:
            return ToolResult(f"The code was not run: it holds {code[error.start:error.end]!r} at position {error.start}, "
                              "which is not a character.", 0.0, {"tool_error": 1.0})
        deadline = time.monotonic() + self.call_timeout_s  # counted from now: queueing for a thread is part of it
        response = await asyncio.get_running_loop().run_in_executor(self._executor, self._call, code, deadline)
        text, metrics = format_run(response)
        if metrics.get("sandbox_error"):
            self._failures_in_a_row += 1
            if 0 < self.max_failures_in_a_row <= self._failures_in_a_row:
                raise ToolUnavailable(f"the code sandbox failed {self._failures_in_a_row} calls in a row, each after "
                                      f"its retries (last: {response.message}); is it still running? Restart it "
                                      "(`reinforge sandbox serve`) and run the same command again: it resumes from "
                                      "the last checkpoint")
        else:
            self._failures_in_a_row = 0
        return ToolResult(text, None, metrics)
