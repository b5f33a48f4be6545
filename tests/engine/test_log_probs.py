import pytest
import torch

from reinforge.algorithms import entropy_from_logits, log_probs_from_logits
from reinforge.engine.log_probs import linear_log_probs


@pytest.mark.parametrize("temperature,chunk_size", [(1.0, 4), (0.7, 5), (1.3, 100)])
def test_chunked_log_probs_and_entropy_match_full_logits(temperature, chunk_size):
    generator = torch.Generator().manual_seed(0)
    hidden = (0.5 * torch.randn(13, 8, generator=generator, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(31, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 31, (13,), generator=generator)
    grad_lp, grad_ent = torch.randn(13, generator=generator), torch.randn(13, generator=generator)

    log_probs, entropy = linear_log_probs(hidden, weight, targets, temperature, chunk_size)
    ((log_probs * grad_lp).sum() + (entropy * grad_ent).sum()).backward()
    fused_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None

    logits = (hidden @ weight.t()) / temperature
    expected_lp = log_probs_from_logits(logits[None], targets[None])[0]
    expected_ent = entropy_from_logits(logits[None])[0]
    ((expected_lp * grad_lp).sum() + (expected_ent * grad_ent).sum()).backward()
    torch.testing.assert_close(log_probs, expected_lp.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(entropy, expected_ent.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused_grads[0], hidden.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused_grads[1], weight.grad, atol=1e-4, rtol=1e-4)


def test_log_probs_alone_backpropagate():
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4)
    log_probs, _ = linear_log_probs(hidden, weight, torch.arange(6), chunk_size=4)
    log_probs.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
