"""sk.build_tree against an independent ancestor walk written here in Python."""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip

BACKENDS = ["reference"]


def run_build_tree(parents, num_nodes, prefix_lens, backend, device):
    """The op on ``device``; inputs and outputs on the CPU."""
    backend_or_skip("build_tree", backend)
    info = sk.build_tree(
        parents.to(device),
        num_nodes=None if num_nodes is None else num_nodes.to(device),
        prefix_lens=None if prefix_lens is None else prefix_lens.to(device),
        backend=backend,
    )
    return info.mask.cpu(), info.depth.cpu(), info.positions.cpu()


def expected_tree(parents, num_nodes, prefix_lens):
    """Per request, per node: follow parents up to the root in pure Python."""
    parents = parents.tolist()
    batch_size, tree_size = len(parents), len(parents[0]) if parents else 0
    num_words = (tree_size + 31) // 32
    mask, depth, positions = [], [], []
    for b in range(batch_size):
        limit = tree_size if num_nodes is None else int(num_nodes[b])
        prefix = 0 if prefix_lens is None else int(prefix_lens[b])
        mask_rows, depth_row = [], []
        for i in range(tree_size):
            path = []
            node = i
            while True:
                if node >= limit:
                    path = None
                    break
                path.append(node)
                if node == 0:
                    break
                parent = parents[b][node]
                if not 0 <= parent < node:
                    path = None
                    break
                node = parent
            words = [0] * num_words
            for node in path or []:
                words[node // 32] |= 1 << (node % 32)
            mask_rows.append([w - 2**32 if w >= 2**31 else w for w in words])
            depth_row.append(len(path) - 1 if path else -1)
        mask.append(mask_rows)
        depth.append(depth_row)
        positions.append([prefix + d for d in depth_row])
    return (
        torch.tensor(mask, dtype=torch.int32).view(batch_size, tree_size, num_words),
        torch.tensor(depth, dtype=torch.int32).view(batch_size, tree_size),
        torch.tensor(positions, dtype=torch.int64).view(batch_size, tree_size),
    )


def random_parents(generator, batch_size, tree_size, num_nodes):
    """Random valid trees; padding slots hold a mix of -1 and in-range garbage."""
    parents = torch.full((batch_size, tree_size), -1, dtype=torch.int32)
    for b in range(batch_size):
        for i in range(1, tree_size):
            if i < num_nodes[b] or torch.rand((), generator=generator) < 0.5:
                # Mostly recent parents, so paths get deep (depth ~17 at N = 70;
                # test_sign_bit covers depth > 31).
                low = max(0, i - 3) if torch.rand((), generator=generator) < 0.7 else 0
                parents[b, i] = int(torch.randint(low, i, (), generator=generator))
    return parents


def check(parents, num_nodes, prefix_lens, backend, device):
    mask, depth, positions = run_build_tree(parents, num_nodes, prefix_lens, backend, device)
    want_mask, want_depth, want_positions = expected_tree(parents, num_nodes, prefix_lens)
    assert mask.dtype == torch.int32 and depth.dtype == torch.int32
    assert positions.dtype == torch.int64
    torch.testing.assert_close(mask, want_mask, rtol=0, atol=0)
    torch.testing.assert_close(depth, want_depth, rtol=0, atol=0)
    torch.testing.assert_close(positions, want_positions, rtol=0, atol=0)
    return mask, depth


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tree_size", [1, 5, 31, 32, 33, 70])
@pytest.mark.parametrize("batch_size", [1, 3, 7])
def test_random_trees(batch_size, tree_size, backend, device):
    generator = torch.Generator().manual_seed(1000 * batch_size + tree_size)
    num_nodes = torch.randint(1, tree_size + 1, (batch_size,), generator=generator)
    num_nodes[0] = tree_size  # at least one full tree
    num_nodes = num_nodes.to(torch.int32)
    prefix_lens = torch.randint(0, 500, (batch_size,), generator=generator, dtype=torch.int32)
    parents = random_parents(generator, batch_size, tree_size, num_nodes)
    check(parents, num_nodes, prefix_lens, backend, device)
    check(parents, None, None, backend, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sign_bit(backend, device):
    # Request 0: a 40-node chain, so rows 31.. have word 0 all ones (-1 as
    # int32). Request 1: node 31 hangs off the root, so its word 0 is only
    # bits 0 and 31.
    chain = torch.arange(40, dtype=torch.int32) - 1
    star = torch.zeros(40, dtype=torch.int32)
    star[0] = -1
    parents = torch.stack([chain, star])
    mask, depth = check(parents, None, torch.tensor([7, 0], dtype=torch.int32), backend, device)
    assert mask[0, 30, 0] == 2**31 - 1
    assert (mask[0, 31:, 0] == -1).all()
    assert mask[0, 39, 1] == 2**8 - 1
    assert depth[0].tolist() == list(range(40))
    assert mask[1, 31].tolist() == [1 - 2**31, 0]
    assert mask[1, 32].tolist() == [1, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_malformed_trees(backend, device):
    parents = torch.tensor(
        [
            [-1, 0, 1, 3, 2, 0],  # node 3 is its own parent; node 4 still fine
            [-1, 0, 5, 2, 0, 1],  # node 2's parent is after it: 2 and child 3 cut
            [-1, -7, 0, 1, -2, 4],  # parents below -1: 1, 4 and their subtrees cut
            [5, 0, 0, 1, 1, 2],  # root's parent is ignored
            [-1, 0, 1, 2, 3, 4],  # num_nodes = 0: nothing is reachable
            [-1, 0, 100, 0, 1, 2],  # parent far out of range
        ],
        dtype=torch.int32,
    )
    num_nodes = torch.tensor([6, 6, 6, 4, 0, 9], dtype=torch.int32)
    prefix_lens = torch.tensor([3, 0, 1, 5, 2, 4], dtype=torch.int32)
    mask, depth = check(parents, num_nodes, prefix_lens, backend, device)
    assert depth.tolist() == [
        [0, 1, 2, -1, 3, 1],
        [0, 1, -1, -1, 1, 2],
        [0, -1, 1, -1, -1, -1],
        [0, 1, 1, 2, -1, -1],
        [-1, -1, -1, -1, -1, -1],
        [0, 1, -1, 1, 2, -1],
    ]
    assert (mask[depth < 0] == 0).all()
