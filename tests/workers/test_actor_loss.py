"""actor.skip_zero_advantage_backward: rows whose advantages are all 0 run forward only, and the update and
its metrics are those of the full backward (up to floating-point order)."""

import pytest
import torch

from reinforge.config.schema import Config
from reinforge.engine.forward import build_position_ids
from reinforge.engine.fsdp import full_model_state
from reinforge.protocol import Batch
from reinforge.workers.actor_loss import no_grad_rows
from reinforge.workers.actor_rollout import ActorRolloutWorker

ROWS, PROMPT, RESPONSE = 8, 4, 6


def grpo_like_batch(zero_rows: list[int], old_log_prob_noise: float = 0.0) -> Batch:
    """Four prompts x two samples; ``zero_rows`` get advantage 0 (a group whose samples scored alike)."""
    generator = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 60, (ROWS // 2, PROMPT), generator=generator).repeat_interleave(2, dim=0)
    responses = torch.randint(3, 60, (ROWS, RESPONSE), generator=generator)
    response_mask = torch.ones(ROWS, RESPONSE)
    response_mask[1, 4:] = 0
    response_mask[5, 2:] = 0
    attention_mask = torch.cat([torch.ones(ROWS, PROMPT, dtype=torch.long), response_mask.long()], dim=1)
    advantages = torch.randn(ROWS, 1, generator=generator).expand(ROWS, RESPONSE) * response_mask
    advantages[zero_rows] = 0.0
    batch = Batch.from_dict(tensors={"prompts": prompts, "responses": responses, "response_mask": response_mask,
                                     "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
                                     "position_ids": build_position_ids(attention_mask), "advantages": advantages})
    if old_log_prob_noise:  # an off-policy batch: ratios away from 1, so some tokens are clipped
        batch["old_log_probs"] = -3.0 + old_log_prob_noise * torch.randn(ROWS, RESPONSE, generator=generator)
    return batch


def make_worker(model_dir, skip: bool, device: str = "cpu", **actor: object) -> ActorRolloutWorker:
    config = Config()
    config.model.path = str(model_dir)
    config.trainer.device = device
    config.data.train_batch_size = ROWS // 2
    config.actor.max_tokens_per_micro_batch = 24
    config.actor.optim.lr = 1e-2
    # the k projection's bias gets no gradient in exact arithmetic (softmax ignores a constant shift); AdamW's
    # usual eps of 1e-8 would blow its rounding noise, which the order of additions changes, up to the lr
    config.actor.optim.eps = 1e-3
    config.actor.skip_zero_advantage_backward = skip
    for key, value in actor.items():
        setattr(config.actor, key, value)
    return ActorRolloutWorker(config, total_training_steps=4)


def update_twice(worker: ActorRolloutWorker, batch: Batch) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    metrics = [worker.update_actor(batch) for _ in range(2)]
    return metrics, full_model_state(worker.model)


COMPARED = ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm")


@pytest.mark.parametrize("zero_rows, noise, mini_batch_size", [
    ([2, 3, 6, 7], 0.0, None),   # two whole groups alike, on-policy
    ([2, 3, 4], 2.0, 2),         # a group and one sample of another; off-policy, two optimizer steps a call
    (list(range(ROWS)), 0.0, None),  # every group alike: the step still steps with zero gradients
])
def test_forward_only_rows_give_the_update_and_metrics_of_the_full_backward(tiny_model_dir, zero_rows, noise,
                                                                             mini_batch_size):
    batch = grpo_like_batch(zero_rows, noise)
    runs = {}
    for skip in (False, True):
        worker = make_worker(tiny_model_dir, skip, mini_batch_size=mini_batch_size)
        runs[skip] = update_twice(worker, batch)
    (full_metrics, full_state), (skipped_metrics, skipped_state) = runs[False], runs[True]
    for name, tensor in full_state.items():
        torch.testing.assert_close(skipped_state[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    for full, skipped in zip(full_metrics, skipped_metrics, strict=True):
        for key in COMPARED:
            assert skipped[key] == pytest.approx(full[key], rel=1e-4, abs=1e-7), key
        # a forward-only row costs its forward's share of a trained one in the FLOP count (a third here)
        assert skipped["perf/computed_tokens/actor"] < full["perf/computed_tokens/actor"]
    if noise:
        assert full_metrics[0]["actor/pg_clipfrac"] > 0  # the comparison covered clipped tokens
    if len(zero_rows) < ROWS:  # the comparison is of a real update (with none, AdamW's weight decay still moves)
        initial = full_model_state(make_worker(tiny_model_dir, True).model)
        assert any(not torch.equal(tensor, initial[name]) for name, tensor in skipped_state.items())


def test_rows_are_forward_only_only_where_the_loss_is_linear_in_the_advantage(tiny_model_dir):
    batch = grpo_like_batch([0, 1])
    config = Config()
    rows = no_grad_rows(config, batch)
    assert rows is not None and rows.tolist() == [True, True] + [False] * (ROWS - 2)
    for key, value in [("skip_zero_advantage_backward", False), ("use_kl_loss", True), ("entropy_coeff", 0.01)]:
        changed = Config()
        setattr(changed.actor, key, value)
        assert no_grad_rows(changed, batch) is None, key
    for loss_mode in ("dro", "clip_cov", "kl_cov"):  # a term without the advantage, or batch-wide token selection
        changed = Config()
        changed.actor.policy_loss.loss_mode = loss_mode
        assert no_grad_rows(changed, batch) is None, loss_mode
    padded = grpo_like_batch([])
    padded["response_mask"][4] = 0  # a row without response tokens has no loss either
    assert no_grad_rows(config, padded).tolist() == [False] * 4 + [True] + [False] * 3


@pytest.mark.gpu
def test_forward_only_rows_on_cuda_with_compiled_layers(tiny_model_dir):
    """On CUDA the decoder layers are compiled and run in bf16: the forward-only pass (no grad, train mode)
    compiles its own graphs, and the update stays that of the full backward within bf16's rounding."""
    batch = grpo_like_batch([2, 3, 6, 7])
    results = {}
    for skip in (False, True):
        worker = make_worker(tiny_model_dir, skip, device="cuda")
        assert worker.device.type == "cuda"
        results[skip] = update_twice(worker, batch)
    (full_metrics, full_state), (skipped_metrics, skipped_state) = results[False], results[True]
    for key in COMPARED:
        assert skipped_metrics[-1][key] == pytest.approx(full_metrics[-1][key], rel=2e-2, abs=1e-4), key
    for name, tensor in full_state.items():
        torch.testing.assert_close(skipped_state[name], tensor, rtol=2e-2, atol=2e-3, msg=name)


def test_loss_scale_factor_is_the_constant_seq_mean_token_sum_norm_divides_by():
    """verl's actor.loss_scale_factor: Dr. GRPO's divisor in place of the response length."""
    from reinforge.engine.train_step import MiniBatchCounts
    from reinforge.workers.actor_loss import actor_loss

    batch = grpo_like_batch(zero_rows=[])
    counts = MiniBatchCounts(num_tokens=float(batch["response_mask"].sum()), num_sequences=float(ROWS),
                             max_response_length=RESPONSE)
    log_probs = -torch.rand(ROWS, RESPONSE, generator=torch.Generator().manual_seed(0))
    losses = {}
    for factor in (None, 512):
        config = Config()
        config.actor.loss_agg_mode = "seq-mean-token-sum-norm"
        config.actor.loss_scale_factor = factor
        losses[factor], _ = actor_loss(config, batch, counts, log_probs, torch.zeros_like(log_probs), on_policy=True)
    expected = -(batch["advantages"] * batch["response_mask"]).sum() / ROWS
    torch.testing.assert_close(losses[None], expected / RESPONSE)
    torch.testing.assert_close(losses[512], expected / 512)
