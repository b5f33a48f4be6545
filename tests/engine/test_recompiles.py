"""The compiled decoder layers compile once: packed micro-batches of other shapes reuse the graphs (CUDA).

Real training varies every micro-batch (its number of groups, samples per group, prompt and response
lengths), so micro-batches of shared-prompt groups with random sizes run through forward and backward and
no-grad scoring; dynamo's graph count after the first one must not grow. The collision case: a first
micro-batch whose ``packed_kv_index`` has exactly ``hidden_size`` entries (a 64-token prompt and a 128-token
response: 64 + 64 + 128 = 256), which duck sizing would take for the hidden size and guard on.
"""

from __future__ import annotations

import random

import pytest
import torch

HIDDEN_SIZE = 256


def grouped_micro_batch(num_groups: int, samples: int, vocab: int, rng: random.Random,
                        lengths: tuple[int, int] | None = None):
    """Groups of ``samples`` rows sharing a left-padded prompt, with right-padded responses, packed with shared
    prompts; ``lengths`` (prompt, response) fixes every row's lengths, else they are drawn."""
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


@pytest.mark.gpu
@pytest.mark.parametrize("collide", [False, True], ids=["random-shapes", "kv-index-the-size-of-hidden"])
def test_packed_micro_batches_of_new_shapes_compile_no_new_graphs(collide):
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from reinforge.engine.forward import response_log_probs
    from reinforge.engine.fused import prepare_for_training

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=HIDDEN_SIZE, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)
    prepare_for_training(model, torch.device("cuda"))
    rng = random.Random(0)
    graphs = []
    for index in range(12):
        if collide and index == 0:
            micro = grouped_micro_batch(1, 1, config.vocab_size, rng, lengths=(64, 128))
            assert len(micro.meta["packing_plan"].kv_index) == HIDDEN_SIZE
        else:
            micro = grouped_micro_batch(rng.randint(1, 6), rng.choice([1, 4, 8]), config.vocab_size, rng)
        log_probs, *_ = response_log_probs(model, micro)
        log_probs.sum().backward()
        with torch.no_grad():
            response_log_probs(model, micro)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0, "nothing was compiled: the layers run eagerly and this test measures nothing"
    assert graphs == [graphs[0]] * len(graphs), f"graphs compiled after each micro-batch: {graphs}"
