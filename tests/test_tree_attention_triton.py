"""The Triton tree_attention kernel on the shapes that stress its tiling.

Each case is checked against the float64 dense computation with an explicit
mask (the tolerance rule of test_tree_attention.py) and against the
reference backend. Under the interpreter the launcher uses 16-key tiles and
splits the prefix when a batch has fewer than 4 programs, so small inputs
cross key tiles, cache blocks and splits.
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip
from test_tree_attention import (ODD_SIZES, OUTSIDE_CONTRACT, against_reference, ancestor_bits,
                                 check_against_float64, check_error, check_in_a_cuda_graph,
                                 check_rows_that_see_nothing_are_zero, long_context_case, make_inputs,
                                 nan_in_every_prefix, narrow_table_case, odd_size_case, outside_contract_case,
                                 pack_bits, strided_case, unread_slots_case)


@pytest.fixture(autouse=True)
def _triton_available():
    backend_or_skip("tree_attention", "triton")


@pytest.mark.parametrize("batch_size,tree_size,num_q_heads,num_kv_heads,head_dim,block_size,prefixes,dtype",
                         ODD_SIZES)
def test_odd_sizes(batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, block_size, prefixes, dtype, device):
    inputs, tree_bits, num_nodes = odd_size_case(batch_size, tree_size, num_q_heads, num_kv_heads, head_dim,
                                                 block_size, prefixes, dtype)
    out, _ = check_against_float64(inputs, tree_bits, num_nodes, head_dim**-0.5, "triton", device)
    against_reference(out, inputs, pack_bits(tree_bits), num_nodes, head_dim**-0.5, device)


@pytest.mark.parametrize("num_splits", [1, 3, 40])
def test_long_context_in_shuffled_blocks_any_split(num_splits, device):
    """A 397-position prefix over 50 shuffled 8-slot blocks, merged from 1, 3
    or 40 splits (40: more splits than 16-key prefix tiles, so some splits
    see nothing and must not count)."""
    from specdec_kernels.launchers.tree_attention import triton_tree_attention

    inputs, tree_bits, num_nodes = long_context_case()
    q, k_cache, v_cache, block_tables, prefix_lens = inputs
    tree_mask = pack_bits(tree_bits)
    tensors = [t.to(device) for t in (q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes)]
    out = triton_tree_attention(*tensors, 0.125, num_splits=num_splits).cpu()
    against_reference(out, inputs, tree_mask, num_nodes, 0.125, device)
    if num_splits == 3:  # float64 once: it gathers the cache position by position
        check_error(out, inputs, tree_bits, num_nodes, 0.125)


def test_split_partial_states_keep_unread_slots_and_empty_rows_out(device):
    """The split path (partial states, then the merge) on the cases of test_tree_attention.py: slots the op does
    not read never reach the output, rows that see nothing are zero whatever the cache holds."""
    from specdec_kernels.launchers.tree_attention import triton_tree_attention

    clean, poisoned, tree_bits, num_nodes = unread_slots_case()
    tree_mask = pack_bits(tree_bits).to(device)

    def split_run(inputs):
        tensors = [t.to(device) for t in inputs]
        return triton_tree_attention(*tensors, tree_mask, num_nodes.to(device), 0.125, num_splits=3).cpu()

    out = split_run(poisoned)
    assert torch.equal(out, split_run(clean))
    check_error(out, clean, tree_bits, num_nodes, 0.125)
    check_rows_that_see_nothing_are_zero(split_run(nan_in_every_prefix(clean)), num_nodes)


@pytest.mark.parametrize("num_splits", [3, 40])
def test_merge_in_the_last_program_gives_the_bits_of_the_merge_launch(num_splits, device, monkeypatch):
    """The one-launch form (``MERGE_IN_KERNEL``: the last split program of each tile merges it) against the
    default second launch: the same merge in the same order, so the same bits; its counters end at zero.
    Two requests, Hq = 2 Hkv: several tiles, each with its own counter."""
    from specdec_kernels import _workspace
    from specdec_kernels.launchers import tree_attention as launcher

    generator = torch.Generator().manual_seed(23)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, 2, 5, 4, 2, 64, torch.float16, 8, torch.tensor([397, 150], dtype=torch.int32))
    tensors = [t.to(device) for t in (q, k_cache, v_cache, block_tables, prefix_lens,
                                      pack_bits(ancestor_bits(generator, 2, 5)), num_nodes)]
    second_launch = launcher.triton_tree_attention(*tensors, 0.125, num_splits=num_splits)
    monkeypatch.setattr(launcher, "MERGE_IN_KERNEL", True)
    config = launcher.launch_config(2, 5, 2, 2, 64, block_tables.shape[1] * 8, None)._replace(num_splits=num_splits)
    assert launcher.merges_in_kernel(config, 64)
    for _ in range(2):  # the second call starts from the counters the first left
        assert torch.equal(launcher.triton_tree_attention(*tensors, 0.125, num_splits=num_splits), second_launch)
    counters = [buffer for key, buffer in _workspace._buffers.items() if key[0] == "tree_attention.merge_counter"]
    assert counters and all(not buffer.any() for buffer in counters)


def test_strided_inputs(device):
    """Every input a view with padded strides; q's last dim strided too (the launcher copies it)."""
    views, dense = strided_case()
    q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes = dense
    out = sk.tree_attention(*(t.to(device) for t in views[:6]), num_nodes=views[6].to(device), backend="triton").cpu()
    expected = sk.tree_attention(*(t.to(device) for t in dense[:6]), num_nodes=num_nodes.to(device),
                                 backend="triton").cpu()
    assert torch.equal(out, expected)
    against_reference(out, dense[:5], tree_mask, num_nodes, q.shape[-1]**-0.5, device)


