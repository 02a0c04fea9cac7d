"""The CUDA build_tree (csrc/include/specdec/build_tree.cuh) against the reference, bit for bit.

Two ways in, each case runs both where it can:

* ``host``: ``torch.ops.specdec_C.build_tree`` on CPU tensors runs the
  kernel's node program on the host, node after node, so these cases check
  the .cuh file on machines without a GPU;
* ``gpu``: ``sk.build_tree(..., backend="cuda")`` launches the kernel (GPU only).
"""

import pytest
import torch

import specdec_kernels as sk
from conftest import extension_op_marks
from test_build_tree import check_in_a_cuda_graph, expected_tree, garbage_case, random_parents, reference_tree

needs_op, needs_gpu, RUNNERS = extension_op_marks("build_tree")


def run_cuda_build_tree(runner, parents, num_nodes, prefix_lens):
    """The CUDA program (host emulation or GPU kernel); inputs and outputs on the CPU."""
    if runner == "host":
        return torch.ops.specdec_C.build_tree(parents, num_nodes, prefix_lens)
    info = sk.build_tree(parents.cuda(), num_nodes=None if num_nodes is None else num_nodes.cuda(),
                         prefix_lens=None if prefix_lens is None else prefix_lens.cuda(), backend="cuda")
    return tuple(output.cpu() for output in info)


def check_against_reference(runner, parents, num_nodes, prefix_lens):
    got = run_cuda_build_tree(runner, parents, num_nodes, prefix_lens)
    want = reference_tree(parents.contiguous(), num_nodes, prefix_lens)
    for name, value, expected in zip(("mask", "depth", "positions"), got, want):
        assert value.dtype == expected.dtype and value.shape == expected.shape, name
        assert torch.equal(value, expected), name
    return got


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("tree_size", [1, 5, 64, 65, 1024])
def test_random_trees_equal_the_reference(tree_size, runner):
    # B = 5 (prime), ragged counts, one full tree, big prefixes.
    generator = torch.Generator().manual_seed(tree_size)
    batch_size = 5
    num_nodes = torch.randint(1, tree_size + 1, (batch_size,), generator=generator, dtype=torch.int32)
    num_nodes[0] = tree_size
    parents = random_parents(generator, batch_size, tree_size, num_nodes)
    prefix_lens = torch.randint(0, 2**40, (batch_size,), generator=generator, dtype=torch.int64)
    check_against_reference(runner, parents, num_nodes, prefix_lens)
    check_against_reference(runner, parents, None, None)
    if tree_size <= 65:  # the independent walk in Python is slow at N = 1024
        got = run_cuda_build_tree(runner, parents, num_nodes, prefix_lens)
        assert all(torch.equal(a, b) for a, b in zip(got, expected_tree(parents, num_nodes, prefix_lens)))


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("tree_size", [1, 5, 31, 32, 33, 64, 65, 1024])
def test_malformed_trees_equal_the_reference(tree_size, runner):
    # Deep chains at every size (depth 1023 crosses all 32 words of a row),
    # parents out of [0, i), cycles, garbage roots, counts outside [1, N].
    parents, num_nodes, prefix_lens = garbage_case(tree_size, chain_share=0.5)
    check_against_reference(runner, parents, num_nodes, prefix_lens)
    check_against_reference(runner, parents, None, prefix_lens.to(torch.int32).clamp(max=9))
    wide_counts = torch.tensor([2**40, -2**40, 1, tree_size, 2**31], dtype=torch.int64)
    check_against_reference(runner, parents.to(torch.int64), wide_counts, None)


@pytest.mark.parametrize("runner", RUNNERS)
def test_depth_and_positions_of_the_contract_example(runner):
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 5]], dtype=torch.int32)
    mask, depth, positions = check_against_reference(runner, parents, torch.tensor([4, 3], dtype=torch.int32),
                                                     torch.tensor([10, 2], dtype=torch.int32))
    assert mask[0, :, 0].tolist() == [1, 3, 5, 11]
    assert depth.tolist() == [[0, 1, 1, 2], [0, 1, 2, -1]]
    assert positions.tolist() == [[10, 11, 11, 12], [2, 3, 4, 1]]


