"""Finding the tool calls in an assistant turn: parsers in a registry, by the format the model writes calls in.

A parser reads the decoded text of one assistant turn and returns the calls in it. A call that
cannot be read (bad JSON, no name) is returned with an ``error`` rather than dropped: the loop
answers it with a tool message explaining the problem, so the model sees what went wrong (verl
drops such calls and only logs them). A reasoning model's thinking, up to its last ``</think>``, is no
place for calls (Qwen3's template takes a reply's content as the text after it, as vLLM's reasoning parsers do): a
call written or a tag mentioned there is not read. Built in: ``hermes`` (Qwen2.5, Qwen3, SmolLM3, Hermes:
``<tool_call>`` JSON), ``llama3_json`` (Llama 3.1-3.3: the turn is a JSON call, optionally after
``<|python_tag|>``), ``mistral`` (``[TOOL_CALLS]`` then a JSON list of calls, or the newer
``[TOOL_CALLS]name[ARGS]{...}``) and ``deepseek_v3`` (``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name``
then the arguments in a json code block).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be read; the loop answers it with this text instead of running a tool."""
    id: str | None = None
    """The id the model wrote for the call (Mistral's ``"id"``), which its tool result names; None where it wrote
    none."""


class ToolParser(Protocol):
    opening: str
    """The text a turn's calls start with (what a served reply's content ends before, and what a stream holds
    back the start of); a parser without one is read as Hermes's ``<tool_call>``."""

    def parse(self, text: str) -> list[ToolCall]:
        """The calls in one assistant turn, in order."""
        ...


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {}


JSON_ERRORS = (ValueError, RecursionError)
"""What decoding a sampled call may raise: bad JSON (``json.JSONDecodeError``), an integer of more digits than Python
converts (a ValueError), or JSON nested deeper than Python's recursion limit (a model that repeats ``[`` or ``{``):
each would otherwise stop the rollout."""


def json_problem(error: Exception, at: bool = True) -> str:
    """Why a call's JSON does not read, for the model."""
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} (at character {error.pos})" if at else error.msg
    if isinstance(error, RecursionError):
        return "it is nested too deeply"
    return "it holds a number too long to read"


REASONING_END = "</think>"


