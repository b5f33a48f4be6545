"""``reinforge serve``'s endpoint through the official ``openai`` client: chat, tools, stream, n, logprobs,
completions, models, health, back-pressure and errors."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from reinforge.rollout.base import Completion
from reinforge.serve.app import OpenAIEndpoint
from reinforge.serve.chat import ChatCodec, openai_message
from reinforge.serve.service import GenerationService

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")


class Served:
    """An endpoint listening from an event loop of its own thread."""

    def __init__(self, endpoint: OpenAIEndpoint):
        self.endpoint = endpoint
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(endpoint.start(), self.loop).result(30)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.endpoint.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class TextClient:
    """A token client answering every prompt with the ids of a fixed text and the end-of-turn token (cut at
    max_tokens, as an engine cuts)."""

    def __init__(self, tokenizer, text: str, release: asyncio.Event | None = None):
        self.ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        self.release = release

    async def generate(self, prompt_ids, sampling, request_id):
        if self.release is not None:
            await self.release.wait()
        ids = self.ids[:sampling.max_tokens]
        return Completion(ids, [-0.25] * len(ids), "stop" if len(ids) == len(self.ids) else "length")


@pytest.fixture(scope="module")
def tool_tokenizer():
    from reinforge.models.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer

    return build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)


def served_text(tokenizer, text: str, max_concurrency: int = 8, release=None) -> Served:
    service = GenerationService(TextClient(tokenizer, text, release), tokenizer, "scripted", codec=ChatCodec(tokenizer),
                                max_model_len=4096, eos_token_ids=(tokenizer.eos_token_id,))
    return Served(OpenAIEndpoint(service, max_concurrency=max_concurrency))


CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}


def test_a_hermes_tool_call_comes_back_as_openai_tool_calls(tool_tokenizer):
    served = served_text(tool_tokenizer, 'Let me.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n'
                                         '</tool_call>')
    try:
        response = served.client().chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "2+3?"}], tools=[CALC], logprobs=True)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me."
        (call,) = choice.message.tool_calls
        assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expr": "2+3"}
        assert len(choice.logprobs.content) == response.usage.completion_tokens
        stream = served.client().chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "2+3?"}], tools=[CALC], stream=True)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "Let me."
        [with_calls] = [chunk for chunk in chunks if chunk.choices[0].delta.tool_calls]
        assert with_calls.choices[0].delta.tool_calls[0].function.name == "calc"
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        served.close()


def test_tool_calls_are_read_only_when_tools_are_sent_and_a_cut_reply_finishes_with_length(tool_tokenizer):
    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'
    served = served_text(tool_tokenizer, f"Let me.\n{call}\n{call}")
    try:
        client = served.client()
        ask = [{"role": "user", "content": "2+3?"}]
        for options in ({}, {"tools": [CALC], "tool_choice": "none"}):  # the text as sampled, as OpenAI answers
            choice = client.chat.completions.create(model="m", messages=ask, **options).choices[0]
            assert choice.message.content == f"Let me.\n{call}\n{call}" and not choice.message.tool_calls
            assert choice.finish_reason == "stop"
        # the first call whole, the second cut at max_tokens: the reply is cut, not a finished turn of calls
        choice = client.chat.completions.create(model="m", messages=ask, tools=[CALC],
                                                max_tokens=len(f"Let me.\n{call}\n<tool")).choices[0]
        assert choice.finish_reason == "length" and len(choice.message.tool_calls) == 1
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="m", messages=ask, tools=[CALC], tool_choice="required")
        assert refused.value.body["message"].startswith('tool_choice="required" is not supported: the engine samples '
                                                        "freely and cannot force a tool call")
        # parallel_tool_calls=false: at most one call in the turn (both were answered); the rest is unchanged
        assert len(client.chat.completions.create(model="m", messages=ask, tools=[CALC]).choices[0].message
                   .tool_calls) == 2
        choice = client.chat.completions.create(model="m", messages=ask, tools=[CALC],
                                                parallel_tool_calls=False).choices[0]
        assert (len(choice.message.tool_calls), choice.message.content, choice.finish_reason) == (1, "Let me.",
                                                                                                  "tool_calls")
        chunks = list(client.chat.completions.create(model="m", messages=ask, tools=[CALC], parallel_tool_calls=False,
                                                     stream=True))
        assert [len(chunk.choices[0].delta.tool_calls) for chunk in chunks if chunk.choices[0].delta.tool_calls] == [1]
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="m", messages=ask, tools=[CALC], extra_body={"parallel_tool_calls":
                                                                                            "false"})
        assert refused.value.body["message"] == 'parallel_tool_calls="false" is invalid; send true or false'
    finally:
        served.close()


@pytest.mark.parametrize("tool_format, text, content", [
    ("hermes", 'Let me.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>', "Let me."),
    ("hermes", '<think>\nUse <tool_call>.\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n'
               '</tool_call>', "<think>\nUse <tool_call>.\n</think>"),  # the thinking's mention of the tag stays
    ("llama3_json", '{"name": "calc", "parameters": {"expr": "2+3"}}', ""),  # the turn is the call
    ("mistral", 'Let me. [TOOL_CALLS] [{"name": "calc", "arguments": {"expr": "2+3"}}]', "Let me."),
    ("deepseek_v3", 'Let me.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n```json\n'
                    '{"expr": "2+3"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Let me."),
])
def test_each_formats_calls_come_back_as_tool_calls_with_the_text_before_them(tool_tokenizer, tool_format, text,
                                                                             content):
    codec = ChatCodec(tool_tokenizer, tool_format=tool_format)
    reply, _ = codec.reply(tool_tokenizer(text, add_special_tokens=False)["input_ids"] + [tool_tokenizer.eos_token_id])
    assert reply == {"role": "assistant", "content": content,
                     "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expr": "2+3"}}}]}
    generated = openai_message(reply)["tool_calls"][0]["id"]
    assert len(generated) == 9 and generated.isascii() and generated.isalnum()


def test_a_call_id_the_model_wrote_is_the_one_the_reply_gives(tool_tokenizer):
    """Mistral's models write each call's 9-character id, and its template takes a tool result only with that id."""
    codec = ChatCodec(tool_tokenizer, tool_format="mistral")
    text = '[TOOL_CALLS] [{"name": "calc", "arguments": {"expr": "2+3"}, "id": "a1B2c3D4e"}]'
    reply, _ = codec.reply(tool_tokenizer(text, add_special_tokens=False)["input_ids"] + [tool_tokenizer.eos_token_id])
    assert [call["id"] for call in openai_message(reply)["tool_calls"]] == ["a1B2c3D4e"]


class ScriptedReplies:
    """Answers the calls with the given token ids in turn, and notes each prompt."""

    def __init__(self, replies: list[list[int]]):
        self.replies, self.prompts = list(replies), []

    async def generate(self, prompt_ids, sampling, request_id):
        self.prompts.append(list(prompt_ids))
        ids = self.replies.pop(0)
        return Completion(ids, [-0.25] * len(ids), "stop")


@pytest.mark.parametrize("model_id", ["a1B2c3D4e", None])
def test_a_mistral_tool_result_is_rendered_with_its_call_id_served_or_in_a_trajectory(model_id):
    """Mistral's template takes a tool result only with its call's 9-character id: the id the endpoint gave must reach
    it (the result was refused, or a trajectory's next call failed with a 500), and a trajectory's tool turn is the
    one tool_agent appends."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "agent"))
    from family_templates import family_tokenizer

    from reinforge.agent.tool_agent import call_id
    from reinforge.agent.tool_images import tool_message
    from reinforge.agent.tool_parsers import ToolCall
    from reinforge.config.schema import MultiTurnConfig
    from reinforge.rollout.base import SamplingParams
    from reinforge.serve.trajectories import TrajectorySession

    tokenizer = family_tokenizer("mistral-v0.3")
    written = f', "id": "{model_id}"' if model_id else ""
    call = tokenizer(f'[TOOL_CALLS] [{{"name": "calc", "arguments": {{"expr": "2+3"}}{written}}}]',
                     add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    answer = tokenizer("5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    client = ScriptedReplies([call, answer, call, answer, answer])
    codec = ChatCodec(tokenizer, tool_format="mistral")
    service = GenerationService(client, tokenizer, "policy", codec=codec, max_model_len=4096,
                                eos_token_ids=(tokenizer.eos_token_id,))
    served = Served(OpenAIEndpoint(service))
    session = TrajectorySession(SamplingParams(max_tokens=400), MultiTurnConfig())
    served.endpoint.open_trajectory("m", session)
    try:
        for base_url in (served.url + "/v1", served.url + "/t/m/v1"):
            api = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
            messages = [{"role": "user", "content": "2+3?"}]
            reply = api.chat.completions.create(model="m", messages=messages, tools=[CALC]).choices[0].message
            (tool_call,) = reply.tool_calls
            assert len(tool_call.id) == 9 and tool_call.id.isalnum()
            messages += [reply.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": tool_call.id, "content": "5"}]
            assert api.chat.completions.create(model="m", messages=messages, tools=[CALC]).choices[0].message.content \
                == "5"
        first, second = session.records
        assert second.continues == 0
        messages[-1]["tool_call_id"] = "call_1"  # one the template refuses: a 400 with its complaint, not a 500
        with pytest.raises(openai.BadRequestError, match="Tool call IDs should be alphanumeric strings with length 9"):
            api.chat.completions.create(model="m", messages=messages, tools=[CALC])
        result = tool_message("5", (), call_id(ToolCall("calc", id=model_id), 0, 0))
        assert second.prompt_ids == first.prompt_ids + call + codec.renderer.increment([result])
    finally:
        served.close()


def test_stop_strings_cut_the_reply_and_errors_are_one_line_in_openais_format(tool_tokenizer):
    served = served_text(tool_tokenizer, "one two three")
    try:
        client = served.client()
        response = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                  stop=["two"], presence_penalty=0, response_format={"type": "text"})
        assert response.choices[0].message.content == "one " and response.choices[0].finish_reason == "stop"
        completion = client.completions.create(model="m", prompt="count:", logprobs=1, n=2)
        assert [choice.text for choice in completion.choices] == ["one two three"] * 2
        with pytest.raises(openai.BadRequestError, match="suffix=\"end\" is not supported"):  # it was ignored
            client.completions.create(model="m", prompt="count:", suffix="end")
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], temperature=5)
        assert error.value.body["message"] == "temperature=5 is out of range; send a number from 0.0 to 2.0"
        tool_turn = {"role": "assistant", "content": None, "tool_calls": "calc(2)"}
        for options, message in (({"stop": 3}, "stop=3 is invalid"), ({"tools": "calc"}, "tools='calc' is invalid"),
                                 ({"messages": [tool_turn]}, "an assistant message's tool_calls is 'calc(2)'"),
                                 ({"response_format": {"type": "json_object"}}, 'response_format={"type": '
                                  '"json_object"} is not supported: the engine samples without it'),
                                 ({"presence_penalty": 0.5}, "presence_penalty=0.5 is not supported"),
                                 ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
                                  'chat_template_kwargs={"enable_thinking": false} is not supported')):
            with pytest.raises(openai.BadRequestError) as error:  # each was a 500 with a Python traceback's last line
                client.chat.completions.create(**{"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                  **options})
            assert error.value.body["message"].startswith(message), error.value.body
        for stop in ([f"s{index}" for index in range(33)], ["x" * 1001]):  # each was searched at every token
            with pytest.raises(openai.BadRequestError, match=f"stop has {len(stop)} strings, the longest of "
                                                             f"{len(stop[-1])} characters; send at most 32 stop "
                                                             "strings of at most 1000 characters each"):
                client.completions.create(model="m", prompt="x", stop=stop)
        assert client.completions.create(model="m", prompt="x", stop=["t"] * 40 + ["x" * 1000]).choices[0].text == "one "
        sampling = served.endpoint.service._sampling({"top_k": 5, "min_p": 0.1}, 3, ())  # vLLM's extra sampling keys
        assert (sampling.top_k, sampling.min_p) == (5, 0.1)
        assert served.endpoint.service._sampling({"top_k": 10 ** 30}, 3, ()).top_k == -1  # was sent on: a 500
        with pytest.raises(openai.NotFoundError, match="trajectory 'nope' is not open"):
            openai.OpenAI(base_url=served.url + "/t/nope/v1", api_key="none", max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}])
        with urllib.request.urlopen(served.url + "/health") as answer:
            assert json.loads(answer.read())["status"] == "ok"
        assert [model.id for model in client.models.list()] == ["scripted"]
    finally:
        served.close()


