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
from test_tree_attention import ancestor_bits, check_against_float64, check_error, make_inputs, pack_bits


@pytest.fixture(autouse=True)
def _triton_available():
    backend_or_skip("tree_attention", "triton")


def against_reference(out, inputs, tree_mask, num_nodes, scale, device):
    """The kernel agrees with the reference up to the rounding of the output dtype."""
    expected = sk.tree_attention(*(t.to(device) for t in inputs), tree_mask.to(device),
                                 num_nodes=None if num_nodes is None else num_nodes.to(device), scale=scale,
                                 backend="reference").cpu()
    tolerance = torch.finfo(out.dtype).eps * expected.abs().max().item()
    assert (out.float() - expected.float()).abs().max().item() <= tolerance


# (B, N, Hq, Hkv, D, block size, prefix lengths, dtype): N = 1; N not a
# multiple of 32 with Hq = 8 Hkv; Hq = Hkv; D = 256 in one 256-slot block;
# prefixes of 0 and not multiples of the block size everywhere.
ODD_SIZES = [
    (2, 1, 2, 2, 64, 8, [0, 13], torch.float16),
    (3, 33, 8, 1, 128, 16, [0, 5, 47], torch.bfloat16),
    (2, 5, 4, 4, 64, 32, [70, 0], torch.float16),
    (1, 6, 4, 2, 256, 256, [300], torch.bfloat16),
]


@pytest.mark.parametrize("batch_size,tree_size,num_q_heads,num_kv_heads,head_dim,block_size,prefixes,dtype",
                         ODD_SIZES)
def test_odd_sizes(batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, block_size, prefixes, dtype, device):
    generator = torch.Generator().manual_seed(tree_size * 100 + head_dim)
    prefix_lens = torch.tensor(prefixes, dtype=torch.int32)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, dtype, block_size, prefix_lens
    )
    tree_bits = ancestor_bits(generator, batch_size, tree_size)
    inputs = (q, k_cache, v_cache, block_tables, prefix_lens)
    out, _ = check_against_float64(inputs, tree_bits, num_nodes, head_dim**-0.5, "triton", device)
    against_reference(out, inputs, pack_bits(tree_bits), num_nodes, head_dim**-0.5, device)


@pytest.mark.parametrize("num_splits", [1, 3, 40])
def test_long_context_in_shuffled_blocks_any_split(num_splits, device):
    """A 397-position prefix over 50 shuffled 8-slot blocks, merged from 1, 3
    or 40 splits (40: more splits than 16-key prefix tiles, so some splits
    see nothing and must not count)."""
    from specdec_kernels.launchers.tree_attention import triton_tree_attention

    generator = torch.Generator().manual_seed(5)
    prefix_lens = torch.tensor([397], dtype=torch.int32)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, 1, 7, 8, 2, 64, torch.float16, 8, prefix_lens
    )
    assert block_tables.shape[1] == 51
    tree_bits = ancestor_bits(generator, 1, 7)
    tree_mask = pack_bits(tree_bits)
    tensors = [t.to(device) for t in (q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes)]
    out = triton_tree_attention(*tensors, 0.125, num_splits=num_splits).cpu()
    inputs = (q, k_cache, v_cache, block_tables, prefix_lens)
    against_reference(out, inputs, tree_mask, num_nodes, 0.125, device)
    if num_splits == 3:  # float64 once: it gathers the cache position by position
        check_error(out, inputs, tree_bits, num_nodes, 0.125)


