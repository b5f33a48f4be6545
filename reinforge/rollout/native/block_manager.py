"""Paged KV-cache bookkeeping: which cache blocks each sequence owns, how many share each, and
which full blocks are kept for reuse (the prefix cache).

The cache is cut into fixed-size blocks; a sequence's block table lists its blocks in order.
Blocks are reference-counted so that the n samples of a prompt share the prompt's full blocks
after one prefill (a fork); a partly filled last block cannot be shared, since each sample
writes its own next tokens into it, so a fork gets a fresh block and a copy to make.

Prefix cache: when a sequence releases its blocks (it finished or was preempted), each full block
whose keys and values are all written is registered under a key made of the hash of the blocks
before it and its own token ids, so the key names the block's whole prefix. A registered block
nobody holds stays in the cache, and is evicted least recently used first when a fresh block is
needed. A new sequence whose tokens start with registered blocks takes them (``match_prefix``,
then ``allocate(..., cached=...)``) and prefills only the rest. ``reset_prefix_cache`` forgets
every registration (the weights changed, so the cached keys and values are stale).

Sliding windows: when every layer of the model attends through a window of W keys (Mistral), a query
at position p reads no key before p - W + 1, so blocks wholly before that go back to the pool as a
sequence grows (``release_out_of_window``): a sequence then holds at most its window's blocks (and the
one being filled) however long it gets. Its table keeps its length, the released entries marked
``RELEASED``, so block indices still map positions; no kernel reads them (the window masks them out, and
the decode kernel starts its loop at the window). With prefix caching, a released block is registered
first, exactly as at the sequence's release, so the prefix stays reusable while it is cached. A model with
full layers beside its sliding ones (Gemma 2 and 3) has one manager per window, each over its layers' own
cache (scheduler.py, model_runner.py): the sliding layers' manager releases as above, the full layers' keeps all.
"""

from __future__ import annotations

from collections import OrderedDict, deque

BlockKey = tuple[int, tuple[int, ...]]
"""(hash of the blocks before this one, this block's token ids)."""