def test_unknown_routes_wrong_methods_oversized_bodies_and_non_boolean_flags_are_openai_errors(tool_tokenizer,
                                                                                              monkeypatch):
    import reinforge.serve.app

    monkeypatch.setattr(reinforge.serve.app, "MAX_BODY_BYTES", 1024 * 1024)
    served = served_text(tool_tokenizer, "ok")
    try:
        def answer(method: str, path: str, body: bytes | None = None) -> tuple[int, dict, dict]:
            request = urllib.request.Request(served.url + path, body, {"Content-Type": "application/json"},
                                             method=method)
            try:
                with urllib.request.urlopen(request) as response:
                    return response.status, dict(response.headers), json.loads(response.read())
            except urllib.error.HTTPError as error:
                return error.code, dict(error.headers), json.loads(error.read())  # each was text, or a 500

        status, _, body = answer("GET", "/v1/embeddings")
        assert status == 404 and body["error"]["message"].startswith("there is no route GET /v1/embeddings; this "
                                                                     "server answers POST /v1/chat/completions")
        status, headers, body = answer("GET", "/v1/chat/completions")
        assert status == 405 and headers["Allow"] == "POST"
        assert body["error"]["message"] == "GET /v1/chat/completions is not answered; use POST on this route"
        big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (1024 * 1024)}]}).encode()
        status, _, body = answer("POST", "/v1/chat/completions", big)
        assert status == 413 and body["error"]["message"] == ("the request body is over the server's limit of 1 "
                                                              "MiB; send a shorter conversation")
        host, port = served.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as connection:  # its body is never sent
            connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                               b"\r\nContent-Length: %d\r\n\r\n" % (1 << 30))
            assert connection.recv(65536).startswith(b"HTTP/1.1 413")  # from its Content-Length: 64 MiB were read
        for deep in (b"[" * 100000, b'{"a":' * 50000):  # each was a 500 with a RecursionError
            status, _, body = answer("POST", "/v1/chat/completions", deep)
            assert status == 400 and body["error"]["message"].startswith("the request body nests its JSON too deeply")
        client = served.client()
        for key in ("stream", "logprobs"):  # "false" streamed, as a true value
            with pytest.raises(openai.BadRequestError, match=f'{key}="false" is invalid; send true or false'):
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                               extra_body={key: "false"})
        with pytest.raises(openai.BadRequestError, match='stream_options.include_usage="false" is invalid'):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True,
                                           stream_options={"include_usage": "false"})  # the usage was sent
        assert client.models.retrieve("scripted").id == "scripted"
        with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' is not served here"):
            client.models.retrieve("gpt-4o")
    finally:
        served.close()