def test_strided_inputs(device):
    """Every input a view with padded strides; q's last dim strided too (the launcher copies it)."""
    generator = torch.Generator().manual_seed(9)
    batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, block_size = 3, 9, 4, 2, 64, 16
    prefix_lens = torch.tensor([0, 21, 40], dtype=torch.int32)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, torch.bfloat16, block_size,
        prefix_lens
    )
    tree_bits = ancestor_bits(generator, batch_size, tree_size)
    tree_mask = pack_bits(tree_bits)

    # K and V interleaved in one allocation, heads padded: [blocks, slots, 2, Hkv + 1, D].
    kv = torch.zeros(k_cache.shape[0], block_size, 2, num_kv_heads + 1, head_dim, dtype=k_cache.dtype)
    kv[:, :, 0, :num_kv_heads], kv[:, :, 1, :num_kv_heads] = k_cache, v_cache
    strided_k, strided_v = kv[:, :, 0, :num_kv_heads], kv[:, :, 1, :num_kv_heads]
    strided_q = torch.zeros(batch_size, tree_size, num_q_heads, 2 * head_dim, dtype=q.dtype)
    strided_q[..., ::2] = q
    strided_q = strided_q[..., ::2]
    wide_tables = torch.full((batch_size, 2 * block_tables.shape[1] + 1), -1, dtype=torch.int32)
    wide_tables[:, 1::2] = block_tables
    wide_lens = torch.stack([prefix_lens, torch.full_like(prefix_lens, 10**6)], 1)
    wide_mask = torch.zeros(batch_size, tree_size, 3, dtype=torch.int32)
    wide_mask[:, :, 1:2] = tree_mask
    wide_counts = torch.stack([num_nodes, torch.zeros_like(num_nodes)], 1)
    views = (strided_q, strided_k, strided_v, wide_tables[:, 1::2], wide_lens[:, 0])
    assert not any(t.is_contiguous() for t in views)

    out = sk.tree_attention(*(t.to(device) for t in views), wide_mask[:, :, 1:2].to(device),
                            num_nodes=wide_counts[:, 0].to(device), backend="triton").cpu()
    expected = sk.tree_attention(q.to(device), k_cache.to(device), v_cache.to(device), block_tables.to(device),
                                 prefix_lens.to(device), tree_mask.to(device), num_nodes=num_nodes.to(device),
                                 backend="triton").cpu()
    assert torch.equal(out, expected)
    against_reference(out, (q, k_cache, v_cache, block_tables, prefix_lens), tree_mask, num_nodes,
                      head_dim**-0.5, device)


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
    """The table is a column slice of a wider one whose next columns hold
    valid block ids: positions past the slice must stay invisible."""
    generator = torch.Generator().manual_seed(13)
    prefix_lens = torch.tensor([30, 12], dtype=torch.int32)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, 2, 10, 4, 2, 64, torch.float16, 8, prefix_lens
    )
    narrow = block_tables[:, :3]  # 24 positions: request 0's prefix is cut, request 1's nodes from 12 on
    tree_bits = ancestor_bits(generator, 2, 10)
    inputs = (q, k_cache, v_cache, narrow, prefix_lens)
    out, _ = check_against_float64(inputs, tree_bits, num_nodes, 0.125, "triton", device)
    against_reference(out, (q, k_cache, v_cache, narrow.contiguous(), prefix_lens), pack_bits(tree_bits), num_nodes,
                      0.125, device)


@pytest.mark.parametrize("prefixes,counts,num_blocks,max_blocks", [
    ([-2, -10], None, 6, 3),  # negative prefixes: tree nodes before position 0 are invisible
    ([3, 4], [0, 9], 6, 3),  # counts outside [1, N]
    ([2**31 - 1, 7], None, 6, 3),  # a prefix far past the table
    ([3, 4], None, 0, 3),  # an empty cache
    ([3, 4], None, 6, 0),  # an empty table
])
def test_values_outside_the_contract_have_the_reference_outcome(prefixes, counts, num_blocks, max_blocks, device):
    generator = torch.Generator().manual_seed(19)
    q = torch.randn(2, 5, 4, 64, generator=generator).half()
    k_cache, v_cache = torch.randn(2, 6, 8, 2, 64, generator=generator).half()[:, :num_blocks]
    tables = torch.arange(6, dtype=torch.int32).view(2, 3)[:, :max_blocks]
    mask = sk.build_tree(torch.tensor([[-1, 0, 0, 1, 2]] * 2, dtype=torch.int32)).mask
    num_nodes = None if counts is None else torch.tensor(counts, dtype=torch.int32)
    tensors = [t.to(device) for t in (q, k_cache, v_cache, tables, torch.tensor(prefixes, dtype=torch.int32), mask)]
    out = sk.tree_attention(*tensors, num_nodes=None if num_nodes is None else num_nodes.to(device),
                            backend="triton").cpu()
    against_reference(out, (q, k_cache, v_cache, tables, torch.tensor(prefixes, dtype=torch.int32)), mask,
                      num_nodes, None, device)


def test_reads_no_tensor_value_on_the_host(device, monkeypatch):
    """Everything before the launch uses shapes only: with every way of
    reading a tensor's value on the host disabled, the Triton path still runs
    (the reference, which reads ``prefix_lens.max()``, would not), on a
    shape that splits."""
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
    """No host read on the Triton path: one request over a long prefix (it
    splits, so both launches are captured) is replayed with new prefix
    lengths and queries."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    generator = torch.Generator().manual_seed(17)
    prefix_lens = torch.tensor([3000], dtype=torch.int32)
    q, k_cache, v_cache, block_tables, prefix_lens, _ = make_inputs(
        generator, 1, 8, 32, 8, 128, torch.bfloat16, 16, prefix_lens
    )
    tree_mask = pack_bits(ancestor_bits(generator, 1, 8))
    q, k_cache, v_cache, block_tables, prefix_lens, tree_mask = (
        t.to(device) for t in (q, k_cache, v_cache, block_tables, prefix_lens, tree_mask))
    capture_stream = torch.cuda.Stream()
    with torch.cuda.stream(capture_stream):  # compile outside the capture
        sk.tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, backend="triton")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        out = sk.tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, backend="triton")
    for prefix in (3000, 17, 0):
        prefix_lens.fill_(prefix)
        q.normal_()
        graph.replay()
        # The kernel is deterministic: a replay equals an eager call bit for bit
        # (accuracy is the other tests' business).
        eager = sk.tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, backend="triton")
        assert torch.equal(out, eager)
