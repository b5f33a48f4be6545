"""Log-probs and entropy of target tokens, fused with the output projection, chunk by chunk.

Full-vocabulary float32 logits are never materialised: ``linear_log_probs`` computes
``hidden @ weight.T`` in the compute dtype and reduces each row to a log-prob, an entropy and
a log-sum-exp in float32 (on CUDA with the one-pass Triton kernels of
``engine.log_prob_kernels``; elsewhere with the PyTorch functions here). When a gradient is
needed and the logits fit in ``max_logits_bytes`` they are kept for the backward, which overwrites them with their
gradient and runs one product for each input; otherwise (and without grad) the rows go
``chunk_size`` at a time and the backward recomputes each chunk's logits. The gradient is

    d log p_y / dz = onehot(y) - p        d H / dz = -p * (log p + H)

with z = logits / temperature. A model that transforms ``lm_head``'s output (``logit_scale``, a final
soft-cap ``c tanh(x / c)``, see ``engine.forward.logit_transform``) has it applied to each row here, on the
fly, and chained into the gradient (``dz/dx = scale (1 - tanh^2)``), so the log-probs are those of the
model's own logits. ``compute_log_prob`` (no grad) and the training pass run the
same product and kernels here: given the same hidden states they give the same log-probs bit
for bit (the layers before may still round differently with and without grad once compiled).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

DEFAULT_CHUNK_SIZE = 4096


def model_logits(logits: Tensor, logit_scale: float = 1.0, softcap: float | None = None) -> Tensor:
    """The logits the model returns from ``lm_head``'s output: times ``logit_scale``, then soft-capped; float32."""
    x = logits.float()
    if logit_scale != 1.0:
        x = x * logit_scale
    if softcap is not None:
        x = torch.tanh(x / softcap) * softcap
    return x


def _model_logits_slope(logits: Tensor, logit_scale: float, softcap: float | None) -> Tensor | float:
    """d model_logits / d logits, elementwise (a float when it is the same everywhere)."""
    if softcap is None:
        return logit_scale
    capped = torch.tanh(logits.float() * (logit_scale / softcap))
    return logit_scale * (1.0 - capped * capped)


