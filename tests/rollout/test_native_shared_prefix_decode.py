"""Decode attention that reads a group's shared blocks once (the n samples of a prompt share its full blocks)
against the PyTorch reference and the kernel that reads every sequence's blocks itself.

On the CPU the kernels run in Triton's interpreter on small shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parent))
from test_native_long_decode import reference  # noqa: E402

from reinforge.rollout.native import decode_kernels  # noqa: E402
from reinforge.rollout.native.kv_quant import QuantizedCache, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def grouped_inputs(groups: list[tuple[int, int]], singles: list[int], num_heads: int, num_kv_heads: int,
                   head_dim: int, page: int, prefix_blocks: int, seed: int = 0):
    """Sequences in groups of ``(members, context)`` whose tables start with the same ``prefix_blocks`` blocks,
    then sequences of their own; every other block is a sequence's own, shuffled in the pool."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [context for members, context in groups for _ in range(members)] + singles
    max_blocks = -(-max(lengths) // page)
    num_blocks = max_blocks * len(lengths) + len(groups) * prefix_blocks + 3
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for members, _ in groups:
        shared = [pool.pop() for _ in range(prefix_blocks)]
        tables += [shared + [pool.pop() for _ in range(max_blocks - prefix_blocks)] for _ in range(members)]
    tables += [[pool.pop() for _ in range(max_blocks)] for _ in singles]
    k_cache, v_cache = (torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=generator) for _ in range(2))
    q = torch.randn(len(lengths), num_heads, head_dim, generator=generator)
    return q, k_cache, v_cache, tables, lengths


def test_groups_are_sequences_starting_with_the_same_blocks_below_every_members_context():
    tables = [[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 4, 3], [5, 6, 10, 11], [12, 13, 14, 15], [5, 6, 16, 17],
              [-1, -1, 20, 21], [-1, -1, 22, 23]]
    contexts = [50, 60, 40, 33, 60, 47, 60, 60]
    groups, lengths = decode_kernels.shared_prefix_groups(tables, contexts, page=16)
    # the first three share two blocks (the third differs in its third); 3 and 5 share two, but 3's context of 33
    # leaves only its first two blocks whole; released entries (-1, outside a window) are never shared
    assert groups == [[0, 1, 2], [3, 5]] and lengths == [32, 32]
    assert decode_kernels.shared_prefix_groups(tables, contexts, page=16, max_members=2)[0] == [[0, 1], [3, 5]]
    assert decode_kernels.shared_prefix_groups(tables, contexts, page=16, min_blocks=3)[0] == []


@pytest.mark.parametrize(("num_heads", "window", "softcap"), [(6, None, None), (4, 37, None), (2, None, 0.5),
                                                              (6, 50, 0.5)])
def test_reading_shared_blocks_once_a_group_is_the_reference(num_heads, window, softcap):
    """Two groups (4 members, 3 members) and two sequences of their own; grouped query heads (3, 2 or 1 per KV
    head), a head dim that is no power of two, a window that starts inside the shared blocks for some members."""
    page = 4
    q, k_cache, v_cache, tables, lengths = grouped_inputs([(4, 52), (3, 30)], [9, 41], num_heads, 2, 24, page,
                                                          prefix_blocks=5)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    lengths[0], lengths[2] = 45, 38  # members of one group at other lengths
    table_tensor = torch.tensor(tables, dtype=torch.int32)
    expected = reference(q, k_cache, v_cache, table_tensor, lengths, 0.3, window, softcap)
    prefix = decode_kernels.shared_prefix(tables, lengths.tolist(), page, DEVICE)
    assert prefix is not None and prefix.group_prefix_lens.tolist() == [20, 20]
    args = (q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), table_tensor.to(DEVICE), lengths.to(DEVICE), 0.3,
            softcap, window)
    shared = decode_kernels.paged_decode_attention(*args, block_n=16, num_splits=1, prefix=prefix)
    plain = decode_kernels.paged_decode_attention(*args, block_n=16, num_splits=1)
    torch.testing.assert_close(shared.cpu(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


def test_a_shared_prefix_over_an_fp8_cache_is_the_unshared_kernels_result():
    page = 4
    q, k_cache, v_cache, tables, lengths = grouped_inputs([(3, 26)], [13], 4, 2, 16, page, prefix_blocks=4)
    k_fp8, v_fp8 = (QuantizedCache(*quantize(cache), torch.float32) for cache in (k_cache, v_cache))
    table_tensor = torch.tensor(tables, dtype=torch.int32)
    context = torch.tensor(lengths, dtype=torch.int32)
    prefix = decode_kernels.shared_prefix(tables, lengths, page, "cpu")
    shared = decode_kernels.paged_decode_attention(q, k_fp8, v_fp8, table_tensor, context, 0.25, block_n=16,
                                                   num_splits=1, prefix=prefix)
    plain = decode_kernels.paged_decode_attention(q, k_fp8, v_fp8, table_tensor, context, 0.25, block_n=16,
                                                  num_splits=1)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


def test_a_shared_prefix_is_for_the_unsplit_kernel():
    page = 4
    q, k_cache, v_cache, tables, lengths = grouped_inputs([(2, 20)], [], 2, 1, 16, page, prefix_blocks=2)
    prefix = decode_kernels.shared_prefix(tables, lengths, page, "cpu")
    with pytest.raises(ValueError, match="unsplit kernel only"):
        decode_kernels.paged_decode_attention(q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
                                              torch.tensor(lengths, dtype=torch.int32), 0.25, num_splits=2,
                                              prefix=prefix)
