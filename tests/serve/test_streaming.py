"""``stream: true`` through the official ``openai`` client: tokens arrive as the engine samples them, and the deltas
add up to the reply a request without streaming gets (content, tool calls, stop strings, logprobs, usage)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from reinforge.rollout.base import Completion
from reinforge.serve.app import OpenAIEndpoint
from reinforge.serve.chat import ChatCodec
from reinforge.serve.service import GenerationService
from reinforge.serve.streaming import ReplyText, last_of, tail_of_sequence

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from tests.serve.test_serve import CALC, Served  # noqa: E402


class TokenByTokenClient:
    """Answers every prompt with the ids of a fixed text and the end-of-turn token, handing each token over as it is
    'sampled' (with a pause between tokens, so the chunks go out one by one)."""

    def __init__(self, tokenizer, text: str):
        self.ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]

    async def generate(self, prompt_ids, sampling, request_id):
        return Completion(self.ids, [-0.5] * len(self.ids), "stop")

    async def generate_streamed(self, prompt_ids, sampling, request_id, on_token):
        for token_id in self.ids:
            await asyncio.sleep(0.001)
            on_token(token_id, -0.5, None)
        return await self.generate(prompt_ids, sampling, request_id)


@pytest.fixture(scope="module")
def tool_tokenizer():
    from reinforge.models.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer

    return build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)


def served_streaming(tokenizer, text: str) -> Served:
    service = GenerationService(TokenByTokenClient(tokenizer, text), tokenizer, "scripted", codec=ChatCodec(tokenizer),
                                max_model_len=4096, eos_token_ids=(tokenizer.eos_token_id,))
    return Served(OpenAIEndpoint(service))


def content_of(chunks) -> str:
    return "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)


@pytest.fixture(scope="module")
def native(tiny_model_dir):
    """The tiny model served on the native engine on the CPU."""
    from reinforge.serve.command import build_client, load_model

    model, tokenizer = load_model(str(tiny_model_dir), None, "float32", torch.device("cpu"))
    client, engine = build_client(model, tokenizer, "native", 256, 0.5, max_num_seqs=16)
    assert engine == "native"
    service = GenerationService(client, tokenizer, "tiny", codec=ChatCodec(tokenizer), max_model_len=256,
                                eos_token_ids=(tokenizer.eos_token_id,))
    served = Served(OpenAIEndpoint(service))
    yield served
    served.close()


def test_a_chat_stream_on_the_native_engine_sends_the_tokens_as_sampled_and_adds_up_to_the_reply(native):
    api = native.client()
    request = dict(model="tiny", messages=[{"role": "user", "content": "1+1"}], seed=7, max_tokens=24,
                   temperature=1.0, n=2, logprobs=True)
    whole = api.chat.completions.create(**request)
    chunks = list(api.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    for index, choice in enumerate(whole.choices):
        mine = [chunk.choices[0] for chunk in chunks if chunk.choices and chunk.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(part.delta.content or "" for part in mine) == choice.message.content
        assert sum(bool(part.delta.content) for part in mine) > 1  # one chunk per token, not the reply at once
        assert [part.finish_reason for part in mine if part.finish_reason] == [choice.finish_reason]
        streamed = [entry for part in mine if part.logprobs for entry in part.logprobs.content]
        assert [(entry.token, entry.logprob) for entry in streamed] == [
            (entry.token, pytest.approx(entry.logprob, abs=1e-6)) for entry in choice.logprobs.content]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_a_completions_stream_on_the_native_engine_adds_up_to_the_text(native):
    api = native.client()
    request = dict(model="tiny", prompt="1+1=", seed=3, max_tokens=16, temperature=1.0, logprobs=1)
    whole = api.completions.create(**request)
    chunks = list(api.completions.create(**request, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert sum(bool(chunk.choices[0].text) for chunk in chunks) > 1
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    tokens = [token for chunk in chunks if chunk.choices[0].logprobs for token in chunk.choices[0].logprobs.tokens]
    offsets = [offset for chunk in chunks if chunk.choices[0].logprobs
               for offset in chunk.choices[0].logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens and offsets == whole.choices[0].logprobs.text_offset


def test_a_streamed_tool_call_sends_the_content_before_it_then_the_call_then_tool_calls_as_finish(tool_tokenizer):
    served = served_streaming(tool_tokenizer, 'Let me.  \n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}'
                                              '\n</tool_call>')
    try:
        chunks = list(served.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "2+3?"}], tools=[CALC], stream=True))
    finally:
        served.close()
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert [delta.content for delta in deltas if delta.content] == ["L", "e", "t", " m", "e", "."]  # a space waits
    [with_calls] = [delta for delta in deltas if delta.tool_calls]
    assert with_calls.tool_calls[0].index == 0 and len(with_calls.tool_calls[0].id) == 9
    assert json.loads(with_calls.tool_calls[0].function.arguments) == {"expr": "2+3"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_stream_cut_at_a_stop_string_sends_no_part_of_it(tool_tokenizer):
    served = served_streaming(tool_tokenizer, "one two three")
    try:
        client = served.client()
        chat = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                   stop=["two"], stream=True))
        text = list(client.completions.create(model="m", prompt="count:", stop=["thr"], stream=True))
        with pytest.raises(openai.BadRequestError, match="stream_options=3 is invalid"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True,
                                           stream_options=3)
        for create, request in ((client.chat.completions.create, {"messages": [{"role": "user", "content": "x"}]}),
                                (client.completions.create, {"prompt": "count:"})):
            with pytest.raises(openai.BadRequestError, match="stream_options is only allowed with stream: true"):
                create(model="m", stream_options={"include_usage": True}, **request)
    finally:
        served.close()
    assert content_of(chat) == "one " and chat[-1].choices[0].finish_reason == "stop"
    assert "".join(chunk.choices[0].text for chunk in text) == "one two "


def test_reply_text_holds_back_what_the_end_of_the_reply_may_take_away():
    ending = tail_of_sequence([7, 8])
    assert ending([1, 2, 7]) == [1, 2] and ending([1, 7, 8]) == [1] and ending([1, 8]) == [1, 8]
    assert last_of((9,))([1, 9]) == [1] and last_of((9,))([9, 1]) == [9, 1]

    def streamed(text: str, cut: list[str], tool_call_opening: str | None) -> list[str]:
        reply = ReplyText(lambda ids: "".join(map(chr, ids)), lambda ids: ids, cut, tool_call_opening)
        return [reply.add(ord(character)) for character in text]

    assert streamed("ab st", ["stop"], None) == ["a", "b", " ", "", ""]  # "st" may begin "stop"
    assert streamed("ab  <tool", [], "<tool_call>") == ["a", "b", "", "", "", "", "", "", ""]
    assert streamed("a <b", [], "<tool_call>") == ["a", "", "", " <b"]
    assert streamed("a [TOOL", [], "[TOOL_CALLS]") == ["a", "", "", "", "", "", ""]  # Mistral's marker
    reply = ReplyText(lambda ids: "".join(map(chr, ids)) + "\ufffd", lambda ids: ids, [], None)
    assert reply.add(ord("x")) == "x"  # an incomplete character at the end waits for its next bytes
    assert reply.finish("xy") == "y"


def test_the_engine_hands_a_streamed_requests_tokens_over_as_it_samples_them_and_leaves_others_alone():
    """generate_async's on_token: each sample's tokens, log-probs and asked-for alternatives (the top log-probs of
    the tempered distribution each was sampled from), in order, on the event loop, before the completions; a request
    without either, sampled in the same steps, is what it is alone."""
    import threading

    from reinforge.models.tiny import build_tiny_causal_lm
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.native import NativeEngine

    model = build_tiny_causal_lm(vocab_size=128, seed=5).eval()
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=4, max_num_seqs=8, num_kv_blocks=64)
    streamed_request = GenerationRequest([5, 9, 40, 41], SamplingParams(n=2, max_tokens=9, temperature=0.7, seed=3,
                                                                        num_top_log_probs=3))
    plain_request = GenerationRequest([7, 8, 9], SamplingParams(max_tokens=6, temperature=1.0, seed=4))
    tokens: dict[int, list[tuple[int, float, list]]] = {0: [], 1: []}
    threads = set()

    def on_token(sample_index: int, token_id: int, log_prob: float, top_log_probs: list | None) -> None:
        threads.add(threading.current_thread())
        tokens[sample_index].append((token_id, log_prob, top_log_probs))

    async def main():
        return await asyncio.gather(engine.generate_async(streamed_request, on_token),
                                    engine.generate_async(plain_request))

    streamed, plain = asyncio.run(main())
    assert threads == {threading.main_thread()}
    for index, completion in enumerate(streamed):
        assert [token for token, *_ in tokens[index]] == completion.token_ids and len(completion.token_ids) == 9
        assert [log_prob for _, log_prob, _ in tokens[index]] == pytest.approx(completion.log_probs)
        assert [top for *_, top in tokens[index]] == completion.top_log_probs
        with torch.no_grad():
            logits = model(torch.tensor([[5, 9, 40, 41, *completion.token_ids]])).logits[0, 3:-1].float()
        expected = torch.log_softmax(logits / 0.7, dim=-1).topk(3)
        assert [[token for token, _ in top] for top in completion.top_log_probs] == expected.indices.tolist()
        assert [value for top in completion.top_log_probs for _, value in top] == pytest.approx(
            expected.values.flatten().tolist(), abs=1e-5)
    [alone] = engine.generate([plain_request])[0]
    assert plain[0].token_ids == alone.token_ids and plain[0].log_probs == pytest.approx(alone.log_probs, abs=1e-5)
    assert plain[0].top_log_probs is None
    assert engine._streams == {}


def sentencepiece_tokenizer():
    """A Llama 2 / Mistral style tokenizer (transformers' LlamaTokenizer: "▁" marks a space, byte fallback, the
    decoder strips the space at the start of a text) over a few words, with a Mistral-like chat template."""
    from transformers import LlamaTokenizer

    words = ["The", "capital", "of", "France", "is", "Paris", "nice"]
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), "▁", *(f"▁{word}" for word in words),
              *"abcdefghijklmnopqrstuvwxyzCFPT.,"]
    tokenizer = LlamaTokenizer(vocab={piece: index for index, piece in enumerate(dict.fromkeys(pieces))}, merges=[])
    tokenizer.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} "
                               "[/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
    return tokenizer


@pytest.mark.parametrize("pieces", [["▁Paris", "▁is", "▁nice", "."], ["▁", "▁Paris", "▁is", "<0xC3>", "<0xA9>"]])
def test_a_sentencepiece_reply_keeps_its_spaces_streamed_or_not_and_a_completion_continues_its_prompt(pieces):
    """A SentencePiece tokenizer drops the space "▁" marks at the start of a decoded text: a completion decoded alone
    lost the space between its prompt and itself, and each logprobs token ("▁is" read "is") lost its own, so the
    tokens did not add up to the text."""
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(pieces) + [tokenizer.eos_token_id]
    service = GenerationService(TokenByTokenClient(tokenizer, ""), tokenizer, "scripted", codec=ChatCodec(tokenizer),
                                max_model_len=4096, eos_token_ids=(tokenizer.eos_token_id,))
    service.client.ids = ids

    async def answers(body: dict, whole, streamed) -> tuple[dict, list[dict]]:
        return await whole(dict(body)), [chunk async for chunk in streamed(dict(body))]

    prompt = "The capital of France is"
    whole, chunks = asyncio.run(answers({"prompt": prompt, "logprobs": 0}, service.complete, service.complete_stream))
    prompt_ids = tokenizer(prompt)["input_ids"]
    text = tokenizer.decode(prompt_ids + ids[:-1], skip_special_tokens=True)[len(prompt):]  # what the prompt continues
    assert text.startswith(" ") and whole["choices"][0]["text"] == text
    assert "".join(choice["text"] for chunk in chunks for choice in chunk["choices"]) == text
    log_probs = whole["choices"][0]["logprobs"]
    assert [token for chunk in chunks for token in chunk["choices"][0]["logprobs"]["tokens"]] == log_probs["tokens"]
    whole_characters = "<0xC3>" not in pieces  # a character's bytes read "\ufffd" each, as OpenAI writes them
    if whole_characters:
        assert "".join(log_probs["tokens"]) == text + "</s>"
        assert log_probs["text_offset"] == [len("".join(log_probs["tokens"][:position])) for position in range(len(ids))]

    body = {"messages": [{"role": "user", "content": prompt}], "logprobs": True}
    whole, chunks = asyncio.run(answers(body, lambda body: service.chat(body, None),
                                        lambda body: service.chat_stream(body, None)))
    content = whole["choices"][0]["message"]["content"]
    assert content == tokenizer.decode(ids[:-1]) and not content.startswith(" " * 2)  # a message of its own
    assert "".join(choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"]) == content
    entries = whole["choices"][0]["logprobs"]["content"]
    assert [entry for chunk in chunks for choice in chunk["choices"] for entry in (choice.get("logprobs") or {}).get(
        "content", [])] == entries
    if whole_characters:
        assert "".join(entry["token"] for entry in entries) == content + "</s>"
        assert [bytes(entry["bytes"]) for entry in entries] == [b" Paris", b" is", b" nice", b".", b"</s>"]
