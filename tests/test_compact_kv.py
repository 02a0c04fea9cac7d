"""sk.compact_kv against a sequential Python implementation that copies sources first."""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip

BACKENDS = ["reference"]
BLOCK_SIZE = 4


def expected_compact(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes):
    """Request by request: read every source, then write every destination."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    num_blocks, block_size = k_cache.shape[:2]
    max_blocks = block_tables.shape[1]

    def locate(b, position):
        if position < 0 or position // block_size >= max_blocks:
            return None
        block = int(block_tables[b, position // block_size])
        return (block, position % block_size) if 0 <= block < num_blocks else None

    for b in range(block_tables.shape[0]):
        prefix = int(prefix_lens[b])
        moves = []
        for depth, node in enumerate(accepted_nodes[b].tolist()):
            if node < 0:
                break
            source, destination = locate(b, prefix + node), locate(b, prefix + depth)
            if source is not None and destination is not None:
                moves.append((source, destination))
        copies = [(k_cache[source].clone(), v_cache[source].clone()) for source, _ in moves]
        for (_, destination), (key, value) in zip(moves, copies):
            k_cache[destination] = key
            v_cache[destination] = value
    return k_cache, v_cache


def make_cache(generator, batch_size, max_blocks, dtype, num_kv_heads=2, head_dim=8, spare_blocks=3):
    """Shuffled block tables over a cache with a few blocks no request owns."""
    num_blocks = batch_size * max_blocks + spare_blocks
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = order[: batch_size * max_blocks].view(batch_size, max_blocks).to(torch.int32)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    return k_cache, v_cache, block_tables


def check(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes, backend, device):
    backend_or_skip("compact_kv", backend)
    want_k, want_v = expected_compact(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes)
    assert not torch.equal(want_k, k_cache), "the case moves nothing"
    k_on_device, v_on_device = k_cache.to(device), v_cache.to(device)
    result = sk.compact_kv(
        k_on_device, v_on_device, block_tables.to(device), prefix_lens.to(device), accepted_nodes.to(device),
        backend=backend,
    )
    assert result is None
    # Whole caches, bit for bit: moved slots and every untouched slot.
    assert torch.equal(k_on_device.cpu(), want_k)
    assert torch.equal(v_on_device.cpu(), want_v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_overlapping_moves(dtype, backend, device):
    generator = torch.Generator().manual_seed(0)
    k_cache, v_cache, block_tables = make_cache(generator, 6, 8, dtype)
    prefix_lens = torch.tensor([5, 3, 6, 2, 0, 11], dtype=torch.int32)
    accepted_nodes = torch.tensor(
        [
            [0, 2, 3, -1, -1, -1, -1, -1],  # 2 -> 1 and 3 -> 2 overlap
            [0, 1, 5, 6, -1, -1, -1, -1],  # 5 -> 2, 6 -> 3 across a block edge
            [0, 3, 7, 9, 12, 13, 17, 19],  # a full-length path over five blocks
            [0, -1, -1, -1, -1, -1, -1, -1],  # root only: nothing moves
            [0, 1, 2, 4, 8, 9, 10, -1],  # prefix 0, a path that keeps its head
            [0, 4, 5, 6, 7, 8, 9, 10],  # every move overlaps the next source
        ],
        dtype=torch.int32,
    )
    check(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes, backend, device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_random_paths(index_dtype, backend, device):
    generator = torch.Generator().manual_seed(1)
    batch_size, tree_size = 7, 20
    prefix_lens = torch.randint(0, 30, (batch_size,), generator=generator, dtype=torch.int32)
    max_blocks = (int(prefix_lens.max()) + tree_size + BLOCK_SIZE - 1) // BLOCK_SIZE
    k_cache, v_cache, block_tables = make_cache(generator, batch_size, max_blocks, torch.float16, 4, 16)
    accepted_nodes = torch.full((batch_size, tree_size), -1, dtype=index_dtype)
    for b in range(batch_size):
        # An accepted path climbs the tree, so its node indices increase.
        length = int(torch.randint(1, tree_size + 1, (), generator=generator))
        nodes = torch.randperm(tree_size - 1, generator=generator)[: length - 1] + 1
        accepted_nodes[b, :length] = torch.cat([torch.zeros(1, dtype=torch.int64), nodes.sort().values])
    check(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes, backend, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_entries_are_skipped(backend, device):
    generator = torch.Generator().manual_seed(2)
    k_cache, v_cache, block_tables = make_cache(generator, 6, 5, torch.bfloat16)
    num_blocks = k_cache.shape[0]
    prefix_lens = torch.tensor([2, 2, 4, 1, 3, 0], dtype=torch.int32)
    block_tables[3, 2] = -1  # positions 8..11 of request 3 are not stored
    block_tables[4, 1] = num_blocks  # positions 4..7 of request 4 point past the cache
    block_tables[5, 0] = 2**31 - 1
    accepted_nodes = torch.tensor(
        [
            [0, 3, -1, 4, 5, 6],  # entries after the -1 are ignored
            [0, 2, 5, -7, 6, 7],  # any negative entry ends the path
            [0, 1, 40, 5, 7, 9],  # node 40 is past the table: only that move is skipped
            [0, 2, 8, 9, 10, 12],  # sources or destinations in a missing block are skipped
            [0, 5, 6, 9, 10, 13],  # likewise for a block id >= num_blocks
            [0, 5, 6, 7, 9, 11],  # destinations 0..3 are in a bad block, the rest move
        ],
        dtype=torch.int32,
    )
    check(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes, backend, device)
