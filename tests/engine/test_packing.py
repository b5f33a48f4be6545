import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from reinforge.engine.attention import use_varlen_attention
from reinforge.engine.forward import build_position_ids, response_log_probs, response_values
from reinforge.engine.micro_batches import balanced_micro_batches, rows_in_batch_order
from reinforge.engine.packing import attach_plan, plan_packing
from reinforge.models import ValueModel, build_tiny_causal_lm
from reinforge.packed_attention import padded_packed_attention
from reinforge.protocol import Batch

sys.path.insert(0, str(Path(__file__).parent))
from test_micro_batches_and_update import sgd_policy_update, varlen_lm  # noqa: E402


def grouped_batch(num_prompts: int = 3, samples: int = 4, prompt_width: int = 6, response_width: int = 7,
                  seed: int = 0) -> Batch:
    """GRPO-like rows: each prompt repeated ``samples`` times, responses of different lengths (one empty)."""
    generator = torch.Generator().manual_seed(seed)
    prompts, prompt_masks = [], []
    for index in range(num_prompts):
        length = prompt_width - index  # left padding grows with the index
        tokens = torch.randint(3, 60, (prompt_width,), generator=generator)
        mask = torch.zeros(prompt_width, dtype=torch.long)
        mask[prompt_width - length:] = 1
        for _ in range(samples):
            prompts.append(tokens * mask)
            prompt_masks.append(mask)
    rows = num_prompts * samples
    prompts, prompt_mask = torch.stack(prompts), torch.stack(prompt_masks)
    responses = torch.randint(3, 60, (rows, response_width), generator=generator)
    response_mask = torch.zeros(rows, response_width)
    for row in range(rows):
        response_mask[row, : (row * 5) % (response_width + 1)] = 1  # row 0 has an empty response
    responses = responses * response_mask.long()
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    # interleave the groups, as a shuffled or DP-split batch would
    order = torch.randperm(rows, generator=generator)
    batch = Batch.from_dict(tensors={
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
        "position_ids": build_position_ids(attention_mask),
        "advantages": torch.randn(rows, response_width, generator=generator) * response_mask,
    })
    return batch.index(order)


def test_the_plan_runs_each_prompt_once_and_keeps_every_response_token():
    batch = grouped_batch()
    unshared, shared = plan_packing(batch), plan_packing(batch, share_prompts=True)
    prompt_tokens = batch["attention_mask"][:, :batch["prompts"].shape[1]].sum(-1)
    response_tokens = int(batch["response_mask"].sum())
    assert unshared.num_tokens == int(batch["attention_mask"].sum())
    assert shared.num_tokens == response_tokens + sum(int(prompt_tokens[rows].unique()) for rows in
                                                      _rows_by_prompt(batch))
    assert unshared.kv_index is None and shared.kv_index is not None
    assert int(shared.kv_index.numel()) == sum(shared.key_lengths)
    assert torch.equal(shared.response_index, unshared.response_index)
    assert shared.predictor_index.numel() == unshared.predictor_index.numel() == response_tokens


def _rows_by_prompt(batch: Batch) -> list[list[int]]:
    groups: dict[tuple, list[int]] = {}
    for row in range(len(batch)):
        groups.setdefault(tuple(batch["prompts"][row].tolist()), []).append(row)
    return list(groups.values())


