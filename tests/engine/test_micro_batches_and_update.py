import copy

import pytest
import torch

from reinforge.algorithms import LossNormalizer, compute_policy_loss, log_probs_from_logits
from reinforge.config.schema import OptimConfig, PolicyLossConfig
from reinforge.engine.attention import use_varlen_attention
from reinforge.engine.forward import build_position_ids, response_log_probs
from reinforge.engine.micro_batches import (
    balanced_micro_batches,
    rows_in_batch_order,
    split_by_token_budget,
    trim_padding,
)
from reinforge.engine.optim import build_optimizer, build_scheduler, lr_multiplier
from reinforge.engine.train_step import FORWARD_ONLY, ModelUpdate, UpdateSettings, padded_micro_batches
from reinforge.models import build_tiny_causal_lm
from reinforge.protocol import Batch


def varlen_lm(seed: int):
    model = build_tiny_causal_lm(vocab_size=64, seed=seed)
    use_varlen_attention(model)
    return model


def make_rollout_batch(rows: int = 6, prompt_width: int = 5, response_width: int = 4, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 60, (rows, prompt_width), generator=generator)
    responses = torch.randint(3, 60, (rows, response_width), generator=generator)
    prompt_mask = torch.ones(rows, prompt_width, dtype=torch.long)
    response_mask = torch.ones(rows, response_width)
    for row in range(rows):
        prompt_mask[row, : row % 3] = 0  # left padding
        response_mask[row, response_width - row % 2 - 1:] = 0 if row % 2 else 1  # right padding
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    return Batch.from_dict(tensors={
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
        "position_ids": build_position_ids(attention_mask),
        "advantages": torch.randn(rows, response_width, generator=generator) * response_mask,
    })


def test_micro_batches_keep_order_and_budget():
    batch = make_rollout_batch()
    pieces = split_by_token_budget(batch, max_tokens=20)
    assert sum(len(piece) for piece in pieces) == len(batch)
    for piece in pieces:
        assert len(piece) == 1 or piece["input_ids"].numel() <= 20
    assert torch.equal(torch.cat([p["advantages"][:, :1] for p in pieces]), batch["advantages"][:, :1])
    assert len(split_by_token_budget(batch, max_tokens=10_000)) == 1


def test_trim_padding_drops_only_shared_padding():
    batch = make_rollout_batch().index([0, 3])  # row 0 and row 3 both have a full prompt
    trimmed = trim_padding(batch)
    assert trimmed["prompts"].shape[1] == 5
    assert trimmed["input_ids"].shape[1] == trimmed["prompts"].shape[1] + trimmed["responses"].shape[1]


def test_balanced_micro_batches_cover_every_row_once_within_budget():
    batch = make_rollout_batch(rows=7)
    lengths = batch["attention_mask"].sum(-1)
    pieces = balanced_micro_batches(batch, max_tokens=20)
    rows = sorted(row for piece in pieces for row in piece.meta["rows"])
    assert rows == list(range(7))
    for piece in pieces:
        assert int(piece["attention_mask"].sum()) <= max(20, int(lengths.max()))
    loads = [int(piece["attention_mask"].sum()) for piece in pieces]
    assert max(loads) - min(loads) <= int(lengths.max())
    assert len(balanced_micro_batches(batch, max_tokens=10_000)) == 1


def test_micro_batches_are_built_when_the_loop_asks_for_them(monkeypatch):
    from reinforge.engine import micro_batches

    batch = make_rollout_batch(rows=7)
    built = []
    attach = micro_batches.attach_plan
    monkeypatch.setattr(micro_batches, "attach_plan", lambda piece, share: built.append(piece) or attach(piece, share))
    lazy = micro_batches.iter_balanced_micro_batches(batch, max_tokens=20)
    first = next(lazy)
    assert len(built) == 1  # the others are built while the device runs this one
    pieces = [first, *lazy]
    assert len(built) == len(pieces) > 1
    assert [piece.meta["rows"] for piece in pieces] == [
        piece.meta["rows"] for piece in micro_batches.balanced_micro_batches(batch, max_tokens=20)]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_forward_matches_padded_forward(arch):
    model = build_tiny_causal_lm(arch=arch, vocab_size=64, seed=1).eval()
    use_varlen_attention(model)
    batch = make_rollout_batch()
    width = batch["responses"].shape[1]
    # the padded reference: SDPA with the attention mask over [left-padded prompt | response]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, -width - 1:-1]
    expected = log_probs_from_logits(logits, batch["responses"])
    pieces = balanced_micro_batches(batch, max_tokens=20)
    parts = [response_log_probs(model, piece)[0] for piece in pieces]
    rebuilt = rows_in_batch_order(pieces, parts, len(batch), width)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(rebuilt[mask], expected[mask], atol=1e-5, rtol=1e-5)


