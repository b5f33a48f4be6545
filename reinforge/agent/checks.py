"""Checks run before any model loads: the dataset's agent rows (verl falls back to single-turn silently, #2966),
the tool-call format and the tools themselves."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from reinforge.agent.loop import AGENT_LOOPS, agent_name_of
from reinforge.agent.tool_parsers import get_tool_parser
from reinforge.agent.turn_tokens import ToolTurnRenderer


def check_tools(tool_format: str, tools: dict[str, Any]) -> None:
    """Raise one line when ``rollout.multi_turn.format`` names no known parser or a tool cannot work (its
    create, execute or release is not async, or ``BaseTool.check`` fails: e.g. its sandbox does not answer)."""
    get_tool_parser(tool_format)
    for name, tool in tools.items():
        for method in ("create", "execute", "release"):  # a plain def would fail every call ("can't be awaited")
            if not inspect.iscoroutinefunction(getattr(tool, method, None)):
                raise ValueError(f"tool {name!r}: {type(tool).__name__}.{method} is not an async function; write "
                                 f"`async def {method}(...)` (a blocking call inside may use asyncio.to_thread)")
        try:
            tool.check()
        except ValueError:
            raise  # the tool's own line: what is wrong and the fix
        except Exception as error:  # a bug in the check, or the error of a service it asked: name the tool
            raise ValueError(f"tool {name!r} ({type(tool).__name__}) cannot work: its check() raised "
                             f"{type(error).__name__}: {error}; fix the tool or the service it calls") from None


def images_refused_by(where: str, agent_name: str) -> str:
    """The line refusing a row with images (``where`` names it) to an agent loop that talks to the model in text."""
    return (f"{where} has images, but agent {agent_name!r} talks to the model through an endpoint that passes it text "
            "alone, and its answers would be trained as answers to the image; give rows with images to tool_agent or "
            "another built-in loop, or drop their images")


def check_images_reach_agents(rows: Iterable[tuple[str, Any, bool]]) -> None:
    """Raise one line for the first row with images whose agent loop passes the model text alone.
    rows: (where, agent_name, has_images) per row."""
    for where, raw_name, has_images in rows:
        name = agent_name_of(raw_name)
        if has_images and not getattr(AGENT_LOOPS.get(name), "takes_images", True):
            raise ValueError(images_refused_by(where, name))


def check_agent_rows(rows: Iterable[tuple[str, Any, Any]], tools: dict[str, Any]) -> None:
    """Raise one line for the first row that names an unknown loop, needs tools without a tool config,
    passes tools_kwargs to a tool the config lacks, or whose create_kwargs / execute_kwargs a tool cannot take
    (every call of the tool would fail, each answered with a TypeError the model cannot fix).

    rows: (where, agent_name, extra_info) per row, ``where`` naming it for a person ("train row 41").
    """
    problems: dict[tuple[str, frozenset, frozenset], str | None] = {}  # by the kwargs' names: rows repeat them
    for where, raw_name, extra_info in rows:
        name = agent_name_of(raw_name)
        loop_class = AGENT_LOOPS.get(name)
        if loop_class is None:
            raise ValueError(f"{where} asks for agent_name={name!r}, which is not a registered agent loop; known: "
                             f"{', '.join(sorted(AGENT_LOOPS))}; fix the row's agent_name or register the loop")
        if loop_class.uses_tools and not tools:
            raise ValueError(f"{where} asks for agent_name={name!r}, which calls tools, but "
                             "rollout.multi_turn.tool_config_path is not set; point it at a YAML tool config "
                             "(see docs/agent.md)")
        tools_kwargs = (extra_info or {}).get("tools_kwargs") if isinstance(extra_info, dict) else None
        if tools_kwargs is not None and not isinstance(tools_kwargs, dict):
            raise ValueError(f"{where} has extra_info.tools_kwargs of type {type(tools_kwargs).__name__}; it must map "
                             "each tool's name to {create_kwargs: {...}, execute_kwargs: {...}}")
        for tool_name, kwargs in (tools_kwargs or {}).items():
            if kwargs is None:  # parquet struct columns give every row every tool's key: None means absent
                continue
            parts = kwargs if isinstance(kwargs, dict) else None
            wrong = (f"is a {type(kwargs).__name__}" if parts is None else next(
                (f"has {key}={parts[key]!r}" for key in ("create_kwargs", "execute_kwargs")
                 if parts.get(key) is not None and not isinstance(parts[key], dict)), None))
            if wrong is not None:
                raise ValueError(f"{where}: extra_info.tools_kwargs[{tool_name!r}] {wrong}; it must be "
                                 "{create_kwargs: {...}, execute_kwargs: {...}} (each a mapping of keyword arguments)")
            if tool_name not in tools:
                raise ValueError(f"{where} has extra_info.tools_kwargs for {tool_name!r}, which is not in the tool "
                                 f"config (its tools: {', '.join(sorted(tools)) or 'none'}); fix the name or add "
                                 "the tool")
        if not loop_class.uses_tools:
            continue
        for tool_name, tool in tools.items():
            parts = (tools_kwargs or {}).get(tool_name) or {}
            create_kwargs, execute_kwargs = parts.get("create_kwargs") or {}, parts.get("execute_kwargs") or {}
            key = (tool_name, frozenset(create_kwargs), frozenset(execute_kwargs))
            if key not in problems:
                find = getattr(tool, "kwargs_problem", None)
                problems[key] = find(create_kwargs, execute_kwargs) if find is not None else None
            if problems[key] is not None:
                raise ValueError(f"{where}: the tool {tool_name!r} gets extra_info.tools_kwargs[{tool_name!r}] = "
                                 f"{parts!r}, but {problems[key]}; fix the row's tools_kwargs or the tool's signature")


def check_tool_turns(agent_names: Iterable[Any], tokenizer: Any, chat_template: str | None) -> None:
    """When any row's loop calls tools, raise one line if the chat template cannot render tool turns as token
    increments (``ToolTurnRenderer``: no template, an end-of-turn token it does not write, earlier turns rewritten once
    tools follow), here, before any model loads, rather than at a rollout's first tool call."""
    if not any(getattr(AGENT_LOOPS.get(agent_name_of(name)), "uses_tools", False) for name in agent_names):
        return
    source = "data.chat_template" if chat_template else "the tokenizer's chat template"
    try:
        ToolTurnRenderer(tokenizer, chat_template)
    except ValueError as error:
        raise ValueError(f"tool_agent rows need tool turns rendered by {source}, but {error}") from None

