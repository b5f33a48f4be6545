"""``reinforge bench serve``: chat requests through the HTTP endpoint against the same requests in process.

    reinforge bench serve --out serve.json        # CUDA, the 0.5B standard model
    reinforge bench serve --cpu --out serve.json  # tiny model: a smoke test

Workload: the Qwen2.5-0.5B architecture with random bf16 weights (as ``reinforge bench``), 256 chat requests
sent at once, each a user message of 128 random tokens and a reply of up to 512 sampled tokens (seeded per request,
temperature 1). The tokenizer is a word-level one built here over the model's whole vocabulary (``w<id>`` is token
id, plus ChatML's special tokens), so a message's text is exactly its token ids and no tokenizer download is needed.

- in process: the prompts the endpoint renders, each sent by its own asyncio task to
  ``AsyncEngineClient(engine).generate`` (what an agent loop's turn does), all at once;
- HTTP: the same conversations as ``POST /v1/chat/completions`` bodies over aiohttp, all at once, to an
  ``OpenAIEndpoint`` in this process (its event loop also runs the client; the engine steps in its worker thread).

The same seeds give the same replies both ways in float32 (``same_replies``, the CPU run); in bf16 the two runs
batch the requests differently, which changes rounding, so replies may part after a few tokens. Reported: sampled
tokens / wall time of each run, their ratio, and p50 / p99 latency of a request (send to last byte). A warm-up pass of each runs first (CUDA graphs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import torch

from reinforge.agent import AsyncEngineClient
from reinforge.bench.rollout import QWEN25_05B, TINY, build_model, environment, random_prompts
from reinforge.rollout.base import SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.serve.app import OpenAIEndpoint
from reinforge.serve.chat import ChatCodec
from reinforge.serve.service import GenerationService

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' + message['content'] + "
          "'<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}")
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
ROLES = ("user", "assistant", "system", "tool")


def word_tokenizer(vocab_size: int) -> Any:
    """Word-level: ``w<id>`` is token id; the last ids are ChatML's specials and role names."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    named = [*ROLES, *SPECIALS]
    vocab = {f"w{token_id}": token_id for token_id in range(vocab_size - len(named))}
    vocab |= {name: vocab_size - len(named) + index for index, name in enumerate(named)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


async def run_in_process(client: AsyncEngineClient, prompts: list[list[int]], samplings: list[SamplingParams]) -> dict:
    latencies: list[float] = []

    async def one(index: int) -> list[int]:
        start = time.perf_counter()
        completion = await client.generate(prompts[index], samplings[index], f"bench/{index}")
        latencies.append(time.perf_counter() - start)
        return list(completion.token_ids)

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(index) for index in range(len(prompts))))
    return {"elapsed": time.perf_counter() - start, "tokens": tokens, "latencies": latencies}


async def run_http(url: str, bodies: list[dict]) -> dict:
    import aiohttp

    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(body: dict) -> dict:
            start = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", json=body) as response:
                answer = await response.json()
            latencies.append(time.perf_counter() - start)
            if response.status != 200:
                raise RuntimeError(f"the endpoint answered {response.status}: {answer}")
            return answer

        start = time.perf_counter()
        answers = await asyncio.gather(*(one(body) for body in bodies))
    return {"elapsed": time.perf_counter() - start, "answers": answers, "latencies": latencies}


def summary(name: str, elapsed: float, num_tokens: int, latencies: list[float]) -> dict:
    return {"run": name, "elapsed_s": round(elapsed, 3), "sampled_tokens": num_tokens,
            "tokens_per_s": round(num_tokens / elapsed, 1), "p50_latency_s": round(percentile(latencies, 0.5), 3),
            "p99_latency_s": round(percentile(latencies, 0.99), 3)}


