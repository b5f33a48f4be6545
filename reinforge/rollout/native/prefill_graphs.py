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
beyond every bucket runs eagerly. The packed path is graphed where it runs on the device without
the host: the flash kernel (CUDA, bf16/fp16, where ``flash_prefix_applies``) and, for soft-capped
layers (Gemma 2), the soft-cap kernels (where ``softcap_kernel_runs_on``).

A model whose full and sliding layers keep separate KV pools (Gemma 2 and 3, Qwen2 with
``max_window_layers``; ``model_runner.layer_groups``) gives every pool its own cache slots and
context slots in the padded inputs, its padding in its own spare block; each layer of the graph
reads its pool's (``AttentionMetadata.per_layer``).

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

from reinforge.rollout.native.attention import AttentionMetadata, per_layer_metadata
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
    num_pools: int = 1

    def sections(self) -> dict[str, slice]:
        """Where each input lies in the step's int64 array: ``token_ids``, ``positions`` (``tokens`` each), ``rows``
        (``MAX_SEQS`` logits rows), then for each KV pool p its ``slots_p`` (``tokens``) and ``context_slots_p``
        (``contexts``)."""
        sizes = [("token_ids", self.tokens), ("positions", self.tokens), ("rows", MAX_SEQS)]
        for pool in range(self.num_pools):
            sizes += [(f"slots_{pool}", self.tokens), (f"context_slots_{pool}", self.contexts)]
        sections, start = {}, 0
        for name, size in sizes:
            sections[name] = slice(start, start + size)
            start += size
        return sections

    @property
    def int64_size(self) -> int:
        return 2 * self.tokens + MAX_SEQS + self.num_pools * (self.tokens + self.contexts)


@dataclass
class PaddedPrefill:
    """A prefill step's inputs laid out for the graph of ``key``: int64 as ``key.sections()`` names its parts;
    int32 holds cu_seqlens_q then cu_seqlens_k (``MAX_SEQS + 1`` each)."""

    key: PrefillKey
    int64: np.ndarray
    int32: np.ndarray
    num_seqs: int

    def section(self, name: str) -> np.ndarray:
        return self.int64[self.key.sections()[name]]


def pad_prefill(token_ids: np.ndarray, positions: np.ndarray, pool_slots: list[np.ndarray], seq_lens: list[int],
                pool_context_slots: list[np.ndarray], context_lens: list[int],
                spare_slots: list[int]) -> PaddedPrefill | None:
    """The padded layout of a packed prefill step, or None when it fits no graph (it then runs eagerly).

    pool_slots, pool_context_slots, spare_slots: for each KV pool, the new tokens' cache slots, every context
    token's slot and the slot padding writes to (a slot of the pool's spare block)."""
    num_tokens, num_seqs, num_contexts = len(token_ids), len(seq_lens), sum(context_lens)
    tokens = bucket(num_tokens, TOKEN_BUCKETS)
    queries = bucket(max(seq_lens), QUERY_BUCKETS)
    contexts = bucket(num_contexts, CONTEXT_BUCKETS)
    if tokens is None or queries is None or contexts is None or num_seqs > MAX_SEQS:
        return None
    key = PrefillKey(tokens, queries, contexts, len(pool_slots))
    int64 = np.empty(key.int64_size, dtype=np.int64)
    padded = PaddedPrefill(key, int64, np.empty(2 * (MAX_SEQS + 1), dtype=np.int32), num_seqs)

    def fill(name: str, values: np.ndarray, length: int, padding: int) -> None:
        section = padded.section(name)
        section[:length], section[length:] = values, padding

    fill("token_ids", token_ids, num_tokens, 0)
    fill("positions", positions, num_tokens, 0)
    fill("rows", np.cumsum(seq_lens) - 1, num_seqs, 0)  # each sequence's last token; empty ones read row 0
    for pool, (slots, context_slots, spare) in enumerate(zip(pool_slots, pool_context_slots, spare_slots, strict=True)):
        fill(f"slots_{pool}", slots, num_tokens, spare)
        fill(f"context_slots_{pool}", context_slots, num_contexts, spare)
    cu_q, cu_k = padded.int32[:MAX_SEQS + 1], padded.int32[MAX_SEQS + 1:]
    cu_q[0], cu_q[1:num_seqs + 1], cu_q[num_seqs + 1:] = 0, np.cumsum(seq_lens), num_tokens
    cu_k[0], cu_k[1:num_seqs + 1], cu_k[num_seqs + 1:] = 0, np.cumsum(context_lens), num_contexts
    return padded


class PrefillGraphs:
    """Captured prefill forwards of one ``PagedDecoder`` over one KV cache, by ``PrefillKey``.

    layer_groups: the layers of each KV pool (``model_runner.layer_groups``; one group of every layer for most
    models)."""

    def __init__(self, decoder: PagedDecoder, device: torch.device, layer_groups: list[list[int]]):
        self.decoder = decoder
        self.device = device
        self.layer_groups = layer_groups
        self._graphs: dict[PrefillKey, torch.cuda.CUDAGraph] = {}
        self._seen: dict[PrefillKey, int] = {}
        self._pool = None
        largest = PrefillKey(TOKEN_BUCKETS[-1], QUERY_BUCKETS[-1], CONTEXT_BUCKETS[-1], len(layer_groups)).int64_size
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

    def run(self, padded: PaddedPrefill, kv_cache: Tensor | list[Tensor]) -> Tensor | None:
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

    def _forward(self, key: PrefillKey, kv_cache: Tensor | list[Tensor]) -> Tensor:
        sections = {name: self._int64[part] for name, part in key.sections().items()}
        rows = sections["rows"]
        metas = [AttentionMetadata(
            slot_mapping=sections[f"slots_{pool}"], is_prefill=True, seq_lens=[key.queries],
            prefix_lens=rows,  # read by no kernel: it routes the layers to the packed path
            max_context_len=key.contexts, context_slots=sections[f"context_slots_{pool}"],
            context_lengths=[key.contexts], cu_seqlens_q=self._int32[:MAX_SEQS + 1],
            cu_seqlens_k=self._int32[MAX_SEQS + 1:]) for pool in range(key.num_pools)]
        meta = metas[0]
        if key.num_pools > 1:
            meta.per_layer = per_layer_metadata(self.layer_groups, metas)
        return self.decoder.forward(sections["token_ids"], sections["positions"], kv_cache, meta, logits_indices=rows,
                                    final_softcap=False)

    def _capture(self, key: PrefillKey, kv_cache: Tensor | list[Tensor], num_seqs: int) -> bool:
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
