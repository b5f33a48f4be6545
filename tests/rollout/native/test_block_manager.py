"""KV block bookkeeping: allocation, freeing, and the reference counts of forked prefixes."""

from __future__ import annotations

import pytest

from reinforge.rollout.native.block_manager import RELEASED, BlockManager


def test_allocate_and_free_return_blocks():
    manager = BlockManager(num_blocks=8, block_size=4)
    table = manager.allocate(9)  # 9 tokens need 3 blocks of 4
    assert len(table) == 3 and manager.num_free_blocks == 5
    assert all(manager.ref_counts[block] == 1 for block in table)
    manager.free(table)
    assert table == [] and manager.num_free_blocks == 8


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    manager = BlockManager(num_blocks=8, block_size=4)
    parent = manager.allocate(10)  # blocks: full, full, partial (2 of 4)
    child, copy = manager.fork(parent, 10)
    assert child[:2] == parent[:2] and child[2] != parent[2]
    assert copy == (parent[2], child[2])
    assert [manager.ref_counts[block] for block in parent] == [2, 2, 1]
    assert manager.num_free_blocks == 4
    manager.free(parent)
    assert manager.num_free_blocks == 5  # only the parent's private block came back
    assert [manager.ref_counts[block] for block in child] == [1, 1, 1]
    manager.free(child)
    assert manager.num_free_blocks == 8


def test_fork_of_exactly_full_blocks_copies_nothing():
    manager = BlockManager(num_blocks=4, block_size=4)
    parent = manager.allocate(8)
    child, copy = manager.fork(parent, 8)
    assert child == parent and copy is None
    assert manager.num_free_blocks == 2


def test_growth_and_exhaustion():
    manager = BlockManager(num_blocks=2, block_size=4)
    table = manager.allocate(4)
    assert not manager.needs_block(table, 4) and manager.needs_block(table, 5)
    manager.append_block(table)
    assert manager.num_free_blocks == 0 and not manager.can_allocate(1)
    with pytest.raises(RuntimeError):
        manager.append_block(table)
    with pytest.raises(RuntimeError):
        manager.allocate(1)


def test_blocks_behind_every_window_go_back_to_the_pool():
    manager = BlockManager(num_blocks=8, block_size=2, sliding_window=3)
    table = manager.allocate(7)  # positions 0..6 in blocks 0..3
    # the query at position 6 sees keys 4, 5, 6: blocks 0 (keys 0, 1) and 1 (keys 2, 3) are read no more
    assert manager.release_out_of_window(table, 6) == 2
    assert table == [RELEASED, RELEASED, 2, 3] and manager.num_free_blocks == 6
    assert manager.release_out_of_window(table, 6) == 0 and manager.release_out_of_window(table, 7) == 0
    manager.free(table)
    assert manager.num_free_blocks == 8 and table == []
    assert BlockManager(num_blocks=8, block_size=2).release_out_of_window(manager.allocate(7), 6) == 0


def test_released_blocks_stay_in_the_prefix_cache():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True, sliding_window=3)
    tokens = [5, 6, 7, 8, 9, 10, 11]
    table = manager.allocate(len(tokens))
    manager.release_out_of_window(table, 6, tokens, [], manager.epoch)
    assert manager.match_prefix(tokens + [12], []) == [0, 1]  # registered, held by nobody, still cached
    manager.free(table, tokens, num_written=6, known=[], epoch=manager.epoch)
    assert manager.match_prefix(tokens + [12], []) == [0, 1, 2]
