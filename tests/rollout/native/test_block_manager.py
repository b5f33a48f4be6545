"""KV block bookkeeping: allocation, freeing, and the reference counts of forked prefixes."""

from __future__ import annotations

import pytest

from reinforge.rollout.native.block_manager import BlockManager


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