def test_rejects_a_block_size_that_is_not_a_power_of_two(device):
    """Checked on the host before the launch; the reference takes any block size."""
    q = torch.zeros(1, 2, 2, 64, dtype=torch.float16, device=device)
    cache = torch.zeros(2, 12, 2, 64, dtype=torch.float16, device=device)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=device)
    lens = torch.zeros(1, dtype=torch.int32, device=device)
    mask = torch.ones(1, 2, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="power-of-two block size"):
        sk.tree_attention(q, cache, cache, tables, lens, mask, backend="triton")
    assert sk.tree_attention(q, cache, cache, tables, lens, mask, backend="reference").shape == q.shape


def test_positions_past_the_table_are_never_read(device):
    inputs, tree_bits, num_nodes = narrow_table_case()
    out, _ = check_against_float64(inputs, tree_bits, num_nodes, 0.125, "triton", device)
    q, k_cache, v_cache, narrow, prefix_lens = inputs
    against_reference(out, (q, k_cache, v_cache, narrow.contiguous(), prefix_lens), pack_bits(tree_bits), num_nodes,
                      0.125, device)


@pytest.mark.parametrize("prefixes,counts,num_blocks,max_blocks", OUTSIDE_CONTRACT)
def test_values_outside_the_contract_have_the_reference_outcome(prefixes, counts, num_blocks, max_blocks, device):
    *tensors, num_nodes = outside_contract_case(prefixes, counts, num_blocks, max_blocks)
    out = sk.tree_attention(*(t.to(device) for t in tensors),
                            num_nodes=None if num_nodes is None else num_nodes.to(device), backend="triton").cpu()
    against_reference(out, tensors[:5], tensors[5], num_nodes, None, device)


def test_reads_no_tensor_value_on_the_host(device, monkeypatch):
    """Everything before the launch uses shapes only: with every way of
    reading a tensor's value on the host disabled, the Triton path still runs
    (the reference on CPU tensors, which reads ``prefix_lens.max()`` there,
    would not), on a shape that splits."""
    generator = torch.Generator().manual_seed(23)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, 1, 3, 4, 2, 64, torch.float16, 16, torch.tensor([40], dtype=torch.int32)
    )
    tree_mask = pack_bits(ancestor_bits(generator, 1, 3))
    tensors = [t.to(device) for t in (q, k_cache, v_cache, block_tables, prefix_lens, tree_mask)]

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    out = sk.tree_attention(*tensors, num_nodes=num_nodes.to(device), backend="triton")
    monkeypatch.undo()
    against_reference(out.cpu(), (q, k_cache, v_cache, block_tables, prefix_lens), tree_mask, num_nodes, None,
                      device)


def test_captured_in_a_cuda_graph_with_a_split(device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    check_in_a_cuda_graph("triton", device)