def on_policy_update(model, optimizer, scheduler, batch: Batch, settings: UpdateSettings, split=padded_micro_batches,
                     loss_agg_mode: str = "token-mean", no_grad_rows=None) -> dict[str, float]:
    """One on-policy vanilla policy-gradient update of ``model`` by the engine's ``ModelUpdate``; its ``actor/*`` metrics."""
    update = ModelUpdate(model, optimizer, scheduler, settings, torch.device("cpu"), split=split)
    for micro, counts in update.micro_batches(batch, no_grad_rows):
        if micro.meta.get(FORWARD_ONLY):
            with torch.no_grad():
                response_log_probs(model, micro)
            update.record({})
            continue
        log_probs, _ = response_log_probs(model, micro)
        loss, _ = compute_policy_loss("vanilla", old_log_probs=log_probs.detach(), log_probs=log_probs,
                                      advantages=micro["advantages"], response_mask=micro["response_mask"],
                                      loss_agg_mode=loss_agg_mode, config=PolicyLossConfig(),
                                      normalizer=LossNormalizer(**vars(counts)))
        update.backward(loss, {"pg_loss": float(loss.detach())})
    return update.metrics("actor")


def sgd_policy_update(base, batch: Batch, budget: int, micro_batches=balanced_micro_batches,
                      loss_agg_mode: str = "token-mean"):
    """A copy of ``base`` after one on-policy vanilla policy-gradient update by ``ModelUpdate``; (model, metrics).

    Plain SGD at lr 1: the parameter change is the gradient itself (Adam would amplify rounding noise).
    """
    model = copy.deepcopy(base).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = build_scheduler(optimizer, 10, OptimConfig(lr=1.0))
    settings = UpdateSettings(max_tokens_per_micro_batch=budget, grad_clip=1e9)
    metrics = on_policy_update(model, optimizer, scheduler, batch, settings, split=micro_batches,
                               loss_agg_mode=loss_agg_mode)
    return model, metrics


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_update_is_the_same_whatever_the_micro_batch_split(loss_agg_mode):
    base = varlen_lm(seed=2)
    batch = make_rollout_batch(rows=6)
    (model_a, metrics_a), (model_b, metrics_b) = (sgd_policy_update(base, batch, budget, loss_agg_mode=loss_agg_mode)
                                                  for budget in (10_000, 9))
    assert metrics_a["actor/grad_norm"] == pytest.approx(metrics_b["actor/grad_norm"], rel=1e-4)
    for p_a, p_b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(p_a, p_b, atol=1e-6, rtol=1e-5)
    assert not torch.equal(next(model_a.parameters()), next(base.parameters()))


def test_non_finite_gradient_skips_the_step():
    model = varlen_lm(seed=3)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    scheduler = build_scheduler(optimizer, 10, OptimConfig(lr=1e-2))

    update = ModelUpdate(model, optimizer, scheduler, UpdateSettings(max_tokens_per_micro_batch=16384, grad_clip=1.0),
                         torch.device("cpu"))
    for micro, _ in update.micro_batches(make_rollout_batch()):
        log_probs, _ = response_log_probs(model, micro)
        update.backward(log_probs.sum() * float("nan"), {})
    assert update.metrics("actor")["actor/num_skipped_steps"] == 1
    for old, new in zip(before, model.parameters(), strict=True):
        assert torch.equal(old, new)


