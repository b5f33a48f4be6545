"""The rollout-engine interface: token ids in, token ids and log-probs out.

Every backend (``hf`` wrapping transformers' ``generate``, ``native`` with its paged KV
cache) implements :class:`RolloutEngine`. Text crosses this boundary only as stop strings
(``SamplingParams.stop``, read by an engine given the tokenizer): callers
tokenize once, and the engine returns exactly the ids it sampled together with the
log-probability of each sampled token under the distribution it sampled from (after
temperature, before top-p/top-k truncation), so the trainer can measure the
rollout/training mismatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from torch import Tensor, nn


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    """Upper bound on generated tokens per sample. The native engine also ends a sample where prompt and sample fill
    its ``max_model_len`` (finish_reason 'length'); a prompt of max_model_len tokens or more is refused."""
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after any of these (the stop token is kept in the output). One id alone or a list is taken
    as that tuple."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends at the token whose text completes one (``stop_strings.py``); the ids end
    with that token. Needs an engine built with the tokenizer. One string alone (vLLM's ``stop="###"``) or a list is
    taken as that tuple; an empty string is refused."""
    num_top_log_probs: int = 0
    """Also return, for each sampled token, the log-probs of this many most likely tokens of the distribution it was
    sampled from (0: none, and nothing is computed for them)."""
    ignore_eos: bool = False
    """Keep generating past stop tokens until max_tokens (benchmarks)."""
    n: int = 1
    """Samples per request; they share the prompt's prefill where the backend can."""
    seed: int | None = None
    """Per-request seed: the same seed and prompt give the same samples."""
    first_sample: int = 0
    """Sample j of this request is seeded as sample first_sample + j of its seed, and sampling noise is
    keyed by absolute position: a partial sample resumed as prompt + its tokens continues as it would have."""

    def __post_init__(self) -> None:
        # a string alone would otherwise be read as its characters, each a stop string; lists would leave the
        # params unhashable
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, int):
            object.__setattr__(self, "stop_token_ids", (self.stop_token_ids,))
        elif not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_problem(sampling: SamplingParams) -> str | None:
    """What is out of range in ``sampling`` (the ranges the rollout config checks), or None."""
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        return f"temperature={sampling.temperature}, which must be a finite number >= 0 (0 is greedy)"
    if not 0.0 < sampling.top_p <= 1.0:
        return f"top_p={sampling.top_p}, which must be in (0, 1]"
    if not 0.0 <= sampling.min_p <= 1.0:  # above 1 even the most likely token falls below the bar
        return f"min_p={sampling.min_p}, which must be in [0, 1] (0: off)"
    if any(not text for text in sampling.stop):
        return f"stop={sampling.stop!r} with an empty string, which every text holds; leave it out"
    if sampling.num_top_log_probs < 0:
        return f"num_top_log_probs={sampling.num_top_log_probs}, which must be at least 0 (0: none)"
    return None



@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    keep_prefix: bool = True
    """Native engine with prefix caching: keep this request's full KV blocks for a later request that
    continues it (an agent's next turn). False saves the hashing when nothing will (a single-turn step)."""
    multi_modal_inputs: dict[str, Tensor] | None = None
    """A vision-language prompt's images as its processor made them, besides the token ids: ``pixel_values``
    (patches, patch_dim) and ``image_grid_thw`` (images, 3), images in the order their ``<|image_pad|>`` runs
    appear in ``prompt_token_ids``; None for a text prompt."""


@dataclass
class Completion:
    """One sample: the generated ids and the log-prob of each under the sampling distribution."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    """'stop' (a stop token was produced, or a stop string completed) or 'length' (max_tokens reached, or the
    native engine's max_model_len)."""
    top_log_probs: list[list[tuple[int, float]]] | None = None
    """With ``sampling.num_top_log_probs``: for each sampled token, (token id, log-prob) of the most likely tokens
    of the distribution it was sampled from, most likely first; None otherwise."""


class GenerationInterrupted(Exception):
    """A ``generate`` call stopped midway because no one waits for its samples any more (every caller cancelled, or
    the server stopping); it returns none of them."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the actor-rollout worker needs from a generation backend."""

    reads_model_in_place: bool
    """True when generation reads the model's parameters (they must stay gathered while it runs);
    False when ``sync_weights``/``wake_up`` copy them, after which the trainer may free its gathered copy."""

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """Completions for each request (``request.sampling.n`` of them), in request order."""
        ...

    def sync_weights(self, model: nn.Module) -> None:
        """Make the engine generate with the current parameters of ``model``."""
        ...

    def wake_up(self) -> None:
        """Allocate generation memory (KV cache) before a rollout."""
        ...

    def sleep(self, abandon: bool = False) -> None:
        """Free generation memory after a rollout so training gets it back.

        ``abandon`` after a failed generation: drop unfinished requests rather than refuse."""
        ...


def prompt_problem(prompt_token_ids: list[int], vocab_size: int) -> str | None:
    """What is wrong with a prompt's token ids for a model of ``vocab_size`` input embeddings, or None."""
    if not prompt_token_ids:
        return "an empty prompt"
    lowest, highest = min(prompt_token_ids), max(prompt_token_ids)
    if lowest < 0 or highest >= vocab_size:
        return f"prompt token id {lowest if lowest < 0 else highest}, outside the model's vocabulary [0, {vocab_size})"
    return None