def test_shared_prompts_give_the_unshared_log_probs_entropy_and_gradients():
    model = varlen_lm(seed=3)
    batch = grouped_batch()
    results = []
    for share in (False, True):
        model.zero_grad()
        micro = attach_plan(Batch(dict(batch.tensors), {}, {}), share_prompts=share)
        log_probs, entropy = response_log_probs(model, micro, temperature=0.7, with_entropy=True)
        ((log_probs * batch["advantages"]).sum() + entropy.sum()).backward()
        results.append((log_probs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = results
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-5, rtol=1e-5)
    padding = batch["response_mask"] == 0
    assert bool((lp_a[padding] == 0).all()) and bool((lp_b[padding] == 0).all())
    for grad_a, grad_b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(grad_b, grad_a, atol=1e-5, rtol=1e-4)


def test_a_micro_batch_of_single_rows_keeps_the_shared_layout_and_the_same_attention_arguments():
    """With shared prompts on, a micro-batch left with one row of each prompt still takes the shared layout: the
    compiled decoder layers meet one set of keyword arguments in every micro-batch of a run (a micro-batch of
    single rows without kv_index and packed_flash_shared would recompile them, 2.7 s of a 0.5B step on the H200)."""
    from reinforge.engine.forward import _attention_kwargs
    from reinforge.engine.packing import pack_rows

    batch = grouped_batch()
    singles = batch.index([rows[0] for rows in _rows_by_prompt(batch)])
    plans = [attach_plan(Batch(dict(part.tensors), {}, {}), share_prompts=True) for part in (batch, singles)]
    assert all(part.meta["packing_plan"].kv_index is not None for part in plans)
    keys = [set(_attention_kwargs(pack_rows(part), torch.float32)) for part in plans]
    assert keys[0] == keys[1] and "packed_flash_shared" in keys[0]
    model = varlen_lm(seed=5)
    with torch.no_grad():  # the layout changes no number
        shared = response_log_probs(model, plans[1], temperature=1.0)
        unshared = response_log_probs(model, attach_plan(Batch(dict(singles.tensors), {}, {})), temperature=1.0)
    torch.testing.assert_close(shared, unshared, atol=1e-5, rtol=1e-5)


def test_shared_prompts_give_the_unshared_values():
    critic = ValueModel(build_tiny_causal_lm(vocab_size=64, seed=4).model)
    use_varlen_attention(critic.backbone)
    batch = grouped_batch(seed=1)
    unshared = response_values(critic, attach_plan(batch.index(list(range(len(batch)))), share_prompts=False))
    shared = response_values(critic, attach_plan(batch.index(list(range(len(batch)))), share_prompts=True))
    torch.testing.assert_close(shared, unshared, atol=1e-5, rtol=1e-5)


def test_micro_batches_keep_each_prompt_group_together_within_budget():
    batch = grouped_batch(num_prompts=4, samples=4)
    pieces = balanced_micro_batches(batch, max_tokens=40, share_prompts=True)
    rows = sorted(row for piece in pieces for row in piece.meta["rows"])
    assert rows == list(range(len(batch)))
    groups = _rows_by_prompt(batch)
    for piece in pieces:
        plan = piece.meta["packing_plan"]
        assert plan.num_tokens <= 40 or len(piece) == 1
        present = set(piece.meta["rows"])
        # a group is split only where it exceeds the budget on its own
        for group in groups:
            if present & set(group) and not set(group) <= present:
                prompt = int(batch["attention_mask"][group[0], :batch["prompts"].shape[1]].sum())
                assert prompt + int(batch["response_mask"][group].sum()) > 40
    # shared pieces run fewer tokens than the same rows unshared
    total_shared = sum(piece.meta["packing_plan"].num_tokens for piece in pieces)
    assert total_shared < int(batch["attention_mask"].sum())


def test_scoring_by_micro_batches_with_shared_prompts_matches_unshared():
    model = varlen_lm(seed=5).eval()
    batch = grouped_batch(num_prompts=4, samples=3, seed=2)
    width = batch["responses"].shape[1]
    out = []
    for share in (False, True):
        pieces = balanced_micro_batches(batch, max_tokens=30, share_prompts=share)
        with torch.no_grad():
            parts = [response_log_probs(model, piece)[0] for piece in pieces]
        out.append(rows_in_batch_order(pieces, parts, len(batch), width))
    torch.testing.assert_close(out[1], out[0], atol=1e-5, rtol=1e-5)


def test_update_with_shared_prompts_equals_the_unshared_update():
    base = varlen_lm(seed=6)
    batch = grouped_batch(num_prompts=3, samples=4, seed=3)
    models = [sgd_policy_update(base, batch, 35, micro_batches=partial(balanced_micro_batches, share_prompts=share))[0]
              for share in (False, True)]
    for p_a, p_b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p_b, p_a, atol=1e-6, rtol=1e-5)
    assert not torch.equal(next(models[0].parameters()), next(base.parameters()))


def test_a_row_without_prompt_tokens_is_refused_with_its_index():
    batch = grouped_batch()
    batch["attention_mask"][2, :batch["prompts"].shape[1]] = 0
    with pytest.raises(ValueError, match="row 2 .* no prompt token"):
        plan_packing(batch)


