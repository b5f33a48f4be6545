import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reinforge.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    LossNormalizer,
    compute_policy_loss,
    log_probs_from_logits,
)
from reinforge.algorithms.policy_losses import overflow_safe_exp
from reinforge.config.schema import PolicyLossConfig


def policy_loss(name, log_ratio, advantages, mask=None, mode="token-mean", config=None, **kwargs):
    """Loss with old log-probs -1 and new ones -1 + log_ratio; returns (loss, metrics, grad wrt log_probs)."""
    log_ratio = torch.as_tensor(log_ratio, dtype=torch.float64)
    old_log_probs = torch.full_like(log_ratio, -1.0)
    log_probs = (old_log_probs + log_ratio).requires_grad_()
    advantages = torch.as_tensor(advantages, dtype=torch.float64)
    mask = torch.ones_like(log_ratio) if mask is None else torch.as_tensor(mask, dtype=torch.float64)
    loss, metrics = compute_policy_loss(
        name,
        old_log_probs=old_log_probs,
        log_probs=log_probs,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=mode,
        config=config or PolicyLossConfig(),
        **kwargs,
    )
    loss.backward()
    return loss.item(), {key: float(value) for key, value in metrics.items()}, log_probs.grad


def test_vanilla_by_hand():
    # A=1 and r=e^0.5 clips at 1.2; A=-1 and r=e^-0.5 clips at 0.8; A=-1 and r=e^2 hits the dual clip 3
    loss, metrics, grad = policy_loss("vanilla", [[0.5, -0.5, 2.0, 0.1]], [[1.0, -1.0, -1.0, 1.0]])
    expected_losses = [-1.2, 0.8, 3.0, -math.exp(0.1)]
    assert loss == pytest.approx(sum(expected_losses) / 4)
    # the dual-clipped token is not PPO-clipped (its unclipped loss is the larger one)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 4)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 4)
    assert metrics["ppo_kl"] == pytest.approx(-(0.5 - 0.5 + 2.0 + 0.1) / 4)
    # only the unclipped token has a gradient: d(-A r)/d log pi = -A r, over 4 tokens
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0, -math.exp(0.1) / 4]], dtype=torch.float64))


def test_vanilla_asymmetric_clip_higher():
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, metrics, _ = policy_loss("vanilla", [[math.log(1.25), math.log(1.3)]], [[1.0, 1.0]], config=config)
    assert loss == pytest.approx(-(1.25 + 1.28) / 2)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)


def test_vanilla_clamps_the_log_ratio_and_ppo_kl_averages_the_clamped_one():
    loss, metrics, grad = policy_loss("vanilla", [[50.0, -30.0, 0.5]], [[-1.0, 1.0, 1.0]],
                                      config=PolicyLossConfig(clip_ratio_c=1e12))
    assert loss == pytest.approx((math.exp(20.0) - math.exp(-20.0) - 1.2) / 3)
    assert grad[0, 0] == 0
    # verl's convention: -mean(clamp(log r, -20, 20)) = -(20 - 20 + 0.5) / 3
    assert metrics["ppo_kl"] == pytest.approx(-0.5 / 3)


def test_vanilla_rejects_a_small_dual_clip():
    with pytest.raises(ValueError, match="clip_ratio_c=0.5"):
        policy_loss("vanilla", [[0.0]], [[1.0]], config=PolicyLossConfig(clip_ratio_c=0.5))


def test_importance_weights_scale_each_token():
    weights = torch.tensor([[2.0, 0.5]], dtype=torch.float64)
    loss, _, _ = policy_loss("vanilla", [[0.0, 0.0]], [[1.0, 1.0]], importance_weights=weights)
    assert loss == pytest.approx(-(2.0 + 0.5) / 2)
    with pytest.raises(ValueError, match="one weight per token"):
        policy_loss("vanilla", [[0.0, 0.0]], [[1.0, 1.0]], importance_weights=torch.ones(2))