def test_bodies_python_cannot_read_or_tokenize_and_parts_of_the_wrong_type_are_400s_not_500s(tool_tokenizer):
    served = served_text(tool_tokenizer, "ok")
    try:
        def answer(path: str, body: bytes, content_type: str = "application/json") -> tuple[int, str]:
            request = urllib.request.Request(served.url + path, body, {"Content-Type": content_type}, method="POST")
            try:
                with urllib.request.urlopen(request) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as error:
                return error.code, json.loads(error.read())["error"]["message"]

        user = b'[{"role": "user", "content": "hi"}]'
        for path, body, content_type, wanted in (
                ("/v1/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "application/json",
                 "the request body holds a number of over 4300 digits"),
                ("/v1/completions", b'{"prompt": "a\\ud800b"}', "application/json",
                 "the request body holds '\\ud800', half of a UTF-16 surrogate pair and no character"),
                ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
                 "application/json", "the request body holds '\\udfff'"),
                ("/v1/completions", b'{"prompt": "x"}', "application/json; charset=no-such-codec",
                 "the request body's charset 'no-such-codec' is not one this server knows"),
                ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
                 "application/json", "a text part's text is 5; send it as a string"),
                ("/v1/chat/completions", b'{"messages": ' + user[:-1] + b', {"role": "assistant", "tool_calls": [{'
                 b'"function": {"name": "calc", "arguments": [1]}}]}, {"role": "user", "content": "x"}]}',
                 "application/json", "tool call arguments [1] are neither a JSON string nor an object")):
            status, message = answer(path, body, content_type)  # each was a 500 (the arguments were taken for {})
            assert status == 400 and message.startswith(wanted), (status, message)
    finally:
        served.close()


def test_requests_past_the_concurrency_limit_are_answered_429_with_retry_after(tool_tokenizer):
    served = served_text(tool_tokenizer, "ok", max_concurrency=1)
    try:
        async def make_release() -> asyncio.Event:
            return asyncio.Event()
        release = asyncio.run_coroutine_threadsafe(make_release(), served.loop).result(10)
        served.endpoint.service.client.release = release
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
        request = urllib.request.Request(served.url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        held = threading.Thread(target=lambda: urllib.request.urlopen(request).read())
        held.start()
        for _ in range(500):
            if served.endpoint.in_flight:
                break
            threading.Event().wait(0.01)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request)
        assert refused.value.code == 429 and refused.value.headers["Retry-After"] == "1"
        assert json.loads(refused.value.read())["error"]["code"] == "rate_limit_exceeded"
        served.loop.call_soon_threadsafe(release.set)
        held.join(10)
        assert served.endpoint.in_flight == 0
    finally:
        served.close()


class HangingClient:
    """A token client whose generation never ends on its own; it notes when it starts and when it is cancelled."""

    def __init__(self):
        self.started, self.cancelled = threading.Event(), threading.Event()

    async def generate(self, prompt_ids, sampling, request_id):
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_cancels_the_generation_it_waits_for(tool_tokenizer, stream):
    import socket

    client = HangingClient()
    service = GenerationService(client, tool_tokenizer, "scripted", codec=ChatCodec(tool_tokenizer),
                                max_model_len=4096, eos_token_ids=(tool_tokenizer.eos_token_id,))
    served = Served(OpenAIEndpoint(service))
    try:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": stream}).encode()
        host, port = served.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n" % len(body) + body)
            assert client.started.wait(10)
        assert client.cancelled.wait(10)
        for _ in range(500):
            if not served.endpoint.in_flight:
                break
            threading.Event().wait(0.01)
        assert served.endpoint.in_flight == 0
    finally:
        served.close()


