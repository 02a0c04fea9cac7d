"""sk.build_tree against an independent ancestor walk written here in Python."""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip

BACKENDS = ["reference", "triton"]


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


def reference_tree(parents, num_nodes, prefix_lens):
    from specdec_kernels.reference.build_tree import build_tree

    return build_tree(parents, num_nodes, prefix_lens)


def check_against_reference(parents, num_nodes, prefix_lens, device):
    """The Triton backend equals the reference bit for bit on all three outputs."""
    got = run_build_tree(parents, num_nodes, prefix_lens, "triton", device)
    want = reference_tree(parents.contiguous(), num_nodes, prefix_lens)
    for name, value, expected in zip(("mask", "depth", "positions"), got, want):
        assert value.dtype == expected.dtype, name
        assert torch.equal(value, expected), name
    return got


def garbage_case(tree_size, chain_share):
    """``(parents, num_nodes, prefix_lens)`` of 5 requests (prime) with malformed trees.

    Parents are any int32 (mostly in range, some negative, some >= i, some
    far out), a ``chain_share`` of them the previous node (deep chains); a
    self-parent and a cycle; counts outside [1, N] on purpose.
    tests/test_build_tree_cuda.py runs it too.
    """
    generator = torch.Generator().manual_seed(tree_size)
    batch_size = 5
    nodes = torch.arange(tree_size)
    parents = (torch.rand(batch_size, tree_size, generator=generator) * nodes).to(torch.int32)
    parents = torch.where(torch.rand(batch_size, tree_size, generator=generator) < chain_share,
                          (nodes - 1).clamp(min=0).to(torch.int32), parents)
    noise = torch.randint(-2**31, 2**31 - 1, (batch_size, tree_size), generator=generator, dtype=torch.int64)
    bad = torch.rand(batch_size, tree_size, generator=generator) < 0.02
    parents = torch.where(bad, noise.to(torch.int32), parents)
    parents[:, 0] = torch.tensor([-1, 0, 7, -1, 2**31 - 1], dtype=torch.int32)
    parents[1, -1] = tree_size - 1  # its own parent
    if tree_size >= 4:
        parents[2, 2], parents[2, 3] = 3, 2  # a cycle: 2 -> 3 -> 2
    num_nodes = torch.tensor([tree_size, 0, -3, tree_size + 5, max(1, tree_size // 2)], dtype=torch.int32)
    prefix_lens = torch.tensor([0, 17, 2**40, -5, 3], dtype=torch.int64)
    return parents, num_nodes, prefix_lens


@pytest.mark.parametrize("tree_size", [1, 31, 32, 33, 64, 1024])
def test_triton_equals_reference_on_garbage(tree_size, device):
    # Deep chains where the interpreter can afford them (a walk is a loop
    # step per ancestor); uniform parents at N = 1024 give depth ~ ln N.
    parents, num_nodes, prefix_lens = garbage_case(tree_size, chain_share=0.5 if tree_size <= 64 else 0.0)
    check_against_reference(parents, num_nodes, prefix_lens, device)
    if tree_size <= 64:
        check_against_reference(parents, None, None, device)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_triton_index_dtypes_and_strides(index_dtype, device):
    generator = torch.Generator().manual_seed(3)
    batch_size, tree_size = 3, 40
    num_nodes = torch.tensor([40, 9, 33], dtype=torch.int32)
    parents = random_parents(generator, batch_size, tree_size, num_nodes).to(index_dtype)
    prefix_lens = torch.tensor([5, 0, 2**33], dtype=torch.int64)
    # Strided views: every other column of a wider tensor, every other request.
    wide = torch.full((2 * batch_size, 2 * tree_size), 2**30, dtype=index_dtype)
    wide[::2, ::2] = parents
    counts = torch.zeros(2 * batch_size, dtype=index_dtype)
    counts[::2] = num_nodes.to(index_dtype)
    prefixes = torch.zeros(2 * batch_size, dtype=torch.int64)
    prefixes[::2] = prefix_lens
    check_against_reference(wide[::2, ::2], counts[::2], prefixes[::2], device)
    check_against_reference(parents, num_nodes.to(index_dtype), prefix_lens.to(torch.int32).clamp(max=9), device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_names_argument_request_and_node(backend, device):
    backend_or_skip("build_tree", backend)
    good = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 1]], dtype=torch.int32, device=device)
    sk.build_tree(good, num_nodes=torch.tensor([4, 2], dtype=torch.int32, device=device), backend=backend,
                  validate=True)
    cases = [
        (torch.tensor([[-1, 0, 0, 1], [0, 0, 1, 1]]), None, r"parents.*request 1 node 0"),
        (torch.tensor([[-1, 0, 0, 1], [-1, 0, 2, 1]]), None, r"parents.*request 1 node 2 has parent 2"),
        (torch.tensor([[-1, 0, -1, 1], [-1, 0, 1, 1]]), None, r"parents.*request 0 node 2 has parent -1"),
        (torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 1]]), torch.tensor([4, 0]), r"num_nodes.*request 1 has 0"),
        (torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 1]]), torch.tensor([5, 1]), r"num_nodes.*request 0 has 5"),
    ]
    for parents, num_nodes, pattern in cases:
        parents = parents.to(torch.int32).to(device)
        num_nodes = None if num_nodes is None else num_nodes.to(torch.int32).to(device)
        with pytest.raises(ValueError, match="build_tree: .*" + pattern):
            sk.build_tree(parents, num_nodes=num_nodes, backend=backend, validate=True)
    # Past n_b nothing is checked.
    sk.build_tree(torch.tensor([[-1, 0, 9, 9]], dtype=torch.int32, device=device),
                  num_nodes=torch.tensor([2], dtype=torch.int32, device=device), backend=backend, validate=True)


