"""Runs the decoder for a scheduled step: the KV cache, step inputs and CUDA graphs.

The runner owns the KV cache (allocated by ``allocate_kv_cache`` at wake-up, freed at sleep)
and, through its decoder, the copy of the weights (``load_weights`` at wake-up and at a weight
sync while loaded, ``free_weights`` at sleep). It turns sequences into packed input
tensors (token ids, positions, cache slots, block tables) and returns logits (uncapped: a final logit soft-cap
is the sampler's, ``PagedDecoder.forward``'s ``final_softcap``). Block tables
live in a host array with one row per running sequence, updated only when a sequence gains
blocks, so a decode step copies rows instead of rebuilding lists. Decode steps replay CUDA
graphs captured for a set of batch sizes (padded up to the next captured size; padding rows
write to a spare block nobody reads). The paged attention's launch (``decode_kernels.decode_tiling``: split
count, block, warps, stages) depends on the contexts only through whether the longest has reached
``decode_kernels.SPLIT_MIN_CONTEXT``, so a batch size has at most two decode graphs. Prefill steps of up to 2,048
tokens replay graphs too, from the second step of a padded shape on (``prefill_graphs.py``); larger ones run
eagerly.

Layer groups (``layer_groups``): when some layers attend through a window and others do not (Gemma 2 and 3,
Qwen2 with ``max_window_layers``), each window's layers have their own cache tensor (``kv_caches``), block pool
and block tables (``Sequence.group_tables``), so a sliding group needs no more than its window of blocks per
sequence. Each layer then reads its group's cache, slots and block tables (``AttentionMetadata.per_layer``);
decode graphs hold each group's tables as static inputs, prefill graphs each group's slots. A model whose layers
share one window (or none) has one group and runs as if groups did not exist.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor, nn

from reinforge.packed_attention.softcap_kernels import softcap_kernel_runs_on
from reinforge.rollout.native.attention import AttentionMetadata, SharedPrefix, per_layer_metadata
from reinforge.rollout.native.decode_kernels import (
    _INTERPRETED,
    SHARED_PREFIX_MEMBERS,
    DecodeTiling,
    decode_tiling,
    num_sms,
    shared_memory_per_program,
    shared_prefix_arrays,
)
from reinforge.rollout.native.kv_quant import KV_CACHE_DTYPES, QuantizedCache, block_bytes, fp8_refusal, layer_caches
from reinforge.rollout.native.model import PagedDecoder, whole
from reinforge.rollout.native.multimodal import MultimodalPrompts, is_vision_language
from reinforge.rollout.native.prefill_graphs import PrefillGraphs, pad_prefill
from reinforge.rollout.native.sequence import Sequence

logger = logging.getLogger(__name__)


def to_device(array: np.ndarray, device: torch.device) -> Tensor:
    """A host array as a tensor on ``device``; to CUDA through pinned memory, without waiting for the device."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def layer_groups(windows: list[int | None]) -> list[list[int]]:
    """The layers of each cache group, from each layer's window (None: full attention): one group per distinct
    window, full attention first, when some layers are full and others slide; else one group of every layer (when
    every layer slides, blocks behind the widest window are released)."""
    distinct = sorted(set(windows), key=lambda window: -1 if window is None else window)
    if len(distinct) == 1 or None not in distinct:
        return [list(range(len(windows)))]
    return [[index for index, window in enumerate(windows) if window == key] for key in distinct]


def prefill_chunks(starts: list[int], stops: list[int], budget: int | None) -> list[list[tuple[int, int, int]]]:
    """The forwards of a prefill of sequences i's tokens starts[i]..stops[i], each at most ``budget`` new tokens
    (None: one forward): lists of (sequence index, start, stop), the sequences in order and each sequence's pieces
    in order, so a piece's earlier tokens are in the cache when it runs."""
    if budget is None or sum(stops) - sum(starts) <= budget:
        return [list(zip(range(len(starts)), starts, stops, strict=True))]
    chunks: list[list[tuple[int, int, int]]] = [[]]
    room = budget
    for index, (start, stop) in enumerate(zip(starts, stops, strict=True)):
        while start < stop:
            if room == 0:
                chunks.append([])
                room = budget
            end = min(stop, start + room)
            chunks[-1].append((index, start, end))
            room -= end - start
            start = end
    return chunks


GROUP_INPUTS = ("prefix_members", "group_prefix_lens")
"""The decode graph's inputs of shared-prefix groups (``attention.SharedPrefix``), one entry a group, not a row."""