def _chunk_forward(logits: Tensor, targets: Tensor, inv_temperature: float, logit_scale: float = 1.0,
                   softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    z = model_logits(logits, logit_scale, softcap) * inv_temperature
    lse = torch.logsumexp(z, dim=-1)
    log_probs = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    probs = torch.exp(z - lse.unsqueeze(-1))
    entropy = lse - (probs * z).sum(-1)
    return log_probs, entropy, lse


def _chunk_grad(logits: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor, grad_log_probs: Tensor,
                grad_entropy: Tensor, inv_temperature: float, logit_scale: float = 1.0,
                softcap: float | None = None) -> Tensor:
    z = model_logits(logits, logit_scale, softcap) * inv_temperature
    log_p = z - lse.unsqueeze(-1)
    probs = torch.exp(log_p)
    grad = -probs * (grad_log_probs.unsqueeze(-1) + (log_p + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1))
    grad = grad.scatter_add(-1, targets.unsqueeze(-1), grad_log_probs.unsqueeze(-1))
    return (grad * inv_temperature * _model_logits_slope(logits, logit_scale, softcap)).to(logits.dtype)


MAX_LOGITS_BYTES = 24 * 2**30
"""Default of ``max_logits_bytes``: when a micro-batch's logits (rows x vocab in the compute dtype)
fit in this many bytes (and in a fifth of the GPU's memory), they come from one matrix product,
and when gradients are needed the forward keeps them for the backward: one product each way
instead of one per chunk, no recomputation, and the backward writes the logits' gradient over
them. 52k response rows x 151,936 vocabulary in bf16 take 16 GB. Larger ones are chunked.
Scoring without gradients takes the same one product, so its log-probs are those of the
training pass bit for bit.
"""


def _fits_at_once(hidden: Tensor, vocab_size: int, max_logits_bytes: int) -> bool:
    budget = max_logits_bytes
    if hidden.is_cuda:
        budget = min(budget, torch.cuda.get_device_properties(hidden.device).total_memory // 5)
    return hidden.shape[0] * vocab_size * hidden.element_size() <= budget


def _torch_row_stats(logits: Tensor, targets: Tensor, inv_temperature: float, logit_scale: float = 1.0,
                     softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``_chunk_forward`` over the rows, ``DEFAULT_CHUNK_SIZE`` at a time (bounded float32 temporaries)."""
    parts = [_chunk_forward(logits[start:start + DEFAULT_CHUNK_SIZE], targets[start:start + DEFAULT_CHUNK_SIZE],
                            inv_temperature, logit_scale, softcap)
             for start in range(0, logits.shape[0], DEFAULT_CHUNK_SIZE)]
    if not parts:
        return tuple(logits.new_empty(0, dtype=torch.float32) for _ in range(3))
    return tuple(torch.cat(values) for values in zip(*parts, strict=True))


def _torch_row_grads(logits: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor, grad_log_probs: Tensor,
                     grad_entropy: Tensor, inv_temperature: float, out: Tensor | None = None,
                     logit_scale: float = 1.0, softcap: float | None = None) -> Tensor:
    """``_chunk_grad`` over the rows, ``DEFAULT_CHUNK_SIZE`` at a time; ``out`` may be ``logits``."""
    out = torch.empty_like(logits) if out is None else out
    for start in range(0, logits.shape[0], DEFAULT_CHUNK_SIZE):
        rows = slice(start, start + DEFAULT_CHUNK_SIZE)
        out[rows] = _chunk_grad(logits[rows], targets[rows], lse[rows], entropy[rows],
                                grad_log_probs[rows].float(), grad_entropy[rows].float(), inv_temperature,
                                logit_scale, softcap)
    return out


def _row_math(tensor: Tensor):
    """(stats, grads) for rows of logits: the Triton kernels on CUDA (one read of the logits forward,
    one read and one write backward), else the PyTorch functions."""
    if tensor.is_cuda:
        from reinforge.engine import log_prob_kernels

        return log_prob_kernels.row_stats, log_prob_kernels.row_grads
    return _torch_row_stats, _torch_row_grads


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                chunk_size: int, needs_grad: bool, max_logits_bytes: int, logit_scale: float,
                softcap: float | None, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        stats = functools.partial(_row_math(hidden)[0], logit_scale=logit_scale, softcap=softcap)
        inv_temperature = 1.0 / temperature
        num_rows = hidden.shape[0]
        ctx.bias = bias
        if _fits_at_once(hidden, weight.shape[0], max_logits_bytes):
            logits = _project(hidden, weight, bias)
            log_probs, entropy, lse = stats(logits, targets, inv_temperature)
            if needs_grad:
                ctx.save_for_backward(hidden, weight, targets, lse, entropy, logits)
            else:
                del logits
        else:
            log_probs = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
            entropy = torch.empty_like(log_probs)
            lse = torch.empty_like(log_probs)
            for start in range(0, num_rows, chunk_size):
                stop = min(start + chunk_size, num_rows)
                log_probs[start:stop], entropy[start:stop], lse[start:stop] = stats(
                    _project(hidden[start:stop], weight, bias), targets[start:stop], inv_temperature)
            ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.inv_temperature, ctx.chunk_size, ctx.consumed = inv_temperature, chunk_size, False
        ctx.logit_scale, ctx.softcap = logit_scale, softcap
        ctx.mark_non_differentiable(lse)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: Tensor | None, grad_entropy: Tensor | None):
        if ctx.consumed:
            raise RuntimeError("linear_log_probs wrote its logits' gradient over the stored logits: its graph "
                               "cannot be backpropagated twice (retain_graph); run the forward again")
        saved = ctx.saved_tensors
        hidden, weight, targets, lse, entropy = saved[:5]
        grads = functools.partial(_row_math(hidden)[1], logit_scale=ctx.logit_scale, softcap=ctx.softcap)
        if grad_log_probs is None:
            grad_log_probs = torch.zeros_like(lse)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(lse)
        if len(saved) == 6:  # the forward kept the logits: whole-batch products, gradient over the logits
            logits = saved[5]
            ctx.consumed = True
            grad_logits = grads(logits, targets, lse, entropy, grad_log_probs, grad_entropy, ctx.inv_temperature,
                                out=logits)
            grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
            grad_weight = grad_logits.t() @ hidden if ctx.needs_input_grad[1] else None
            grad_bias = grad_logits.sum(0, dtype=torch.float32).to(ctx.bias.dtype) if ctx.needs_input_grad[9] else None
            return grad_hidden, grad_weight, None, None, None, None, None, None, None, grad_bias
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[9] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            stop = min(start + ctx.chunk_size, hidden.shape[0])
            chunk = hidden[start:stop]
            logits = _project(chunk, weight, ctx.bias)
            grad_logits = grads(logits, targets[start:stop], lse[start:stop], entropy[start:stop],
                                grad_log_probs[start:stop], grad_entropy[start:stop], ctx.inv_temperature, out=logits)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += grad_logits.t() @ chunk
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0, dtype=torch.float32)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(ctx.bias.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, grad_bias


def _project(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The output layer's logits of ``hidden``: ``hidden @ weight.T``, plus its bias where it has one (Phi-2's)."""
    logits = hidden @ weight.t()
    return logits if bias is None else logits.add_(bias)


def linear_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                     chunk_size: int = DEFAULT_CHUNK_SIZE,
                     max_logits_bytes: int = MAX_LOGITS_BYTES, logit_scale: float = 1.0,
                     softcap: float | None = None, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """log softmax(model_logits(hidden @ weight.T + bias) / temperature)[target] and the entropy, both float32 (N,).

    hidden: (N, hidden_size); weight: (vocab, hidden_size) and bias (vocab,) or None in the same dtype; targets:
    (N,). Logits larger than ``max_logits_bytes`` go ``chunk_size`` rows at a time. ``logit_scale`` and
    ``softcap``: see ``model_logits``.
    """
    if temperature <= 0:
        temperature = 1.0
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                              or (bias is not None and bias.requires_grad))
    return _LinearLogProbs.apply(hidden, weight, targets, float(temperature), int(chunk_size), needs_grad,
                                 int(max_logits_bytes), float(logit_scale),
                                 None if softcap is None else float(softcap), bias)



SUM_PI_SQUARED_CHUNK_ROWS = 1024
"""Rows per step of ``_sum_pi_squared``: one float32 temporary of this many rows x vocab (0.6 GB at a
151,936 vocabulary), beyond the logits the memory plan already counts."""


def _sum_pi_squared(logits: Tensor, lse: Tensor, inv_temperature: float, logit_scale: float = 1.0,
                    softcap: float | None = None) -> Tensor:
    """sum_v softmax(z)_v^2 per row, z = logits / temperature, from the row's log-sum-exp; float32 (rows,).

    PyTorch on every device, ``SUM_PI_SQUARED_CHUNK_ROWS`` rows at a time, in place on one copy.
    """
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], SUM_PI_SQUARED_CHUNK_ROWS):
        rows = slice(start, start + SUM_PI_SQUARED_CHUNK_ROWS)
        squared = logits[rows].to(torch.float32, copy=True)
        if logit_scale != 1.0 or softcap is not None:
            squared = model_logits(squared, logit_scale, softcap)
        squared.mul_(inv_temperature).sub_(lse[rows].unsqueeze(-1)).mul_(2.0).exp_()
        out[rows] = squared.sum(-1)
    return out