@pytest.mark.gpu
def test_flash_kernel_runs_shared_segments_like_the_unshared_layout_on_the_gpu():
    from reinforge.engine.attention import flash_runs_shared_segments

    device = torch.device("cuda")
    assert flash_runs_shared_segments(device)
    model = varlen_lm(seed=7).to(device, torch.bfloat16)
    batch = grouped_batch(num_prompts=4, samples=8, prompt_width=40, response_width=90).to(device)
    out = []
    for share in (False, True):
        with torch.no_grad():
            micro = Batch(dict(batch.tensors), {}, {})
            micro.meta["packing_plan"] = plan_packing(batch, share_prompts=share)
            out.append(response_log_probs(model, micro)[0])
    # bf16: the shared layout changes only the order of some reductions
    torch.testing.assert_close(out[1], out[0], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("native_gqa", [True, False])
def test_flash_varlen_with_grouped_heads_matches_sdpa_per_segment_on_the_gpu(native_gqa, monkeypatch):
    from reinforge.engine import attention

    monkeypatch.setattr(attention, "NATIVE_GQA_FALLBACK", native_gqa)
    generator = torch.Generator(device="cuda").manual_seed(0)
    query_lengths, key_lengths = [5, 7, 3], [5, 12, 10]  # a prompt segment, then two end-aligned responses
    q = torch.randn(sum(query_lengths), 14, 64, device="cuda", generator=generator).bfloat16().requires_grad_()
    k = torch.randn(sum(key_lengths), 2, 64, device="cuda", generator=generator).bfloat16().requires_grad_()
    v = torch.randn(sum(key_lengths), 2, 64, device="cuda", generator=generator).bfloat16().requires_grad_()
    cu_q = torch.tensor([0, 5, 12, 15], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 5, 17, 27], dtype=torch.int32, device="cuda")
    out = attention._flash_varlen(q, k, v, cu_q, cu_k, 7, 12, 0.125)
    expected = padded_packed_attention(q.float(), k.float(), v.float(), query_lengths, key_lengths, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.float(), expected_grad.float(), atol=5e-2, rtol=5e-2)


def test_shared_key_rows_sum_their_gradients_in_float32_and_compile_without_a_break():
    import torch._dynamo

    from reinforge.engine.attention import GatherRows

    def loss_of(keys: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (GatherRows.apply(keys, index) * weight).sum()

    generator = torch.Generator().manual_seed(0)
    for rows in (12, 20):  # a prompt's 4 keys gathered for its own segment and each of two responses, then theirs
        keys = torch.randn(rows, 2, 8, generator=generator).to(torch.bfloat16).requires_grad_(True)
        index = torch.cat([torch.arange(4), torch.arange(4), torch.arange(4, rows // 2 + 2), torch.arange(4),
                           torch.arange(rows // 2 + 2, rows)])
        weight = torch.randn(len(index), 2, 8, generator=generator).to(torch.bfloat16)
        compiled = torch.compile(loss_of, backend="aot_eager", dynamic=True)
        compiled(keys, index, weight).backward()
        expected = torch.zeros(rows, 2, 8).index_add_(0, index, weight.float()).to(torch.bfloat16)
        assert torch.equal(keys.grad, expected)  # each row's sum rounded to bfloat16 once
    assert torch._dynamo.explain(loss_of)(keys, index, weight).graph_break_count == 0


@pytest.mark.parametrize("queries", [1, 3, 5])
def test_an_unpacked_call_without_a_mask_reads_it_as_sdpa_does(queries):
    """Without a mask (transformers leaves it out where SDPA's is_causal stands for it) one query attends to every key
    and several attend causally from the first key: a static cache's prefill hands over more key slots than tokens,
    the last ones still empty. Through the explicit path (a soft-cap), against that attention written out."""
    from reinforge.engine.attention import varlen_attention_forward

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, queries, 8, generator=generator)
    key, value = (torch.randn(1, 2, 5, 8, generator=generator) for _ in range(2))
    out, _ = varlen_attention_forward(torch.nn.Module(), query, key, value, None, scaling=0.5, softcap=3.0)
    keys, values = key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1)
    scores = torch.tanh(query @ keys.transpose(-1, -2) * 0.5 / 3.0) * 3.0
    if queries > 1:
        scores = scores.masked_fill(~torch.ones(queries, 5, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(out, (scores.softmax(-1) @ values).transpose(1, 2))