class ModelRunner:
    def __init__(self, model: nn.Module, *, block_size: int, max_num_seqs: int, max_model_len: int,
                 use_triton: bool, cuda_graph_batch_sizes: list[int], device: torch.device | None = None,
                 max_prefill_chunk_tokens: int | None = None, kv_cache_dtype: str = "auto", weights_fixed: bool = False,
                 decode_products: str = "cublas", shared_prefix_decode: bool = False):
        """max_prefill_chunk_tokens: the most new tokens one prefill forward runs (None: no limit);
        kv_cache_dtype: auto (the model dtype) or fp8 (e4m3 with a scale per vector, kv_quant.py); weights_fixed:
        the model's weights never change, so the decoder reads them in place (``model.weights_read_in_place``);
        shared_prefix_decode: an unsplit Triton decode step reads the blocks several sequences share (the n samples
        of a prompt) once for all of them (``attention.SharedPrefix``)."""
        self.shared_prefix_decode = shared_prefix_decode
        self.decoder = PagedDecoder(model, max_model_len, use_triton, device, weights_fixed, decode_products)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_prefill_chunk_tokens = max_prefill_chunk_tokens
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        refusal = fp8_refusal(self.decoder.spec.model_type,
                              not all(hasattr(block, "num_kv_heads") for block in self.decoder.attention),
                              self.decoder.device, self.decoder.use_triton) if kv_cache_dtype == "fp8" else None
        if refusal is not None:
            raise ValueError(refusal)
        self.kv_cache_dtype = kv_cache_dtype
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.device = self.decoder.device
        self.cuda_graph_batch_sizes = sorted(size for size in cuda_graph_batch_sizes if size <= max_num_seqs)
        self.kv_cache: Tensor | list[Tensor] | None = None
        """What the decoder reads layer by layer: the cache tensor (layers first), or with several layer groups
        (or a cache allocated a layer at a time), a list of each layer's tensor."""
        self.spare_block = -1
        self.block_table_host = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        windows = [layer.sliding_window for layer in self.decoder.spec.layers]
        self.layer_groups = layer_groups(windows)
        self.group_windows = [windows[layers[0]] for layers in self.layer_groups]
        """Each group's window (None: full attention); one group for most models."""
        self.kv_caches: list[Tensor | list[Tensor]] = []
        """Each group's cache tensor (its layers first), or its layers' tensors (``_cache_tensor``), while
        allocated."""
        self.spare_blocks: list[int] = []
        num_extra = len(self.layer_groups) - 1
        self.group_table_host = [np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
                                 for _ in range(num_extra)]
        self._group_row_owner = [[-1] * max_num_seqs for _ in range(num_extra)]
        self._group_row_num_blocks = [[0] * max_num_seqs for _ in range(num_extra)]
        self._row_owner = [-1] * max_num_seqs
        self._row_num_blocks = [0] * max_num_seqs
        self._captured: dict[tuple[int, DecodeTiling], torch.cuda.CUDAGraph] = {}
        """Decode graphs by (batch size, attention tiling)."""
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        """The decode graph each batch size replayed last (what a profile of the current step replays)."""
        self._graph_pool = None
        self._graph_inputs: dict[str, Tensor] = {}
        self._graph_logits: dict[tuple[int, DecodeTiling], Tensor] = {}
        self._graph_parameter_pointers: tuple[int, ...] = ()
        self.capture_seconds = 0.0
        """Time spent capturing CUDA graphs (warm-up forward included), summed over the runner's life."""
        self._prefill_graphs: PrefillGraphs | None = None
        self._prefill_graphs_off = False
        """A capture failed or disagreed with the eager forward once: prefill steps stay eager."""
        self.last_decode_positions: Tensor | None = None
        """(batch,) positions of the last decode step's input tokens, on the device."""
        self.multimodal = MultimodalPrompts(model, self.decoder.dtype, self.device) \
            if is_vision_language(model.config) else None
        """A vision-language model's requests with images and its vision tower (multimodal.py); None for text."""
        self.row_rope_delta = np.zeros(max_num_seqs, dtype=np.int64)
        """The rope delta of each row's sequence (M-RoPE), set when the row gets a new sequence."""

    def set_model(self, model: nn.Module) -> None:
        """Generate with ``model``'s current weights from now on.

        Loaded weight copies are refreshed in place; captured graphs are dropped if their storage moved
        (only when ``model`` is another module than before).
        """
        loaded = self.decoder.weights is not None
        if model is not self.decoder.model:
            self.decoder.free_weights()
            self.decoder = PagedDecoder(model, self.decoder.max_model_len, self.decoder.use_triton, self.decoder.device,
                                        self.decoder.weights_fixed, self.decoder.decode_products)
        if loaded:
            self.load_weights()
        if self.decoder.parameter_pointers() != self._graph_parameter_pointers:
            self.drop_cuda_graphs()

    def load_weights(self) -> None:
        """Copy the model's weights into the decoder's own buffers (allocated if freed, else in place)."""
        self.decoder.load_weights()
        if self.multimodal is not None:
            self.multimodal.tower.load(self.decoder.model, whole)
        if self.decoder.parameter_pointers() != self._graph_parameter_pointers:
            self.drop_cuda_graphs()  # a frozen weight read in place moved (see model.ModelWeights)

    def free_weights(self) -> None:
        """Free the decoder's weight copies (and the graphs that read them)."""
        self.drop_cuda_graphs()
        self.decoder.free_weights()
        if self.multimodal is not None:
            self.multimodal.tower.free()

    def kv_bytes_per_block(self, group: int | None = None) -> int:
        """Bytes of one block of every layer's cache, or of layer group ``group``'s layers only."""
        if self.kv_cache_dtype == "fp8":
            _, heads, dim = self.decoder.cache_entry
            every_layer = self.decoder.num_layers * 2 * block_bytes(self.block_size, heads, dim)
        else:
            every_layer = self.decoder.kv_bytes_per_block(self.block_size)
        if group is None:
            return every_layer
        return every_layer // self.decoder.num_layers * len(self.layer_groups[group])

    def allocate_kv_cache(self, num_blocks: int | list[int]) -> None:
        """The decoder's ``kv_cache_shape`` with num_blocks + 1 blocks; the extra block takes graph padding.
        fp8: (layers, 2, num_blocks + 1, block bytes) uint8, each block its values then their scales (kv_quant.py).
        With several layer groups, num_blocks lists each group's blocks and each group gets its own tensor."""
        counts = [num_blocks] * len(self.layer_groups) if isinstance(num_blocks, int) else list(num_blocks)
        self.kv_caches = [self._cache_tensor(len(layers), count)
                          for layers, count in zip(self.layer_groups, counts, strict=True)]
        self.spare_blocks = counts
        self.spare_block = counts[0]
        if len(self.layer_groups) == 1:
            self.kv_cache = self.kv_caches[0]
            return
        views: list[Tensor | None] = [None] * self.decoder.num_layers
        for layers, cache in zip(self.layer_groups, self.kv_caches, strict=True):
            for position, layer in enumerate(layers):
                views[layer] = cache[position]
        self.kv_cache = views

    def _cache_tensor(self, num_layers: int, num_blocks: int) -> Tensor | list[Tensor]:
        """One tensor, layers first; or, when the device's free memory is cut into pieces none of which holds it
        (the allocator's cached segments partly in use, as after a training step), a list of each layer's tensor:
        indexed by layer, the two read alike."""
        if self.kv_cache_dtype == "fp8":
            _, heads, dim = self.decoder.cache_entry
            shape = (num_layers, 2, num_blocks + 1, block_bytes(self.block_size, heads, dim))
            dtype = torch.uint8
        else:
            shape = (num_layers, *self.decoder.kv_cache_shape(num_blocks + 1, self.block_size)[1:])
            dtype = self.decoder.dtype
        try:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        except torch.OutOfMemoryError:
            if num_layers == 1:
                raise
        layers = [torch.zeros(shape[1:], dtype=dtype, device=self.device) for _ in range(num_layers)]
        logger.info("KV cache: one tensor of %.2f GiB did not fit in the device's free memory, which is in pieces; "
                    "it is allocated as %d tensors, one a layer", num_layers * layers[0].nbytes / 2**30, num_layers)
        return layers

    def attention_caches(self, layer: int) -> tuple[Tensor | QuantizedCache, Tensor | QuantizedCache]:
        """Layer ``layer``'s K and V caches as the attention kernels take them (fp8: ``QuantizedCache`` views)."""
        cache = self.kv_cache[layer]
        if self.kv_cache_dtype == "fp8":
            _, heads, dim = self.decoder.cache_entry
            return layer_caches(cache, heads, dim, self.decoder.dtype)
        return cache[0], cache[1]

    def forget_block_tables(self) -> None:
        """Drop the cached block-table rows: a new scheduler numbers its sequences from 1 again, so a row's
        recorded owner could match a different sequence of the same id (and block count) and keep its stale blocks."""
        self._row_owner = [-1] * self.max_num_seqs
        self._row_num_blocks = [0] * self.max_num_seqs
        self._group_row_owner = [[-1] * self.max_num_seqs for _ in self._group_row_owner]
        self._group_row_num_blocks = [[0] * self.max_num_seqs for _ in self._group_row_num_blocks]

    @property
    def num_kv_blocks(self) -> int:
        """Blocks the scheduler may hand out (the cache's spare block excluded), of the first layer group."""
        return self.kv_caches[0][0].shape[1] - 1

    @property
    def group_num_kv_blocks(self) -> list[int]:
        """Each layer group's blocks (spare blocks excluded)."""
        return [cache[0].shape[1] - 1 for cache in self.kv_caches]

    def free_kv_cache(self) -> None:
        self.drop_cuda_graphs()
        self.kv_cache = None
        self.kv_caches = []

    def drop_cuda_graphs(self) -> None:
        self._prefill_graphs = None
        self._captured.clear()
        self._graphs.clear()
        self._graph_inputs.clear()
        self._graph_logits.clear()
        self._graph_pool = None
        self._graph_parameter_pointers = ()

    def copy_blocks(self, copies: list[tuple[int, int]], group: int = 0) -> None:
        """Copy (source, destination) blocks of layer group ``group``'s cache."""
        if not copies:
            return
        source = torch.tensor([copy[0] for copy in copies], device=self.device)
        destination = torch.tensor([copy[1] for copy in copies], device=self.device)
        cache = self.kv_caches[group]
        if isinstance(cache, list):  # a tensor a layer
            for layer in cache:
                layer[:, destination] = layer[:, source]
        else:
            cache[:, :, destination] = cache[:, :, source]

    def _to_device(self, array: np.ndarray) -> Tensor:
        return to_device(array, self.device)

    @torch.no_grad()
    def prefill(self, seqs: list[Sequence]) -> Tensor:
        """Logits (len(seqs), vocab) at each sequence's last token, after writing the keys and values of its tokens
        past ``seq.num_cached_tokens`` (those before come from the prefix cache, at their own positions).

        New tokens beyond ``max_prefill_chunk_tokens`` run in several forwards (``prefill_chunks``): each chunk's
        queries attend to the chunks before through the cache, as after a prefix-cache hit, so activations stay
        bounded however long a prompt (or a preempted sequence's recompute) is. A forward that fits a prefill
        graph (``prefill_graphs``) replays it from the second one of its shape on."""
        starts = [seq.num_cached_tokens for seq in seqs]
        stops = [seq.num_tokens for seq in seqs]
        chunks = prefill_chunks(starts, stops, self.max_prefill_chunk_tokens)
        if len(chunks) == 1:
            return self._prefill_forward(seqs, starts, stops)
        last_rows = []
        for chunk in chunks:
            chunk_seqs = [seqs[index] for index, _, _ in chunk]
            logits = self._prefill_forward(chunk_seqs, [start for _, start, _ in chunk], [stop for _, _, stop in chunk])
            finished = [row for row, (index, _, stop) in enumerate(chunk) if stop == stops[index]]
            if finished:  # a copy: a graph's logits are a buffer the next forward overwrites
                last_rows.append(logits[self._to_device(np.array(finished, dtype=np.int64))])
        return torch.cat(last_rows)

    def _prefill_forward(self, seqs: list[Sequence], starts: list[int], stops: list[int]) -> Tensor:
        """Logits (len(seqs), vocab) at each sequence's token stop - 1, after one forward of its tokens
        start..stop (the keys and values before start are in the cache)."""
        seq_lens = [stop - start for start, stop in zip(starts, stops, strict=True)]
        token_ids = np.concatenate([np.asarray(seq.token_ids[start:stop], dtype=np.int64)
                                    for seq, start, stop in zip(seqs, starts, stops, strict=True)])
        positions = np.concatenate([np.arange(start, stop) for start, stop in zip(starts, stops, strict=True)])
        pool_tables = [[seq.block_table for seq in seqs],
                       *([seq.group_tables[group] for seq in seqs] for group in range(len(self.group_table_host)))]
        pool_slots = [self._token_slots(tables, starts, stops) for tables in pool_tables]
        slots = pool_slots[0]
        contexts = stops
        # the decoder reads positions only to look up rotary rows (LongRoPE: see rotary_tables.py); a chunk's
        # rows are those of its whole sequence's prefill
        positions = self.decoder.rotary.rotary_positions(
            positions, np.repeat([seq.num_tokens for seq in seqs], seq_lens))
        images = None if self.multimodal is None else \
            self.multimodal.prefill_inputs([seq.request_key for seq in seqs], starts, contexts)
        if images is not None:  # image pad tokens carry their images' keys (multimodal.py), never embedded
            token_ids = np.where(token_ids < 0, self.multimodal.image_token_id, token_ids)
        graphs = self._graphs_for_prefill() if images is None else None
        if graphs is not None or any(starts):
            # every context token's slot in each pool (the packed path reads the cached and new keys through them)
            pool_context_slots = [self._context_slots(tables, contexts) for tables in pool_tables]
            context_slots = pool_context_slots[0]
        if graphs is not None:
            padded = pad_prefill(token_ids, positions, pool_slots, seq_lens, pool_context_slots, contexts,
                                 [spare * self.block_size for spare in self.spare_blocks])
            if padded is not None and graphs.wants(padded.key):
                before = graphs.capture_seconds
                logits = graphs.run(padded, self.kv_cache)
                self.capture_seconds += graphs.capture_seconds - before
                if logits is not None:
                    return logits
                self._prefill_graphs, self._prefill_graphs_off = None, True
        token_index = np.concatenate([np.arange(length) for length in seq_lens])
        batch_index = np.repeat(np.arange(len(seqs)), seq_lens)
        last_index = np.cumsum(seq_lens) - 1
        meta = AttentionMetadata(slot_mapping=self._to_device(slots), is_prefill=True, seq_lens=seq_lens,
                                 batch_index=self._to_device(batch_index), token_index=self._to_device(token_index))
        if any(starts):  # queries also attend to cached keys: read every key from the cache through the block table
            # int64: indexing the cache with them needs no conversion at every layer
            block_tables = np.zeros((len(seqs), max(len(seq.block_table) for seq in seqs)), dtype=np.int64)
            for row, seq in enumerate(seqs):
                block_tables[row, :len(seq.block_table)] = seq.block_table
            meta.block_tables = self._to_device(block_tables)
            meta.context_lens = self._to_device(np.array(contexts, dtype=np.int32))
            meta.prefix_lens = self._to_device(np.array(starts, dtype=np.int64))
            meta.max_context_len = max(contexts)
            meta.context_lengths = contexts
            meta.context_slots = self._to_device(context_slots)
            meta.cu_seqlens_q = self._to_device(np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32))
            meta.cu_seqlens_k = self._to_device(np.concatenate([[0], np.cumsum(contexts)]).astype(np.int32))
        if self.group_table_host:
            group_metas = [meta]
            for pool in range(1, len(pool_tables)):
                tables = pool_tables[pool]
                group_meta = replace(meta, slot_mapping=self._to_device(pool_slots[pool]), prefix_visible={})
                if any(starts):
                    group_tables = np.zeros((len(seqs), max(len(table) for table in tables)), dtype=np.int64)
                    for row, table in enumerate(tables):
                        group_tables[row, :len(table)] = table
                    group_meta.block_tables = self._to_device(group_tables)
                    group_meta.context_slots = self._to_device(pool_context_slots[pool])
                group_metas.append(group_meta)
            meta.per_layer = per_layer_metadata(self.layer_groups, group_metas)
        return self.decoder.forward(self._to_device(token_ids), self._to_device(positions), self.kv_cache, meta,
                                    logits_indices=self._to_device(last_index), images=images, final_softcap=False)

    def _token_slots(self, tables: list[list[int]], starts: list[int], stops: list[int]) -> np.ndarray:
        """The cache slot of each sequence's tokens starts[i]..stops[i], through its table ``tables[i]``."""
        return np.concatenate([
            np.asarray(table, dtype=np.int64)[np.arange(start, stop) // self.block_size] * self.block_size
            + np.arange(start, stop) % self.block_size for table, start, stop in zip(tables, starts, stops, strict=True)])

    def _context_slots(self, tables: list[list[int]], contexts: list[int]) -> np.ndarray:
        """The cache slot of every context token of each sequence, through its table ``tables[i]``."""
        return np.concatenate([
            np.asarray(table, dtype=np.int64)[np.arange(length) // self.block_size] * self.block_size
            + np.arange(length) % self.block_size for table, length in zip(tables, contexts, strict=True)])

    def _graphs_for_prefill(self) -> PrefillGraphs | None:
        """The prefill graphs, where prefill steps may replay them: CUDA graphs on (as for decode steps) and the
        packed path running on the device alone (``packed_prefill_on_device``), with no capture having failed."""
        if self._prefill_graphs_off or not self.cuda_graph_batch_sizes or self.device.type != "cuda" \
                or not self.packed_prefill_on_device() or self.kv_cache is None:
            return None
        if self._prefill_graphs is None:
            self._prefill_graphs = PrefillGraphs(self.decoder, self.device, self.layer_groups)
        return self._prefill_graphs

    def packed_prefill_on_device(self) -> bool:
        """Whether a prefill over cached keys runs from slots and offsets alone, no host sync (what a graph
        captures): the flash kernel, or for soft-capped scores (Gemma 2) the soft-cap kernels; MLA runs the
        reference."""
        decoder = self.decoder
        if decoder.spec.attn_softcap is None or decoder.spec.mla is not None:
            return decoder.flash_prefix
        return decoder.use_triton and softcap_kernel_runs_on(self.device, decoder.dtype, decoder.cache_entry[2])

    def decode_tiling(self, batch: int, max_context_len: int) -> DecodeTiling:
        """How a decode step's paged attention is launched (``decode_kernels.decode_tiling``; unsplit off the Triton
        path and for latent attention, which has its own kernel)."""
        decoder = self.decoder
        if not decoder.use_triton or self.device.type != "cuda" or \
                not all(hasattr(block, "num_kv_heads") for block in decoder.attention):
            return DecodeTiling()
        return decode_tiling(batch, decoder.cache_entry[1], decoder.cache_entry[2], max_context_len,
                             num_sms(self.device), self.kv_cache_dtype == "fp8", shared_memory_per_program(self.device),
                             num_heads=max(block.num_heads for block in decoder.attention))

    def _decode_inputs(self, seqs: list[Sequence], lookahead: int) -> dict[str, np.ndarray]:
        # runs at every decode step on the host while the device works: Python lists for the per-row
        # bookkeeping (a numpy scalar read costs several list reads) and one pass over the sequences
        owners, num_blocks = self._row_owner, self._row_num_blocks
        rows, lengths = [], []
        grown_rows, grown_columns, grown_blocks = [], [], []  # blocks gained since the last step, written at once
        for seq in seqs:
            row, table = seq.row, seq.block_table
            if owners[row] != seq.seq_id:
                self.block_table_host[row, :len(table)] = table
                owners[row] = seq.seq_id
                num_blocks[row] = len(table)
                if self.multimodal is not None:  # M-RoPE: the row's tokens rotate at position + its rope delta
                    self.row_rope_delta[row] = self.multimodal.rope_delta(seq.request_key)
            elif num_blocks[row] != len(table):
                for column in range(num_blocks[row], len(table)):
                    grown_rows.append(row)
                    grown_columns.append(column)
                    grown_blocks.append(table[column])
                num_blocks[row] = len(table)
            rows.append(row)
            lengths.append(len(seq.token_ids))
        if grown_rows:
            self.block_table_host[grown_rows, grown_columns] = grown_blocks
        rows = np.array(rows, dtype=np.int64)
        context_lens = np.array(lengths, dtype=np.int32) + np.int32(lookahead)
        positions = context_lens.astype(np.int64) - 1
        block_tables = self.block_table_host[rows]
        blocks = block_tables[np.arange(len(seqs)), positions // self.block_size].astype(np.int64)
        inputs = {
            "positions": positions,
            "slot_mapping": blocks * self.block_size + positions % self.block_size,
            "context_lens": context_lens,
            "block_tables": block_tables,
        }
        if self.group_table_host:
            self._group_decode_inputs(seqs, rows, positions, inputs)
        if self.multimodal is not None:
            inputs["rope_positions"] = positions + self.row_rope_delta[rows]
        if not lookahead:
            inputs["input_ids"] = np.fromiter((seq.token_ids[-1] for seq in seqs), dtype=np.int64, count=len(seqs))
        return inputs

    def _add_shared_prefixes(self, inputs: dict[str, np.ndarray]) -> None:
        """Each layer group's sequences that share blocks (``decode_kernels.shared_prefix_arrays``) into ``inputs``:
        ``prefix_members``, ``group_prefix_lens`` and ``prefix_lens`` (with ``_{g}`` for the groups from 1)."""
        for group in range(len(self.layer_groups)):
            suffix = f"_{group}" if group else ""
            members, group_lens, prefix_lens = shared_prefix_arrays(inputs[f"block_tables{suffix}"],
                                                                    inputs["context_lens"], self.block_size)
            inputs[f"prefix_members{suffix}"] = members
            inputs[f"group_prefix_lens{suffix}"] = group_lens
            inputs[f"prefix_lens{suffix}"] = prefix_lens

    def _write_groups(self, inputs: dict[str, np.ndarray]) -> None:
        """The decode graph's group buffers (``GROUP_INPUTS`` of each layer group) whole: ``inputs``' groups first,
        every other one empty (no members, nothing shared), so no group of an earlier batch is left in them."""
        for name, tensor in self._graph_inputs.items():
            if name.startswith(GROUP_INPUTS):
                whole = np.full(tuple(tensor.shape), -1 if name.startswith("prefix_members") else 0, dtype=np.int32)
                array = inputs.get(name)
                if array is not None:
                    whole[:len(array)] = array
                tensor.copy_(torch.from_numpy(whole).pin_memory(), non_blocking=True)

    def _shares_prefixes(self) -> bool:
        """Whether decode steps read shared blocks once a group: the Triton kernels on CUDA, the model's attention
        ones (latent attention has its own kernel)."""
        return (self.shared_prefix_decode and self.decoder.use_triton
                and (self.device.type == "cuda" or _INTERPRETED)
                and all(hasattr(block, "num_kv_heads") for block in self.decoder.attention))

    def _group_decode_inputs(self, seqs: list[Sequence], rows: np.ndarray, positions: np.ndarray,
                             inputs: dict[str, np.ndarray]) -> None:
        """The other layer groups' block tables and slots (``block_tables_{g}``, ``slot_mapping_{g}``, g from 1), their
        host rows kept as ``_decode_inputs`` keeps the first group's. A released entry (``RELEASED``) stays as it
        was in the row: no query reads it."""
        for group, host in enumerate(self.group_table_host):
            owners, num_blocks = self._group_row_owner[group], self._group_row_num_blocks[group]
            for seq in seqs:
                row, table = seq.row, seq.group_tables[group]
                if owners[row] != seq.seq_id:
                    host[row, :len(table)] = table
                    owners[row] = seq.seq_id
                elif num_blocks[row] != len(table):
                    host[row, num_blocks[row]:len(table)] = table[num_blocks[row]:]
                num_blocks[row] = len(table)
            block_tables = host[rows]
            blocks = block_tables[np.arange(len(seqs)), positions // self.block_size].astype(np.int64)
            inputs[f"slot_mapping_{group + 1}"] = blocks * self.block_size + positions % self.block_size
            inputs[f"block_tables_{group + 1}"] = block_tables

    @torch.no_grad()
    def decode(self, seqs: list[Sequence], next_input_ids: Tensor | None = None) -> Tensor:
        """Logits (len(seqs), vocab) for the last token of each sequence.

        next_input_ids: (len(seqs),) tokens sampled on the device but not yet appended to the
        sequences; when given, the step decodes them (one position further than the host state).
        """
        inputs = self._decode_inputs(seqs, lookahead=0 if next_input_ids is None else 1)
        batch = len(seqs)
        max_context_len = int(inputs["context_lens"].max()) if batch else 0
        graph_size = next((size for size in self.cuda_graph_batch_sizes if size >= batch), None)
        tiling = self.decode_tiling(batch if graph_size is None else graph_size, max_context_len)
        if tiling.splits == 1 and self._shares_prefixes():  # only the unsplit kernel reads them
            self._add_shared_prefixes(inputs)
        if graph_size is None or not self.cuda_graph_batch_sizes:
            tensors = {name: self._to_device(array) for name, array in inputs.items()}
            if next_input_ids is not None:
                tensors["input_ids"] = next_input_ids
            self.last_decode_positions = tensors["positions"]
            return self._decode_forward(tensors, tiling)
        key = (graph_size, tiling)
        if key not in self._captured:
            self.capture_cuda_graph(*key)
        static = self._graph_inputs
        if batch < graph_size:
            self._fill_padding(batch, graph_size)
        if "prefix_members" in inputs:
            self._write_groups(inputs)
        for name, array in inputs.items():
            if not name.startswith(GROUP_INPUTS):
                static[name][:batch].copy_(torch.from_numpy(array).pin_memory(), non_blocking=True)
        if next_input_ids is not None:
            static["input_ids"][:batch].copy_(next_input_ids)
        graph = self._graphs[graph_size] = self._captured[key]
        graph.replay()
        self.last_decode_positions = static["positions"][:batch]
        return self._graph_logits[key][:batch]

    def _decode_forward(self, tensors: dict[str, Tensor], tiling: DecodeTiling) -> Tensor:
        def prefix(suffix: str) -> SharedPrefix | None:
            members = tensors.get(f"prefix_members{suffix}")
            if tiling.splits > 1 or members is None or not len(members):
                return None
            return SharedPrefix(members, tensors[f"group_prefix_lens{suffix}"], tensors[f"prefix_lens{suffix}"])

        meta = AttentionMetadata(slot_mapping=tensors["slot_mapping"], is_prefill=False,
                                 block_tables=tensors["block_tables"], context_lens=tensors["context_lens"],
                                 decode_tiling=tiling, shared_prefix=prefix(""))
        if self.group_table_host:
            meta.per_layer = per_layer_metadata(self.layer_groups, [meta, *(
                replace(meta, slot_mapping=tensors[f"slot_mapping_{group}"], block_tables=tensors[f"block_tables_{group}"],
                        shared_prefix=prefix(f"_{group}"))
                for group in range(1, len(self.layer_groups)))])
        return self.decoder.forward(tensors["input_ids"], tensors.get("rope_positions", tensors["positions"]),
                                    self.kv_cache, meta, final_softcap=False)

    def _fill_padding(self, start: int, stop: int) -> None:
        """Rows start..stop of the graph inputs become padding: one token, written to the spare block."""
        static = self._graph_inputs
        static["input_ids"][start:stop].zero_()
        static["positions"][start:stop].zero_()
        if "rope_positions" in static:
            static["rope_positions"][start:stop].zero_()
        static["slot_mapping"][start:stop].fill_(self.spare_block * self.block_size)
        static["context_lens"][start:stop].fill_(1)
        static["block_tables"][start:stop].fill_(self.spare_block)
        for name in ("prefix_lens", *(f"prefix_lens_{group}" for group in range(1, len(self.layer_groups)))):
            if name in static:
                static[name][start:stop].zero_()
        for group in range(1, len(self.layer_groups)):  # each group's own spare block
            static[f"slot_mapping_{group}"][start:stop].fill_(self.spare_blocks[group] * self.block_size)
            static[f"block_tables_{group}"][start:stop].fill_(self.spare_blocks[group])

    @torch.no_grad()
    def capture_cuda_graph(self, size: int, tiling: DecodeTiling) -> None:
        """Capture the decode forward for batch ``size`` (its attention launched as ``tiling``) when a step
        first needs it.

        Capturing lazily matters for the hybrid engine: every wake-up gathers the weights anew,
        so graphs rarely outlive a rollout, and a rollout of equal-length samples uses one or
        two sizes of the whole set. All graphs share one memory pool.
        """
        start = time.perf_counter()
        if not self._graph_inputs:
            largest = self.cuda_graph_batch_sizes[-1]
            self._graph_inputs = {
                "input_ids": torch.zeros(largest, dtype=torch.int64, device=self.device),
                "positions": torch.zeros(largest, dtype=torch.int64, device=self.device),
                "slot_mapping": torch.zeros(largest, dtype=torch.int64, device=self.device),
                "context_lens": torch.ones(largest, dtype=torch.int32, device=self.device),
                "block_tables": torch.zeros(largest, self.max_blocks_per_seq, dtype=torch.int32, device=self.device),
            }
            if self.multimodal is not None:
                self._graph_inputs["rope_positions"] = torch.zeros(largest, dtype=torch.int64, device=self.device)
            for group in range(1, len(self.layer_groups)):
                self._graph_inputs[f"slot_mapping_{group}"] = torch.zeros(largest, dtype=torch.int64, device=self.device)
                self._graph_inputs[f"block_tables_{group}"] = torch.zeros(largest, self.max_blocks_per_seq,
                                                                          dtype=torch.int32, device=self.device)
            if self._shares_prefixes():  # at most half the rows form groups (two members or more)
                for group in range(len(self.layer_groups)):
                    suffix = f"_{group}" if group else ""
                    self._graph_inputs[f"prefix_members{suffix}"] = torch.full(
                        (max(largest // 2, 1), SHARED_PREFIX_MEMBERS), -1, dtype=torch.int32, device=self.device)
                    self._graph_inputs[f"group_prefix_lens{suffix}"] = torch.zeros(
                        max(largest // 2, 1), dtype=torch.int32, device=self.device)
                    self._graph_inputs[f"prefix_lens{suffix}"] = torch.zeros(largest, dtype=torch.int32,
                                                                             device=self.device)
            self._graph_pool = torch.cuda.graph_pool_handle()
            self._graph_parameter_pointers = self.decoder.parameter_pointers()
        self._fill_padding(0, size)
        self._write_groups({})  # no group left from an earlier, larger batch
        views = {name: tensor[:max(size // 2, 1)] if name.startswith(GROUP_INPUTS)
                 else tensor[:size] for name, tensor in self._graph_inputs.items()}
        self._decode_forward(views, tiling)  # warm-up: Triton compiles and cuBLAS picks its kernels outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a training worker on another thread of this process (trainer.separate_rollout) may
        # launch kernels and allocate while this thread captures
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            self._graph_logits[size, tiling] = self._decode_forward(views, tiling)
        self._captured[size, tiling] = graph
        self._graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - start