class ResetClient:
    """A token client whose engine connection resets (an engine's error, not the HTTP client hanging up)."""

    async def generate(self, prompt_ids, sampling, request_id):
        raise ConnectionResetError("the engine's connection was reset")


def test_a_client_gone_while_its_stream_is_written_is_no_server_error_and_an_engines_reset_is_one(
        tool_tokenizer, monkeypatch, caplog):
    """A write to a client that had hung up was logged as a failed request with its traceback (and answered with a
    500 after the stream's 200); an engine's ConnectionResetError was taken for the client hanging up, so the stream
    ended with no error event and no [DONE]."""
    import logging

    from aiohttp import web
    from aiohttp.client_exceptions import ClientConnectionResetError

    writes = []
    write = web.StreamResponse.write

    async def closing_write(self, data):
        writes.append(data)
        if len(writes) == 2 and b"one two" in data:
            raise ClientConnectionResetError("Cannot write to closing transport")
        return await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", closing_write)
    served = served_text(tool_tokenizer, "one two")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}).encode()

    def stream(url: str) -> str:
        request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read().decode()
    try:
        with caplog.at_level(logging.INFO, logger="reinforge.serve.app"):
            assert stream(served.url).count("data: ") == 1  # the role; then the client was gone
        assert [record.message for record in caplog.records if record.name == "reinforge.serve.app"] == [
            "a client hung up mid-stream; its generation is stopped"]
        assert served.endpoint.in_flight == 0
    finally:
        served.close()
    service = GenerationService(ResetClient(), tool_tokenizer, "scripted", codec=ChatCodec(tool_tokenizer),
                                max_model_len=4096, eos_token_ids=(tool_tokenizer.eos_token_id,))
    served = Served(OpenAIEndpoint(service))
    try:
        events = stream(served.url).split("\n\n")
        assert json.loads(events[-3].removeprefix("data: "))["error"]["message"] == (
            "ConnectionResetError: the engine's connection was reset")
        assert events[-2] == "data: [DONE]"
    finally:
        served.close()


def test_serve_on_the_native_engine_samples_as_asked(tiny_model_dir, tmp_path, caplog):
    from reinforge.serve.command import build_client, load_model, resolve_model_folder

    path, adapter = resolve_model_folder(str(tiny_model_dir))
    assert (path, adapter) == (str(tiny_model_dir), None)
    run = tmp_path / "run"
    for step in (1, 2, 3, 4):  # step 4 is not sealed (no manifest), step 3's weights are cut off: served from 2
        shutil.copytree(tiny_model_dir, run / "checkpoints" / f"step_{step}" / "hf")
        if step < 4:
            (run / "checkpoints" / f"step_{step}" / "manifest.json").write_text("{}")
    [weights] = (run / "checkpoints" / "step_3" / "hf").glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:-100])
    assert resolve_model_folder(str(run)) == (str(run / "checkpoints" / "step_2" / "hf"), None)
    assert "skipped step_4: not sealed (its writing was interrupted); step_3: model folder " in caplog.text
    assert "step_3/hf is half-written: model.safetensors holds" in caplog.text
    assert resolve_model_folder(str(run / "checkpoints" / "step_1")) == (str(run / "checkpoints" / "step_1" / "hf"),
                                                                          None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither an HF model folder"):
        resolve_model_folder(str(tmp_path / "empty"))
    # a folder that is not there is named as the argument given (it said "check model.path", a key serve has not)
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path / 'gone'} does not exist .*; pass an HF model folder"):
        resolve_model_folder(str(tmp_path / "gone"))
    assert resolve_model_folder("Qwen/Qwen2.5-0.5B") == ("Qwen/Qwen2.5-0.5B", None)  # a hub id: loading decides
    model, tokenizer = load_model(path, adapter, "float32", torch.device("cpu"))
    client, engine = build_client(model, tokenizer, "native", 256, 0.5, max_num_seqs=16)
    assert engine == "native"
    service = GenerationService(client, tokenizer, "tiny", codec=ChatCodec(tokenizer), max_model_len=256,
                                eos_token_ids=(tokenizer.eos_token_id,))
    served = Served(OpenAIEndpoint(service))
    try:
        api = served.client()
        messages = [{"role": "user", "content": "1+1"}]
        first = api.chat.completions.create(model="tiny", messages=messages, n=2, seed=4, max_tokens=12,
                                            temperature=1.0, top_p=0.9, logprobs=True)
        again = api.chat.completions.create(model="tiny", messages=messages, n=2, seed=4, max_tokens=12,
                                            temperature=1.0, top_p=0.9)
        assert len(first.choices) == 2 and first.usage.completion_tokens <= 24
        assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
        assert all(entry.logprob <= 0 for choice in first.choices for entry in choice.logprobs.content)
        greedy = api.completions.create(model="tiny", prompt="1+1=", max_tokens=8, temperature=0)
        assert greedy.choices[0].finish_reason in ("stop", "length") and greedy.usage.completion_tokens <= 8
        with pytest.raises(openai.BadRequestError, match="exceed the model's context of 256"):
            api.completions.create(model="tiny", prompt="1+1=", max_tokens=400)
    finally:
        served.close()


