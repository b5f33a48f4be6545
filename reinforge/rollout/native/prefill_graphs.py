"""CUDA graphs for small prefill steps: an agent turn's prefill replays a captured forward.

An agent's next turn prefills a few dozen new tokens per trajectory (tool output, template)
after a prefix-cache hit. Launched op by op from Python, such a step costs several times more host
time than device work (on an H200, 14-17 ms of host time for 2.6 ms of device work), and every
running sequence waits for it. Replayed from a graph it costs one launch.

A graph has fixed shapes, so a step's inputs are padded to a key of three buckets: packed tokens
(``TOKEN_BUCKETS``), the longest sequence's new tokens (``QUERY_BUCKETS``, which sizes the flash
kernel's grid) and context tokens (``CONTEXT_BUCKETS``), with room for ``MAX_SEQS`` sequences.
Padding tokens belong to no sequence: their keys and values go to the cache's spare block, the
attention kernel never reads their rows (cu_seqlens end at the real tokens), and every other
operation is row by row, so whatever their rows hold stays in them. Padding sequences are empty
(their offsets repeat the last one); their logits rows are read from token 0 and dropped. A step
beyond every bucket runs eagerly. Only the flash path is graphed (CUDA, bf16/fp16, where
``flash_prefix_applies``).

Each key is captured when a step first needs it, right after an eager forward of the same padded
inputs; the replay must give that forward's logits, or graphed prefill is switched off for the
runner with a warning (the eager path stays correct). All graphs share one memory pool and write
their logits into one buffer.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from reinforge.rollout.native.attention import AttentionMetadata
from reinforge.rollout.native.model import PagedDecoder

TOKEN_BUCKETS = (128, 256, 512, 1024, 2048)
QUERY_BUCKETS = (128, 512, 2048)
CONTEXT_BUCKETS = (4096, 16384, 65536, 131072)
MAX_SEQS = 128


def bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``value``; None when none does."""
    return next((size for size in buckets if size >= value), None)


@dataclass(frozen=True)
class PrefillKey:
    tokens: int
    queries: int
    contexts: int


@dataclass
class PaddedPrefill:
    """A prefill step's inputs laid out for the graph of ``key``.

    int64 holds, in order: token ids, positions, cache slots (``key.tokens`` each), logits rows
    (``MAX_SEQS``), context slots (``key.contexts``); int32 holds cu_seqlens_q then cu_seqlens_k
    (``MAX_SEQS + 1`` each).
    """

    key: PrefillKey
    int64: np.ndarray
    int32: np.ndarray
    num_seqs: int


def pad_prefill(token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: list[int],
                context_slots: np.ndarray, context_lens: list[int], spare_slot: int) -> PaddedPrefill | None:
    """The padded layout of a packed prefill step, or None when it fits no graph (it then runs eagerly)."""
    num_tokens, num_seqs = len(token_ids), len(seq_lens)
    tokens = bucket(num_tokens, TOKEN_BUCKETS)
    queries = bucket(max(seq_lens), QUERY_BUCKETS)
    contexts = bucket(len(context_slots), CONTEXT_BUCKETS)
    if tokens is None or queries is None or contexts is None or num_seqs > MAX_SEQS:
        return None
    key = PrefillKey(tokens, queries, contexts)
    int64 = np.empty(3 * tokens + MAX_SEQS + contexts, dtype=np.int64)
    ids, pos, slot = int64[:tokens], int64[tokens:2 * tokens], int64[2 * tokens:3 * tokens]
    rows, context = int64[3 * tokens:3 * tokens + MAX_SEQS], int64[3 * tokens + MAX_SEQS:]
    ids[:num_tokens], ids[num_tokens:] = token_ids, 0
    pos[:num_tokens], pos[num_tokens:] = positions, 0
    slot[:num_tokens], slot[num_tokens:] = slots, spare_slot
    rows[:num_seqs], rows[num_seqs:] = np.cumsum(seq_lens) - 1, 0
    context[:len(context_slots)], context[len(context_slots):] = context_slots, spare_slot
    int32 = np.empty(2 * (MAX_SEQS + 1), dtype=np.int32)
    cu_q, cu_k = int32[:MAX_SEQS + 1], int32[MAX_SEQS + 1:]
    cu_q[0], cu_q[1:num_seqs + 1], cu_q[num_seqs + 1:] = 0, np.cumsum(seq_lens), num_tokens
    cu_k[0], cu_k[1:num_seqs + 1], cu_k[num_seqs + 1:] = 0, np.cumsum(context_lens), len(context_slots)
    return PaddedPrefill(key, int64, int32, num_seqs)


