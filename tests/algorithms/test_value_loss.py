import pytest
import torch

from reinforge.algorithms import LossNormalizer, compute_value_loss


def test_value_loss_by_hand():
    values = torch.tensor([[0.5, 1.4, 7.0]], requires_grad=True)
    old_values = torch.tensor([[0.0, 1.1, 0.0]])
    returns = torch.tensor([[1.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, clipfrac = compute_value_loss(values, old_values, returns, mask, 0.2, "token-mean")
    # token 0: clipped prediction 0.2, max(0.25, 0.64) = 0.64 (clipped wins)
    # token 1: clipped prediction 1.3, max(0.16, 0.09) = 0.16 (unclipped wins)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.16) / 2)
    assert clipfrac.item() == pytest.approx(0.5)
    loss.backward()
    # only the unclipped token gets a gradient: 0.5 * 2 * (1.4 - 1.0) / 2
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.2, 0.0]]))


def test_value_loss_unclipped_gradient():
    values = torch.tensor([[0.5]], requires_grad=True)
    loss, clipfrac = compute_value_loss(
        values, torch.tensor([[0.4]]), torch.tensor([[1.0]]), torch.ones(1, 1), 0.5, "token-sum"
    )
    loss.backward()
    assert clipfrac.item() == 0.0
    torch.testing.assert_close(values.grad, torch.tensor([[-0.5]]))


def test_value_loss_micro_batches_sum_to_full_batch():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    old_values = values + 0.3 * torch.randn(4, 3, generator=generator, dtype=torch.float64)
    returns = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    full, _ = compute_value_loss(values, old_values, returns, mask, 0.2, "seq-mean-token-mean")
    normalizer = LossNormalizer.from_mask(mask)
    parts = [
        compute_value_loss(
            values[rows], old_values[rows], returns[rows], mask[rows], 0.2, "seq-mean-token-mean", normalizer
        )[0]
        for rows in (slice(0, 1), slice(1, 4))
    ]
    torch.testing.assert_close(sum(parts), full)