@pytest.mark.gpu
def test_chat_through_http_reaches_most_of_the_in_process_rate_on_the_gpu(tmp_path):
    """256 concurrent chat requests on the 0.5B shape: at least 80% of the in-process tokens/s."""
    from reinforge.bench.serve import serve_bench_main

    out = tmp_path / "serve.json"
    assert serve_bench_main(["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["num_requests"] == 256
    assert result["http_over_in_process"] >= 0.8, result["rows"]


@pytest.mark.slow
def test_reinforge_serve_answers_the_openai_client_until_interrupted(tiny_model_dir):
    import os
    import signal
    import subprocess

    # started as a script's background job is (and as pytest-xdist's workers are): with SIGINT ignored, which a
    # child inherits; the endpoint still stops on it
    process = subprocess.Popen([sys.executable, "-m", "reinforge", "serve", str(tiny_model_dir), "--port", "0",
                                "--max-model-len", "128"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2])),
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        line = ""
        while "serving" not in line:
            line = process.stdout.readline()
            assert line or process.poll() is None, "reinforge serve exited before serving"
        url = line.split(" at ", 1)[1].split()[0]
        assert "(native engine on cpu, at most 256 requests at once)" in line
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "1+1"}],
                                               max_tokens=5, seed=1)
        assert reply.usage.completion_tokens <= 5 and reply.model == str(tiny_model_dir)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(60)  # the server gives requests in flight 5 s; the rest is the CPU's load
        except subprocess.TimeoutExpired:
            process.kill()
            output = process.communicate()[0]
            pytest.fail(f"reinforge serve did not stop within 60 s of SIGINT; its last output:\n{output[-3000:]}")
        assert code == 130


def test_a_lora_adapter_folder_is_merged_into_the_base_it_names(tiny_model_dir, tmp_path):
    peft = pytest.importorskip("peft")
    from reinforge.models.loading import load_causal_lm
    from reinforge.serve.command import load_model, resolve_model_folder

    base = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device="cpu")
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    for name, parameter in adapted.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would make the adapter a no-op
            parameter.data.normal_(0, 0.5)
    adapted.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[5, 9, 40, 41, 42]])
    with torch.no_grad():
        expected = adapted(ids).logits
    assert resolve_model_folder(str(tmp_path / "adapter")) == (str(tiny_model_dir), str(tmp_path / "adapter"))
    merged, _ = load_model(str(tiny_model_dir), str(tmp_path / "adapter"), "float32", torch.device("cpu"))
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_a_failed_request_leaves_the_native_engine_serving_the_next(tiny_model_dir, monkeypatch):
    """A step that fails drops its sequences with its requests: the next request runs on a new scheduler. A prompt
    outside the vocabulary is refused before it reaches a step."""
    from reinforge.rollout.base import SamplingParams
    from reinforge.serve.command import build_client, load_model

    model, tokenizer = load_model(str(tiny_model_dir), None, "float32", torch.device("cpu"))
    client, name = build_client(model, tokenizer, "native", 96, 0.5, 8)
    assert name == "native"
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    runner = client.engine.runner
    prefill = runner.prefill

    def failing_prefill(seqs):
        monkeypatch.setattr(runner, "prefill", prefill)  # the first step fails, the later ones run
        raise IndexError("index out of range in self")

    monkeypatch.setattr(runner, "prefill", failing_prefill)

    async def calls():
        with pytest.raises(IndexError):
            await client.generate([5, 6], greedy, "bad")
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            await client.generate([5, 10 ** 6], greedy, "out of the vocabulary")
        return [(await client.generate(prompt, greedy, f"good-{index}")).token_ids
                for index, prompt in enumerate(([5, 6], [7, 8]))]

    first, second = asyncio.run(calls())
    assert len(first) == len(second) == 3


def test_prompts_out_of_the_vocabulary_top_logprobs_out_of_range_and_image_parts_are_answered_as_openai_does(tool_tokenizer):
    service = GenerationService(TextClient(tool_tokenizer, "H7ab"), tool_tokenizer, "scripted",
                                codec=ChatCodec(tool_tokenizer), max_model_len=4096,
                                eos_token_ids=(tool_tokenizer.eos_token_id,), vocab_size=len(tool_tokenizer))
    served = Served(OpenAIEndpoint(service))
    try:
        client = served.client()
        for prompt, wanted in (([5, 10 ** 6], "outside the model's vocabulary"), ("", "'prompt' is empty")):
            with pytest.raises(openai.BadRequestError, match=wanted):
                client.completions.create(model="x", prompt=prompt, max_tokens=3)
        for options, wanted in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs=21 is out of range"),
                                ({"top_logprobs": 3}, "top_logprobs=3 without logprobs=true")):
            with pytest.raises(openai.BadRequestError, match=wanted):
                client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], **options)
        with pytest.raises(openai.BadRequestError, match="logprobs=21 is out of range"):
            client.completions.create(model="x", prompt="hi", logprobs=21)
        picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        with pytest.raises(openai.BadRequestError, match="content part of type 'image_url' is not supported: this "
                                                         "endpoint passes the model text alone"):
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": [
                picture, {"type": "text", "text": "What is in the picture?"}]}])
        reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": [
            {"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}])
        assert reply.choices[0].message.content == "H7ab"
    finally:
        served.close()


class CountingClient(TextClient):
    """A ``TextClient`` that counts the samples it is asked for."""

    def __init__(self, tokenizer, text: str):
        super().__init__(tokenizer, text)
        self.calls = 0

    async def generate(self, prompt_ids, sampling, request_id):
        self.calls += 1
        return await super().generate(prompt_ids, sampling, request_id)


def test_n_is_an_integer_from_1_to_the_servers_limit(tool_tokenizer):
    """n=100000 was sampled: 100,000 sequences for one request, the server's memory gone."""
    client_ = CountingClient(tool_tokenizer, "ok")
    service = GenerationService(client_, tool_tokenizer, "scripted", codec=ChatCodec(tool_tokenizer),
                                max_model_len=4096, eos_token_ids=(tool_tokenizer.eos_token_id,), max_n=4)
    served = Served(OpenAIEndpoint(service))
    try:
        client = served.client()
        chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        for create, request in ((client.chat.completions.create, chat),
                                (client.completions.create, {"model": "m", "prompt": "x"})):
            with pytest.raises(openai.BadRequestError) as error:
                create(**request, n=100000)
            assert error.value.body["message"] == ("n=100000 is over this server's limit of 4 choices per request "
                                                   "(reinforge serve --max-n); send n from 1 to 4")
            assert error.value.body["param"] == "n"
            for value in (0, -3, 1.5, "2", True):
                with pytest.raises(openai.BadRequestError) as error:
                    create(**request, extra_body={"n": value})
                assert error.value.body["message"].startswith(f"n={json.dumps(value)} is invalid; send an integer "
                                                              "from 1 to 4"), error.value.body
            with pytest.raises(openai.BadRequestError, match="over this server's limit"):
                create(**request, n=5, stream=True)
        assert client_.calls == 0
        assert len(client.chat.completions.create(**chat, n=4).choices) == 4
    finally:
        served.close()


class StopAtClient:
    """Samples the ids of ``text`` and stops at the first of the request's stop ids, as an engine does."""

    def __init__(self, tokenizer, text: str):
        self.ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])

    async def generate(self, prompt_ids, sampling, request_id):
        for end, token in enumerate(self.ids):
            if token in sampling.stop_token_ids:
                return Completion(self.ids[:end + 1], [-0.25] * (end + 1), "stop")
        return Completion(self.ids, [-0.25] * len(self.ids), "length")


