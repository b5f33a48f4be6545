"""OpenAI chat messages to token ids and back, token in and token out.

A conversation's first call is rendered by the chat template (``apply_chat_template`` with its tools and the
generation prompt). A later call of the same session whose messages are an earlier call's messages, then the reply
the server gave it, then new tool or user messages, is not rendered again: its prompt is the earlier call's prompt
ids, the ids the engine sampled, and the new messages as a chat-template increment (``ToolTurnRenderer``, the
increment ``tool_agent`` appends), so the tokens the model sampled stay as sampled. Any other call (an edited,
shortened or reordered history, other tools) is rendered from its messages and starts a new segment.
"""

from __future__ import annotations

import json
import logging
import secrets
import string
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from reinforge.agent.tool_agent import CALL_ID_CHARS, call_id
from reinforge.agent.tool_parsers import ToolCall, get_tool_parser, reasoning_end
from reinforge.agent.turn_tokens import ToolMessagesDropped, ToolTurnRenderer
from reinforge.data.chat_template import chat_template_text, template_error_message
from reinforge.rollout.stop_strings import cut_at_stop


class RequestError(ValueError):
    """A request the server refuses: status, OpenAI error type and code, and a one-line message."""

    def __init__(self, message: str, status: int = 400, code: str | None = None,
                 error_type: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.error_type, self.param = status, code, error_type, param

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.error_type, self.code, self.param)


def error_body(message: str, error_type: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error format: {"error": {"message", "type", "param", "code"}}, ``param`` the request key at fault."""
    return {"error": {"message": " ".join(message.split()), "type": error_type, "param": param, "code": code}}


def text_of(content: Any) -> str:
    """A message's content as text: a string, None, or a list of text parts, joined. Any other part (an image, audio,
    a file) is refused: the endpoint passes the model token ids alone, and an answer without the image would read
    as the answer to it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise RequestError(f"message content part of type {kind!r} is not supported: this endpoint passes "
                                   "the model text alone (no images, audio or files); send text parts only")
            if not isinstance(part.get("text", ""), str):
                raise RequestError(f"a text part's text is {json.dumps(part['text'])[:80]}; send it as a string")
        return "".join(part.get("text", "") for part in content)
    raise RequestError(f"message content of type {type(content).__name__} is not supported; send a string or a list "
                       "of text parts")


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if raw is not None and not isinstance(raw, str):
        raise RequestError(f"tool call arguments {json.dumps(raw)[:80]} are neither a JSON string nor an object; send "
                           "the arguments the server returned")
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except json.JSONDecodeError as error:
        raise RequestError(f"tool call arguments {raw!r} are not JSON ({error.msg}); send a JSON object") from None
    return value if isinstance(value, dict) else {"value": value}


