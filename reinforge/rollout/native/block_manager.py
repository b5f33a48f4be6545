"""Paged KV-cache bookkeeping: which cache blocks each sequence owns, and how many share each.

The cache is cut into fixed-size blocks; a sequence's block table lists its blocks in order.
Blocks are reference-counted so that the n samples of a prompt share the prompt's full blocks
after one prefill (a fork); a partly filled last block cannot be shared, since each sample
writes its own next tokens into it, so a fork gets a fresh block and a copy to make. A block
returns to the free list when its last sequence ends or is preempted.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache has {num_blocks} blocks; raise gpu_memory_utilization or num_kv_blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def _take(self) -> int:
        block_id = self.free_block_ids.popleft()
        self.ref_counts[block_id] = 1
        return block_id

    def allocate(self, num_tokens: int) -> list[int]:
        """A fresh block table with room for ``num_tokens`` tokens."""
        needed = self.num_blocks_for(num_tokens)
        if not self.can_allocate(needed):
            raise RuntimeError(f"{needed} KV blocks requested, {self.num_free_blocks} free")
        return [self._take() for _ in range(needed)]

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
        if not self.free_block_ids:
            raise RuntimeError("no free KV block to append")
        block_table.append(self._take())

    def free(self, block_table: list[int]) -> None:
        """Release a sequence's blocks; blocks nobody else holds become free."""
        for block_id in reversed(block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        block_table.clear()
