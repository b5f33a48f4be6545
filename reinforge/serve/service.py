"""The OpenAI API's generation calls over a token client: request bodies in, response bodies out.

``GenerationService`` answers ``/v1/chat/completions`` and ``/v1/completions`` bodies (the HTTP layer is
``app.py``). It reaches the engine only through a ``TokenClient`` (``generate(prompt_ids, sampling, request_id)``):
``AsyncEngineClient`` on the native engine's ``generate_async``, whose requests from every connection join one
continuously batched engine, or ``BatchingClient`` on the hf backend. A call of a trajectory session (``/t/<id>/v1``)
is sampled as the trainer sets and recorded (``trajectories.py``); any other call samples as its request says.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from reinforge.agent.loop import TokenClient
from reinforge.rollout.base import Completion, SamplingParams
from reinforge.rollout.noise import sample_seed
from reinforge.rollout.stop_strings import cut_at_stop
from reinforge.serve.chat import (
    CallRecord,
    ChatCodec,
    ChatSession,
    RequestError,
    new_id,
    normalize_message,
    now,
    openai_message,
)
from reinforge.serve.logprobs import TokenBytes
from reinforge.serve.streaming import (
    CONTEXT_TOKENS,
    ReplyText,
    StreamedChoice,
    last_of,
    piece_text,
    tail_of_sequence,
    text_after,
)
from reinforge.serve.trajectories import TrajectorySession


@dataclass
class ChatCall:
    """A chat request checked and rendered: what it samples, and what its choices need to be answered."""

    body: dict[str, Any]
    session: ChatSession | None
    messages: list[dict[str, Any]]
    tools: Any
    reads_tool_calls: bool
    """Whether replies are parsed for tool calls: tools were sent and tool_choice is not "none"."""
    one_tool_call: bool
    """``parallel_tool_calls: false``: a reply answers with its first tool call only."""
    cut: list[str]
    """The request's stop strings: the engine stops at the token that completes one, and the text ends before it."""
    prompt_ids: list[int]
    continues: int | None
    sampling: SamplingParams
    num_samples: int
    request_id: str
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Each choice's assistant message as the codec parsed it (what a session records)."""


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"{key}={value!r} is out of range; send a number from {low} to {high}")
    return float(value)


def _integer(body: dict[str, Any], key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(f"{key}={value!r} is invalid; send an integer of at least {low}")
    return value


SEED_RANGE = (-(1 << 63), (1 << 63) - 1)
"""The seeds a request may send: any 64-bit signed integer (OpenAI's and vLLM's bound)."""


def _seed(body: dict[str, Any]) -> int | None:
    """The request's ``seed`` as the engine's unsigned 64-bit seed: a negative one is read as its two's complement,
    so every signed 64-bit seed names a stream of its own and the same seed always samples the same."""
    value = body.get("seed")
    if value is None:
        return None
    low, high = SEED_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"seed={json.dumps(value)[:80]} is invalid; send an integer from {low} to {high}",
                           param="seed")
    return value & ((1 << 64) - 1)


def flag(body: dict[str, Any], key: str) -> bool:
    """A request's true/false setting (``stream``, a chat request's ``logprobs``); absent or null is false."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{key}={json.dumps(value)[:80]} is invalid; send true or false")
    return bool(value)


DEFAULT_MAX_N = 128
"""The most choices one request may ask for (``n``) unless ``reinforge serve --max-n`` says otherwise: each is a
sequence the engine samples, so an unbounded ``n`` is a request that fills the server's memory."""

MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1000
"""The most stop strings a request may send, and the longest one (OpenAI takes 4)."""

MAX_TOP_LOG_PROBS = 20
"""The most alternatives a token's logprobs may list (OpenAI's chat bound, vLLM's default max_logprobs)."""

DEFAULT_MAX_LOGPROB_ENTRIES = 1_000_000
"""The most logprob entries one response may hold, n * max_tokens * (top_logprobs + 1), unless ``reinforge serve
--max-logprob-entries`` says otherwise: n=128 choices of 8192 tokens with 20 alternatives each are 22 million entries,
built in the server's memory (and held by the engine as it samples) for one request."""

UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({},), "response_format": ({"type": "text"},), "best_of": (1,), "echo": (False,), "suffix": ("",),
}
"""Request keys the engine has no way to honour, with the values that ask for nothing (accepted, as clients send
them by default); any other value is refused rather than ignored."""


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key, defaults in UNSUPPORTED_DEFAULTS.items():
        value = body.get(key)
        if value is not None and not any(value == default and type(value) is type(default) for default in defaults):
            raise RequestError(f"{key}={json.dumps(value)[:80]} is not supported: the engine samples without it; "
                               "leave it out")


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """A chat request's tools, checked to be OpenAI function schemas; None for none."""
    if not tools:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(tool.get("function"),
                                                                                                   dict)
            and isinstance(tool["function"].get("name"), str) for tool in tools):
        raise RequestError(f"tools={str(tools)[:80]!r} is invalid; send a list of "
                           '{"type": "function", "function": {"name", "description", "parameters"}} objects')
    return tools


def _reads_tool_calls(tools: Any, tool_choice: Any) -> bool:
    """Whether a chat request's replies are parsed for tool calls (OpenAI's tool_choice: "auto", the default with
    tools, or "none"); raises RequestError for a choice the engine cannot honour."""
    if tool_choice is None or tool_choice == "auto":
        return bool(tools)
    if tool_choice == "none":
        return False
    if not tools:
        raise RequestError(f"tool_choice={tool_choice!r} without tools; send tools, or leave tool_choice out")
    if tool_choice == "required" or isinstance(tool_choice, dict):
        raise RequestError(f"tool_choice={json.dumps(tool_choice)} is not supported: the engine samples freely and "
                           "cannot force a tool call; send tool_choice \"auto\" (the model calls tools when it "
                           "chooses to) or \"none\"")
    raise RequestError(f"tool_choice={tool_choice!r} is invalid; send \"auto\" or \"none\"")