def normalize_message(message: Any) -> dict[str, Any]:
    """A message as the chat template reads it: role, content text, tool calls with their arguments as objects."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"each message needs a 'role' string; got {str(message)[:80]!r}")
    role = message["role"]
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(f"message role {role!r} is not supported; use system, user, assistant or tool")
    normalized: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                  "content": text_of(message.get("content"))}
    if role == "tool" and isinstance(message.get("tool_call_id"), str):  # Mistral's template shows (and needs) it
        normalized["tool_call_id"] = message["tool_call_id"]
    if role == "assistant" and message.get("tool_calls"):
        if not isinstance(message["tool_calls"], list) or not all(isinstance(call, dict) for call in
                                                                   message["tool_calls"]):
            raise RequestError(f"an assistant message's tool_calls is {str(message['tool_calls'])[:80]!r}; send a list "
                               'of {"id", "type": "function", "function": {"name", "arguments"}} objects')
        calls = []
        for call in message["tool_calls"]:
            function = call.get("function") or {}
            if not isinstance(function.get("name"), str):
                raise RequestError("an assistant tool call needs function.name; send the tool_calls the server returned")
            calls.append({"type": "function", "function": {"name": function["name"],
                                                           "arguments": _arguments(function.get("arguments"))},
                          **({"id": call["id"]} if isinstance(call.get("id"), str) else {})})
        normalized["tool_calls"] = calls
    return normalized


def _without_ids(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: value for key, value in call.items() if key != "id"} for call in calls]


def _same_reply(sent: dict[str, Any], returned: dict[str, Any]) -> bool:
    """Whether an assistant message sent back is the reply the server gave (content up to surrounding space; its
    calls' ids are the ones the answer gave, which the sampled text may not hold)."""
    return (sent["role"] == "assistant" and sent["content"].strip() == returned["content"].strip()
            and _without_ids(sent.get("tool_calls", [])) == _without_ids(returned.get("tool_calls", [])))


logger = logging.getLogger(__name__)


@dataclass
class CallRecord:
    """One chat call of a session: what it was asked, the exact prompt ids, and what the engine sampled."""

    messages: list[dict[str, Any]]
    tools: Any
    prompt_ids: list[int]
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    reply: dict[str, Any]
    continues: int | None = None
    """Index of the call this one continues by increment; None: rendered from its messages."""


@dataclass
class ChatSession:
    """The calls of one trajectory (or one client's conversation), in order."""

    records: list[CallRecord] = field(default_factory=list)

    def continued_call(self, messages: list[dict[str, Any]], tools: Any) -> tuple[int, list[dict[str, Any]]] | None:
        """(index of the latest call the messages continue, the new messages after its reply), or None."""
        for index in range(len(self.records) - 1, -1, -1):
            record = self.records[index]
            size = len(record.messages)
            if (len(messages) > size + 1 and record.tools == tools and messages[:size] == record.messages
                    and _same_reply(messages[size], record.reply)
                    and all(message["role"] in ("tool", "user") for message in messages[size + 1:])):
                return index, messages[size + 1:]
        return None


def _turn_fields(message: dict[str, Any]) -> dict[str, Any]:
    return {key: message[key] for key in ("role", "content", "tool_call_id") if key in message}


def _tool_turns(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The tool turns of a conversation, in order: each run of consecutive tool messages, as an increment reads them."""
    turns: list[list[dict[str, Any]]] = []
    previous = None
    for message in messages:
        if message.get("role") == "tool":
            if previous != "tool":
                turns.append([])
            turns[-1].append(_turn_fields(message))
        previous = message.get("role")
    return turns


class ChatCodec:
    """Messages to prompt ids, and sampled ids to an assistant message, for one tokenizer and chat template."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None, tool_format: str = "hermes"):
        self.tokenizer = tokenizer
        self.chat_template = chat_template_text(tokenizer, chat_template, tools=True)  # a tool turn's increments
        try:  # a request without tools, where the tokenizer names its templates
            self.plain_template = chat_template_text(tokenizer, chat_template)
        except ValueError:  # no default among them: the tool one renders every request
            self.plain_template = self.chat_template
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template, so chat messages cannot be rendered; serve a model "
                             "whose tokenizer_config.json has one or pass --chat-template FILE")
        self.renderer = ToolTurnRenderer(tokenizer, self.chat_template, check_tool_turns=False)
        self.drops_tool_messages: str | None = None
        """Why the template cannot show tool messages (it drops them), or None."""
        try:  # Gemma's and Mistral's templates have no tool role, Phi-3's ends a conversation with EOS: they still
            self.renderer.check_tool_turns()  # chat; a continued conversation is then rendered again from messages
            self.increments = True
        except ValueError as error:
            if isinstance(error, ToolMessagesDropped):
                self.drops_tool_messages = str(error)
            logger.warning("conversations are rendered whole on each call, not continued token for token: %s", error)
            self.increments = False
        self.parser = get_tool_parser(tool_format)

    def render(self, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        """The prompt ids of the messages; RequestError where the template refuses them (Gemma's system role) or
        would drop their tool messages."""
        if self.drops_tool_messages and any(message["role"] == "tool" for message in messages):
            raise RequestError("the served model's chat template has no tool role: it would drop the tool messages, "
                               "and the model would not see their content; send the tool's output in a user message, "
                               "or serve with --chat-template FILE whose template has one")
        try:
            template = self.chat_template if tools else self.plain_template
            ids = self.tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=template,
                                                     add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as error:  # jinja2's TemplateError from the template's raise_exception, or odd content
            raise RequestError(template_error_message(error, "these messages", "--chat-template FILE")) from None
        return list(ids)

    def increment(self, record: CallRecord, new_messages: list[dict[str, Any]]) -> list[int]:
        """The tokens after a call's sampled ids that bring in new messages: the end-of-turn token if the call was
        stopped before it (as ``tool_agent`` closes such a turn; not after a token the template writes itself to
        end a turn, Llama 3.1's ``<|eom_id|>``), then the template's increment."""
        closing = self.renderer.closing_ids(record.token_ids, record.finish_reason)
        turns = [_turn_fields(message) for message in new_messages]
        try:  # the conversation's earlier tool turns: a template may write a later one otherwise (DeepSeek-V3's)
            return closing + self.renderer.increment(turns, _tool_turns(record.messages))
        except Exception as error:  # the template's raise_exception (a tool result's call id it does not take)
            raise RequestError(template_error_message(error, "these messages", "--chat-template FILE")) from None

    def prompt_ids(self, session: ChatSession | None, messages: list[dict[str, Any]],
                   tools: Any) -> tuple[list[int], int | None]:
        """The prompt of a call and the index of the call it continues (None: rendered)."""
        continued = session.continued_call(messages, tools) if session is not None and self.increments else None
        if continued is None:
            return self.render(messages, tools), None
        index, new_messages = continued
        record = session.records[index]
        return record.prompt_ids + record.token_ids + self.increment(record, new_messages), index

    def reply(self, token_ids: list[int], reads_tool_calls: bool = True,
              stop: list[str] | tuple[str, ...] = ()) -> tuple[dict[str, Any], list[ToolCall]]:
        """The assistant message of sampled ids: text without the end-of-turn token and ending before the first of
        the ``stop`` strings, tool calls taken out (left in the text when ``reads_tool_calls`` is false: the request
        sent no tools, or tool_choice "none")."""
        eos_ids = self.renderer.eos_ids
        body = token_ids[:-len(eos_ids)] if token_ids[-len(eos_ids):] == eos_ids else token_ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        before = cut_at_stop(text, stop)
        text = text if before is None else before
        calls = [call for call in self.parser.parse(text) if call.error is None] if reads_tool_calls else []
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:  # the content is the text before the calls (none when the turn is its calls: Llama 3's JSON)
            marker = getattr(self.parser, "opening", None)
            opening = text.find(marker or "<tool_call>", reasoning_end(text))  # a tag its thinking mentions stays
            message["content"] = text[:opening].rstrip() if opening >= 0 else "" if marker else text
            message["tool_calls"] = [{"type": "function", "function": {"name": call.name, "arguments": call.arguments},
                                      **({"id": call.id} if call.id else {})} for call in calls]
        return message, calls


ID_CHARACTERS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A new tool call id of 9 letters and digits: the only kind Mistral's templates take in a tool result."""
    return "".join(secrets.choice(ID_CHARACTERS) for _ in range(CALL_ID_CHARS))


def openai_message(reply: dict[str, Any], tool_turn: int | None = None) -> dict[str, Any]:
    """The reply as OpenAI's API writes it: arguments as JSON strings, each call with an id (the one the model
    wrote, as Mistral's models write theirs and its template takes no other; else a new one). With ``tool_turn`` (a
    trajectory's call: the tool turns before its reply), each id is the one ``tool_agent`` gives that call's result,
    so the tool messages sent back render as ``tool_agent``'s do."""
    message: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
    if reply.get("tool_calls"):
        message["content"] = reply["content"] or None
        message["tool_calls"] = [
            {"id": call_id(ToolCall(call["function"]["name"], id=call.get("id")), tool_turn, index)
             if tool_turn is not None else call.get("id") or new_call_id(), "type": "function",
             "function": {"name": call["function"]["name"], "arguments": json.dumps(call["function"]["arguments"])}}
            for index, call in enumerate(reply["tool_calls"])]
    return message


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