class PrefillGraphs:
    """Captured prefill forwards of one ``PagedDecoder`` over one KV cache, by ``PrefillKey``."""

    def __init__(self, decoder: PagedDecoder, device: torch.device):
        self.decoder = decoder
        self.device = device
        self._graphs: dict[PrefillKey, torch.cuda.CUDAGraph] = {}
        self._seen: dict[PrefillKey, int] = {}
        self._pool = None
        largest = 3 * TOKEN_BUCKETS[-1] + MAX_SEQS + CONTEXT_BUCKETS[-1]
        self._int64 = torch.zeros(largest, dtype=torch.int64, device=device)
        self._int32 = torch.zeros(2 * (MAX_SEQS + 1), dtype=torch.int32, device=device)
        self._host_int64 = torch.zeros(largest, dtype=torch.int64, pin_memory=True)
        self._host_int32 = torch.zeros(2 * (MAX_SEQS + 1), dtype=torch.int32, pin_memory=True)
        self._uploaded: torch.cuda.Event | None = None
        self._logits: Tensor | None = None
        self.capture_seconds = 0.0

    def wants(self, key: PrefillKey) -> bool:
        """Whether a step of ``key`` replays a graph: from its second step on (a key met once is not worth a
        capture, which costs an eager forward and more)."""
        self._seen[key] = self._seen.get(key, 0) + 1
        return key in self._graphs or self._seen[key] >= 2

    def run(self, padded: PaddedPrefill, kv_cache: Tensor) -> Tensor | None:
        """Logits (num_seqs, vocab) of the step (a view of a buffer the next prefill overwrites), or None when
        graphed prefill is off (a capture failed or disagreed with the eager forward)."""
        self._upload(padded)
        key = padded.key
        if key not in self._graphs and not self._capture(key, kv_cache, padded.num_seqs):
            return None
        self._graphs[key].replay()
        return self._logits[:padded.num_seqs]

    def _upload(self, padded: PaddedPrefill) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the pinned buffers still feed the last step's copy otherwise
        self._host_int64[:len(padded.int64)].numpy()[:] = padded.int64
        self._host_int32.numpy()[:] = padded.int32
        self._int64[:len(padded.int64)].copy_(self._host_int64[:len(padded.int64)], non_blocking=True)
        self._int32.copy_(self._host_int32, non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record()

    def _forward(self, key: PrefillKey, kv_cache: Tensor) -> Tensor:
        tokens = key.tokens
        int64 = self._int64
        rows = int64[3 * tokens:3 * tokens + MAX_SEQS]
        meta = AttentionMetadata(
            slot_mapping=int64[2 * tokens:3 * tokens], is_prefill=True, seq_lens=[key.queries],
            prefix_lens=rows,  # read by no kernel: it routes the layers to the packed (flash) path
            max_context_len=key.contexts, context_slots=int64[3 * tokens + MAX_SEQS:3 * tokens + MAX_SEQS + key.contexts],
            context_lengths=[key.contexts], cu_seqlens_q=self._int32[:MAX_SEQS + 1],
            cu_seqlens_k=self._int32[MAX_SEQS + 1:])
        return self.decoder.forward(int64[:tokens], int64[tokens:2 * tokens], kv_cache, meta, logits_indices=rows)

    def _capture(self, key: PrefillKey, kv_cache: Tensor, num_seqs: int) -> bool:
        """Capture ``key`` after an eager forward of the uploaded inputs (its warm-up and reference)."""
        start = time.perf_counter()
        try:
            expected = self._forward(key, kv_cache)[:num_seqs].float()
            if self._logits is None:
                self._logits = torch.empty(MAX_SEQS, expected.shape[1], dtype=self.decoder.dtype, device=self.device)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a training thread of this process (trainer.separate_rollout) may run meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._logits.copy_(self._forward(key, kv_cache))
            graph.replay()
            got = self._logits[:num_seqs].float()
            scale = expected.abs().max().clamp(min=1.0)
            agrees = bool(torch.isfinite(got).all()) and float((got - expected).abs().max()) <= 2e-2 * float(scale)
        except (RuntimeError, NotImplementedError) as error:
            self._switch_off(f"capturing it failed ({error})")
            return False
        finally:
            self.capture_seconds += time.perf_counter() - start
        if not agrees:
            self._switch_off("its replay disagreed with the eager forward")
            return False
        self._graphs[key] = graph
        return True

    def _switch_off(self, reason: str) -> None:
        """Say so once; the runner then drops these graphs and keeps its prefill steps eager."""
        warnings.warn(f"graphed prefill is off for this engine: {reason}; prefill steps run eagerly", stacklevel=3)
