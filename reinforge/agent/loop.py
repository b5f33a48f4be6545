"""What every agent loop shares: its output, its context, the token client, and the registry of loops by name.

A loop runs one trajectory: ``await loop.run(sampling, **row)`` with the row's columns
(``prompt_ids``, ``raw_prompt``, ``extra_info``, ``uid``, ...) and returns an
``AgentLoopOutput``. It talks to the rollout engine only through ``TokenClient``: token ids
in, sampled token ids and their log-probs out. A row picks its loop by its ``agent_name``
column (``single_turn`` when absent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from reinforge.config.schema import MultiTurnConfig
from reinforge.rollout.base import Completion, SamplingParams


@dataclass
class AgentLoopOutput:
    prompt_ids: list[int]
    response_ids: list[int]
    """Everything after the prompt: sampled tokens and tool (template) tokens."""
    response_mask: list[int]
    """1 where the policy sampled the token, 0 on tool, user and template tokens."""
    response_log_probs: list[float]
    """The engine's log-prob of each sampled token; 0 where response_mask is 0."""
    num_turns: int = 2
    """User and assistant turns, counting the prompt's (verl's convention): a plain answer is 2."""
    reward_score: float | None = None
    """Set by a loop that scores its own trajectory; None leaves scoring to the reward manager."""
    finish_reason: str = "stop"
    """Why it ended: stop (the model answered), length (response budget), max_turns, tool_overflow."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Seconds in generate_sequences and tool_calls, counts of tool calls, errors, truncations."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form: tool_rewards (list of per-call rewards), ..."""
    multi_modal_inputs: dict[str, Any] | None = None
    """A vision-language trajectory's images, the prompt's then its tool turns' (``pixel_values``,
    ``image_grid_thw``); None without images."""


class TokenClient(Protocol):
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str,
                       multi_modal_inputs: dict[str, Any] | None = None) -> Completion:
        """One sample (``sampling.n`` is 1) continuing ``prompt_ids`` (with the images of its image pad tokens)."""
        ...


@dataclass
class AgentContext:
    """What a loop is built with: the tokenizer, the client, the tools and the multi-turn settings."""

    tokenizer: Any
    client: TokenClient
    config: MultiTurnConfig
    tools: dict[str, Any] = field(default_factory=dict)
    """Tool name -> BaseTool, loaded once per worker."""
    chat_template: str | None = None
    renderer: Any = None
    """The ToolTurnRenderer of the tokenizer and template, made by the first loop that needs it."""
    processor: Any = None
    """A vision-language model's processor (turns tool images into image tokens and pixels); None for text."""


class AgentLoop:
    """One trajectory's loop. Subclasses implement ``run``; ``uses_tools`` says whether it needs a tool config."""

    uses_tools = False
    takes_images = True
    """Whether the row's images reach the model (False: a loop that talks to it in text alone; a row with images
    is refused before any model loads)."""

    def __init__(self, context: AgentContext):
        self.context = context

    async def run(self, sampling: SamplingParams, **row: Any) -> AgentLoopOutput:
        raise NotImplementedError


AGENT_LOOPS: dict[str, type[AgentLoop]] = {}
DEFAULT_AGENT = "single_turn"


def register_agent_loop(name: str) -> Callable[[type[AgentLoop]], type[AgentLoop]]:
    def add(loop_class: type[AgentLoop]) -> type[AgentLoop]:
        if name in AGENT_LOOPS:
            raise ValueError(f"agent loop {name!r} is registered twice")
        AGENT_LOOPS[name] = loop_class
        return loop_class
    return add


def get_agent_loop(name: str) -> type[AgentLoop]:
    if name not in AGENT_LOOPS:
        raise ValueError(f"agent_name={name!r} is not a registered agent loop; known: {', '.join(sorted(AGENT_LOOPS))}")
    return AGENT_LOOPS[name]


def agent_name_of(row_agent_name: Any) -> str:
    """A row's loop name: its agent_name, or single_turn when it has none."""
    return DEFAULT_AGENT if row_agent_name is None or row_agent_name == "" else str(row_agent_name)