class GenerationService:
    def __init__(self, client: TokenClient, tokenizer: Any, model_name: str, *, codec: ChatCodec | None,
                 max_model_len: int, default_max_tokens: int = 1024, eos_token_ids: tuple[int, ...] = (),
                 vocab_size: int | None = None, max_n: int = DEFAULT_MAX_N,
                 max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES):
        if max_n < 1:
            raise ValueError(f"max_n={max_n}; allow at least 1 choice per request")
        if max_logprob_entries < 1:
            raise ValueError(f"max_logprob_entries={max_logprob_entries}; allow at least 1 logprob entry per response")
        self.client = client
        self.max_n = max_n
        self.max_logprob_entries = max_logprob_entries
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.codec = codec
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size or len(tokenizer)
        self.token_bytes = TokenBytes(tokenizer)
        self.num_requests = 0

    def _num_samples(self, body: dict[str, Any]) -> int:
        """The request's ``n`` (absent or null: 1), an integer from 1 to ``max_n``."""
        value = body.get("n")
        if value is None:
            return 1
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(f"n={json.dumps(value)[:80]} is invalid; send an integer from 1 to {self.max_n} "
                               "(the number of choices)", param="n")
        if value > self.max_n:
            raise RequestError(f"n={value} is over this server's limit of {self.max_n} choices per request "
                               f"(reinforge serve --max-n); send n from 1 to {self.max_n}", param="n")
        return value

    @staticmethod
    def _stop(body: dict[str, Any]) -> list[str]:
        """The request's stop strings: the engine ends a sample at the token whose text completes one."""
        stop = body.get("stop")
        strings = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else [] if stop is None else [stop]
        if not all(isinstance(text, str) and text for text in strings):
            raise RequestError(f"stop={stop!r} is invalid; send a string or a list of strings")
        strings = list(dict.fromkeys(strings))
        # every sampled token of every choice is searched for each of them, on the engine's loop: thousands of stop
        # strings, or one of megabytes, slowed every request the engine was serving
        if len(strings) > MAX_STOP_STRINGS or any(len(text) > MAX_STOP_CHARS for text in strings):
            longest = max(len(text) for text in strings)
            raise RequestError(f"stop has {len(strings)} strings, the longest of {longest} characters; send at most "
                               f"{MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters each",
                               param="stop")
        return strings

    def _check_log_prob_entries(self, num_samples: int, max_tokens: int, num_top: int) -> None:
        """A 400 for a request whose logprobs could hold more entries than the server builds for one response."""
        entries = num_samples * max_tokens * (num_top + 1)
        if entries > self.max_logprob_entries:
            raise RequestError(f"n={num_samples} choices of up to max_tokens={max_tokens} tokens with {num_top} "
                               f"alternatives each are up to {entries} logprob entries, over this server's limit of "
                               f"{self.max_logprob_entries} per response (reinforge serve --max-logprob-entries); "
                               "ask for fewer choices, tokens or top_logprobs", param="logprobs")

    def _sampling(self, body: dict[str, Any], prompt_length: int, stop_ids: tuple[int, ...],
                  stop: list[str] | tuple[str, ...] = ()) -> SamplingParams:
        room = self.max_model_len - prompt_length
        if room <= 0:
            raise RequestError(f"the prompt has {prompt_length} tokens, at least the model's context of "
                               f"{self.max_model_len}; send a shorter conversation", code="context_length_exceeded")
        max_tokens = _integer(body, "max_completion_tokens", 1) or _integer(body, "max_tokens", 1)
        if max_tokens is not None and max_tokens > room:
            raise RequestError(f"max_tokens={max_tokens} and the prompt's {prompt_length} tokens exceed the model's "
                               f"context of {self.max_model_len}; ask for at most {room}",
                               code="context_length_exceeded")
        _refuse_unsupported(body)
        top_k = body.get("top_k")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
            raise RequestError(f"top_k={top_k!r} is invalid; send an integer of at least 1 (-1 or 0: no top-k)")
        return SamplingParams(max_tokens=max_tokens or min(self.default_max_tokens, room),
                              temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                              top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
                              # a top-k of the whole vocabulary or more is no top-k (one past an int64 failed the
                              # native engine's step, and with it every request the step held)
                              top_k=-1 if top_k is None or top_k >= self.vocab_size else top_k, min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
                              stop_token_ids=tuple(dict.fromkeys((*self.eos_token_ids, *stop_ids))),
                              stop=tuple(stop), seed=_seed(body))

    @staticmethod
    def _samplings(sampling: SamplingParams, num_samples: int) -> list[SamplingParams]:
        """One sampling per choice: a seeded request's choices each get a seed of their own."""
        return [sampling if num_samples == 1 or sampling.seed is None
                else dataclasses.replace(sampling, seed=sample_seed(sampling.seed, index))
                for index in range(num_samples)]

    async def _sample(self, prompt_ids: list[int], sampling: SamplingParams, num_samples: int,
                      request_id: str) -> list[Completion]:
        tasks = [asyncio.ensure_future(self.client.generate(prompt_ids, each, f"{request_id}/{index}"))
                 for index, each in enumerate(self._samplings(sampling, num_samples))]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # a choice that failed fails the request: the others are not sampled on for no one
            for task in tasks:
                task.cancel()

    async def _sample_streamed(self, prompt_ids: list[int], sampling: SamplingParams, num_samples: int,
                               request_id: str, choices: list[StreamedChoice],
                               ) -> AsyncIterator[tuple[int, Completion | None]]:
        """(index, None) after each token a choice samples (its ``delta`` and ``log_probs`` updated), then
        (index, completion) when the choice is done. A client without ``generate_streamed`` (the hf backend's)
        hands each completion over whole."""
        events: asyncio.Queue[tuple[int, tuple[Any, ...] | Completion | BaseException]] = asyncio.Queue()
        streamed = getattr(self.client, "generate_streamed", None)

        async def sample(index: int, each: SamplingParams) -> None:
            try:
                if streamed is None:
                    completion = await self.client.generate(prompt_ids, each, f"{request_id}/{index}")
                else:
                    completion = await streamed(prompt_ids, each, f"{request_id}/{index}",
                                                lambda *token: events.put_nowait((index, token)))
                events.put_nowait((index, completion))
            except Exception as error:  # noqa: BLE001 - raised where the stream is read
                events.put_nowait((index, error))

        tasks = [asyncio.create_task(sample(index, each))
                 for index, each in enumerate(self._samplings(sampling, num_samples))]
        try:
            for _ in range(num_samples):
                while True:
                    event = await events.get()
                    index, choice = event[0], choices[event[0]]
                    if isinstance(event[1], tuple):  # (token id, log-prob, its alternatives)
                        choice.add(*event[1])
                        yield index, None
                        continue
                    if isinstance(event[1], BaseException):
                        raise event[1]
                    choice.finish(event[1])
                    yield index, event[1]
                    break
        finally:  # a client that hangs up stops waiting here
            for task in tasks:
                task.cancel()

    def _text(self, token_ids: list[int], finish_reason: str, cut: list[str],
              stop_ids: tuple[int, ...] = (), context: list[int] | None = None) -> tuple[str, str]:
        """(text, finish_reason) of a completion, its text as it reads after ``context`` (its prompt's last ids)."""
        ids = token_ids[:-1] if finish_reason == "stop" and token_ids and token_ids[-1] in (*self.eos_token_ids,
                                                                                              *stop_ids) \
            else token_ids
        text = text_after(self._decode, context or [], ids)
        before = cut_at_stop(text, cut)
        return (before, "stop") if before is not None else (text, finish_reason)

    def _log_probs(self, completion: Completion, context: list[int] | None = None) -> list[dict[str, Any]]:
        """Each sampled token's entry, its text read after the ids before it (``context``, then the completion's)."""
        tops = completion.top_log_probs or [None] * len(completion.token_ids)
        ids = list(context or [])[-CONTEXT_TOKENS:] + list(completion.token_ids)
        start = len(ids) - len(completion.token_ids)
        # each token read after the CONTEXT_TOKENS before it (a slice of those alone: a long completion copies no prefix)
        return [self._log_prob(token_id, log_prob, top, ids[max(start + position - CONTEXT_TOKENS, 0):start + position])
                for position, (token_id, log_prob, top)
                in enumerate(zip(completion.token_ids, completion.log_probs, tops, strict=True))]

    def _log_prob(self, token_id: int, log_prob: float, top: list[tuple[int, float]] | None = None,
                  before: list[int] | None = None) -> dict[str, Any]:
        """A sampled token's entry of OpenAI's ``logprobs.content``, with its alternatives (``top``) as asked, each
        token's text as it reads after the ids ``before`` it."""
        entry = self._token_log_prob(token_id, log_prob, before)
        entry["top_logprobs"] = [self._token_log_prob(*alternative, before) for alternative in top or []]
        return entry

    def _token_log_prob(self, token_id: int, log_prob: float, before: list[int] | None = None) -> dict[str, Any]:
        return {"token": piece_text(self._decode, before or [], token_id), "logprob": float(log_prob),
                "bytes": list(self.token_bytes(token_id))}

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    @staticmethod
    def _no_stream_options(body: dict[str, Any]) -> None:
        """OpenAI's refusal of ``stream_options`` on a request that does not stream (they would change nothing)."""
        if body.get("stream_options") is not None:
            raise RequestError("stream_options is only allowed with stream: true; drop it or set \"stream\": true",
                               param="stream_options")

    @staticmethod
    def _include_usage(body: dict[str, Any]) -> bool:
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise RequestError(f"stream_options={options!r} is invalid; send an object such as "
                               '{"include_usage": true}')
        value = (options or {}).get("include_usage")
        if value is not None and not isinstance(value, bool):  # "false" would have been taken for true
            raise RequestError(f"stream_options.include_usage={json.dumps(value)[:80]} is invalid; send true or false",
                               param="stream_options")
        return bool(value)

    def _chat_call(self, body: dict[str, Any], session: ChatSession | None) -> ChatCall:
        """A chat request body checked and rendered; raises RequestError before anything is sampled."""
        if self.codec is None:
            raise RequestError("the served model's tokenizer has no chat template; use /v1/completions or serve "
                               "with --chat-template FILE")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of {role, content} objects")
        messages = [normalize_message(message) for message in messages]
        if body.get("chat_template_kwargs"):  # vLLM's: Qwen3's enable_thinking, say
            raise RequestError(f"chat_template_kwargs={json.dumps(body['chat_template_kwargs'])[:80]} is not supported: "
                               "every call renders with the chat template's defaults (a continued conversation's tool "
                               "turns too); serve with --chat-template FILE holding a template that renders as you need")
        tools = _tools(body.get("tools"))
        reads_tool_calls = _reads_tool_calls(tools, body.get("tool_choice"))
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise RequestError(f"parallel_tool_calls={json.dumps(parallel)[:80]} is invalid; send true or false",
                               param="parallel_tool_calls")
        training = isinstance(session, TrajectorySession)
        num_samples = self._num_samples(body)
        num_top = _integer(body, "top_logprobs", 0) or 0
        flag(body, "logprobs")
        if num_top > MAX_TOP_LOG_PROBS:
            raise RequestError(f"top_logprobs={num_top} is out of range; send an integer from 0 to {MAX_TOP_LOG_PROBS}")
        if num_top and not body.get("logprobs"):
            raise RequestError(f"top_logprobs={num_top} without logprobs=true; send logprobs=true with it")
        if training and num_samples != 1:
            raise RequestError(f"n={num_samples} in a trajectory; a trajectory samples one reply per call")
        cut = self._stop(body)
        prompt_ids, continues = self.codec.prompt_ids(session, messages, tools)
        if training:
            sampling = session.turn_sampling(prompt_ids, continues, _integer(body, "max_completion_tokens", 1)
                                             or _integer(body, "max_tokens", 1), self.codec.renderer.stop_ids,
                                             tuple(cut))
            request_id = f"{session.request_id}/{len(session.records)}"
        else:
            sampling = self._sampling(body, len(prompt_ids), self.codec.renderer.stop_ids, cut)
            request_id = new_id("chat")
        sampling = dataclasses.replace(sampling, num_top_log_probs=num_top)
        if body.get("logprobs"):
            self._check_log_prob_entries(num_samples, sampling.max_tokens, num_top)
        return ChatCall(body, session, messages, tools, reads_tool_calls, parallel is False, cut, prompt_ids,
                        continues, sampling, num_samples, request_id)

    @staticmethod
    def _dropped_stops(call: ChatCall) -> tuple[int, ...]:
        """The stop tokens a reply's text leaves out: all of them, but none in a trajectory (its tokens are kept
        whole and its replies are matched token for token)."""
        return () if isinstance(call.session, TrajectorySession) else call.sampling.stop_token_ids

    def _chat_choice(self, call: ChatCall, index: int, completion: Completion,
                     log_probs: bool = True) -> dict[str, Any]:
        """The choice of one completion (its message with the content and tool calls, finish_reason, and its logprobs
        when the request asks for them and ``log_probs``: a stream has sent them already)."""
        token_ids = list(completion.token_ids)
        finish_reason = completion.finish_reason
        if (finish_reason == "stop" and token_ids and token_ids[-1] in self._dropped_stops(call)
                and token_ids[-len(self.codec.renderer.eos_ids):] != self.codec.renderer.eos_ids):
            token_ids = token_ids[:-1]  # a stop token (another EOS) is not part of the reply
        reply, calls = self.codec.reply(token_ids, call.reads_tool_calls, call.cut)
        if finish_reason == "length" and call.cut and cut_at_stop(self._decode(token_ids), call.cut) is not None:
            finish_reason = "stop"  # a client whose engine does not stop at strings (the text still ends there)
        # a reply cut at max_tokens is "length" even after a whole call: the client must not take it for finished
        tool_turn = call.session.tool_turns(call.prompt_ids) if isinstance(call.session, TrajectorySession) else None
        answered = reply
        if call.one_tool_call and len(reply.get("tool_calls", [])) > 1:
            # the engine cannot keep the model from writing more calls: the reply answers with the first alone, and a
            # conversation that goes on from it is rendered from its messages (it is not the reply as sampled)
            answered = dict(reply, tool_calls=reply["tool_calls"][:1])
        choice: dict[str, Any] = {"index": index, "message": openai_message(answered, tool_turn),
                                  "finish_reason": "tool_calls" if calls and finish_reason != "length" else finish_reason}
        if log_probs and call.body.get("logprobs"):
            choice["logprobs"] = {"content": self._log_probs(completion)}
        call.replies[index] = reply
        return choice

    def _record(self, call: ChatCall, completions: list[Completion], seconds: float) -> None:
        """A session's record of the call (one per completion, in order); a trajectory's generation time."""
        self.num_requests += 1
        if call.session is None:
            return
        for index, completion in enumerate(completions):
            call.session.records.append(CallRecord(call.messages, call.tools, call.prompt_ids,
                                                   list(completion.token_ids), list(completion.log_probs),
                                                   completion.finish_reason, call.replies[index], call.continues))
        if isinstance(call.session, TrajectorySession):
            call.session.generate_seconds += seconds

    @staticmethod
    def _usage(prompt_ids: list[int], completions: list[Completion]) -> dict[str, int]:
        completion_tokens = sum(len(completion.token_ids) for completion in completions)
        return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens}

    async def chat(self, body: dict[str, Any], session: ChatSession | None) -> dict[str, Any]:
        """A chat.completion body for a chat request body; a trajectory session records the call."""
        self._no_stream_options(body)
        call = self._chat_call(body, session)
        start = time.perf_counter()
        completions = await self._sample(call.prompt_ids, call.sampling, call.num_samples, call.request_id)
        choices = [self._chat_choice(call, index, completion) for index, completion in enumerate(completions)]
        self._record(call, completions, time.perf_counter() - start)
        return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(), "model": self.model_name,
                "choices": choices, "usage": self._usage(call.prompt_ids, completions)}

    def chat_stream(self, body: dict[str, Any], session: ChatSession | None) -> AsyncIterator[dict[str, Any]]:
        """The chat.completion.chunk bodies of a streamed chat request, as the engine samples: each choice's role,
        its content deltas, its tool calls once parsed, its finish_reason; then the usage when
        ``stream_options.include_usage``. The request is checked here (RequestError) before anything streams."""
        call = self._chat_call(body, session)
        include_usage = self._include_usage(body)
        log_prob = self._log_prob if body.get("logprobs") else None
        stopped = last_of(self._dropped_stops(call))  # a stop token ends the reply and is not part of it
        tail = tail_of_sequence(list(self.codec.renderer.eos_ids))
        opening = getattr(self.codec.parser, "opening", None) or "<tool_call>"
        choices = [StreamedChoice(ReplyText(self._decode, lambda ids: tail(stopped(ids)), call.cut,
                                            opening if call.reads_tool_calls else None), log_prob)
                   for _ in range(call.num_samples)]

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            chunk_id, created = new_id("chatcmpl"), now()

            def chunk(index: int | None, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
                body: dict[str, Any] = {"id": chunk_id, "object": "chat.completion.chunk", "created": created,
                                        "model": self.model_name, "choices": []}
                if index is not None:
                    choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
                    entries = choices[index].take_log_probs()
                    if log_prob is not None and (entries or "content" in delta):
                        choice["logprobs"] = {"content": entries}
                    body["choices"].append(choice)
                return dict(body, usage=None) if include_usage else body

            for index in range(call.num_samples):
                yield chunk(index, {"role": "assistant", "content": ""})
            start = time.perf_counter()
            completions: dict[int, Completion] = {}
            async for index, completion in self._sample_streamed(call.prompt_ids, call.sampling, call.num_samples,
                                                                 call.request_id, choices):
                if completion is None:
                    if choices[index].delta:
                        yield chunk(index, {"content": choices[index].delta})
                    continue
                completions[index] = completion
                choice = self._chat_choice(call, index, completion, log_probs=False)
                message = choice["message"]
                rest = choices[index].text.finish(message["content"] or "")
                if rest:
                    yield chunk(index, {"content": rest})
                if message.get("tool_calls"):
                    yield chunk(index, {"tool_calls": [dict(tool_call, index=position) for position, tool_call
                                                       in enumerate(message["tool_calls"])]})
                yield chunk(index, {}, choice["finish_reason"])
            done = [completions[index] for index in range(call.num_samples)]
            self._record(call, done, time.perf_counter() - start)
            if include_usage:
                yield dict(chunk(None, {}), usage=self._usage(call.prompt_ids, done))

        return chunks()

    def _completion_call(self, body: dict[str, Any]) -> tuple[list[int], SamplingParams, int, list[str]]:
        """A completions request body checked: (prompt ids, sampling, number of choices, stop strings to cut at)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(isinstance(token, int) for token in prompt):
            prompt_ids = list(prompt)
        else:
            raise RequestError("'prompt' must be a string or a list of token ids (one prompt per request)")
        if not prompt_ids:
            raise RequestError("'prompt' is empty; send at least one token")
        wrong = [token for token in prompt_ids if isinstance(token, bool) or not 0 <= token < self.vocab_size]
        if wrong:
            raise RequestError(f"'prompt' holds token id {wrong[0]}, outside the model's vocabulary of "
                               f"{self.vocab_size}; send ids from 0 to {self.vocab_size - 1}")
        cut = self._stop(body)
        num_top = self._num_text_log_probs(body)
        sampling = dataclasses.replace(self._sampling(body, len(prompt_ids), (), cut), num_top_log_probs=num_top or 0)
        num_samples = self._num_samples(body)
        if num_top is not None:
            self._check_log_prob_entries(num_samples, sampling.max_tokens, num_top)
        return prompt_ids, sampling, num_samples, cut

    @staticmethod
    def _num_text_log_probs(body: dict[str, Any]) -> int | None:
        """A completions request's ``logprobs``: how many alternatives each token lists (0: only its own log-prob),
        None for no logprobs."""
        value = body.get("logprobs")
        if value is None or value is False:
            return None
        if value is True:
            return 0
        if not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOG_PROBS:
            raise RequestError(f"logprobs={value!r} is out of range; send an integer from 0 to {MAX_TOP_LOG_PROBS} "
                               "(the alternatives each token lists)")
        return value

    @staticmethod
    def _text_log_probs(entries: list[dict[str, Any]], offset: int = 0, num_top: int = 0) -> dict[str, Any]:
        """The completions API's logprobs of some tokens, the first at ``offset`` in the text; with ``num_top``, each
        token's alternatives and itself as {token text: logprob} (OpenAI's up to logprobs + 1)."""
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry["token"])
        top = None
        if num_top:  # alternatives of one text (lone bytes all read "\ufffd") keep the likeliest's
            top = [dict(reversed([(alternative["token"], alternative["logprob"]) for alternative in entry["top_logprobs"]]))
                   | {entry["token"]: entry["logprob"]} for entry in entries]
        return {"tokens": [entry["token"] for entry in entries],
                "token_logprobs": [entry["logprob"] for entry in entries], "top_logprobs": top,
                "text_offset": offsets}

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """A text_completion body for a completions request body (one prompt: a string or token ids)."""
        self._no_stream_options(body)
        prompt_ids, sampling, num_samples, cut = self._completion_call(body)
        num_top = self._num_text_log_probs(body)
        completions = await self._sample(prompt_ids, sampling, num_samples, new_id("cmpl"))
        self.num_requests += 1
        choices = []
        for index, completion in enumerate(completions):  # its text continues the prompt's, a leading space kept
            text, finish_reason = self._text(list(completion.token_ids), completion.finish_reason, cut,
                                             sampling.stop_token_ids, prompt_ids)
            choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
            if num_top is not None:
                choice["logprobs"] = self._text_log_probs(self._log_probs(completion, prompt_ids), 0, num_top)
            choices.append(choice)
        return {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": self.model_name,
                "choices": choices, "usage": self._usage(prompt_ids, completions)}

    def complete_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The text_completion chunk bodies of a streamed completions request, as the engine samples: each
        choice's text deltas, then its finish_reason; then the usage when ``stream_options.include_usage``."""
        prompt_ids, sampling, num_samples, cut = self._completion_call(body)
        include_usage = self._include_usage(body)
        num_top = self._num_text_log_probs(body)
        log_probs = num_top is not None
        context = prompt_ids[-CONTEXT_TOKENS:]  # the text continues the prompt's, as ``complete`` decodes it
        choices = [StreamedChoice(ReplyText(lambda ids: text_after(self._decode, context, ids),
                                            last_of(sampling.stop_token_ids), cut, None),
                                  self._log_prob if log_probs else None, context) for _ in range(num_samples)]

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            chunk_id, created = new_id("cmpl"), now()
            offsets = [0] * num_samples

            def chunk(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
                entries = choices[index].take_log_probs()
                choice = {"index": index, "text": text, "finish_reason": finish_reason,
                          "logprobs": self._text_log_probs(entries, offsets[index], num_top) if log_probs else None}
                offsets[index] += sum(len(entry["token"]) for entry in entries)
                body = {"id": chunk_id, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": [choice]}
                return dict(body, usage=None) if include_usage else body

            completions: list[Completion] = []
            async for index, completion in self._sample_streamed(prompt_ids, sampling, num_samples, new_id("cmpl"),
                                                                 choices):
                choice = choices[index]
                if completion is None:
                    if choice.delta:
                        yield chunk(index, choice.delta, None)
                    continue
                completions.append(completion)
                text, finish_reason = self._text(list(completion.token_ids), completion.finish_reason, cut,
                                                 sampling.stop_token_ids, context)
                yield chunk(index, choice.text.finish(text), finish_reason)
            self.num_requests += 1
            if include_usage:
                yield {"id": chunk_id, "object": "text_completion", "created": created, "model": self.model_name,
                       "choices": [], "usage": self._usage(prompt_ids, completions)}

        return chunks()