@pytest.mark.parametrize("scale", [float("nan"), 1.0], ids=["non-finite", "finite"])
def test_the_fused_optimizer_skips_a_non_finite_step_on_the_device_as_the_host_would(scale):
    """skip_on_device: torch's fused AdamW reads the step's found_inf itself; the host never waits before it."""
    weights = []
    for on_device in (True, False):
        model = varlen_lm(seed=3)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scheduler = build_scheduler(optimizer, 10, OptimConfig(lr=1e-2))
        settings = UpdateSettings(max_tokens_per_micro_batch=16384, grad_clip=1.0, skip_on_device=on_device)
        update = ModelUpdate(model, optimizer, scheduler, settings, torch.device("cpu"))
        assert update.skips_on_device == on_device
        for micro, _ in update.micro_batches(make_rollout_batch()):
            log_probs, _ = response_log_probs(model, micro)
            update.backward(log_probs.sum() * scale, {})
        metrics = update.metrics("actor")
        assert metrics["actor/num_skipped_steps"] == (1 if scale != scale else 0)
        assert not hasattr(optimizer, "found_inf")  # never left for a later step to read
        if scale != scale:
            assert all(torch.equal(old, new) for old, new in zip(before, model.parameters(), strict=True))
        weights.append([p.detach().clone() for p in model.parameters()])
    for on_device, on_host in zip(*weights, strict=True):
        torch.testing.assert_close(on_device, on_host, atol=0.0, rtol=0.0)


def test_learning_rate_schedules():
    constant = OptimConfig(lr=1.0, warmup_steps=2)
    assert [lr_multiplier(s, 10, constant) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cosine = OptimConfig(lr=1.0, schedule="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(0, 10, cosine) == pytest.approx(1.0)
    assert lr_multiplier(10, 10, cosine) == pytest.approx(0.1)
    assert lr_multiplier(5, 10, cosine) == pytest.approx(0.55)
    ratio = OptimConfig(lr=1.0, warmup_ratio=0.5)
    assert lr_multiplier(0, 4, ratio) == pytest.approx(0.5)
    # transformers' get_linear_schedule_with_warmup after warmup: (total - step) / (total - warmup), down to 0
    linear = OptimConfig(lr=1.0, schedule="linear")
    assert [lr_multiplier(s, 4, linear) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    warmed = OptimConfig(lr=1.0, schedule="linear", warmup_steps=2)
    assert [lr_multiplier(s, 6, warmed) for s in range(2, 7)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_items_just_over_half_the_budget_are_split_in_few_tries(monkeypatch):
    """Responses cut at one length make items that each need their own micro-batch; finding that must not try
    every count from the token bound up (thousands of longest-first passes for a large batch)."""
    from reinforge.engine import micro_batches

    passes = []
    longest_first = micro_batches._longest_first
    monkeypatch.setattr(micro_batches, "_longest_first",
                        lambda lengths, num_bins: passes.append(num_bins) or longest_first(lengths, num_bins))
    loads = micro_batches.micro_batch_loads([5120] * 4096, 8192)
    assert loads == [5120] * 4096
    assert len(passes) < 30
    passes.clear()
    mixed = [4000 + (row * 37) % 1100 for row in range(3000)]
    loads = micro_batches.micro_batch_loads(mixed, 8192)
    assert max(loads) <= 8192 and sum(loads) == sum(mixed) and len(passes) < 30


def test_an_optimizer_that_holds_none_of_the_parameters_the_backward_reached_stops_the_update():
    """A run must not report a gradient norm and step on nothing: its first step says so in one line."""
    model = varlen_lm(seed=3)
    stranger = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(stranger.parameters(), lr=1e-2)
    scheduler = build_scheduler(optimizer, 10, OptimConfig(lr=1e-2))
    update = ModelUpdate(model, optimizer, scheduler, UpdateSettings(max_tokens_per_micro_batch=16384, grad_clip=1.0),
                         torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"the backward reached \d+ parameters of .* and the optimizer holds none"):
        for micro, _ in update.micro_batches(make_rollout_batch()):
            log_probs, _ = response_log_probs(model, micro)
            update.backward(log_probs.sum(), {})
