"""The preference losses on small cases worked out by hand."""

import math

import pytest
import torch

from reinforge.algorithms.preference_losses import bradley_terry_loss, dpo_loss


def test_bradley_terry_is_minus_log_sigmoid_of_the_reward_difference_less_the_margin():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])
    loss = bradley_terry_loss(chosen, rejected, torch.tensor([0.0, -1.0]))
    assert loss.tolist() == pytest.approx([math.log(1 + math.exp(-1.0)), math.log(1 + math.exp(-1.0))])


def test_centring_adds_the_squared_sum_of_the_pair_rewards():
    chosen, rejected = torch.tensor([3.0]), torch.tensor([1.0])
    plain = bradley_terry_loss(chosen, rejected)
    centred = bradley_terry_loss(chosen, rejected, center_coefficient=0.01)
    assert float(centred - plain) == pytest.approx(0.01 * 16.0)


# policy log-ratios: chosen +1.0, rejected -1.0, so delta = 2
LOGPS = (torch.tensor([-4.0]), torch.tensor([-6.0]), torch.tensor([-5.0]), torch.tensor([-5.0]))


@pytest.mark.parametrize(("loss_type", "expected"), [
    ("sigmoid", math.log(1 + math.exp(-0.2))),  # -log sigmoid(beta * delta), beta 0.1
    ("ipo", (2.0 - 5.0) ** 2),  # (delta - 1 / (2 beta))^2
    ("hinge", 1.0 - 0.2),  # relu(1 - beta * delta)
])
def test_dpo_losses_at_a_known_log_ratio(loss_type, expected):
    loss, chosen_rewards, rejected_rewards = dpo_loss(*LOGPS, beta=0.1, loss_type=loss_type)
    assert float(loss) == pytest.approx(expected)
    assert float(chosen_rewards) == pytest.approx(0.1) and float(rejected_rewards) == pytest.approx(-0.1)


def test_sigmoid_ignores_label_smoothing_and_robust_reads_it():
    sigmoid = dpo_loss(*LOGPS, beta=0.1, loss_type="sigmoid", label_smoothing=0.2)[0]
    assert float(sigmoid) == pytest.approx(math.log(1 + math.exp(-0.2)))
    assert float(dpo_loss(*LOGPS, beta=0.1, loss_type="robust")[0]) == pytest.approx(float(sigmoid))
    robust = dpo_loss(*LOGPS, beta=0.1, loss_type="robust", label_smoothing=0.2)[0]
    log_sigmoid_plus, log_sigmoid_minus = math.log(1 / (1 + math.exp(-0.2))), math.log(1 / (1 + math.exp(0.2)))
    assert float(robust) == pytest.approx((0.8 * -log_sigmoid_plus + 0.2 * log_sigmoid_minus) / 0.6)


def test_an_unknown_loss_type_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="is not one of sigmoid, ipo, hinge, robust"):
        dpo_loss(*LOGPS, beta=0.1, loss_type="kto")
