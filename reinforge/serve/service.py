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
import time
from typing import Any

from reinforge.agent.loop import TokenClient
from reinforge.rollout.base import Completion, SamplingParams
from reinforge.rollout.noise import sample_seed
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
from reinforge.serve.trajectories import TrajectorySession


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


class GenerationService:
    def __init__(self, client: TokenClient, tokenizer: Any, model_name: str, *, codec: ChatCodec | None,
                 max_model_len: int, default_max_tokens: int = 1024, eos_token_ids: tuple[int, ...] = ()):
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.codec = codec
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_requests = 0

    def _stop(self, body: dict[str, Any], training: bool) -> tuple[tuple[int, ...], list[str]]:
        """Stop strings of one token become stop ids; longer ones cut the text (outside trajectories)."""
        stop = body.get("stop")
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(text, str) and text for text in strings):
            raise RequestError(f"stop={stop!r} is invalid; send a string or a list of strings")
        ids, cut = [], []
        for text in strings:
            encoded = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(encoded) == 1:
                ids.append(encoded[0])
            elif training:
                raise RequestError(f"stop={text!r} is more than one token; a trajectory's calls stop at single "
                                   "tokens only (its sampled tokens are kept whole)")
            else:
                cut.append(text)
        return tuple(ids), cut

    def _sampling(self, body: dict[str, Any], prompt_length: int, stop_ids: tuple[int, ...]) -> SamplingParams:
        room = self.max_model_len - prompt_length
        if room <= 0:
            raise RequestError(f"the prompt has {prompt_length} tokens, at least the model's context of "
                               f"{self.max_model_len}; send a shorter conversation", code="context_length_exceeded")
        max_tokens = _integer(body, "max_completion_tokens", 1) or _integer(body, "max_tokens", 1)
        if max_tokens is not None and max_tokens > room:
            raise RequestError(f"max_tokens={max_tokens} and the prompt's {prompt_length} tokens exceed the model's "
                               f"context of {self.max_model_len}; ask for at most {room}",
                               code="context_length_exceeded")
        return SamplingParams(max_tokens=max_tokens or min(self.default_max_tokens, room),
                              temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                              top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
                              stop_token_ids=tuple(dict.fromkeys((*self.eos_token_ids, *stop_ids))),
                              seed=_integer(body, "seed", 0))

    async def _sample(self, prompt_ids: list[int], sampling: SamplingParams, num_samples: int,
                      request_id: str) -> list[Completion]:
        samplings = [sampling if num_samples == 1 or sampling.seed is None
                     else dataclasses.replace(sampling, seed=sample_seed(sampling.seed, index))
                     for index in range(num_samples)]
        return list(await asyncio.gather(*(self.client.generate(prompt_ids, each, f"{request_id}/{index}")
                                           for index, each in enumerate(samplings))))

    def _text(self, token_ids: list[int], finish_reason: str, cut: list[str]) -> tuple[str, str]:
        ids = token_ids[:-1] if finish_reason == "stop" and token_ids and token_ids[-1] in self.eos_token_ids \
            else token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        positions = [text.find(stop) for stop in cut if stop in text]
        return (text[:min(positions)], "stop") if positions else (text, finish_reason)

    def _log_probs(self, completion: Completion) -> list[dict[str, Any]]:
        entries = []
        for token_id, log_prob in zip(completion.token_ids, completion.log_probs, strict=True):
            token = self.tokenizer.decode([token_id], skip_special_tokens=False)
            entries.append({"token": token, "logprob": float(log_prob), "bytes": list(token.encode()),
                            "top_logprobs": []})
        return entries

    async def chat(self, body: dict[str, Any], session: ChatSession | None) -> dict[str, Any]:
        """A chat.completion body for a chat request body; a trajectory session records the call."""
        if self.codec is None:
            raise RequestError("the served model's tokenizer has no chat template; use /v1/completions or serve "
                               "with --chat-template FILE")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of {role, content} objects")
        messages = [normalize_message(message) for message in messages]
        tools = body.get("tools") or None
        training = isinstance(session, TrajectorySession)
        num_samples = int(_integer(body, "n", 1) or 1)
        if training and num_samples != 1:
            raise RequestError(f"n={num_samples} in a trajectory; a trajectory samples one reply per call")
        stop_ids, cut = self._stop(body, training)
        prompt_ids, continues = self.codec.prompt_ids(session, messages, tools)
        if training:
            sampling = session.turn_sampling(prompt_ids, continues, _integer(body, "max_completion_tokens", 1)
                                             or _integer(body, "max_tokens", 1),
                                             (*self.codec.renderer.stop_ids, *stop_ids))
            request_id = f"{session.request_id}/{len(session.records)}"
        else:
            sampling = self._sampling(body, len(prompt_ids), (*self.codec.renderer.stop_ids, *stop_ids))
            request_id = new_id("chat")
        start = time.perf_counter()
        completions = await self._sample(prompt_ids, sampling, num_samples, request_id)
        self.num_requests += 1
        choices = []
        for index, completion in enumerate(completions):
            reply, calls = self.codec.reply(list(completion.token_ids))
            finish_reason = completion.finish_reason
            if cut:
                reply["content"], finish_reason = self._text(list(completion.token_ids), finish_reason, cut)
                calls = []
                reply.pop("tool_calls", None)
            message = openai_message(reply)
            choice: dict[str, Any] = {"index": index, "message": message,
                                      "finish_reason": "tool_calls" if calls else finish_reason}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": self._log_probs(completion)}
            choices.append(choice)
            if session is not None:
                session.records.append(CallRecord(messages, tools, prompt_ids, list(completion.token_ids),
                                                  list(completion.log_probs), completion.finish_reason, reply,
                                                  continues))
        if training:
            session.generate_seconds += time.perf_counter() - start
        completion_tokens = sum(len(completion.token_ids) for completion in completions)
        return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(), "model": self.model_name,
                "choices": choices, "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                                              "total_tokens": len(prompt_ids) + completion_tokens}}

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """A text_completion body for a completions request body (one prompt: a string or token ids)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(isinstance(token, int) for token in prompt):
            prompt_ids = list(prompt)
        else:
            raise RequestError("'prompt' must be a string or a list of token ids (one prompt per request)")
        stop_ids, cut = self._stop(body, False)
        sampling = self._sampling(body, len(prompt_ids), stop_ids)
        num_samples = int(_integer(body, "n", 1) or 1)
        completions = await self._sample(prompt_ids, sampling, num_samples, new_id("cmpl"))
        self.num_requests += 1
        choices = []
        for index, completion in enumerate(completions):
            text, finish_reason = self._text(list(completion.token_ids), completion.finish_reason, cut)
            choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
            if body.get("logprobs") is not None and body.get("logprobs") is not False:
                entries = self._log_probs(completion)
                offsets, offset = [], 0
                for entry in entries:
                    offsets.append(offset)
                    offset += len(entry["token"])
                choice["logprobs"] = {"tokens": [entry["token"] for entry in entries],
                                      "token_logprobs": [entry["logprob"] for entry in entries],
                                      "top_logprobs": None, "text_offset": offsets}
            choices.append(choice)
        completion_tokens = sum(len(completion.token_ids) for completion in completions)
        return {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": self.model_name,
                "choices": choices, "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                                              "total_tokens": len(prompt_ids) + completion_tokens}}
