"""Token in, token out: the tokens of a tool turn, rendered as an increment of the model's chat template.

A trajectory's tokens are the prompt's, then what the engine sampled, then the tool turns we
append, and so on; history is never decoded and tokenized again (a model may sample a
non-canonical split of a text, which re-tokenizing would silently replace). A tool turn is the
text the chat template writes after an assistant turn's end-of-turn token when tool messages follow it:

    render(base + tools, generation prompt), after the end-of-turn token that follows base's assistant content

where ``base`` ends with an assistant message (after the trajectory's earlier turns: a template may write a later
tool turn unlike the first). The model stops at its end-of-turn token
(``<|im_end|>``, ``<|eot_id|>``); the increment starts with what the template writes after that token
and before the next turn (``\\n`` for ChatML, nothing for Llama 3), which the model never
generates: leaving it out (as verl did until v0.9, #6501) shifts every later turn by a token.
A template that drops tool messages (OLMo 2's, Phi-3's: no tool role) or refuses them (Gemma's,
Mistral's) is refused when the renderer is made.

The boundary: the stream equals ``apply_chat_template`` of the whole conversation when the
model's tokens are the tokenization the whole conversation's text gets at that place (a reply
whose leading whitespace holds a newline is not: after ChatML's ``assistant\\n`` the template's
text merges the two newlines into one token, ``\\n\\n``, which the model sampled as two; an
empty reply is not either, as the template drops the ``\\n`` before it), and the template renders
earlier turns as the model sampled them (Qwen3's leaves an earlier turn's empty ``<think></think>``
out, where the stream keeps it; a turn that thought is rendered as sampled). A template that does not
write an earlier assistant's content as it was is refused: ``increment`` raises.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

from reinforge.data.chat_template import (
    ASSISTANT_MARKER,
    ASSISTANT_TURN,
    apply_chat_template,
    assistant_turn_text,
    chat_template_text,
    end_of_turn_token,
)

TOOL_OUTPUT_PROBE = "reinforge-tool-output-probe"
"""A tool message's content that renders as itself: where the template shows the model a tool's output."""
EARLIER_REPLY = "reinforge-earlier-reply"
"""The content of the earlier assistant turns a later tool turn is rendered after."""
PROBE_CALL_ID = "c00000000"
"""The probe's ``tool_call_id``, of the form the loop gives its results (``tool_agent.call_id``)."""


class ToolMessagesDropped(ValueError):
    """The chat template writes nothing of a tool message's content (it has no tool role): the model would never see
    a tool's output."""


