"""A streamed reply: the text each sampled token makes safe to send, and OpenAI's server-sent chunks.

``ReplyText`` turns the tokens sampled so far into the part of the reply that the finished reply is sure to begin
with: it holds back what the end may still take away (a partial end-of-turn token sequence, an incomplete UTF-8
character, the start of a stop string, whitespace and a partial ``<tool_call>`` before a tool call), so the deltas
sent, then the finished reply's remainder, add up to the text a non-streamed request answers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from reinforge.agent.tool_parsers import reasoning_end
from reinforge.rollout.base import Completion

logger = logging.getLogger(__name__)

def _held_prefix(text: str, markers: list[str]) -> int:
    """The length of the longest end of ``text`` that a marker starts with (and is shorter than it)."""
    held = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:size]):
                held = size
                break
    return held


def tail_of_sequence(ending: list[int]) -> Callable[[list[int]], list[int]]:
    """The ids before ``ending`` (the end-of-turn ids the reply drops), or before any start of it they end with."""
    def body(token_ids: list[int]) -> list[int]:
        for size in range(min(len(ending), len(token_ids)), 0, -1):
            if token_ids[-size:] == ending[:size]:
                return token_ids[:-size]
        return token_ids
    return body


def last_of(stop_ids: tuple[int, ...]) -> Callable[[list[int]], list[int]]:
    """The ids before a last one of ``stop_ids`` (the end-of-sequence token a text reply drops)."""
    def body(token_ids: list[int]) -> list[int]:
        return token_ids[:-1] if token_ids and token_ids[-1] in stop_ids else token_ids
    return body


class ReplyText:
    """The text of one streamed choice so far, and the deltas of it that are safe to send.

    decode: ids to text; body: the ids whose text the reply can hold (the tail the finished reply drops held
    back); cut: stop strings that end the text; tool_call_opening: the text that ends the content where tool calls
    start (the parser's ``opening``, ``<tool_call>`` for Hermes), None when replies are not read for calls.
    """

    def __init__(self, decode: Callable[[list[int]], str], body: Callable[[list[int]], list[int]],
                 cut: list[str], tool_call_opening: str | None):
        self.decode = decode
        self.body = body
        self.cut = cut
        self.tool_call_opening = tool_call_opening
        self.token_ids: list[int] = []
        self.sent = ""

    def visible(self) -> str:
        """The text the finished reply is sure to begin with."""
        text = self.decode(self.body(self.token_ids)).rstrip("\ufffd")
        if self.cut:
            positions = [text.find(stop) for stop in self.cut if stop in text]
            if positions:
                return text[:min(positions)]
            text = text[:len(text) - _held_prefix(text, self.cut)]
        if self.tool_call_opening:
            opening = text.find(self.tool_call_opening, reasoning_end(text))  # not a tag its thinking mentions
            if opening >= 0:
                return text[:opening].rstrip()
            text = text[:len(text) - _held_prefix(text, [self.tool_call_opening])].rstrip()
        return text

    def add(self, token_id: int) -> str:
        """The new text a sampled token makes safe to send ("" when it makes none)."""
        self.token_ids.append(token_id)
        text = self.visible()
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def finish(self, final: str) -> str:
        """The rest of the finished reply's text after what was sent."""
        if not final.startswith(self.sent):
            logger.warning("a streamed reply sent %r, which its final text %r does not begin with", self.sent, final)
            common = 0
            while common < min(len(final), len(self.sent)) and final[common] == self.sent[common]:
                common += 1
            self.sent = final[:common]
        delta, self.sent = final[len(self.sent):], final
        return delta


class StreamedChoice:
    """One choice of a streamed request: its text, the delta of its latest token, and log-probs not yet sent.

    log_prob: a token's log-prob entry as the response writes it (from its id, log-prob and alternatives), or None
    when the request asks for none.
    """

    def __init__(self, text: ReplyText, log_prob: Callable[..., dict[str, Any]] | None = None):
        self.text = text
        self.log_prob = log_prob
        self.delta = ""
        self.log_probs: list[dict[str, Any]] = []
        self.num_tokens = 0

    def add(self, token_id: int, log_prob: float, top_log_probs: list[tuple[int, float]] | None = None) -> None:
        self.delta = self.text.add(token_id)
        self.num_tokens += 1
        if self.log_prob is not None:
            self.log_probs.append(self.log_prob(token_id, log_prob, top_log_probs))

    def finish(self, completion: Completion) -> None:
        """The log-probs of the tokens that were not streamed (all of them, from a client that streams none)."""
        if self.log_prob is not None:
            start = self.num_tokens
            tops = (completion.top_log_probs or [None] * len(completion.token_ids))[start:]
            self.log_probs += [self.log_prob(token_id, log_prob, top) for token_id, log_prob, top in
                               zip(completion.token_ids[start:], completion.log_probs[start:], tops, strict=True)]

    def take_log_probs(self) -> list[dict[str, Any]]:
        taken, self.log_probs = self.log_probs, []
        return taken


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