def test_a_stop_string_of_one_token_is_not_part_of_the_reply(tool_tokenizer):
    service = GenerationService(StopAtClient(tool_tokenizer, "H7abc"), tool_tokenizer, "scripted",
                                codec=ChatCodec(tool_tokenizer), max_model_len=4096,
                                eos_token_ids=(tool_tokenizer.eos_token_id,))
    served = Served(OpenAIEndpoint(service))
    try:
        client = served.client()
        reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], stop=["7"])
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("H", "stop")
        streamed = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                                  stop=["7"], stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == "H"
        text = client.completions.create(model="x", prompt="hi", stop=["a"], max_tokens=8)
        assert (text.choices[0].text, text.choices[0].finish_reason) == ("H7", "stop")
    finally:
        served.close()


def test_the_service_and_the_engine_end_replies_at_the_same_tokens(tiny_model_dir):
    """The generation config's EOS ids (Gemma's <end_of_turn>, Llama 3's <|eot_id|>) end a reply and leave its text,
    as the tokenizer's EOS does."""
    from reinforge.serve.command import eos_token_ids, load_model

    model, tokenizer = load_model(str(tiny_model_dir), None, "float32", torch.device("cpu"))
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 7]
    assert eos_token_ids(model, tokenizer) == sorted({tokenizer.eos_token_id, 7})


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_stop_string_ends_generation_at_the_token_that_completes_it(tiny_model_dir, backend):
    """As OpenAI and vLLM stop: the engine stops at the token whose text completes a stop string (here "Ұ", the two
    byte tokens 0xD2 0xB0, after a lone 0xCD), so the usage, and a trajectory's ids and log-probs, end there; the text
    ends before it."""
    from reinforge.config.schema import MultiTurnConfig
    from reinforge.rollout.base import SamplingParams
    from reinforge.serve.command import build_client, load_model
    from reinforge.serve.trajectories import TrajectorySession

    model, tokenizer = load_model(str(tiny_model_dir), None, "float32", torch.device("cpu"))
    client, name = build_client(model, tokenizer, backend, 128, 0.5, 8)
    assert name == backend
    service = GenerationService(client, tokenizer, "tiny", codec=ChatCodec(tokenizer), max_model_len=128,
                                eos_token_ids=(tokenizer.eos_token_id,))
    request = {"prompt": "1+1=", "max_tokens": 16, "temperature": 1.0, "seed": 3}
    free = asyncio.run(service.complete(request))
    assert free["usage"]["completion_tokens"] == 16 and "Ұ" in free["choices"][0]["text"]
    stopped = asyncio.run(service.complete(dict(request, stop=["Ұ", "never"], logprobs=0)))
    choice = stopped["choices"][0]
    assert stopped["usage"]["completion_tokens"] == len(choice["logprobs"]["tokens"]) == 11  # was 16
    assert (choice["text"], choice["finish_reason"]) == (free["choices"][0]["text"].split("Ұ")[0], "stop")

    session = None

    def turn(stop: list[str] | None) -> tuple[dict, list[int], list[float]]:
        nonlocal session
        session = TrajectorySession(SamplingParams(max_tokens=64, temperature=1.0, seed=5), MultiTurnConfig())
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, **({"stop": stop} if stop else {})}
        answer = asyncio.run(service.chat(body, session))  # a multi-token stop string was refused here
        return answer, session.records[0].token_ids, session.records[0].log_probs

    whole, ids, log_probs = turn(None)
    text = whole["choices"][0]["message"]["content"]
    stop = next(text[at:at + 2] for at in range(1, len(text) - 2) if text[at:at + 2].isprintable()
                and "\ufffd" not in text[at:at + 2] and text.find(text[at:at + 2]) == at)
    cut, cut_ids, cut_log_probs = turn([stop])
    end = next(size for size in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:size]))
    assert cut_ids == ids[:end] and cut_log_probs == pytest.approx(log_probs[:end], abs=1e-5)
    assert (cut["choices"][0]["message"]["content"], cut["choices"][0]["finish_reason"]) == (text[:text.find(stop)],
                                                                                            "stop")
    assert cut["usage"]["completion_tokens"] == end < len(ids)
    reply = cut["choices"][0]["message"]
    asyncio.run(service.chat({"messages": [{"role": "user", "content": "hi"}, reply, {"role": "user", "content": "go"}],
                              "max_tokens": 2}, session))
    first, second = session.records
    assert second.continues == 0 and second.prompt_ids[:len(first.prompt_ids) + end] == first.prompt_ids + cut_ids