def reasoning_end(text: str) -> int:
    """Where a turn's text after its reasoning starts: after its last ``</think>``, or 0 when it has none."""
    end = text.rfind(REASONING_END)
    return 0 if end < 0 else end + len(REASONING_END)


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

    opening, closing = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> list[ToolCall]:
        """Each ``<tool_call>`` with the first ``</tool_call>`` after it, in one pass (a regex's search for the
        closing tag from every opening took seconds, the event loop waiting, on a turn that repeats the opening)."""
        text = text[reasoning_end(text):]
        calls, position = [], 0
        while (start := text.find(self.opening, position)) >= 0:
            end = text.find(self.closing, start + len(self.opening))
            if end < 0:
                calls.append(ToolCall("", error="A <tool_call> was not closed with </tool_call>, so it was not run; "
                                                'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'))
                break
            calls.append(self._read(text[start + len(self.opening):end].strip()))
            position = end + len(self.closing)
        return calls

    @staticmethod
    def _read(body: str) -> ToolCall:
        try:
            call = json.loads(body)
        except JSON_ERRORS as error:
            return ToolCall("", error=f"Invalid JSON in tool call: {json_problem(error)}; "
                                      'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
        # "parameters" (Llama's key, which models trained on both write here too) rather than run the call without them
        return _call_of(call, ("arguments", "parameters"), '<tool_call>{"name": ..., "arguments": {...}}</tool_call>')


def _call_of(call: Any, argument_keys: tuple[str, ...], shape: str) -> ToolCall:
    """A decoded call object as a ToolCall: its name, and its arguments (under the first of ``argument_keys`` it
    has) as an object, or a JSON string holding one."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", error=f'A tool call needs a "name" string: {shape}')
    arguments = next((call[key] for key in argument_keys if key in call), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except JSON_ERRORS as error:
            return ToolCall(call["name"], error=f"Invalid JSON in arguments for {call['name']!r}: "
                                                f"{json_problem(error, at=False)}")
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error=f"The arguments of {call['name']!r} must be a JSON object, "
                                            f"not {type(arguments).__name__}")
    return ToolCall(call["name"], arguments, id=call["id"] if isinstance(call.get("id"), str) else None)


def _json_values(text: str, separator: str) -> tuple[list[Any], str | None]:
    """The JSON values ``text`` holds one after another (``separator`` and spaces between them), and why the rest
    does not read as one (None when all of it does)."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] == separator):
            position += 1
        if position == len(text):
            return values, None
        try:
            value, position = decoder.raw_decode(text, position)
        except JSON_ERRORS as error:
            return values, json_problem(error)
        values.append(value)


@register_tool_parser("llama3_json")
class Llama3JsonToolParser:
    """Llama 3.1-3.3's calls: a turn that is ``{"name": ..., "parameters": {...}}`` (``arguments`` is read too),
    several separated by ``;``, optionally after ``<|python_tag|>``. A turn that starts with ``{`` or the tag and
    does not read as calls is a malformed call (so is one cut before its end); any other turn, a JSON object without
    a "name" among them, is an answer."""

    opening = "<|python_tag|>"
    shape = '{"name": ..., "parameters": {...}}'

    def parse(self, text: str) -> list[ToolCall]:
        text = text[reasoning_end(text):]
        body = text.strip()
        if body.startswith(self.opening):
            body = body[len(self.opening):].strip()
        elif not body.startswith("{") or '"name"' not in body:  # a JSON answer is not a call
            return []
        values, problem = _json_values(body, ";")
        calls = [_call_of(value, ("parameters", "arguments"), self.shape) for value in values]
        if problem is not None:
            calls.append(ToolCall("", error=f"Invalid JSON in tool call: {problem}; write {self.shape}"))
        return calls


@register_tool_parser("mistral")
class MistralToolParser:
    """Mistral's calls: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}`` (v0.3, Nemo), or
    ``[TOOL_CALLS]name[ARGS]{...}`` per call (Mistral Small 3.2 and later), with ``[CALL_ID]id`` before ``[ARGS]`` in
    the tokenizers that write the call's id. Text after the marker that does not read as calls is a malformed call."""

    opening = "[TOOL_CALLS]"
    arguments_marker, call_id_marker = "[ARGS]", "[CALL_ID]"
    shape = '[TOOL_CALLS] [{"name": ..., "arguments": {...}}]'

    def parse(self, text: str) -> list[ToolCall]:
        text = text[reasoning_end(text):]
        calls: list[ToolCall] = []
        for part in text.split(self.opening)[1:]:
            body = part.strip()
            if self.arguments_marker in body and not body.startswith("["):
                named, _, arguments = body.partition(self.arguments_marker)
                name, _, identifier = (part.strip() for part in named.partition(self.call_id_marker))
                values, problem = _json_values(arguments, ",")
                if problem is not None or len(values) != 1:
                    calls.append(ToolCall(name, error=f"Invalid JSON in arguments for {name!r}: "
                                                      f"{problem or 'one JSON object expected'}"))
                else:
                    calls.append(_call_of({"name": name, "arguments": values[0], "id": identifier or None},
                                          ("arguments",), self.shape))
                continue
            values, problem = _json_values(body, ",")
            listed = values[0] if len(values) == 1 and isinstance(values[0], list) else values
            calls += [_call_of(value, ("arguments",), self.shape) for value in listed]
            if problem is not None or not values:
                calls.append(ToolCall("", error=f"Invalid JSON in tool call: {problem or 'no call after the marker'}; "
                                                f"write {self.shape}"))
        return calls


@register_tool_parser("deepseek_v3")
class DeepSeekV3ToolParser:
    """DeepSeek-V3's calls: ``<｜tool▁calls▁begin｜>``, then per call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``,
    a newline and the arguments in a json code block, ``<｜tool▁call▁end｜>``; then ``<｜tool▁calls▁end｜>``. DeepSeek-V3.1's
    and later models' ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` (the arguments as plain JSON) is
    read too. A call begun and not ended (cut), or whose arguments are not a JSON object, is a malformed call."""

    opening = "<｜tool▁calls▁begin｜>"
    call_begin, call_end, separator = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    shape = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>"

    def parse(self, text: str) -> list[ToolCall]:
        text = text[reasoning_end(text):]
        calls = []
        for part in text.split(self.call_begin)[1:]:
            body, ended, _ = part.partition(self.call_end)
            if not ended:
                calls.append(ToolCall("", error=f"A tool call was not closed with {self.call_end}, so it was not run; "
                                                f"write {self.shape}"))
                continue
            kind, separated, named = body.partition(self.separator)
            if not separated:
                calls.append(ToolCall("", error=f"A tool call needs {self.separator} before its name: {self.shape}"))
                continue
            if kind.strip() not in ("", "function"):  # DeepSeek-V3.1 and later: NAME<｜tool▁sep｜>{...}
                name, arguments = kind, named
            else:
                name, _, arguments = named.partition("\n")
            arguments = arguments.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
            try:
                value = json.loads(arguments) if arguments else {}
            except JSON_ERRORS as error:
                calls.append(ToolCall(name.strip(), error=f"Invalid JSON in arguments for {name.strip()!r}: "
                                                          f"{json_problem(error, at=False)}; write {self.shape}"))
                continue
            calls.append(_call_of({"name": name.strip(), "arguments": value}, ("arguments",), self.shape)
                         if name.strip() else ToolCall("", error=f'A tool call needs a name: {self.shape}'))
        return calls
