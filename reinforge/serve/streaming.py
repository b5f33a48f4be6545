"""A streamed reply: the text each sampled token makes safe to send, and OpenAI's server-sent chunks.

``ReplyText`` turns the tokens sampled so far into the part of the reply that the finished reply is sure to begin
with: it holds back what the end may still take away (a partial end-of-turn token sequence, an incomplete UTF-8
character, the start of a stop string, whitespace and a partial ``<tool_call>`` before a tool call), so the deltas
sent, then the finished reply's remainder, add up to the text a non-streamed request answers.

A SentencePiece tokenizer (Llama 2's, Mistral's) strips the space its "▁" marks at the start of a decoded text: "▁Paris"
alone decodes to "Paris", after "▁is" to " is Paris". A completion continues its prompt, so its text is decoded after
the prompt's last tokens (``text_after``), and each sampled token's text in a logprobs entry after the tokens before it
(``piece_text``); the pieces then add up to the text, and the text to what the prompt and the completion decode to.
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


CONTEXT_TOKENS = 4
"""Tokens before a text that it is decoded after (``text_after``, ``piece_text``)."""


def text_after(decode: Callable[[list[int]], str], context_ids: list[int], token_ids: list[int]) -> str:
    """The text ``token_ids`` add after ``context_ids`` (the last ``CONTEXT_TOKENS`` of them): both decoded together,
    less the context's own text. Where that text does not begin the whole (the ids finish a character whose first
    bytes end the context), less the context's whole characters; else the ids decoded alone."""
    context_ids = context_ids[-CONTEXT_TOKENS:]
    if not context_ids:
        return decode(token_ids)
    before, whole = decode(context_ids), decode(context_ids + token_ids)
    for known in (before, before.rstrip("\ufffd")):
        if whole.startswith(known):
            return whole[len(known):]
    return decode(token_ids)


def piece_text(decode: Callable[[list[int]], str], context_ids: list[int], token_id: int) -> str:
    """One token's text where it stands, after ``context_ids`` (a SentencePiece token keeps its leading space); the
    token decoded alone where that gives no text of its own (a byte of a character the context began)."""
    context_ids = context_ids[-CONTEXT_TOKENS:]
    alone = decode([token_id])
    if not context_ids:
        return alone
    before, whole = decode(context_ids), decode(context_ids + [token_id])
    return whole[len(before):] if whole.startswith(before) and len(whole) > len(before) else alone


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

    log_prob: a token's log-prob entry as the response writes it (from its id, log-prob, alternatives and the ids
    before it), or None when the request asks for none; context: the ids before the first token (a completion's
    prompt; none for a chat reply, a message of its own).
    """

    def __init__(self, text: ReplyText, log_prob: Callable[..., dict[str, Any]] | None = None,
                 context: list[int] | None = None):
        self.text = text
        self.log_prob = log_prob
        self.context = list(context or [])[-CONTEXT_TOKENS:]
        self.delta = ""
        self.log_probs: list[dict[str, Any]] = []
        self.num_tokens = 0

    def add(self, token_id: int, log_prob: float, top_log_probs: list[tuple[int, float]] | None = None) -> None:
        before = self.context + self.text.token_ids[-CONTEXT_TOKENS:]
        self.delta = self.text.add(token_id)
        self.num_tokens += 1
        if self.log_prob is not None:
            self.log_probs.append(self.log_prob(token_id, log_prob, top_log_probs, before))

    def finish(self, completion: Completion) -> None:
        """The log-probs of the tokens that were not streamed (all of them, from a client that streams none)."""
        if self.log_prob is not None:
            start, ids = self.num_tokens, self.context + list(completion.token_ids)
            tops = (completion.top_log_probs or [None] * len(completion.token_ids))[start:]
            self.log_probs += [self.log_prob(token_id, log_prob, top, ids[:len(self.context) + position])
                               for position, (token_id, log_prob, top) in
                               enumerate(zip(completion.token_ids[start:], completion.log_probs[start:], tops,
                                             strict=True), start)]

    def take_log_probs(self) -> list[dict[str, Any]]:
        taken, self.log_probs = self.log_probs, []
        return taken


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
