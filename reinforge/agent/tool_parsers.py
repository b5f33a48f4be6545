"""Finding the tool calls in an assistant turn: parsers in a registry, Hermes's format built in.

A parser reads the decoded text of one assistant turn and returns the calls in it. A call that
cannot be read (bad JSON, no name) is returned with an ``error`` rather than dropped: the loop
answers it with a tool message explaining the problem, so the model sees what went wrong (verl
drops such calls and only logs them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be read; the loop answers it with this text instead of running a tool."""


class ToolParser(Protocol):
    def parse(self, text: str) -> list[ToolCall]:
        """The calls in one assistant turn, in order."""
        ...


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[Callable[[], ToolParser]], Callable[[], ToolParser]]:
    def add(factory: Callable[[], ToolParser]) -> Callable[[], ToolParser]:
        if name in TOOL_PARSERS:
            raise ValueError(f"tool parser {name!r} is registered twice")
        TOOL_PARSERS[name] = factory
        return factory
    return add


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"rollout.multi_turn.format={name!r} is not a known tool-call format; "
                         f"known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


@register_tool_parser("hermes")
class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn.

    ``arguments`` may also be a JSON string holding the object (some models write it so). A
    ``<tool_call>`` left open after the last closed call (the model stopped before
    ``</tool_call>``) is a malformed call too: read as no call, the turn would pass for a final
    answer and the model would never learn that its call went nowhere.
    """

    pattern = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    opening = "<tool_call>"

    def parse(self, text: str) -> list[ToolCall]:
        calls = [self._read(body.strip()) for body in self.pattern.findall(text)]
        last_end = max((match.end() for match in self.pattern.finditer(text)), default=0)
        if self.opening in text[last_end:]:
            calls.append(ToolCall("", error="A <tool_call> was not closed with </tool_call>, so it was not run; "
                                            'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'))
        return calls

    @staticmethod
    def _read(body: str) -> ToolCall:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            return ToolCall("", error=f"Invalid JSON in tool call: {error.msg} (at character {error.pos}); "
                                      'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolCall("", error='A tool call needs a "name" string: '
                                      '<tool_call>{"name": ..., "arguments": {...}}</tool_call>')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as error:
                return ToolCall(call["name"], error=f"Invalid JSON in arguments for {call['name']!r}: {error.msg}")
        if not isinstance(arguments, dict):
            return ToolCall(call["name"], error=f"The arguments of {call['name']!r} must be a JSON object, "
                                                f"not {type(arguments).__name__}")
        return ToolCall(call["name"], arguments)
