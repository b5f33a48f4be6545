"""Stop strings: a sample ends at the token whose text completes one (OpenAI's and vLLM's ``stop``).

The sample's text is decoded incrementally, as vLLM's detokenizer does: a new token's text is what decoding the
tokens since the last settled one adds, once it no longer ends in an incomplete UTF-8 character (a byte-level token
may be one byte of a character). Only that new text, after the end of the text before it that a stop string could
start in, is searched, so a stop string split over several tokens is found at the token that completes it. The ids
and log-probs then end at that token; the text a caller returns ends before the stop string (``cut_at_stop``).
An engine that does not watch for stop strings itself has its samples cut at that same token afterwards
(``end_at_stop_string``): the tokens up to it are the ones it sampled either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reinforge.rollout.base import Completion


class StopStringMatcher:
    """Watches one sample's tokens for its stop strings. decode: token ids to text (special tokens kept)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode = decode
        self.stop = stop
        self.keep = max(len(text) for text in stop) - 1
        """Characters of the text so far a stop string completed by the next token could start in."""
        self.token_ids: list[int] = []
        self.tail = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> bool:
        """Add a sampled token; True when the text now holds a stop string."""
        self.token_ids.append(token_id)
        settled = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        text = self.decode(self.token_ids[self.prefix_offset:])
        if len(text) <= len(settled) or text.endswith("\ufffd"):
            return False  # no new character yet, or an incomplete one
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        window = self.tail + text[len(settled):]
        self.tail = window[-self.keep:] if self.keep else ""
        return any(stop in window for stop in self.stop)


def token_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """Token ids to text as the endpoint writes a reply (special tokens kept)."""
    return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=False)


def cut_at_stop(text: str, stop: tuple[str, ...] | list[str]) -> str | None:
    """The text before its first stop string, or None when it holds none."""
    positions = [text.find(each) for each in stop if each in text]
    return text[:min(positions)] if positions else None


def end_at_stop_string(completion: Completion, stop: tuple[str, ...], decode: Callable[[list[int]], str]) -> Completion:
    """``completion`` ended at the token whose text completes one of ``stop``, as the built-in engines end a sample
    while they generate: its ids, log-probs and alternatives cut after that token, finish_reason 'stop'. Unchanged
    when its text holds no stop string (it ended at a stop token or its length first)."""
    matcher = StopStringMatcher(decode, stop)
    for position, token_id in enumerate(completion.token_ids):
        if matcher.add(token_id):
            length = position + 1
            top = completion.top_log_probs
            return dataclasses.replace(completion, token_ids=completion.token_ids[:length],
                                       log_probs=completion.log_probs[:length], finish_reason="stop",
                                       top_log_probs=top[:length] if top is not None else None)
    return completion
