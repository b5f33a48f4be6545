import pytest
import torch

from reinforge.algorithms import entropy_from_logits, log_probs_from_logits
from reinforge.engine import log_probs as log_probs_module
from reinforge.engine.log_probs import linear_log_probs, linear_log_probs_and_sum_pi_squared


@pytest.mark.parametrize("temperature,chunk_size,store_logits", [(1.0, 4, True), (0.7, 5, False), (1.3, 100, False),
                                                                 (0.7, 5, True)])
def test_chunked_log_probs_and_entropy_match_full_logits(temperature, chunk_size, store_logits):
    # without stored logits: the chunked path, whose backward recomputes each chunk's logits
    max_logits_bytes = {} if store_logits else {"max_logits_bytes": 0}
    generator = torch.Generator().manual_seed(0)
    hidden = (0.5 * torch.randn(13, 8, generator=generator, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(31, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 31, (13,), generator=generator)
    grad_lp, grad_ent = torch.randn(13, generator=generator), torch.randn(13, generator=generator)

    log_probs, entropy = linear_log_probs(hidden, weight, targets, temperature, chunk_size, **max_logits_bytes)
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


@pytest.mark.parametrize("store_logits", [True, False])
def test_log_probs_of_an_output_layer_with_a_bias(store_logits):
    """Phi-2's and GPT-J's output layers add a bias: the log-probs, entropy and gradients (the bias's too, and its
    sum over scoring) are those of ``hidden @ weight.T + bias``."""
    max_logits_bytes = {} if store_logits else {"max_logits_bytes": 0}
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(11, 8, generator=generator, dtype=torch.float64).requires_grad_()
    weight = torch.randn(29, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(29, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 29, (11,), generator=generator)
    grad_lp, grad_ent = torch.randn(11, generator=generator), torch.randn(11, generator=generator)
    log_probs, entropy = linear_log_probs(hidden, weight, targets, 0.8, 4, bias=bias, **max_logits_bytes)
    ((log_probs * grad_lp).sum() + (entropy * grad_ent).sum()).backward()
    fused_grads = hidden.grad.clone(), weight.grad.clone(), bias.grad.clone()
    hidden.grad, weight.grad, bias.grad = None, None, None

    logits = (hidden @ weight.t() + bias) / 0.8
    expected_lp = log_probs_from_logits(logits[None], targets[None])[0]
    expected_ent = entropy_from_logits(logits[None])[0]
    ((expected_lp * grad_lp).sum() + (expected_ent * grad_ent).sum()).backward()
    torch.testing.assert_close(log_probs, expected_lp.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_ent.float(), atol=1e-5, rtol=1e-5)
    for got, expected in zip(fused_grads, (hidden.grad, weight.grad, bias.grad), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    scored = linear_log_probs_and_sum_pi_squared(hidden.detach(), weight.detach(), targets, 0.8, 4, bias=bias.detach(),
                                                 **max_logits_bytes)
    torch.testing.assert_close(scored[0], expected_lp.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("store_logits", [True, False])
@pytest.mark.parametrize("logit_scale,softcap", [(1.0, 2.0), (0.25, None), (0.5, 3.0)])
def test_log_probs_of_scaled_and_soft_capped_logits(logit_scale, softcap, store_logits):
    """The log-probs, entropy and gradients are those of the model's logits: scaled, then capped c tanh(x / c)."""
    max_logits_bytes = {} if store_logits else {"max_logits_bytes": 0}
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(11, 8, generator=generator, dtype=torch.float64).requires_grad_()
    weight = torch.randn(29, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 29, (11,), generator=generator)
    grad_lp, grad_ent = torch.randn(11, generator=generator), torch.randn(11, generator=generator)
    log_probs, entropy = linear_log_probs(hidden, weight, targets, 0.8, 4, logit_scale=logit_scale, softcap=softcap,
                                          **max_logits_bytes)
    ((log_probs * grad_lp).sum() + (entropy * grad_ent).sum()).backward()
    fused_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None

    logits = (hidden @ weight.t()) * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / 0.8
    expected_lp = log_probs_from_logits(logits[None], targets[None])[0]
    expected_ent = entropy_from_logits(logits[None])[0]
    ((expected_lp * grad_lp).sum() + (expected_ent * grad_ent).sum()).backward()
    torch.testing.assert_close(log_probs, expected_lp.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_ent.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_grads[1], weight.grad, atol=1e-5, rtol=1e-5)
    scored = linear_log_probs_and_sum_pi_squared(hidden.detach(), weight.detach(), targets, 0.8,
                                                 logit_scale=logit_scale, softcap=softcap)
    torch.testing.assert_close(scored[0], expected_lp.float(), atol=1e-5, rtol=1e-5)
    expected_pi2 = torch.softmax(logits.detach(), -1).pow(2).sum(-1)
    torch.testing.assert_close(scored[2], expected_pi2.float(), atol=1e-5, rtol=1e-5)


def test_log_probs_alone_backpropagate():
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4)
    log_probs, _ = linear_log_probs(hidden, weight, torch.arange(6), chunk_size=4)
    log_probs.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_a_second_backward_through_stored_logits_is_refused():
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4)
    log_probs, _ = linear_log_probs(hidden, weight, torch.arange(6))
    log_probs.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        log_probs.sum().backward()


@pytest.mark.parametrize("vocab_size,logit_scale,softcap", [(37, 1.0, None), (5000, 1.0, None), (37, 0.5, 2.0),
                                                              (5000, 1.0, 30.0)])
def test_triton_row_kernels_match_the_pytorch_math(vocab_size, logit_scale, softcap):
    """Under TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU) the kernels run on the CPU."""
    pytest.importorskip("triton")
    from reinforge.engine import log_prob_kernels

    generator = torch.Generator().manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = (3 * torch.randn(5, vocab_size, generator=generator)).to(device)
    logits[1, : vocab_size // 2] = -1e4  # a row whose mass sits in its second half
    targets = torch.randint(0, vocab_size, (5,), generator=generator).to(device)
    transform = {"logit_scale": logit_scale, "softcap": softcap}
    log_probs, entropy, lse = log_prob_kernels.row_stats(logits, targets, 1 / 0.7, **transform)
    expected = log_probs_module._chunk_forward(logits, targets, 1 / 0.7, **transform)
    for value, reference in zip((log_probs, entropy, lse), expected, strict=True):
        torch.testing.assert_close(value, reference, atol=1e-4, rtol=1e-4)
    grad_lp = torch.randn(5, generator=generator).to(device)
    grad_ent = torch.randn(5, generator=generator).to(device)
    grads = log_prob_kernels.row_grads(logits, targets, lse, entropy, grad_lp, grad_ent, 1 / 0.7, **transform)
    reference = log_probs_module._chunk_grad(logits, targets, lse, entropy, grad_lp, grad_ent, 1 / 0.7, **transform)
    torch.testing.assert_close(grads, reference, atol=1e-5, rtol=1e-4)
    # written over the logits themselves, as the backward does with stored logits
    log_prob_kernels.row_grads(logits, targets, lse, entropy, grad_lp, grad_ent, 1 / 0.7, out=logits, **transform)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-4)


def test_scoring_without_grad_gives_the_training_pass_log_probs_bit_for_bit():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(40, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (40,), generator=generator)
    with torch.no_grad():
        scored, scored_entropy = linear_log_probs(hidden, weight, targets, 0.8, chunk_size=7)
    trained, trained_entropy = linear_log_probs(hidden, weight, targets, 0.8, chunk_size=7)
    assert torch.equal(scored, trained.detach()) and torch.equal(scored_entropy, trained_entropy.detach())


def _sum_pi_squared_case(device="cpu", dtype=torch.float32):
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(23, 16, generator=generator).to(device, dtype)
    weight = torch.randn(41, 16, generator=generator).to(device, dtype)
    targets = torch.randint(0, 41, (23,), generator=generator).to(device)
    probs = torch.softmax((hidden.float() @ weight.float().t()) / 0.7, dim=-1)
    return hidden, weight, targets, probs.square().sum(-1)


@pytest.mark.parametrize("max_logits_bytes", [2**30, 0])  # all rows at once, or 5 at a time
def test_sum_pi_squared_comes_with_the_scoring_pass_log_probs(max_logits_bytes):
    hidden, weight, targets, expected = _sum_pi_squared_case()
    log_probs, entropy, sum_pi_squared = linear_log_probs_and_sum_pi_squared(
        hidden, weight, targets, 0.7, chunk_size=5, max_logits_bytes=max_logits_bytes)
    torch.testing.assert_close(sum_pi_squared, expected)
    with torch.no_grad():
        scored, scored_entropy = linear_log_probs(hidden, weight, targets, 0.7, chunk_size=5,
                                                  max_logits_bytes=max_logits_bytes)
    assert torch.equal(log_probs, scored) and torch.equal(entropy, scored_entropy)


def test_sum_pi_squared_with_the_triton_row_kernels(monkeypatch):
    """The CUDA path: the kernels' log-sum-exp feeds the PyTorch sum (interpreted on the CPU without a GPU)."""
    pytest.importorskip("triton")
    from reinforge.engine import log_prob_kernels

    monkeypatch.setattr(log_probs_module, "_row_math", lambda tensor: (log_prob_kernels.row_stats,
                                                                       log_prob_kernels.row_grads))
    hidden, weight, targets, expected = _sum_pi_squared_case()
    _, _, sum_pi_squared = linear_log_probs_and_sum_pi_squared(hidden, weight, targets, 0.7)
    torch.testing.assert_close(sum_pi_squared, expected)


@pytest.mark.gpu
def test_sum_pi_squared_on_cuda_in_bfloat16():
    hidden, weight, targets, expected = _sum_pi_squared_case("cuda", torch.bfloat16)
    log_probs, _, sum_pi_squared = linear_log_probs_and_sum_pi_squared(hidden, weight, targets, 0.7)
    logits = (hidden @ weight.t()).float() / 0.7
    torch.testing.assert_close(sum_pi_squared, torch.softmax(logits, -1).square().sum(-1), atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        assert torch.equal(log_probs, linear_log_probs(hidden, weight, targets, 0.7)[0])