def check_in_a_cuda_graph(backend, device):
    """Captures one ``backend`` call and replays it on new trees and prefixes: the reference's outputs every time."""
    backend_or_skip("build_tree", backend)
    generator = torch.Generator().manual_seed(4)
    num_nodes = torch.tensor([64, 20, 7], dtype=torch.int32)
    parents = random_parents(generator, 3, 64, num_nodes).to(device)
    counts, prefix = num_nodes.to(device), torch.tensor([3, 4, 5], device=device)
    sk.build_tree(parents, num_nodes=counts, prefix_lens=prefix, backend=backend)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        info = sk.build_tree(parents, num_nodes=counts, prefix_lens=prefix, backend=backend)
    for step in range(3):
        prefix.add_(10)
        parents[1:, 5] = step  # new trees in place
        graph.replay()
        want = reference_tree(parents, counts, prefix)
        assert all(torch.equal(a, b) for a, b in zip(info, want))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a GPU")
def test_triton_build_tree_in_a_cuda_graph(device):
    check_in_a_cuda_graph("triton", device)


def test_triton_gpu_launch_config_under_the_interpreter(device, monkeypatch):
    # The GPU's tiles (N = 1024: 32 programs of 32 nodes per request), so the
    # interpreter also runs the configuration a GPU launches.
    from specdec_kernels.launchers import build_tree as launcher

    monkeypatch.setattr(launcher, "INTERPRETER_MAX_TILE", launcher.MAX_TILE)
    monkeypatch.setattr(launcher, "INTERPRETER_MAX_BLOCK_NODES", launcher.MAX_BLOCK_NODES)
    assert launcher.launch_config(1024, interpreter=True) == launcher.launch_config(1024)
    generator = torch.Generator().manual_seed(8)
    tree_size = 1024
    parents = (torch.rand(2, tree_size, generator=generator) * torch.arange(tree_size)).to(torch.int32)
    parents[0, 700] = 900  # a parent after its child cuts a subtree
    check_against_reference(parents, torch.tensor([1000, 300], dtype=torch.int32),
                            torch.tensor([4, 9], dtype=torch.int32), device)