class ToolTurnRenderer:
    """Renders tool messages as token increments for one tokenizer and chat template.

    eos_text: the end-of-turn token the model stops at. By default the tokenizer's EOS when the template closes an
    assistant turn with it, else the special token the template closes it with: a base model's tokenizer (Qwen2.5's
    ends text with ``<|endoftext|>``) under a ChatML template (``<|im_end|>``). Each turn of a loop then stops at it
    too (``stop_ids``), not only at the tokenizer's EOS.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None, eos_text: str | None = None,
                 check_tool_turns: bool = True):
        self.tokenizer = tokenizer
        self.chat_template = chat_template_text(tokenizer, chat_template, tools=True)
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template to render tool turns with; set data.chat_template")
        after = assistant_turn_text(tokenizer, self.chat_template)[1]
        self.eos_text = eos_text or end_of_turn_token(tokenizer, after)
        if not after.startswith(self.eos_text):
            raise ValueError(f"the chat template does not close an assistant turn with {self.eos_text!r} (it writes "
                             f"{after[:40]!r}); tool turns cannot be appended token for token")
        self.separator = after[len(self.eos_text):]
        """Template text after the end-of-turn token of a conversation's last assistant turn (``\\n`` for ChatML,
        nothing for Llama 3): what the whole conversation's template has past a trajectory's last token."""
        self.eos_ids = self.encode(self.eos_text)
        """The end-of-turn token's ids, which close an assistant turn that a stop token ended."""
        self.stop_ids: tuple[int, ...] = tuple(self.eos_ids) if len(self.eos_ids) == 1 else ()
        """Token ids a turn stops at besides the rollout's own (the tokenizer's EOS, rollout.stop_token_ids)."""
        self.self_closing_ids: frozenset[int] = frozenset(
            token_id for token, token_id in zip(getattr(tokenizer, "all_special_tokens", ()),
                                                getattr(tokenizer, "all_special_ids", ()), strict=False)
            if token != self.eos_text and token in self.chat_template and token_id not in self.eos_ids)
        """Special tokens other than the end-of-turn token that the template writes itself (Llama 3.1's
        ``<|eom_id|>``, which ends a built-in tool's call turn): a turn the model stopped with one needs no
        closing token before the tool turn, as the template closes none there."""
        if check_tool_turns:
            self.check_tool_turns()

    def closing_ids(self, token_ids: list[int], finish_reason: str) -> list[int]:
        """The tokens that close a sampled assistant turn before the tool turn appended to it: none where the model
        ended it with the end-of-turn token, or stopped at a token the template writes itself (``<|eom_id|>``);
        else (a turn a stop token or string ended) the end-of-turn token, as the template closes it."""
        ids = list(token_ids)
        closed = ids[-len(self.eos_ids):] == self.eos_ids or (
            finish_reason == "stop" and bool(ids) and ids[-1] in self.self_closing_ids)
        return [] if closed else list(self.eos_ids)

    def check_tool_turns(self) -> None:
        """Raise one ValueError unless tool messages can follow an assistant turn as a token increment that shows
        the model their content (a template without a tool role either refuses one, as Gemma's and Mistral's
        raise_exception does, named here, or drops it, as OLMo 2's and Phi-3's do)."""
        try:
            text = self.increment_text([{"role": "tool", "content": TOOL_OUTPUT_PROBE, "tool_call_id": PROBE_CALL_ID}])  # a template that cannot
            # work fails here, when the renderer is made (before any model loads, where the caller makes it then)
        except ValueError:
            raise
        except Exception as error:  # jinja2's TemplateError from the template's raise_exception
            raise ValueError(f"the chat template refuses a tool message after an assistant turn ({type(error).__name__}: "
                             f"{error}); set data.chat_template to a template with a tool role") from None
        if TOOL_OUTPUT_PROBE not in text:
            raise ToolMessagesDropped(f"the chat template drops tool messages (after an assistant turn it writes {text[:60]!r} "
                             "for one, without its content), so the model would never see a tool's output; set "
                             "data.chat_template to a template with a tool role")

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return apply_chat_template(self.tokenizer, messages, chat_template=self.chat_template, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)

    def increment_text(self, tool_messages: list[dict[str, Any]],
                       earlier: Sequence[Sequence[dict[str, Any]]] = ()) -> str:
        """The text that follows the model's end-of-turn token: separator, tool turn(s), next assistant header.

        It is the whole conversation's text after the assistant turn's end-of-turn token, so a template may render
        what comes before the assistant's content differently once more turns follow (Qwen3 leaves the empty
        ``<think></think>`` out of an earlier turn): the model's tokens are kept as sampled either way.

        earlier: the tool messages of the trajectory's earlier tool turns, each of which followed an assistant turn
        of its own. A template may write a later tool turn unlike the first (DeepSeek-V3's opens only a
        conversation's first tool outputs with ``<｜tool▁outputs▁begin｜>``): the increment is what the whole
        conversation's template writes at that place. Only as many earlier turns as the template's rendering of a
        tool turn depends on are rendered (``history_turns``): all of them each time would take seconds over a
        trajectory of hundreds of short turns, the event loop waiting."""
        kept = self.history_turns if earlier else 0
        earlier = () if kept == 0 else earlier if kept is None else earlier[-kept:]
        return self._increment_text(tool_messages, earlier)

    @functools.cached_property
    def history_turns(self) -> int | None:
        """How many of a trajectory's earlier tool turns change how the template writes the next one: 0 (most
        templates), 1 (DeepSeek-V3's: whether one came before), or None (all, as far as a probe of two tells)."""
        probe = [{"role": "tool", "content": TOOL_OUTPUT_PROBE, "tool_call_id": PROBE_CALL_ID}]
        texts = [self._increment_text(probe, [probe] * count) for count in range(3)]
        return 0 if texts[1] == texts[0] and texts[2] == texts[0] else 1 if texts[2] == texts[1] else None

    def _increment_text(self, tool_messages: list[dict[str, Any]], earlier: Sequence[Sequence[dict[str, Any]]]) -> str:
        if earlier:
            messages = ASSISTANT_TURN[:1]
            for turn in earlier:
                messages = [*messages, {"role": "assistant", "content": EARLIER_REPLY}, *turn]
            # a template that rewrites earlier turns keeps the first tool turn's rendering, checked when the renderer
            # was made
            with contextlib.suppress(Exception):
                return self._tool_turn_text([*messages, ASSISTANT_TURN[1], *tool_messages])
        return self._tool_turn_text([*ASSISTANT_TURN, *tool_messages])

    def _tool_turn_text(self, messages: list[dict[str, Any]]) -> str:
        """The text ``messages`` (ending with the marked assistant turn and tool messages) render after the marked
        turn's end-of-turn token."""
        full = self._render(messages, add_generation_prompt=True)
        if full.count(ASSISTANT_MARKER) != 1:
            raise ValueError("the chat template renders an assistant turn differently once tool messages follow "
                             "it (its content is not written as it was), so a trajectory's tokens cannot stay as "
                             "sampled; use a template that keeps earlier turns' content as it is")
        rest = full[full.index(ASSISTANT_MARKER) + len(ASSISTANT_MARKER):]
        if not rest.startswith(self.eos_text):
            raise ValueError(f"the chat template closes an assistant turn that tool messages follow with "
                             f"{rest[:40]!r}, not with {self.eos_text!r} as it closes a last turn; tool turns cannot "
                             "be appended token for token")
        return rest[len(self.eos_text):]

    def increment(self, tool_messages: list[dict[str, Any]],
                  earlier: Sequence[Sequence[dict[str, Any]]] = ()) -> list[int]:
        return list(self.tokenizer(self.increment_text(tool_messages, earlier), add_special_tokens=False)["input_ids"])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @functools.cached_property
    def max_token_chars(self) -> int:
        """At least as many characters as any one token stands for: the longest token string of the vocabulary (a
        byte-level token's string has a character per byte, at least one per character it decodes to). A text
        longer than n times this has more than n tokens."""
        return max((len(token) for token in self.tokenizer.get_vocab()), default=1) or 1


def truncate_tokens(token_ids: list[int], limit: int, side: str) -> tuple[list[int], bool]:
    """At most ``limit`` tokens: side=right keeps the start, left keeps the end, middle keeps both ends.

    Returns the tokens and whether any were cut.
    """
    if len(token_ids) <= limit:
        return token_ids, False
    if side == "right":
        return token_ids[:limit], True
    if side == "left":
        return token_ids[len(token_ids) - limit:], True
    if side == "middle":
        head = (limit + 1) // 2
        return token_ids[:head] + token_ids[len(token_ids) - (limit - head):], True
    raise ValueError(f"rollout.multi_turn.tool_response_truncate_side={side!r}; use left, right or middle")
