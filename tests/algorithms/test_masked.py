import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reinforge.algorithms import masked_mean, masked_sum, masked_var, masked_whiten


def test_masked_mean_and_sum_by_hand():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_sum(values, mask).item() == 13.0
    assert masked_mean(values, mask).item() == 13.0 / 4
    assert torch.equal(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 5.0]))


def test_masked_mean_of_nothing_is_zero():
    assert masked_mean(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0


def test_masked_var_is_bessel_corrected():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1, 1, 1, 0])
    assert math.isclose(masked_var(values, mask).item(), 1.0)
    assert math.isclose(masked_var(values, mask, unbiased=False).item(), 2 / 3, rel_tol=1e-6)
    assert masked_var(values, torch.tensor([0, 1, 0, 0])).item() == 0.0


def test_masked_whiten_by_hand():
    values = torch.tensor([1.0, 3.0, 50.0])
    mask = torch.tensor([1, 1, 0])
    # mean 2, unbiased var 2
    expected = torch.tensor([-1.0, 1.0, 0.0]) / math.sqrt(2 + 1e-8)
    torch.testing.assert_close(masked_whiten(values, mask), expected)
    torch.testing.assert_close(
        masked_whiten(values, mask, shift_mean=False), torch.tensor([expected[0] + 2, expected[1] + 2, 0.0])
    )


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**16))
def test_masked_values_never_matter(batch, length, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, length, generator=generator)
    mask = torch.rand(batch, length, generator=generator) > 0.4
    garbage = torch.where(mask, values, torch.full_like(values, 1e30))
    torch.testing.assert_close(masked_mean(values, mask), masked_mean(garbage, mask))
    torch.testing.assert_close(masked_var(values, mask), masked_var(garbage, mask))
    torch.testing.assert_close(masked_whiten(values, mask), masked_whiten(garbage, mask))
