import math

import pytest
import torch

from reinforge.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
)
from reinforge.config.schema import KLControlConfig

LOG_PROBS = torch.tensor([[-1.0, -2.0]])
REF_LOG_PROBS = torch.tensor([[-1.5, -1.0]])  # log ratio d = [0.5, -1.0]


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("k1", "kl"), [0.5, -1.0]),
        (("abs",), [0.5, 1.0]),
        (("k2", "mse"), [0.125, 0.5]),
        (("k3", "low_var_kl"), [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1]),
    ],
)
def test_estimators_by_hand(names, expected):
    for name in names:
        torch.testing.assert_close(kl_penalty(LOG_PROBS, REF_LOG_PROBS, name), torch.tensor([expected]))


def test_k3_is_clamped():
    value = kl_penalty(torch.tensor([0.0, 0.0]), torch.tensor([30.0, -30.0]), "k3")
    torch.testing.assert_close(value, torch.tensor([10.0, 10.0]))


@pytest.mark.parametrize("name", ["k1+", "abs+", "k3+", "low_var_kl+"])
def test_straight_through_has_named_value_and_k2_gradient(name):
    log_probs = LOG_PROBS.clone().requires_grad_()
    value = kl_penalty(log_probs, REF_LOG_PROBS, name)
    torch.testing.assert_close(value, kl_penalty(LOG_PROBS, REF_LOG_PROBS, name[:-1]))
    value.sum().backward()
    torch.testing.assert_close(log_probs.grad, LOG_PROBS - REF_LOG_PROBS)


def test_unknown_estimator_lists_known_ones():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(LOG_PROBS, REF_LOG_PROBS, "full")


def test_adaptive_controller_by_hand_and_state_roundtrip():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    controller.update(current_kl=0.5, num_steps=10)  # error 4 clipped to 0.2
    assert controller.value == pytest.approx(0.1 * 1.02)
    controller.update(current_kl=0.09, num_steps=10)  # error -0.1
    assert controller.value == pytest.approx(0.1 * 1.02 * 0.99)
    restored = AdaptiveKLController(init_kl_coef=1.0, target_kl=0.1, horizon=100)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value


def test_build_kl_controller():
    fixed = build_kl_controller(KLControlConfig(type="fixed", kl_coef=0.3))
    fixed.update(current_kl=5.0, num_steps=10)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3
    assert isinstance(build_kl_controller(KLControlConfig(type="adaptive")), AdaptiveKLController)
    with pytest.raises(ValueError, match="use one of fixed, adaptive"):
        build_kl_controller(KLControlConfig(type="pid"))


def test_apply_kl_penalty_by_hand():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    old_log_probs = torch.tensor([[-1.0, -1.0, 5.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])
    ref_log_probs = torch.tensor([[-1.5, -0.5, 0.0], [-1.2, -1.0, -1.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=30)
    rewards, metrics = apply_kl_penalty(scores, old_log_probs, ref_log_probs, mask, controller, "k1")
    expected = torch.tensor([[-0.05, 1.05, 0.0], [-0.02, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)
    # row means: 0 and 0.2/3; the empty row is left out
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.1 / 3)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    # error 1/3 - 1 is clipped to -0.2; num_steps is the batch size 3
    assert controller.value == pytest.approx(0.1 * (1 - 0.2 * 3 / 30))
