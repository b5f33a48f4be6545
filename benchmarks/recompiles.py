"""Do the compiled decoder layers recompile as micro-batch shapes change? (CUDA; a small Qwen2 model.)

    PYTHONPATH=. python3 benchmarks/recompiles.py [--variant marked]

The 1.5B bench recompiled its decoder layers once in step 2 (benchmarks/compile_events.py: "tensor
'kwargs['packed_kv_index']' size mismatch at index 0"), 3 s of one step. Real training varies much more
than the bench (every micro-batch its own number of groups, prompt and response lengths), so this
runs 12 micro-batches of shared-prompt groups with random sizes through forward and backward (and
no-grad scoring) and prints the graphs dynamo compiled after each, with the reasons it logged.
``--variant marked`` first marks the packed tensors' varying dimensions dynamic
(``torch._dynamo.maybe_mark_dynamic``) and passes the maximum lengths on without ``int()``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch


def grouped_micro_batch(num_groups: int, samples: int, vocab: int, rng: random.Random,
                        lengths: tuple[int, int] | None = None):
    from reinforge.engine.forward import build_position_ids
    from reinforge.engine.packing import attach_plan
    from reinforge.protocol import Batch

    prompt_width, response_width = 96, 160
    prompts, masks, responses, response_masks = [], [], [], []
    for _ in range(num_groups):
        length = lengths[0] if lengths else rng.randint(8, prompt_width)
        tokens = torch.randint(3, vocab, (prompt_width,))
        mask = torch.zeros(prompt_width, dtype=torch.long)
        mask[prompt_width - length:] = 1
        for _ in range(samples):
            prompts.append(tokens * mask)
            masks.append(mask)
            response_length = lengths[1] if lengths else rng.randint(1, response_width)
            response_masks.append(torch.arange(response_width) < response_length)
            responses.append(torch.randint(3, vocab, (response_width,)) * response_masks[-1])
    prompts, responses = torch.stack(prompts), torch.stack(responses)
    response_mask = torch.stack(response_masks).long()
    attention_mask = torch.cat([torch.stack(masks), response_mask], dim=1)
    batch = Batch.from_dict(tensors={
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
        "position_ids": build_position_ids(attention_mask)})
    return attach_plan(batch.to(torch.device("cuda")), share_prompts=True)


def mark_dynamic_variant() -> None:
    import reinforge.engine.attention as attention
    import reinforge.engine.forward as forward

    plain = forward._attention_kwargs

    def marked(packed, compute_dtype):
        kwargs = plain(packed, compute_dtype)
        for key in ("packed_cu_seqlens", "packed_cu_seqlens_k", "packed_kv_index"):
            if isinstance(kwargs.get(key), torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(kwargs[key], 0)
        return kwargs

    forward._attention_kwargs = marked

    def packed_attention(q, k, v, scale, kwargs):
        cu_seqlens, kv_index = kwargs["packed_cu_seqlens"], kwargs.get("packed_kv_index")
        cu_seqlens_k, max_key_length = cu_seqlens, kwargs["packed_max_length"]
        if kv_index is not None:
            k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
            cu_seqlens_k, max_key_length = kwargs["packed_cu_seqlens_k"], kwargs["packed_max_length_k"]
        return attention._flash_varlen(q, k, v, cu_seqlens, cu_seqlens_k, kwargs["packed_max_length"],
                                       max_key_length, scale)

    attention.packed_attention = packed_attention


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["as-is", "marked"], default="as-is")
    parser.add_argument("--micro-batches", type=int, default=12)
    parser.add_argument("--collide", action="store_true",
                        help="the first micro-batch one row whose packed_kv_index has exactly hidden_size (256) entries "
                             "(a prompt of 64 tokens, a response of 128: 64 + 64 + 128), as the 1.5B bench's first "
                             "update micro-batch had 1536, its hidden size")
    parser.add_argument("--no-duck-shape", action="store_true",
                        help="torch.fx.experimental._config.use_duck_shape = False: equal sizes are not one symbol")
    args = parser.parse_args(argv)
    if args.variant == "marked":
        mark_dynamic_variant()
    if args.no_duck_shape:
        import torch.fx.experimental._config

        torch.fx.experimental._config.use_duck_shape = False
    torch._logging.set_logs(recompiles=True)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from reinforge.engine.forward import response_log_probs
    from reinforge.engine.fused import prepare_for_training

    config = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)
    prepare_for_training(model, torch.device("cuda"))
    rng = random.Random(0)
    counters = torch._dynamo.utils.counters
    for index in range(args.micro_batches):
        if args.collide and index == 0:
            micro = grouped_micro_batch(1, 1, config.vocab_size, rng, lengths=(64, 128))
        else:
            micro = grouped_micro_batch(rng.randint(1, 6), rng.choice([1, 4, 8]), config.vocab_size, rng)
        started = time.perf_counter()
        log_probs, _ = response_log_probs(model, micro)
        log_probs.sum().backward()
        with torch.no_grad():
            response_log_probs(model, micro)
        torch.cuda.synchronize()
        print(f"micro-batch {index}: {len(micro)} rows, {micro.meta['packing_plan'].num_tokens} tokens, "
              f"{time.perf_counter() - started:.2f} s, graphs so far {counters['stats']['unique_graphs']}", flush=True)
    print(f"variant {args.variant}{' collide' if args.collide else ''}{' no-duck-shape' if args.no_duck_shape else ''}: "
          f"{counters['stats']['unique_graphs']} graphs for {args.micro_batches} micro-batches")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