@pytest.mark.parametrize("runner", RUNNERS)
def test_positions_wrap_like_torch(runner):
    # prefix + depth in int64 wraps as torch's add does (an unreachable node
    # at INT64_MIN gives INT64_MAX).
    parents = torch.tensor([[-1, 0, 9], [-1, 0, 1]], dtype=torch.int64)
    prefix_lens = torch.tensor([-2**63, 2**63 - 1], dtype=torch.int64)
    _, _, positions = check_against_reference(runner, parents, None, prefix_lens)
    assert positions[0, 2] == 2**63 - 1 and positions[1, 1] == -2**63


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("parents_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("counts_dtype", [torch.int32, torch.int64])
def test_index_dtypes_mix_and_strides(counts_dtype, parents_dtype, runner):
    # Every input a strided view (every other column, every other request);
    # parents, counts and prefixes each in their own width.
    generator = torch.Generator().manual_seed(3)
    batch_size, tree_size = 3, 70
    num_nodes = torch.tensor([70, 9, 33], dtype=torch.int32)
    parents = random_parents(generator, batch_size, tree_size, num_nodes).to(parents_dtype)
    wide = torch.full((2 * batch_size, 2 * tree_size), 2**30, dtype=parents_dtype)
    wide[::2, ::2] = parents
    counts = torch.zeros(2 * batch_size, dtype=counts_dtype)
    counts[::2] = num_nodes.to(counts_dtype)
    prefixes = torch.zeros(2 * batch_size, dtype=torch.int64 if counts_dtype == torch.int32 else torch.int32)
    prefixes[::2] = torch.tensor([5, 0, 2**20])
    check_against_reference(runner, wide[::2, ::2], counts[::2], prefixes[::2])


@needs_op
def test_host_checks_name_the_argument():
    parents = torch.tensor([[-1, 0]], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"specdec_C::build_tree: `parents` must be Int or Long, got Float"):
        torch.ops.specdec_C.build_tree(parents.float(), None, None)
    with pytest.raises(ValueError, match=r"`parents` must have shape \[B, N\], got \[2\]"):
        torch.ops.specdec_C.build_tree(parents[0], None, None)
    with pytest.raises(ValueError, match=r"`num_nodes` must have shape \[B\] = \[1\], got \[2\]"):
        torch.ops.specdec_C.build_tree(parents, torch.tensor([2, 2], dtype=torch.int32), None)
    with pytest.raises(TypeError, match=r"`prefix_lens` must be Int or Long, got Short"):
        torch.ops.specdec_C.build_tree(parents, None, torch.tensor([2], dtype=torch.int16))


@needs_op
def test_registration_opcheck_and_meta():
    parents = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 5, 2, 0]], dtype=torch.int64)
    counts, prefix = torch.tensor([5, 4], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int64)
    torch.library.opcheck(torch.ops.specdec_C.build_tree.default, (parents, counts, prefix))
    mask, depth, positions = torch.ops.specdec_C.build_tree(torch.empty((3, 40), dtype=torch.int32, device="meta"),
                                                            None, None)
    assert (mask.shape, mask.dtype) == ((3, 40, 2), torch.int32)
    assert (depth.shape, depth.dtype, positions.shape, positions.dtype) == ((3, 40), torch.int32, (3, 40),
                                                                           torch.int64)


@needs_gpu
def test_auto_picks_cuda_on_gpu_tensors():
    from specdec_kernels import _backend

    assert _backend.resolve("build_tree", "auto", torch.device("cuda")) == "cuda"


@needs_gpu
def test_cuda_build_tree_in_a_cuda_graph(device):
    check_in_a_cuda_graph("cuda", device)
