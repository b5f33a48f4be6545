"""Trajectories of external agents, assembled from the calls the endpoint recorded.

Each call records its exact prompt ids, the ids the engine sampled and their log-probs. The rule (verl's multi-turn
mask convention: tokens the policy sampled have mask 1, every other token 0):

- a call whose prompt starts with all tokens of a segment so far (prompt, sampled and appended tokens) extends that
  segment: the rest of its prompt (tool results, user turns, template tokens) is appended with mask 0, then its
  sampled tokens with mask 1;
- any other call (the agent rewrote, cut or reordered its history) starts a new segment with its prompt;
- the trajectory trained is the segment of the agent's last call; earlier segments are counted
  (``agent/num_segments/{min,max,mean}``, segments per trajectory) and not trained, since a sample has one prompt.

Budgets are those of ``tool_agent`` (``rollout.multi_turn``): one ``max_tokens`` budget covers the sampled and
appended tokens of a segment, each call samples at most what is left of it, and a call past ``max_assistant_turns``,
past ``max_user_turns``, or whose appended tokens use up the budget ends the trajectory: the endpoint answers it with
an error (code ``trajectory_ended``) and the agent's exception is then the trajectory's normal end.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from reinforge.agent.loop import AgentLoopOutput
from reinforge.config.schema import MultiTurnConfig
from reinforge.rollout.base import SamplingParams
from reinforge.rollout.noise import sample_seed
from reinforge.serve.chat import CallRecord, ChatSession, RequestError


@dataclass
class Segment:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    finish_reason: str = "stop"

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_call(self, record: CallRecord) -> None:
        appended = record.prompt_ids[len(self.prompt_ids) + len(self.response_ids):]
        if appended:
            self.response_ids += appended
            self.response_mask += [0] * len(appended)
            self.log_probs += [0.0] * len(appended)
            self.user_turns += 1
        self.response_ids += record.token_ids
        self.response_mask += [1] * len(record.token_ids)
        self.log_probs += list(record.log_probs)
        self.assistant_turns += 1
        self.finish_reason = record.finish_reason


def extends(prompt_ids: list[int], segment: Segment) -> bool:
    tokens = segment.token_ids
    return len(prompt_ids) >= len(tokens) and prompt_ids[:len(tokens)] == tokens


def assemble_segments(records: list[CallRecord]) -> tuple[list[Segment], int]:
    """The segments of a trajectory's calls and the index of the last call's segment."""
    segments: list[Segment] = []
    last = -1
    for record in records:
        last = next((index for index in range(len(segments) - 1, -1, -1)
                     if extends(record.prompt_ids, segments[index])), -1)
        if last < 0:
            segments.append(Segment(list(record.prompt_ids)))
            last = len(segments) - 1
        segments[last].add_call(record)
    return segments, last


class TrajectorySession(ChatSession):
    """One trajectory's calls, sampled as the trainer sets (the row's sampling) within ``tool_agent``'s budgets."""

    def __init__(self, sampling: SamplingParams, config: MultiTurnConfig, request_id: str = "",
                 max_model_len: int | None = None):
        """max_model_len: the engine's context (prompt and sample), where it has one."""
        super().__init__()
        self.sampling = sampling
        self.config = config
        self.request_id = request_id
        self.max_model_len = max_model_len
        self.ended: str | None = None
        self.ended_why = ""
        self.generate_seconds = 0.0

    def end(self, reason: str, message: str) -> RequestError:
        self.ended, self.ended_why = reason, message
        return RequestError(f"the trajectory has ended ({reason}): {message}", code="trajectory_ended")

    def turn_sampling(self, prompt_ids: list[int], continues: int | None, requested_max_tokens: int | None,
                      stop_ids: tuple[int, ...], stop: tuple[str, ...] = ()) -> SamplingParams:
        """The sampling of the next call, or the RequestError that ends the trajectory."""
        if self.ended is not None:
            raise RequestError(f"the trajectory has ended ({self.ended}); no more calls are answered",
                               code="trajectory_ended")
        budget, config = self.sampling.max_tokens, self.config
        segments, last = assemble_segments(self.records)
        segment = next((candidate for candidate in reversed(segments) if extends(prompt_ids, candidate)), None)
        if segment is not None:
            response_length = len(prompt_ids) - len(segment.prompt_ids)
            if len(segment.response_ids) >= budget:
                raise self.end("length", f"its {budget}-token response budget is spent")
            if config.max_assistant_turns is not None and segment.assistant_turns >= config.max_assistant_turns:
                raise self.end("max_turns", f"max_assistant_turns={config.max_assistant_turns} reached")
            if config.max_user_turns is not None and segment.user_turns >= config.max_user_turns:
                raise self.end("max_turns", f"max_user_turns={config.max_user_turns} reached")
            if response_length >= budget:
                raise self.end("tool_overflow", f"the new messages overflow its {budget}-token response budget")
            remaining = budget - response_length
        else:
            remaining = budget
        if self.max_model_len is not None:  # a prompt rendered anew (a rewritten history) may hold the whole history
            if len(prompt_ids) >= self.max_model_len:
                raise self.end("length", f"its prompt of {len(prompt_ids)} tokens fills the engine's context of "
                                         f"{self.max_model_len} (data.max_prompt_length + data.max_response_length)")
            remaining = min(remaining, self.max_model_len - len(prompt_ids))
        turn = len(self.records)
        return dataclasses.replace(
            self.sampling, n=1, max_tokens=min(remaining, requested_max_tokens or remaining),
            seed=None if self.sampling.seed is None else sample_seed(self.sampling.seed, turn),
            stop_token_ids=tuple(dict.fromkeys((*self.sampling.stop_token_ids, *stop_ids))),
            stop=tuple(dict.fromkeys((*self.sampling.stop, *stop))))

    def tool_turns(self, prompt_ids: list[int]) -> int:
        """The tool turns of the segment a call with ``prompt_ids`` extends, its own new messages counted (0 for a
        call that starts a segment): ``tool_agent``'s ``user_turns`` when it reads that call's reply."""
        segments, _ = assemble_segments(self.records)
        segment = next((candidate for candidate in reversed(segments) if extends(prompt_ids, candidate)), None)
        if segment is None:
            return 0
        return segment.user_turns + (len(prompt_ids) > len(segment.token_ids))

    def output(self) -> AgentLoopOutput:
        """The trained segment as a loop's output (see the module docstring)."""
        if not self.records:
            raise ValueError("the agent made no chat call through its base_url, so there is no trajectory to train; "
                             "point the agent's OpenAI client at the base_url it is given")
        segments, last = assemble_segments(self.records)
        segment = segments[last]
        finish_reason = self.ended or segment.finish_reason
        return AgentLoopOutput(
            prompt_ids=segment.prompt_ids, response_ids=segment.response_ids, response_mask=segment.response_mask,
            response_log_probs=segment.log_probs, num_turns=segment.user_turns + segment.assistant_turns + 1,
            finish_reason=finish_reason,
            metrics={"generate_sequences": self.generate_seconds, "num_segments": float(len(segments)),
                     "tool_overflow": float(self.ended == "tool_overflow")},
            extra={"tool_rewards": [], "num_calls": len(self.records)})


def jsonable(value: Any) -> Any:
    """A row's value as JSON can hold it (numpy arrays and scalars become lists and numbers)."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