def test_a_tokens_logprobs_bytes_are_its_own_even_when_it_is_one_byte_of_a_character(tool_tokenizer, tiny_model_dir):
    """Each byte-level token of "é" and "€" is one byte of it: its bytes are that byte, not the replacement
    character's (EF BF BD); special tokens are the UTF-8 of their text."""
    from reinforge.models.loading import load_tokenizer
    from reinforge.serve.logprobs import TokenBytes

    service = GenerationService(TextClient(tool_tokenizer, "aé€"), tool_tokenizer, "scripted",
                                codec=ChatCodec(tool_tokenizer), max_model_len=4096,
                                eos_token_ids=(tool_tokenizer.eos_token_id,))
    answer = asyncio.run(service.chat({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, None))
    entries = answer["choices"][0]["logprobs"]["content"]
    assert [entry["bytes"] for entry in entries] == [[97], [0xC3], [0xA9], [0xE2], [0x82], [0xAC],
                                                     list(tool_tokenizer.eos_token.encode())]
    assert bytes(byte for entry in entries[:-1] for byte in entry["bytes"]).decode() == "aé€"
    loaded = load_tokenizer(str(tiny_model_dir))  # as `reinforge serve` loads it
    assert [TokenBytes(loaded)(token_id) for token_id in loaded("é\n", add_special_tokens=False)["input_ids"]] == [
        b"\xc3", b"\xa9", b"\n"]


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_top_logprobs_are_the_likeliest_tokens_of_the_distribution_each_token_was_sampled_from(tiny_model_dir, backend):
    """Chat's top_logprobs=k and completions' logprobs=k: each sampled token's k likeliest tokens under
    softmax(logits / temperature), the distribution its own logprob is of, most likely first, with their bytes;
    streamed as a request without stream gets them."""
    from reinforge.serve.command import build_client, load_model

    model, tokenizer = load_model(str(tiny_model_dir), None, "float32", torch.device("cpu"))
    client, _ = build_client(model, tokenizer, backend, 128, 0.5, 8)
    service = GenerationService(client, tokenizer, "tiny", codec=ChatCodec(tokenizer), max_model_len=128,
                                eos_token_ids=(tokenizer.eos_token_id,))
    served = Served(OpenAIEndpoint(service))
    try:
        api = served.client()
        request = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0.7,
                       seed=2, logprobs=True, top_logprobs=3)
        reply = api.chat.completions.create(**request)
        streamed = list(api.chat.completions.create(**request, stream=True))
        text = api.completions.create(model="tiny", prompt="1+1=", max_tokens=4, temperature=0.7, seed=2, logprobs=2)
    finally:
        served.close()
    entries = reply.choices[0].logprobs.content
    ids = client_ids(service, request)  # seeded: the reply's ids
    prompt = service.codec.render([{"role": "user", "content": "hi"}], None)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits / 0.7, dim=-1).topk(3)
    assert [[alternative.token for alternative in entry.top_logprobs] for entry in entries] == [
        [tokenizer.decode([token_id]) for token_id in row] for row in expected.indices.tolist()]
    assert [alternative.logprob for entry in entries for alternative in entry.top_logprobs] == pytest.approx(
        expected.values.flatten().tolist(), abs=1e-5)
    assert [alternative.bytes for alternative in entries[0].top_logprobs] == [
        list(service.token_bytes(token_id)) for token_id in expected.indices[0].tolist()]
    for entry in entries:  # the sampled token's logprob is of the same distribution as its alternatives'
        assert all(abs(alternative.logprob - entry.logprob) < 1e-5 for alternative in entry.top_logprobs
                   if alternative.bytes == entry.bytes)
    chunks = [entry for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for entry in chunk.choices[0].logprobs.content]
    assert [entry.model_dump() for entry in chunks] == [entry.model_dump() for entry in entries]
    tops = text.choices[0].logprobs.top_logprobs
    assert len(tops) == 4 and all(1 <= len(top) <= 3 for top in tops)
    assert all(top[token] == logprob for top, token, logprob in zip(tops, text.choices[0].logprobs.tokens,
                                                                    text.choices[0].logprobs.token_logprobs,
                                                                    strict=True))


def client_ids(service: GenerationService, request: dict) -> list[int]:
    """The ids the service's client samples for a chat request (its prompt as the codec renders it)."""
    call = service._chat_call(dict(request), None)
    return asyncio.run(service._sample(call.prompt_ids, call.sampling, 1, "check"))[0].token_ids


