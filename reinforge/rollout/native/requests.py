"""What the engine keeps between steps: each request's completions so far, and the step in flight."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from reinforge.rollout.base import Completion, GenerationRequest
from reinforge.rollout.native.multimodal import MultimodalPrompt
from reinforge.rollout.native.sequence import Sequence


class RequestState:
    """Collects the n completions of one request and reports when all are done."""

    def __init__(self, request: GenerationRequest, seed: int, on_done: Callable[[list[Completion]], None] | None,
                 on_error: Callable[[BaseException], None] | None,
                 on_token: Callable[[int, int, float, list[tuple[int, float]] | None], None] | None = None):
        self.request = request
        self.seed = seed
        self.completions: list[Completion | None] = [None] * request.sampling.n
        self.num_pending = request.sampling.n
        self.on_done = on_done
        self.on_error = on_error
        self.on_token = on_token
        """A streamed request's ``(sample_index, token_id, log_prob, top_log_probs)`` callback, called as each token
        is sampled (``top_log_probs``: the token's alternatives, None unless the request asks for them)."""
        self.key: int | None = None
        """The engine's key of the request once it is admitted (its sequences' ``request_key``)."""
        self.aborted = False
        """Its caller stopped waiting: it is dropped, admitted or not (``NativeEngine._abort``)."""
        self.multimodal: MultimodalPrompt | None = None
        """A vision-language prompt's images, checked at submission (``MultimodalPrompts.prepare``)."""

    def finish_sample(self, seq: Sequence) -> bool:
        self.completions[seq.sample_index] = Completion(seq.token_ids[seq.num_prompt_tokens:], list(seq.log_probs),
                                                        seq.finish_reason, seq.top_log_probs)
        self.num_pending -= 1
        return self.num_pending == 0


@dataclass
class LaunchedStep:
    """A step whose tokens were sampled on the device but not yet read back.

    tokens, log_probs: (rows,) on the device. On CUDA they are also copied, as soon as they are
    sampled, into pinned host buffers; ``ready`` fires when that copy is done, so reading them does
    not wait for a step launched later on the same stream. top: the rows' most likely tokens' log-probs and ids,
    (rows, k) each, only when a row asks for them (``Sampler.top_log_probs``).
    """

    seqs: list[Sequence]
    tokens: torch.Tensor
    log_probs: torch.Tensor
    host_tokens: torch.Tensor | None = None
    host_log_probs: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    top: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def sampled(cls, seqs: list[Sequence], tokens: torch.Tensor, log_probs: torch.Tensor,
                top: tuple[torch.Tensor, torch.Tensor] | None = None) -> LaunchedStep:
        if tokens.device.type != "cuda":
            return cls(seqs, tokens, log_probs, top=top)
        host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host_log_probs = torch.empty(log_probs.shape, dtype=log_probs.dtype, pin_memory=True)
        host_tokens.copy_(tokens, non_blocking=True)
        host_log_probs.copy_(log_probs, non_blocking=True)
        if top is not None:
            top = tuple(torch.empty(part.shape, dtype=part.dtype, pin_memory=True).copy_(part, non_blocking=True)
                        for part in top)
        ready = torch.cuda.Event()
        ready.record()
        return cls(seqs, tokens, log_probs, host_tokens, host_log_probs, ready, top)

    def read(self) -> tuple[list[int], list[float]]:
        if self.ready is None:
            return self.tokens.tolist(), self.log_probs.tolist()
        self.ready.synchronize()
        return self.host_tokens.tolist(), self.host_log_probs.tolist()

    def read_top(self) -> list[list[tuple[int, float]]] | None:
        """Each row's (token id, log-prob) alternatives, most likely first (after ``read``); None when not asked."""
        if self.top is None:
            return None
        values, ids = self.top
        return [list(zip(row_ids, row_values, strict=True)) for row_ids, row_values in zip(ids.tolist(),
                                                                                           values.tolist(), strict=True)]