def test_gspo_value_and_per_token_gradient():
    log_ratio = torch.tensor([[0.1, -0.3, 0.5], [0.2, 0.4, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([[1.0] * 3, [-2.0] * 3], dtype=torch.float64)
    loss, metrics, grad = policy_loss(
        "gspo", log_ratio, advantages, mask, mode="seq-mean-token-mean", config=PolicyLossConfig(clip_ratio=10.0)
    )
    sequence_ratio = torch.tensor([math.exp(0.3 / 3), math.exp(0.6 / 2)], dtype=torch.float64)
    assert loss == pytest.approx(((-1.0 * sequence_ratio[0]) + (2.0 * sequence_ratio[1])).item() / 2)
    # each token: -A_i * sg(s_i) * d log pi / d log pi, averaged over its n_i tokens and 2 sequences
    expected = torch.stack(
        [-1.0 * sequence_ratio[0] / 3 / 2 * torch.ones(3), 2.0 * sequence_ratio[1] / 2 / 2 * torch.ones(3)]
    )
    torch.testing.assert_close(grad, (expected * mask).double())
    assert metrics["pg_clipfrac"] == 0.0


def test_gspo_clips_whole_sequences():
    loss, metrics, grad = policy_loss("gspo", [[0.5, 0.5]], [[1.0, 1.0]], config=PolicyLossConfig(clip_ratio=0.2))
    assert loss == pytest.approx(-1.2)
    assert metrics["pg_clipfrac"] == 1.0
    assert (grad == 0).all()


def test_gpg_by_hand():
    loss, _, grad = policy_loss("gpg", [[0.0, 0.0]], [[2.0, -1.0]])
    assert loss == pytest.approx(-(2.0 * -1.0 + -1.0 * -1.0) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.5]], dtype=torch.float64))


def test_geo_mean_by_hand():
    # A > 0 clips the log-ratio from above at 0.2: mean(0.1, 0.2) = 0.15
    loss, metrics, _ = policy_loss("geo_mean", [[0.1, 0.3]], [[1.0, 1.0]], config=PolicyLossConfig(clip_ratio=0.2))
    assert loss == pytest.approx(-math.exp(0.15))
    assert metrics["pg_clipfrac"] == 0.5 and metrics["pg_clipfrac_lower"] == 0.0
    # A < 0 clips from below at -0.2 and keeps the large ratio
    loss, metrics, _ = policy_loss("geo_mean", [[-0.3, 0.3]], [[-1.0, -1.0]], config=PolicyLossConfig(clip_ratio=0.2))
    assert loss == pytest.approx(math.exp(0.05))
    # as in verl, a token counts as clipped when its log-ratio leaves the band, on either side
    assert metrics["pg_clipfrac_lower"] == 1.0


def test_cispo_keeps_gradients_of_clipped_tokens():
    loss, metrics, grad = policy_loss("cispo", [[0.5, -0.5, 0.1]], [[1.0, 1.0, 1.0]])
    assert loss == pytest.approx(-(1.2 * -0.5 + 0.8 * -1.5 + math.exp(0.1) * -0.9) / 3)
    # as in verl: pg_clipfrac counts both sides, pg_clipfrac_lower is 0; the sides apart under other names
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 3) and metrics["pg_clipfrac_lower"] == 0.0
    assert metrics["pg_ratio_above_frac"] == pytest.approx(1 / 3)
    assert metrics["pg_ratio_below_frac"] == pytest.approx(1 / 3)
    torch.testing.assert_close(grad, torch.tensor([[-0.4, -0.8 / 3, -math.exp(0.1) / 3]], dtype=torch.float64))


