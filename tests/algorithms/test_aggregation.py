import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reinforge.algorithms import LOSS_AGG_MODES, LossNormalizer, aggregate_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 18.0 / 5),
        ("token-sum", 18.0),
        # the empty third row is not a sequence
        ("seq-mean-token-sum", (3.0 + 15.0) / 2),
        ("seq-mean-token-mean", (1.5 + 5.0) / 2),
        ("seq-mean-token-sum-norm", (3.0 + 15.0) / 3 / 2),
    ],
)
def test_modes_by_hand(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_normalizer_replaces_local_counts():
    normalizer = LossNormalizer(num_tokens=10, num_sequences=4, max_response_length=6)
    assert aggregate_loss(LOSS, MASK, "token-mean", normalizer).item() == pytest.approx(1.8)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-mean", normalizer).item() == pytest.approx(6.5 / 4)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", normalizer).item() == pytest.approx(18 / 6 / 4)


def test_masked_nan_is_ignored_and_all_masked_gives_zero():
    loss = LOSS.clone()
    loss[0, 2] = float("nan")
    for mode in LOSS_AGG_MODES:
        assert torch.isfinite(aggregate_loss(loss, MASK, mode))
        assert aggregate_loss(loss, torch.zeros_like(MASK), mode).item() == 0.0


def test_unknown_mode_lists_known_ones():
    with pytest.raises(ValueError, match="token-mean, token-sum"):
        aggregate_loss(LOSS, MASK, "mean")


def test_normalizer_from_mask():
    normalizer = LossNormalizer.from_mask(MASK)
    assert normalizer == LossNormalizer(num_tokens=5.0, num_sequences=2.0, max_response_length=3)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 2**16))
def test_modes_agree_on_equal_lengths(batch, length, seed):
    loss = torch.randn(batch, length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mask = torch.ones(batch, length)
    token_mean = aggregate_loss(loss, mask, "token-mean")
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean"), token_mean)
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum-norm"), token_mean)
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum"), token_mean * length)
    torch.testing.assert_close(aggregate_loss(loss, mask, "token-sum"), token_mean * length * batch)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@settings(max_examples=15, deadline=None)
@given(batch=st.integers(2, 7), length=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_micro_batch_gradients_equal_full_batch(mode, batch, length, seed):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=generator) > 0.3).double()
    weight = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)

    full_loss = aggregate_loss((weight * features).square(), mask, mode)
    (full_grad,) = torch.autograd.grad(full_loss, weight)

    normalizer = LossNormalizer.from_mask(mask)
    split = int(torch.randint(1, batch, (1,), generator=generator))
    micro_losses = [
        aggregate_loss((weight * features[rows]).square(), mask[rows], mode, normalizer)
        for rows in (slice(0, split), slice(split, batch))
    ]
    (micro_grad,) = torch.autograd.grad(sum(micro_losses), weight)
    torch.testing.assert_close(sum(micro_losses), full_loss)
    torch.testing.assert_close(micro_grad, full_grad)