def test_a_stopped_server_ends_the_hf_backends_call_under_way_at_its_next_token(tiny_model_dir):
    """Ctrl-C raises KeyboardInterrupt out of the event loop (``reinforge.stop_signals``); the loop's shutdown cancels
    the request and the batch's flusher, which interrupts the hf backend's generate call: the server is gone within
    a token or two, with no thread left generating and no reply sent, where the call would take 10 s to its end."""
    import time
    import urllib.request

    from reinforge.agent.runner import BatchingClient
    from reinforge.rollout.hf import HFEngine
    from reinforge.serve.command import load_model

    model, tokenizer = load_model(str(tiny_model_dir), None, "float32", torch.device("cpu"))
    generating, forwards = threading.Event(), []

    def slow_forward(module, args, output):  # 50 tokens of 0.2 s: 10 s, as no token ends the reply
        generating.set()
        forwards.append(time.monotonic())
        time.sleep(0.2)
        output.logits[..., tokenizer.eos_token_id] = float("-inf")
        return output

    model.register_forward_hook(slow_forward)
    client = BatchingClient(HFEngine(model, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_ids=[tokenizer.eos_token_id], tokenizer=tokenizer))
    service = GenerationService(client, tokenizer, "tiny", codec=ChatCodec(tokenizer), max_model_len=128,
                                eos_token_ids=(tokenizer.eos_token_id,))
    endpoint, replies = OpenAIEndpoint(service), []

    def ask(url: str) -> None:
        body = json.dumps({"prompt": "1+1=", "max_tokens": 50, "seed": 1}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                replies.append(response.read())
        except Exception as error:  # noqa: BLE001 - the server went away mid-request
            replies.append(error)

    def interrupt() -> None:
        raise KeyboardInterrupt

    async def serve() -> None:  # as serve_main serves
        asker = threading.Thread(target=ask, args=(await endpoint.start(),), daemon=True)
        asker.start()
        assert await asyncio.to_thread(generating.wait, 10)
        asyncio.get_running_loop().call_soon(interrupt)
        try:
            await asyncio.Event().wait()
        finally:
            await endpoint.close()

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(serve())
    stopped = time.monotonic()
    assert stopped - forwards[0] < 3, f"the server took {stopped - forwards[0]:.1f} s to stop"
    assert forwards[-1] < stopped and len(forwards) < 10
    time.sleep(0.3)
    assert forwards[-1] < stopped, "a thread still generates after the server stopped"
    assert started < forwards[0]
    for _ in range(100):
        if replies:
            break
        time.sleep(0.05)
    assert len(replies) == 1 and isinstance(replies[0], Exception), "no reply, whole or cut, reaches the client"


@pytest.mark.parametrize("flag, value, wanted", [
    ("--max-tokens", "0", "--max-tokens 0: a request without max_tokens could sample nothing"),
    ("--max-n", "0", "--max-n 0: every request asks for at least 1 choice"),
    ("--max-logprob-entries", "0", "--max-logprob-entries 0: a request with logprobs holds at least 1 entry"),
    ("--max-model-len", "-5", "--max-model-len -5: a prompt and its reply need at least 2 tokens"),
    ("--gpu-memory-utilization", "5", "--gpu-memory-utilization 5.0: give a fraction"),
    ("--port", "70000", "--port 70000: give a TCP port"),
])
def test_serve_settings_no_request_could_use_are_refused_before_the_model_loads(tmp_path, flag, value, wanted):
    """Each was taken: the model loaded, then every request without max_tokens failed with a 500 (or the engine
    failed to start)."""
    from reinforge.serve.command import serve_main

    with pytest.raises(ValueError, match="^" + wanted):
        serve_main([str(tmp_path / "no_model_here"), flag, value])


def test_a_port_another_server_holds_is_refused_before_the_model_loads(tmp_path):
    """The port is checked before the model loads, not when the server starts listening."""
    import socket

    from reinforge.serve.command import serve_main

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with pytest.raises(ValueError, match=f"^--port {port}: 127.0.0.1:{port} cannot be listened on .*another --port"):
            serve_main([str(tmp_path / "no_model_here"), "--host", "127.0.0.1", "--port", str(port)])


class SeedRecordingClient(TextClient):
    """A ``TextClient`` that keeps the seed of each sample it is asked for."""

    def __init__(self, tokenizer, text: str):
        super().__init__(tokenizer, text)
        self.seeds: list[int | None] = []

    async def generate(self, prompt_ids, sampling, request_id):
        self.seeds.append(sampling.seed)
        return await super().generate(prompt_ids, sampling, request_id)


def test_any_signed_64_bit_seed_is_taken_and_one_past_it_is_named(tool_tokenizer):
    """A negative seed was refused with a 400; OpenAI and vLLM take any 64-bit integer."""
    recording = SeedRecordingClient(tool_tokenizer, "ok")
    service = GenerationService(recording, tool_tokenizer, "scripted", codec=ChatCodec(tool_tokenizer),
                                max_model_len=4096, eos_token_ids=(tool_tokenizer.eos_token_id,))
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for seed in (-1, -(1 << 63), (1 << 63) - 1, 0):
        asyncio.run(service.chat(dict(chat, seed=seed), None))
        asyncio.run(service.complete({"prompt": "x", "max_tokens": 2, "seed": seed}))
    assert recording.seeds == [(1 << 64) - 1] * 2 + [1 << 63] * 2 + [(1 << 63) - 1] * 2 + [0] * 2
    asyncio.run(service.chat(dict(chat, seed=-1, n=2), None))  # each choice a seed of its own, as for any seed
    assert len(set(recording.seeds[-2:])) == 2 and all(0 <= seed < 1 << 64 for seed in recording.seeds)
    for seed in (1 << 63, -(1 << 63) - 1, 1.5, "3", True):
        with pytest.raises(ValueError, match=r"seed=.* is invalid; send an integer from -9223372036854775808 to "
                                             "9223372036854775807"):
            asyncio.run(service.chat(dict(chat, seed=seed), None))


def test_logprobs_of_more_entries_than_one_response_may_hold_are_a_400_naming_the_limit_and_its_flag(tool_tokenizer):
    """n=128 with top_logprobs=20 over long replies built tens of millions of entries for one response."""
    recording = CountingClient(tool_tokenizer, "ok")
    service = GenerationService(recording, tool_tokenizer, "scripted", codec=ChatCodec(tool_tokenizer),
                                max_model_len=4096, eos_token_ids=(tool_tokenizer.eos_token_id,),
                                max_logprob_entries=1000)
    chat = {"messages": [{"role": "user", "content": "x"}], "n": 8, "max_tokens": 100, "logprobs": True,
            "top_logprobs": 2}
    refusals = [lambda: service.chat(chat, None), lambda: service.chat_stream(chat, None),
                lambda: service.complete({"prompt": "x", "n": 8, "max_tokens": 100, "logprobs": 2}),
                lambda: service.chat(dict(chat, max_tokens=None), None)]  # the server's default max_tokens counts
    for refused in refusals:
        with pytest.raises(ValueError, match=r"^n=8 choices of up to max_tokens=\d+ tokens with 2 alternatives each "
                                             r"are up to \d+ logprob entries, over this server's limit of 1000 per "
                                             r"response \(reinforge serve --max-logprob-entries\)") as error:
            result = refused()
            if asyncio.iscoroutine(result):
                asyncio.run(result)
        assert error.value.param == "logprobs"
    assert recording.calls == 0
    # within the limit, or without logprobs, the request is answered
    assert len(asyncio.run(service.chat(dict(chat, max_tokens=40), None))["choices"]) == 8
    assert len(asyncio.run(service.chat(dict(chat, logprobs=False, top_logprobs=None), None))["choices"]) == 8


class OneChoiceFailsClient:
    """Fails the request's second choice at once; the first waits to be sampled until it is cancelled."""

    def __init__(self):
        self.cancelled = 0

    async def generate(self, prompt_ids, sampling, request_id):
        if request_id.endswith("/1"):
            raise RuntimeError("the engine failed this choice")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def test_a_failed_choice_stops_the_requests_other_choices(tool_tokenizer):
    """The other choices went on sampling to max_tokens for a request already answered 500."""
    failing = OneChoiceFailsClient()
    service = GenerationService(failing, tool_tokenizer, "scripted", codec=ChatCodec(tool_tokenizer),
                                max_model_len=4096, eos_token_ids=(tool_tokenizer.eos_token_id,))

    async def call():
        with pytest.raises(RuntimeError, match="the engine failed this choice"):
            await service.complete({"prompt": "x", "n": 2})
        for _ in range(3):  # the cancellation reaches the waiting choice
            await asyncio.sleep(0)
        assert failing.cancelled == 1  # here: the end of asyncio.run would cancel it anyway

    asyncio.run(call())