def test_sapo_is_policy_gradient_at_ratio_one():
    config = PolicyLossConfig(tau_pos=1.0, tau_neg=2.0)
    loss, _, grad = policy_loss("sapo", [[0.0, 0.0]], [[1.0, -1.0]], config=config)
    assert loss == pytest.approx((-2.0 + 1.0) / 2)  # gate at r = 1 is 2 / tau
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.5]], dtype=torch.float64))
    _, _, far_grad = policy_loss("sapo", [[3.0]], [[1.0]], config=config)
    assert 0 < -far_grad.item() < 0.5  # the gate fades far from r = 1
    # nothing is clipped (verl reports 0); the ratios outside [0.8, 1.2] have their own names
    _, metrics, _ = policy_loss("sapo", [[0.5, -0.5, 0.0, 0.1]], [[1.0, 1.0, -1.0, 1.0]], config=config)
    assert metrics["pg_clipfrac"] == 0.0 and metrics["pg_clipfrac_lower"] == 0.0
    assert metrics["pg_ratio_above_frac"] == pytest.approx(0.25)
    assert metrics["pg_ratio_below_frac"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="tau_pos"):
        policy_loss("sapo", [[0.0]], [[1.0]], config=PolicyLossConfig(tau_neg=0.0))


def test_clip_cov_detaches_a_share_of_tokens():
    config = PolicyLossConfig(clip_cov_ratio=0.5, clip_cov_lb=-100.0, clip_cov_ub=100.0)
    torch.manual_seed(0)
    _, metrics, grad = policy_loss("clip_cov", [[0.0, 0.01, 0.02, 0.03]], [[1.0, -1.0, 2.0, 0.5]], config=config)
    assert metrics["pg_clipcov_frac"] == 0.5
    assert metrics["pg_clipfrac"] == 0.5  # verl's meaning: the share detached
    assert metrics["pg_ppo_clipfrac"] == 0.0
    assert (grad == 0).sum() == 2


