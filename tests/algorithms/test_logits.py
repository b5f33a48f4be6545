import math

import pytest
import torch

from reinforge.algorithms import entropy_from_logits, log_probs_from_logits


def test_log_probs_by_hand():
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)]])
    labels = torch.tensor([2])
    torch.testing.assert_close(log_probs_from_logits(logits, labels), torch.tensor([math.log(0.5)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_match_log_softmax(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator).to(dtype)
    labels = torch.randint(0, 11, (2, 5), generator=generator)
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    result = log_probs_from_logits(logits, labels, chunk_size=3)
    assert result.dtype == torch.float32 and result.shape == (2, 5)
    torch.testing.assert_close(result, expected)


def test_log_probs_gradient_flows():
    logits = torch.zeros(1, 3, requires_grad=True)
    log_probs_from_logits(logits, torch.tensor([0])).sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[2 / 3, -1 / 3, -1 / 3]]))


def test_entropy_by_hand():
    assert entropy_from_logits(torch.zeros(4, 8)).allclose(torch.full((4,), math.log(8)))
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