async def bench(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    shape = TINY if not cuda else QWEN25_05B
    model = build_model(shape, torch.bfloat16 if cuda else torch.float32, device)
    vocab_size = shape["vocab_size"]
    tokenizer = word_tokenizer(vocab_size)
    num_requests = args.requests or (256 if cuda else 8)
    prompt_tokens, max_tokens = (128, 512) if cuda else (16, 16)
    eos_id = tokenizer.eos_token_id
    engine_kwargs: dict[str, Any] = {"eos_token_ids": [eos_id], "max_model_len": prompt_tokens + max_tokens + 16,
                                     "max_num_seqs": max(num_requests, 1), "device": device,
                                     "free_on_sleep": False}  # sleep between runs drops the prefix cache, keeps graphs
    if cuda:
        engine_kwargs["gpu_memory_utilization"] = 0.85
    engine = NativeEngine(model, **engine_kwargs)
    client = AsyncEngineClient(engine)
    codec = ChatCodec(tokenizer)
    service = GenerationService(client, tokenizer, "bench", codec=codec, max_model_len=engine_kwargs["max_model_len"],
                                eos_token_ids=(eos_id,))
    endpoint = OpenAIEndpoint(service, max_concurrency=num_requests)
    url = await endpoint.start()
    contents = [" ".join(f"w{token}" for token in prompt)
                for prompt in random_prompts(num_requests, [prompt_tokens], vocab_size - 16, seed=1)]
    messages = [[{"role": "user", "content": content}] for content in contents]
    prompts = [codec.render(conversation, None) for conversation in messages]
    stop_ids = tuple(dict.fromkeys((eos_id, *codec.renderer.stop_ids)))
    samplings = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=index, stop_token_ids=stop_ids)
                 for index in range(num_requests)]
    bodies = [{"model": "bench", "messages": conversation, "max_tokens": max_tokens, "temperature": 1.0, "seed": index}
              for index, conversation in enumerate(messages)]
    try:
        await run_in_process(client, prompts[:8], samplings[:8])  # warm-up: kernels, CUDA graphs
        await run_http(url, bodies[:8])
        engine.sleep()
        in_process = await run_in_process(client, prompts, samplings)
        engine.sleep()  # the prefix cache is dropped: the HTTP run prefills as the first did
        http = await run_http(url, bodies)
    finally:
        await endpoint.close()
    in_process_texts = [codec.reply(tokens)[0]["content"] for tokens in in_process["tokens"]]
    same_replies = in_process_texts == [answer["choices"][0]["message"]["content"] for answer in http["answers"]]
    in_process_tokens = sum(len(tokens) for tokens in in_process["tokens"])
    http_tokens = sum(answer["usage"]["completion_tokens"] for answer in http["answers"])
    rows = [summary("in process (AsyncEngineClient)", in_process["elapsed"], in_process_tokens, in_process["latencies"]),
            summary("HTTP /v1/chat/completions", http["elapsed"], http_tokens, http["latencies"])]
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    return {"benchmark": "serve", "device": str(device), "model": "Qwen2.5-0.5B shape" if cuda else "tiny",
            "num_requests": num_requests, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "same_replies": same_replies, "http_over_in_process": round(ratio, 3),
            "rows": rows, "environment": environment(device)}


def serve_bench_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="reinforge bench serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny model on the CPU, 8 requests: a smoke test")
    parser.add_argument("--requests", type=int, default=None, help="concurrent requests (default 256; 8 with --cpu)")
    parser.add_argument("--out", help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("reinforge bench serve needs aiohttp; pip install 'reinforge[serve]'", file=sys.stderr)
        return 2
    result = asyncio.run(bench(args))
    for row in result["rows"]:
        print(f"{row['run']:<34} {row['tokens_per_s']:>10.1f} tok/s   p50 {row['p50_latency_s']:.3f} s   "
              f"p99 {row['p99_latency_s']:.3f} s   ({row['sampled_tokens']} tokens in {row['elapsed_s']:.2f} s)")
    print(f"HTTP / in process: {result['http_over_in_process']:.2f}; the same replies both ways: "
          f"{result['same_replies']}")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=2)
    return 0