def test_kl_cov_penalises_the_highest_covariance_token():
    config = PolicyLossConfig(kl_cov_ratio=0.25, ppo_kl_coef=1.0)
    log_ratio = torch.tensor([[0.0, 0.0, 0.0, 0.1]], dtype=torch.float64)
    # log pi = -1 + log_ratio; covariance peaks at the last token (largest A and largest log pi)
    advantages = torch.tensor([[-1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    loss, metrics, _ = policy_loss("kl_cov", log_ratio, advantages, config=config)
    assert loss == pytest.approx((1.0 - math.exp(0.1) + 0.1) / 4)
    assert metrics["pg_klcov_frac"] == 0.25
    assert metrics["ppo_kl"] == pytest.approx(0.1 / 4)  # verl's kl_cov reports mean |log r|
    assert metrics["ppo_kl_signed"] == pytest.approx(-0.1 / 4)


def test_unknown_loss_lists_known_ones():
    with pytest.raises(ValueError, match="cispo, clip_cov, dppo_kl, dppo_tv, dro, geo_mean"):
        policy_loss("ppo", [[0.0]], [[1.0]])


MICRO_BATCH_SAFE = ["vanilla", "dppo_tv", "dppo_kl", "gspo", "gpg", "geo_mean", "cispo", "sapo", "dro"]


@pytest.mark.parametrize("name", MICRO_BATCH_SAFE)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_micro_batch_gradients_equal_full_batch(name, mode, seed):
    generator = torch.Generator().manual_seed(seed)
    batch, length = 5, 4
    mask = (torch.rand(batch, length, generator=generator) > 0.3).double()
    old_log_probs = -torch.rand(batch, length, generator=generator, dtype=torch.float64)
    log_probs = (
        old_log_probs + 0.3 * torch.randn(batch, length, generator=generator, dtype=torch.float64)
    ).requires_grad_()
    advantages = torch.randn(batch, 1, generator=generator, dtype=torch.float64).expand(batch, length)
    config = PolicyLossConfig(dro_beta=0.1)

    def loss_of(rows, normalizer=None):
        loss, _ = compute_policy_loss(
            name,
            old_log_probs=old_log_probs[rows],
            log_probs=log_probs[rows],
            advantages=advantages[rows],
            response_mask=mask[rows],
            loss_agg_mode=mode,
            config=config,
            normalizer=normalizer,
        )
        return loss

    (full_grad,) = torch.autograd.grad(loss_of(slice(None)), log_probs)
    normalizer = LossNormalizer.from_mask(mask)
    micro_loss = loss_of(slice(0, 2), normalizer) + loss_of(slice(2, batch), normalizer)
    (micro_grad,) = torch.autograd.grad(micro_loss, log_probs)
    torch.testing.assert_close(micro_grad, full_grad)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masked_positions_never_matter(name):
    generator = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    old_log_probs = -torch.rand(2, 3, generator=generator)
    log_probs = old_log_probs + 0.1 * torch.randn(2, 3, generator=generator)
    advantages = torch.randn(2, 3, generator=generator)
    results = []
    for fill in (0.0, 1e3):
        torch.manual_seed(0)
        noisy_log_probs = torch.where(mask.bool(), log_probs, torch.full_like(log_probs, -fill)).requires_grad_()
        loss, metrics = compute_policy_loss(
            name,
            old_log_probs=old_log_probs,
            log_probs=noisy_log_probs,
            advantages=torch.where(mask.bool(), advantages, torch.full_like(advantages, fill)),
            response_mask=mask,
            loss_agg_mode="token-mean",
            config=PolicyLossConfig(dro_beta=0.1),
        )
        loss.backward()
        results.append((loss.detach(), noisy_log_probs.grad * mask, metrics))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        torch.testing.assert_close(results[0][2][key], results[1][2][key])
        assert not results[0][2][key].requires_grad


def test_gspo_token_gradient_is_sequence_ratio_times_own_log_prob_gradient():
    """Through a tiny softmax policy: d loss / d theta = sum_t -A s_i / (n_i N) * d log pi_t / d theta."""
    generator = torch.Generator().manual_seed(7)
    theta = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3), generator=generator)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    advantages = torch.tensor([[0.7], [-1.3]], dtype=torch.float64).expand(2, 3)
    old_log_probs = log_probs_from_logits(theta.detach() + 0.1, labels)
    log_probs = log_probs_from_logits(theta, labels)
    loss, _ = compute_policy_loss(
        "gspo",
        old_log_probs=old_log_probs,
        log_probs=log_probs,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode="seq-mean-token-mean",
        config=PolicyLossConfig(clip_ratio=10.0),
    )
    (grad,) = torch.autograd.grad(loss, theta, retain_graph=True)

    lengths = mask.sum(dim=-1)
    sequence_ratio = torch.exp(((log_probs - old_log_probs) * mask).sum(dim=-1) / lengths).detach()
    expected = torch.zeros_like(theta)
    for row in range(2):
        for t in range(3):
            if mask[row, t]:
                (token_grad,) = torch.autograd.grad(log_probs[row, t], theta, retain_graph=True)
                expected += -advantages[row, t] * sequence_ratio[row] / lengths[row] / 2 * token_grad
    torch.testing.assert_close(grad, expected)


def token_loss(name, log_probs, old_log_probs, advantages, config=None, **kwargs):
    """Like policy_loss, but with the log-probs given (a ratio of e^25 needs an old log-prob below -25)."""
    log_probs = torch.tensor(log_probs, dtype=torch.float64, requires_grad=True)
    old_log_probs = torch.tensor(old_log_probs, dtype=torch.float64)
    advantages = torch.tensor(advantages, dtype=torch.float64)
    loss, metrics = compute_policy_loss(
        name, old_log_probs=old_log_probs, log_probs=log_probs, advantages=advantages,
        response_mask=torch.ones_like(log_probs), loss_agg_mode="token-mean",
        config=config or PolicyLossConfig(dro_beta=0.1), **kwargs)
    loss.backward()
    return loss.item(), {key: float(value) for key, value in metrics.items()}, log_probs.grad


E25, E20 = math.exp(25.0), math.exp(20.0)


@pytest.mark.parametrize(("name", "advantage", "expected_loss", "expected_grad"), [
    # bounded to +-20 as in verl: the dual clip caps the loss at -A c = 3; no gradient
    ("vanilla", -1.0, 3.0, 0.0),
    ("vanilla", 1.0, -1.2, 0.0),
    # bounded ratio e^20 truncated at clip_ratio_c = 3: -A 3 log pi with log pi = -1; pi rose by 0.37,
    # beyond 0.2, which drops the token for A > 0 and keeps it for A < 0
    ("dppo_tv", -1.0, -3.0, 3.0),
    ("dppo_tv", 1.0, 0.0, 0.0),
    ("dppo_kl", -1.0, -3.0, 3.0),
    ("dppo_kl", 1.0, 0.0, 0.0),
    # no bound in verl: exp(25) itself, and the gradient of -A r is -A r
    ("clip_cov", -1.0, E25, E25),
    # the one token is the top-covariance token: + 0.1 |log r|, whose gradient is 0.1
    ("kl_cov", -1.0, E25 + 2.5, E25 + 0.1),
    # pessimistic for A < 0 keeps 25 (not clipped to 0.2): -mean A exp(mean log r)
    ("geo_mean", -1.0, E25, E25),
    ("geo_mean", 1.0, -math.exp(0.2), 0.0),
    # the weight sg(clip(e^20)) = 1.2 times -A log pi
    ("cispo", -1.0, -1.2, 1.2),
    # sigmoid saturated at 1: -A 4 / tau_neg, no gradient
    ("sapo", -1.0, 4.0 / 1.05, 0.0),
    # no ratio at all: -A log pi, and DRO adds beta/2 (log r)^2 = 0.05 * 625
    ("gpg", -1.0, -1.0, 1.0),
    ("dro", -1.0, -1.0 + 31.25, 1.0 + 2.5),
])
def test_a_token_with_log_ratio_25(name, advantage, expected_loss, expected_grad):
    """log pi = -1, log pi_old = -26. Only vanilla, dppo_*, cispo and sapo bound the log-ratio (as verl)."""
    loss, metrics, grad = token_loss(name, [[-1.0]], [[-26.0]], [[advantage]])
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert grad.item() == pytest.approx(expected_grad, rel=1e-6)
    # as verl: the losses that bound the log-ratio report the bounded one; kl_cov reports mean |log r|
    expected_kl = {"kl_cov": 25.0, "vanilla": -20.0, "dppo_tv": -20.0, "dppo_kl": -20.0, "cispo": -20.0,
                   "sapo": -20.0}.get(name, -25.0)
    assert metrics["ppo_kl"] == pytest.approx(expected_kl)


def test_gspo_with_a_log_ratio_25_token():
    # the sequence's mean log-ratio is 25 / 4 (under gspo's own bound of 10): s = e^6.25, and with
    # A = -1 the unclipped -A s wins; each token's gradient is -A s / 4 (token-mean over 4 tokens)
    loss, metrics, grad = token_loss("gspo", [[-1.0, -2.0, -2.0, -2.0]], [[-26.0, -2.0, -2.0, -2.0]], [[-1.0] * 4])
    assert loss == pytest.approx(math.exp(6.25))
    torch.testing.assert_close(grad, torch.full((1, 4), math.exp(6.25) / 4, dtype=torch.float64))
    assert metrics["ppo_kl"] == pytest.approx(-25.0 / 4)


def test_dppo_drops_tokens_outside_the_trust_region():
    # pi_old = 0.5; pi = 0.8 (moved +0.3), 0.6 (+0.1), 0.2 (-0.3), 0.45 (-0.05); clip_ratio 0.2
    log_probs = [[math.log(0.8), math.log(0.6), math.log(0.2), math.log(0.45)]]
    old = [[math.log(0.5)] * 4]
    loss, metrics, grad = token_loss("dppo_tv", log_probs, old, [[1.0, 1.0, -1.0, -1.0]])
    # kept: the second (A > 0, +0.1 <= 0.2) and the fourth (A < 0, -0.05 >= -0.2); ratios 1.2 and 0.9
    assert loss == pytest.approx((-1.2 * math.log(0.6) + 0.9 * math.log(0.45)) / 4)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.2 / 4, 0.0, 0.9 / 4]], dtype=torch.float64))
    assert metrics["pg_clipfrac"] == 0.5 and metrics["pg_clipfrac_lower"] == 0.0
    # binary KL of 0.5 -> 0.8 is 0.5 log(0.5 / 0.8) + 0.5 log(0.5 / 0.2) = 0.223 > 0.2; of 0.5 -> 0.6 is 0.020
    _, metrics, grad = token_loss("dppo_kl", log_probs, old, [[1.0, 1.0, -1.0, -1.0]])
    assert metrics["pg_clipfrac"] == 0.5  # 0.5 -> 0.2 is 0.223 as well
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.2 / 4, 0.0, 0.9 / 4]], dtype=torch.float64))
    # a token that moved against its advantage is always kept; the ratio is truncated at clip_ratio_c
    _, metrics, grad = token_loss("dppo_kl", [[math.log(0.9)]], [[math.log(0.1)]], [[-1.0]])
    assert grad.item() == pytest.approx(3.0) and metrics["pg_clipfrac_lower"] == 1.0