RELEASED = -1
"""A block-table entry whose block went back to the pool: every query still to come is past its window."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None, rope_switch_length: int | None = None):
        """sliding_window: the widest window when every layer slides (blocks before it are released), else None.
        rope_switch_length: LongRoPE's original length, past which a sequence's keys are all computed with the
        long factors (rotary_tables.py); the prefix cache keeps such blocks apart from those of shorter ones."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache has {num_blocks} blocks; raise gpu_memory_utilization or num_kv_blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        """Free blocks holding nothing reusable."""
        self.cached_blocks: dict[BlockKey, int] = {}
        self.block_keys: dict[int, BlockKey] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        """Registered blocks nobody holds, least recently released first."""
        self.epoch = 0
        """Counts ``reset_prefix_cache`` calls: blocks a sequence filled before the last reset are never registered."""
        self.rope_switch_length = rope_switch_length

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def _take(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:  # evict the least recently released cached block
            block_id, _ = self.evictable.popitem(last=False)
            del self.cached_blocks[self.block_keys.pop(block_id)]
        self.ref_counts[block_id] = 1
        return block_id

    # ---- prefix cache -----------------------------------------------------------------------

    def block_key_chain(self, token_ids: list[int], num_blocks: int, known: list[BlockKey],
                        num_keys: int | None = None) -> list[BlockKey]:
        """Keys of the first ``num_blocks`` full blocks of ``token_ids``; ``known`` (extended in place) holds
        keys already computed for the same tokens. num_keys: how many keys the sequence's blocks hold or will
        hold (default: one per token); past ``rope_switch_length`` the chain starts from another root."""
        size = self.block_size
        switched = self.rope_switch_length is not None and \
            (len(token_ids) if num_keys is None else num_keys) > self.rope_switch_length
        root = 1 if switched else 0
        if known and known[0][0] != root:  # the sequence crossed the switch length since its keys were chained
            known.clear()
        for index in range(len(known), num_blocks):
            parent = hash(known[-1]) if known else root
            known.append((parent, tuple(token_ids[index * size:(index + 1) * size])))
        return known[:num_blocks]

    def match_prefix(self, token_ids: list[int], known: list[BlockKey]) -> list[int]:
        """Registered blocks holding the longest cached prefix of ``token_ids``, leaving at least the last token
        to compute (its logits are needed). Takes nothing; see ``allocate``."""
        if not self.enable_prefix_caching or not self.cached_blocks:
            return []
        blocks = []
        for key in self.block_key_chain(token_ids, (len(token_ids) - 1) // self.block_size, known):
            block_id = self.cached_blocks.get(key)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def num_blocks_taken(self, cached: list[int]) -> int:
        """How many of ``cached`` would leave the free pool if taken (those nobody holds)."""
        return sum(1 for block_id in cached if self.ref_counts[block_id] == 0)

    def _register(self, token_ids: list[int], block_table: list[int], num_written: int, known: list[BlockKey],
                  num_keys: int | None = None) -> None:
        """Register the full blocks of ``block_table`` whose first ``num_written`` tokens' keys and values are
        written; num_keys: the sequence's keys (default num_written)."""
        num_full = min(num_written // self.block_size, len(block_table))
        chain = self.block_key_chain(token_ids, num_full, known, num_written if num_keys is None else num_keys)
        for key, block_id in zip(chain, block_table, strict=False):
            if block_id == RELEASED or block_id in self.block_keys:
                continue  # registered already (a shared prompt block, or taken from the cache)
            if key in self.cached_blocks:
                continue  # the same content lives in another block; this one just becomes free
            self.cached_blocks[key] = block_id
            self.block_keys[block_id] = key

    def reset_prefix_cache(self) -> None:
        """Forget every registered block (held blocks stay with their sequences, unregistered)."""
        for block_id in self.evictable:
            self.free_block_ids.append(block_id)
        self.evictable.clear()
        self.cached_blocks.clear()
        self.block_keys.clear()
        self.epoch += 1

    # ---- block tables -----------------------------------------------------------------------

    def allocate(self, num_tokens: int, cached: list[int] | None = None) -> list[int]:
        """A block table with room for ``num_tokens`` tokens: ``cached`` (from ``match_prefix``) then fresh blocks."""
        cached = cached or []
        needed = self.num_blocks_for(num_tokens) - len(cached)
        if not self.can_allocate(needed + self.num_blocks_taken(cached)):
            raise RuntimeError(f"{needed} KV blocks requested, {self.num_free_blocks} free")
        for block_id in cached:
            if self.ref_counts[block_id] == 0:
                del self.evictable[block_id]
            self.ref_counts[block_id] += 1
        return [*cached, *(self._take() for _ in range(needed))]

    def fork(self, block_table: list[int], num_tokens: int) -> tuple[list[int], tuple[int, int] | None]:
        """A table sharing ``block_table``'s full blocks; a partial last block is copied.

        Returns the new table and the (source, destination) block copy to make, if any.
        """
        num_full = num_tokens // self.block_size
        shared = block_table[:num_full]
        for block_id in shared:
            self.ref_counts[block_id] += 1
        if num_full == len(block_table):
            return list(shared), None
        private = self._take()
        return [*shared, private], (block_table[num_full], private)

    def needs_block(self, block_table: list[int], num_tokens: int) -> bool:
        """Whether a table must grow to hold ``num_tokens`` tokens."""
        return len(block_table) * self.block_size < num_tokens

    def append_block(self, block_table: list[int]) -> None:
        if not self.num_free_blocks:
            raise RuntimeError("no free KV block to append")
        block_table.append(self._take())

    def free(self, block_table: list[int], token_ids: list[int] | None = None, num_written: int = 0,
             known: list[BlockKey] | None = None, epoch: int | None = None) -> None:
        """Release a sequence's blocks; blocks nobody else holds become free (registered ones stay cached).

        token_ids, num_written: the sequence's tokens, of which the first ``num_written`` have their keys
        and values in the cache; with prefix caching on, its full written blocks are registered first,
        unless ``epoch`` (when its blocks were first filled) is older than the last ``reset_prefix_cache``.
        """
        if self.enable_prefix_caching and token_ids is not None and epoch in (None, self.epoch):
            self._register(token_ids, block_table, num_written, [] if known is None else known)
        for block_id in reversed(block_table):
            if block_id != RELEASED:
                self._unhold(block_id)
        block_table.clear()

    def _unhold(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_counts[block_id] == 0:
            if block_id in self.block_keys:
                self.evictable[block_id] = None
            else:
                self.free_block_ids.append(block_id)

    def release_out_of_window(self, block_table: list[int], query_position: int, token_ids: list[int] | None = None,
                              known: list[BlockKey] | None = None, epoch: int | None = None) -> int:
        """Give back the blocks of ``block_table`` that no query from ``query_position`` on reads (every layer
        slides); their entries become ``RELEASED``. Returns how many entries were released now.

        token_ids, known, epoch: as for ``free``; with prefix caching the released blocks are registered first.
        """
        if self.sliding_window is None:
            return 0
        num_out = min(max(query_position - self.sliding_window + 1, 0) // self.block_size, len(block_table))
        if not num_out or block_table[num_out - 1] == RELEASED:
            return 0
        if self.enable_prefix_caching and token_ids is not None and epoch in (None, self.epoch):
            self._register(token_ids, block_table[:num_out], num_out * self.block_size, [] if known is None else known,
                           query_position + 1)
        released = 0
        for index in range(num_out):
            if block_table[index] != RELEASED:
                self._unhold(block_table[index])
                block_table[index] = RELEASED
                released += 1
        return released