@torch.no_grad()
def linear_log_probs_and_sum_pi_squared(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                                        chunk_size: int = DEFAULT_CHUNK_SIZE,
                                        max_logits_bytes: int = MAX_LOGITS_BYTES, logit_scale: float = 1.0,
                                        softcap: float | None = None,
                                        bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``linear_log_probs`` without gradients, plus sum_v pi(v)^2 of each row; all float32 (N,).

    For scoring only (the optimal token baseline needs the sum). The products and row kernels
    are those of ``linear_log_probs``, so its log-probs and entropy are the same bit for bit;
    the sum reads the same logits once more.
    """
    if temperature <= 0:
        temperature = 1.0
    stats = functools.partial(_row_math(hidden)[0], logit_scale=float(logit_scale),
                              softcap=None if softcap is None else float(softcap))
    inv_temperature = 1.0 / temperature
    if _fits_at_once(hidden, weight.shape[0], max_logits_bytes):
        blocks = [(0, hidden.shape[0])]
    else:
        blocks = [(start, min(start + chunk_size, hidden.shape[0])) for start in range(0, hidden.shape[0], chunk_size)]
    parts = []
    for start, stop in blocks:
        logits = _project(hidden[start:stop] if len(blocks) > 1 else hidden, weight, bias)
        log_probs, entropy, lse = stats(logits, targets[start:stop], inv_temperature)
        parts.append((log_probs, entropy, _sum_pi_squared(logits, lse, inv_temperature, logit_scale, softcap)))
    if not parts:
        return tuple(hidden.new_empty(0, dtype=torch.float32) for _ in range(3))
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))