def test_dro_by_hand_and_needs_its_beta():
    loss, _, grad = token_loss("dro", [[-1.0, -2.0]], [[-1.5, -1.0]], [[2.0, -1.0]],
                               config=PolicyLossConfig(dro_beta=0.4))
    # -(A log pi - 0.2 (log r)^2): -(-2 - 0.05) and -(2 - 0.2)
    assert loss == pytest.approx((2.05 - 1.8) / 2)
    # -A + beta log r
    torch.testing.assert_close(grad, torch.tensor([[(-2.0 + 0.2) / 2, (1.0 - 0.4) / 2]], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"dro_beta=None must be a positive number"):
        token_loss("dro", [[-1.0]], [[-1.0]], [[1.0]], config=PolicyLossConfig())


def test_geo_mean_takes_the_geometric_mean_of_importance_weights():
    weights = torch.tensor([[4.0, 1.0]], dtype=torch.float64)
    loss, _, _ = policy_loss("geo_mean", [[0.0, 0.0]], [[1.0, 1.0]], importance_weights=weights)
    assert loss == pytest.approx(-2.0)  # sqrt(4 * 1), not (4 + 1) / 2
    # a zero weight (rejected by IcePop) zeroes the row without a nan
    loss, _, grad = policy_loss("geo_mean", [[0.0, 0.0]], [[1.0, 1.0]],
                                importance_weights=torch.tensor([[0.0, 1.0]], dtype=torch.float64))
    assert abs(loss) < 1e-4 and torch.isfinite(grad).all()


def test_overflow_is_guarded_without_changing_finite_results():
    for log_ratio in (80.0, 88.0):
        ratio = overflow_safe_exp(torch.tensor(log_ratio, requires_grad=True))
        assert ratio.item() == torch.exp(torch.tensor(log_ratio)).item()
    # exp(100) overflows float32: verl's clip_cov gives an infinite loss and a nan gradient
    log_probs = torch.tensor([[-1.0]], requires_grad=True)
    loss, _ = compute_policy_loss(
        "clip_cov", old_log_probs=torch.tensor([[-101.0]]), log_probs=log_probs, advantages=torch.tensor([[-1.0]]),
        response_mask=torch.ones(1, 1), loss_agg_mode="token-mean", config=PolicyLossConfig())
    loss.backward()
    assert torch.isfinite(loss) and loss.item() > 1e38
    assert log_probs.grad.item() == 0.0
