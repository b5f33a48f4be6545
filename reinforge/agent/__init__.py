"""Multi-turn agent loops with tools (see docs/agent.md).

A row of the dataset picks its loop by ``agent_name`` (``single_turn`` by default, ``tool_agent``
for tool use); the actor-rollout worker runs the loops of a batch concurrently on its rollout
engine (``runner``). Tools are ``BaseTool`` subclasses or typed functions (``tools``), listed
in a YAML tool config (``tool_config``); tool calls are found by a parser (``tool_parsers``);
tool turns are appended as chat-template token increments (``turn_tokens``).
"""

from reinforge.agent import single_turn, tool_agent  # noqa: F401  (register the built-in loops)
from reinforge.agent.checks import check_agent_rows, check_tool_turns, check_tools
from reinforge.agent.loop import (
    AGENT_LOOPS,
    DEFAULT_AGENT,
    AgentContext,
    AgentLoop,
    AgentLoopOutput,
    TokenClient,
    agent_name_of,
    get_agent_loop,
    register_agent_loop,
)
from reinforge.agent.runner import AgentRunner, AsyncEngineClient, BatchingClient, agent_metrics
from reinforge.agent.tool_config import load_tool_config, load_tools
from reinforge.agent.tool_parsers import TOOL_PARSERS, ToolCall, get_tool_parser, register_tool_parser
from reinforge.agent.tools import BaseTool, FunctionTool, ToolResult, ToolUnavailable, as_tool
from reinforge.agent.turn_tokens import ToolTurnRenderer

__all__ = [
    "AGENT_LOOPS", "DEFAULT_AGENT", "TOOL_PARSERS", "AgentContext", "AgentLoop", "AgentLoopOutput", "AgentRunner",
    "AsyncEngineClient", "BaseTool", "BatchingClient", "FunctionTool", "TokenClient", "ToolCall", "ToolResult",
    "ToolUnavailable", "ToolTurnRenderer", "agent_metrics", "agent_name_of", "as_tool", "check_agent_rows",
    "check_tool_turns", "check_tools", "get_agent_loop", "get_tool_parser", "load_tool_config", "load_tools", "register_agent_loop",
    "register_tool_parser",
]
