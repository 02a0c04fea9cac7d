"""sk.tree_attention against a float64 dense softmax built here, request by request.

Tolerance (FlashAttention's rule): the op's max error against float64 may be
at most twice the max error of a naive dense computation in the input dtype,
plus one float32 ulp of the output scale (the reference computes in float32,
so it cannot beat float32 rounding even when the inputs are float32).

The cases at the end are shared with the kernels' own tests
(test_tree_attention_triton.py, test_tree_attention_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip

BACKENDS = ["reference", "triton", "cuda"]  # cuda: GPU only (tests/test_tree_attention_cuda.py runs its host path)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run_tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, scale, backend,
                       device):
    """The op on ``device``; inputs and output on the CPU."""
    backend_or_skip("tree_attention", backend)
    if q.dtype == torch.float32 and backend == "triton":
        pytest.skip("the Triton kernel refuses float32 (test_the_triton_kernel_refuses_float32)")
    tensors = [t.to(device) for t in (q, k_cache, v_cache, block_tables, prefix_lens, tree_mask)]
    out = sk.tree_attention(
        *tensors, num_nodes=None if num_nodes is None else num_nodes.to(device), scale=scale, backend=backend
    )
    return out.cpu()


def pack_bits(tree_bits):
    """bool ``[B, N, N]`` -> int32 words ``[B, N, ceil(N/32)]``, in Python ints."""
    batch_size, tree_size, _ = tree_bits.shape
    num_words = (tree_size + 31) // 32
    words = [[[0] * num_words for _ in range(tree_size)] for _ in range(batch_size)]
    for b, i, j in tree_bits.nonzero().tolist():
        words[b][i][j // 32] |= 1 << (j % 32)
    signed = [[[w - 2**32 if w >= 2**31 else w for w in row] for row in rows] for rows in words]
    return torch.tensor(signed, dtype=torch.int32).view(batch_size, tree_size, num_words)


def ancestor_bits(generator, batch_size, tree_size):
    """bool ``[B, N, N]``: node j is i or an ancestor of i, for random trees."""
    bits = torch.zeros(batch_size, tree_size, tree_size, dtype=torch.bool)
    for b in range(batch_size):
        parents = [-1] + [
            int(torch.randint(max(0, i - 4), i, (), generator=generator)) for i in range(1, tree_size)
        ]
        for i in range(tree_size):
            node = i
            while node >= 0:
                bits[b, i, node] = True
                node = parents[node]
    return bits


def gather_requests(k_cache, v_cache, block_tables, prefix_lens, tree_bits, num_nodes):
    """Per request: the cache read position by position following the block
    table, and the ``[N, L]`` visibility of each position to each node.

    A position whose column is past the table or whose block id is out of
    range is not visible, nor is a padding node's key (it is not read), nor
    anything to a node past ``num_nodes``.
    """
    num_blocks, block_size = k_cache.shape[:2]
    max_blocks = block_tables.shape[1]
    batch_size, tree_size, _ = tree_bits.shape
    bits = tree_bits.tolist()
    requests = []
    for b in range(batch_size):
        prefix = int(prefix_lens[b])
        length = prefix + tree_size
        keys = torch.zeros(length, *k_cache.shape[2:], dtype=torch.float64)
        values = torch.zeros_like(keys)
        stored = [False] * length
        live = tree_size if num_nodes is None else int(num_nodes[b])
        for position in range(min(length, prefix + live)):
            column = position // block_size
            block = int(block_tables[b, column]) if column < max_blocks else -1
            if 0 <= block < num_blocks:
                stored[position] = True
                keys[position] = k_cache[block, position % block_size].double()
                values[position] = v_cache[block, position % block_size].double()
        visible = [
            [i < live and stored[position] and (position < prefix or bits[b][i][position - prefix])
             for position in range(length)]
            for i in range(tree_size)
        ]
        requests.append((keys, values, torch.tensor(visible, dtype=torch.bool).view(tree_size, length)))
    return requests


def dense_attention(q, requests, scale, dtype):
    """Masked softmax attention computed in ``dtype``, one request at a time."""
    batch_size, tree_size, num_q_heads, head_dim = q.shape
    out = torch.zeros(batch_size, tree_size, num_q_heads, head_dim, dtype=dtype)
    for b, (keys, values, visible) in enumerate(requests):
        group = num_q_heads // keys.shape[1]
        # Contiguous [H, N, D] @ [H, D, L]: CPU half matmuls on transposed
        # views are ~30x slower.
        keys = keys.to(dtype).repeat_interleave(group, dim=1).permute(1, 2, 0).contiguous()
        values = values.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1).contiguous()
        queries = q[b].to(dtype).transpose(0, 1).contiguous()
        scores = torch.bmm(queries, keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows seeing nothing
        out[b] = torch.bmm(weights, values).transpose(0, 1)
    return out


def make_inputs(
    generator, batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, dtype, block_size=8, prefix_lens=None
):
    if prefix_lens is None:
        prefix_lens = torch.randint(0, 60, (batch_size,), generator=generator, dtype=torch.int32)
        prefix_lens[0] = 0
    max_blocks = (int(prefix_lens.max()) + tree_size + block_size - 1) // block_size
    num_blocks = batch_size * max_blocks + 3  # a few blocks no request owns
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = order[: batch_size * max_blocks].view(batch_size, max_blocks).to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    q = torch.randn(batch_size, tree_size, num_q_heads, head_dim, generator=generator).to(dtype)
    num_nodes = torch.randint(1, tree_size + 1, (batch_size,), generator=generator, dtype=torch.int32)
    num_nodes[-1] = tree_size
    return q, k_cache, v_cache, block_tables, prefix_lens, num_nodes


def check_against_float64(inputs, tree_bits, num_nodes, scale, backend, device):
    q, k_cache, v_cache, block_tables, prefix_lens = inputs
    out = run_tree_attention(
        q, k_cache, v_cache, block_tables, prefix_lens, pack_bits(tree_bits), num_nodes, scale, backend, device
    )
    return out, check_error(out, inputs, tree_bits, num_nodes, scale)


def check_error(out, inputs, tree_bits, num_nodes, scale):
    """``out``'s error against float64 is at most twice the naive same-dtype path's; padding rows are zero.

    Returns the float64 attention.
    """
    q, k_cache, v_cache, block_tables, prefix_lens = inputs
    assert out.dtype == q.dtype and out.shape == q.shape
    requests = gather_requests(k_cache, v_cache, block_tables, prefix_lens, tree_bits, num_nodes)
    exact = dense_attention(q, requests, scale, torch.float64)
    naive = dense_attention(q, requests, scale, q.dtype)
    error = (out.double() - exact).abs().max().item()
    naive_error = (naive.double() - exact).abs().max().item()
    slack = torch.finfo(torch.float32).eps * exact.abs().max().item()
    assert error <= 2 * naive_error + slack, (error, naive_error)
    if num_nodes is not None:
        live = torch.arange(q.shape[1])[None, :] < num_nodes[:, None].long()
        assert (out[~live] == 0).all(), "padding rows must be zero"
    return exact


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_matches_float64(num_q_heads, num_kv_heads, head_dim, dtype, backend, device):
    generator = torch.Generator().manual_seed(head_dim + 10 * num_q_heads + DTYPES.index(dtype))
    batch_size, tree_size = 3, 37  # two mask words
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, dtype
    )
    tree_bits = ancestor_bits(generator, batch_size, tree_size)
    inputs = (q, k_cache, v_cache, block_tables, prefix_lens)
    check_against_float64(inputs, tree_bits, num_nodes, head_dim**-0.5, backend, device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_arbitrary_mask_bits(dtype, backend, device):
    # The op reads bits, not trees: every bit position matters, including
    # bit 31 of each word (a negative int32).
    generator = torch.Generator().manual_seed(7)
    batch_size, tree_size = 2, 64
    q, k_cache, v_cache, block_tables, prefix_lens, _ = make_inputs(
        generator, batch_size, tree_size, 4, 2, 64, dtype
    )
    tree_bits = torch.rand(batch_size, tree_size, tree_size, generator=generator) < 0.5
    tree_bits[:, :, 31] = True
    tree_bits[:, 5, :] = False
    tree_bits[:, 5, 63] = True  # node 5 sees the prefix and node 63 only
    inputs = (q, k_cache, v_cache, block_tables, prefix_lens)
    check_against_float64(inputs, tree_bits, None, 0.1, backend, device)


def unread_slots_case(dtype=torch.float16):
    """``(clean, poisoned, tree_bits, num_nodes)``: inputs ``(q, k_cache, v_cache, block_tables, prefix_lens)``
    whose caches differ only in the slots the op does not read (padding nodes' keys, positions past each tree,
    blocks no request owns), +inf in K and NaN in V in ``poisoned``. Random mask bits, set for padding nodes too."""
    generator = torch.Generator().manual_seed(23)
    batch_size, tree_size, block_size = 3, 9, 8
    q, k_cache, v_cache, block_tables, prefix_lens, _ = make_inputs(
        generator, batch_size, tree_size, 8, 2, 64, dtype, block_size, torch.tensor([21, 3, 40], dtype=torch.int32)
    )
    num_nodes = torch.tensor([9, 4, 1], dtype=torch.int32)
    tree_bits = torch.rand(batch_size, tree_size, tree_size, generator=generator) < 0.5
    poisoned_k = torch.full_like(k_cache, float("inf"))
    poisoned_v = torch.full_like(v_cache, float("nan"))
    for b in range(batch_size):
        for position in range(int(prefix_lens[b]) + int(num_nodes[b])):
            block, slot = int(block_tables[b, position // block_size]), position % block_size
            poisoned_k[block, slot] = k_cache[block, slot]
            poisoned_v[block, slot] = v_cache[block, slot]
    return ((q, k_cache, v_cache, block_tables, prefix_lens), (q, poisoned_k, poisoned_v, block_tables, prefix_lens),
            tree_bits, num_nodes)


def nan_in_every_prefix(inputs):
    """``inputs`` with NaN in the value at position 0 of every request (all have a prefix): every live row reads
    it."""
    q, k_cache, v_cache, block_tables, prefix_lens = inputs
    v_cache = v_cache.clone()
    v_cache[block_tables[:, 0].long(), 0] = float("nan")
    return q, k_cache, v_cache, block_tables, prefix_lens


def check_rows_that_see_nothing_are_zero(out, num_nodes):
    """Padding rows exactly zero, live rows NaN (they read the NaN: garbage in, garbage out)."""
    live = torch.arange(out.shape[1])[None, :] < num_nodes[:, None].long()
    assert (out[~live] == 0).all()
    assert out[live].isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_the_op_does_not_read_never_reach_the_output(backend, device):
    clean, poisoned, tree_bits, num_nodes = unread_slots_case()
    tree_mask = pack_bits(tree_bits)
    out = run_tree_attention(*poisoned, tree_mask, num_nodes, 0.125, backend, device)
    assert torch.equal(out, run_tree_attention(*clean, tree_mask, num_nodes, 0.125, backend, device))
    check_error(out, clean, tree_bits, num_nodes, 0.125)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_see_nothing_are_zero_whatever_the_cache_holds(backend, device):
    clean, _, tree_bits, num_nodes = unread_slots_case()
    out = run_tree_attention(*nan_in_every_prefix(clean), pack_bits(tree_bits), num_nodes, 0.125, backend, device)
    check_rows_that_see_nothing_are_zero(out, num_nodes)


@pytest.mark.parametrize("head_dim", [24, 96])
def test_the_reference_takes_any_head_dim(head_dim):
    generator = torch.Generator().manual_seed(head_dim)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, 2, 5, 4, 2, head_dim, torch.float32
    )
    inputs = (q, k_cache, v_cache, block_tables, prefix_lens)
    check_against_float64(inputs, ancestor_bits(generator, 2, 5), num_nodes, head_dim**-0.5, "reference", "cpu")


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_the_kernels_reject_other_head_dims_by_name(backend, device):
    backend_or_skip("tree_attention", backend)
    generator = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, 1, 2, 4, 2, 96, torch.float16
    )
    tensors = [t.to(device) for t in (q, k_cache, v_cache, block_tables, prefix_lens)]
    mask = pack_bits(ancestor_bits(generator, 1, 2)).to(device)
    with pytest.raises(ValueError, match=rf"the {backend} kernel needs `q` with a head dimension D in "
                                         r"\(64, 128, 256\) \(the reference takes any\); got D = 96"):
        sk.tree_attention(*tensors, mask, backend=backend)


def test_the_triton_kernel_refuses_float32(device):
    backend_or_skip("tree_attention", "triton")
    generator = torch.Generator().manual_seed(4)
    q, k_cache, v_cache, block_tables, prefix_lens, _ = make_inputs(generator, 1, 2, 4, 2, 64, torch.float32)
    tensors = [t.to(device) for t in (q, k_cache, v_cache, block_tables, prefix_lens)]
    mask = pack_bits(ancestor_bits(generator, 1, 2)).to(device)
    with pytest.raises(TypeError, match=r"the triton kernel takes float16 or bfloat16 `q` \(float32 tiles spill on "
                                        r"GPUs\); got float32: use backend 'cuda' or 'reference'"):
        sk.tree_attention(*tensors, mask, backend="triton")


def test_auto_takes_float32_away_from_triton(monkeypatch):
    """Where ``auto`` would pick Triton (CUDA tensors), float32 inputs go to the CUDA kernel, or without it to the
    reference, through the public function and the registered op alike (backend choice stubbed: no GPU here)."""
    from specdec_kernels import _backend

    generator = torch.Generator().manual_seed(6)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(generator, 2, 5, 4, 2, 64,
                                                                            torch.float32)
    inputs = (q, k_cache, v_cache, block_tables, prefix_lens, pack_bits(ancestor_bits(generator, 2, 5)))
    expected = sk.tree_attention(*inputs, num_nodes=num_nodes, backend="reference")
    monkeypatch.setattr(_backend, "resolve", lambda *args: "triton")
    monkeypatch.setattr(_backend, "available", lambda *args: False)
    assert torch.equal(sk.tree_attention(*inputs, num_nodes=num_nodes, backend="auto"), expected)
    assert torch.equal(torch.ops.specdec.tree_attention(*inputs, num_nodes, None, "auto"), expected)


def bad_block_ids_case():
    """``(inputs, tree_bits, num_nodes)``: block ids out of range, negative, at the cache size, and a table too
    narrow for the last request's tree."""
    generator = torch.Generator().manual_seed(11)
    batch_size, tree_size, block_size = 4, 12, 4
    prefix_lens = torch.tensor([0, 9, 17, 30], dtype=torch.int32)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, batch_size, tree_size, 8, 2, 64, torch.float16, block_size, prefix_lens
    )
    num_blocks = k_cache.shape[0]
    num_nodes[:] = torch.tensor([12, 12, 7, 12], dtype=torch.int32)
    # Request 3 needs 11 columns; with 8 (32 positions) its nodes 2..11 fall
    # past the end of the table.
    block_tables = block_tables[:, :8].contiguous()
    block_tables[0, :] = -1  # request 0 (no prefix) sees nothing at all
    block_tables[1, 0] = num_blocks  # part of the prefix is gone
    block_tables[1, 3] = -5  # nodes 3..6 of request 1 are gone
    block_tables[2, 1] = 2**31 - 1
    tree_bits = ancestor_bits(generator, batch_size, tree_size)
    return (q, k_cache, v_cache, block_tables, prefix_lens), tree_bits, num_nodes


def check_bad_block_ids_outcome(out, exact, num_nodes):
    assert (out[0] == 0).all(), "rows that see no key must be zero"
    live = torch.arange(out.shape[1])[None, :] < num_nodes[:, None].long()
    assert (exact[1:].abs().sum(dim=(-1, -2))[live[1:]] > 0).all(), "the test masks too much"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_block_ids_are_masked(backend, device):
    inputs, tree_bits, num_nodes = bad_block_ids_case()
    out, exact = check_against_float64(inputs, tree_bits, num_nodes, 0.125, backend, device)
    check_bad_block_ids_outcome(out, exact, num_nodes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_scale(backend, device):
    generator = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, 2, 5, 4, 4, 128, torch.bfloat16
    )
    tree_mask = pack_bits(ancestor_bits(generator, 2, 5))
    args = (q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes)
    default = run_tree_attention(*args, None, backend, device)
    explicit = run_tree_attention(*args, 128**-0.5, backend, device)
    assert torch.equal(default, explicit)


def test_the_reference_span_off_the_cpu_gives_the_same_outputs(monkeypatch):
    """Off the CPU the reference gathers the block table's whole capacity (no host read of ``prefix_lens``); the
    extra positions are invisible, so it agrees with the CPU's span, which stops after the longest tree block."""
    from specdec_kernels.reference import tree_attention as reference_module

    cases = [(*inputs, pack_bits(tree_bits), num_nodes)
             for inputs, tree_bits, num_nodes in (long_context_case(), narrow_table_case(),
                                                  *(odd_size_case(*size) for size in ODD_SIZES))]
    cases += [outside_contract_case(*entry) for entry in OUTSIDE_CONTRACT]
    cpu_spans = [reference_module.gathered_positions(case[4], case[0].shape[1], case[3].shape[1] * case[1].shape[1])
                 for case in cases]
    expected = [sk.tree_attention(*case[:6], num_nodes=case[6], backend="reference") for case in cases]
    monkeypatch.setattr(reference_module, "gathered_positions", lambda prefix_lens, tree_size, capacity: capacity)
    longer = 0
    for case, cpu_span, want in zip(cases, cpu_spans, expected):
        capacity = case[3].shape[1] * case[1].shape[1]
        longer += capacity > cpu_span
        got = sk.tree_attention(*case[:6], num_nodes=case[6], backend="reference")
        torch.testing.assert_close(got, want, rtol=4 * torch.finfo(want.dtype).eps, atol=1e-6)
    assert longer >= 4  # the spans differ, or this tests nothing


def test_the_reference_has_no_host_read_on_a_gpu(device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    check_in_a_cuda_graph("reference", device)


# ----------------------------------------------------------------------------- shared by the kernels' tests

# (B, N, Hq, Hkv, D, block size, prefix lengths, dtype): N = 1; N not a
# multiple of 32 with Hq = 8 Hkv; Hq = Hkv; D = 256 in one 256-slot block;
# prefixes of 0 and not multiples of the block size everywhere.
ODD_SIZES = [
    (2, 1, 2, 2, 64, 8, [0, 13], torch.float16),
    (3, 33, 8, 1, 128, 16, [0, 5, 47], torch.bfloat16),
    (2, 5, 4, 4, 64, 32, [70, 0], torch.float16),
    (1, 6, 4, 2, 256, 256, [300], torch.bfloat16),
]


def odd_size_case(batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, block_size, prefixes, dtype):
    """``(inputs, tree_bits, num_nodes)`` for an ODD_SIZES entry."""
    generator = torch.Generator().manual_seed(tree_size * 100 + head_dim)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, dtype, block_size,
        torch.tensor(prefixes, dtype=torch.int32)
    )
    tree_bits = ancestor_bits(generator, batch_size, tree_size)
    return (q, k_cache, v_cache, block_tables, prefix_lens), tree_bits, num_nodes


def against_reference(out, inputs, tree_mask, num_nodes, scale, device):
    """A kernel agrees with the reference up to the rounding of the output dtype."""
    expected = sk.tree_attention(*(t.to(device) for t in inputs), tree_mask.to(device),
                                 num_nodes=None if num_nodes is None else num_nodes.to(device), scale=scale,
                                 backend="reference").cpu()
    tolerance = torch.finfo(out.dtype).eps * expected.abs().max().item()
    assert (out.float() - expected.float()).abs().max().item() <= tolerance


def strided_case():
    """``(views, dense)``: every input a view with padded strides (K and V interleaved in one allocation with a
    padding head, q's last dim strided, the index tensors and the mask columns of wider tensors), and the same
    values as dense tensors; each is ``(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes)``."""
    generator = torch.Generator().manual_seed(9)
    batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, block_size = 3, 9, 4, 2, 64, 16
    prefix_lens = torch.tensor([0, 21, 40], dtype=torch.int32)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, torch.bfloat16, block_size,
        prefix_lens
    )
    tree_mask = pack_bits(ancestor_bits(generator, batch_size, tree_size))

    kv = torch.zeros(k_cache.shape[0], block_size, 2, num_kv_heads + 1, head_dim, dtype=k_cache.dtype)
    kv[:, :, 0, :num_kv_heads], kv[:, :, 1, :num_kv_heads] = k_cache, v_cache
    strided_q = torch.zeros(batch_size, tree_size, num_q_heads, 2 * head_dim, dtype=q.dtype)
    strided_q[..., ::2] = q
    wide_tables = torch.full((batch_size, 2 * block_tables.shape[1] + 1), -1, dtype=torch.int32)
    wide_tables[:, 1::2] = block_tables
    wide_lens = torch.stack([prefix_lens, torch.full_like(prefix_lens, 10**6)], 1)
    wide_mask = torch.zeros(batch_size, tree_size, 3, dtype=torch.int32)
    wide_mask[:, :, 1:2] = tree_mask
    wide_counts = torch.stack([num_nodes, torch.zeros_like(num_nodes)], 1)
    views = (strided_q[..., ::2], kv[:, :, 0, :num_kv_heads], kv[:, :, 1, :num_kv_heads], wide_tables[:, 1::2],
             wide_lens[:, 0], wide_mask[:, :, 1:2], wide_counts[:, 0])
    assert not any(t.is_contiguous() for t in views[:5])
    return views, (q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes)


def narrow_table_case():
    """``(inputs, tree_bits, num_nodes)`` whose table is a column slice of a wider one whose next columns hold valid
    block ids: positions past the slice must stay invisible."""
    generator = torch.Generator().manual_seed(13)
    prefix_lens = torch.tensor([30, 12], dtype=torch.int32)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, 2, 10, 4, 2, 64, torch.float16, 8, prefix_lens
    )
    narrow = block_tables[:, :3]  # 24 positions: request 0's prefix is cut, request 1's nodes from 12 on
    return (q, k_cache, v_cache, narrow, prefix_lens), ancestor_bits(generator, 2, 10), num_nodes


# (prefix lengths, num_nodes, num_blocks, max_blocks) outside the contract.
OUTSIDE_CONTRACT = [
    ([-2, -10], None, 6, 3),  # negative prefixes: tree nodes before position 0 are invisible
    ([3, 4], [0, 9], 6, 3),  # counts outside [1, N]
    ([3, 4], [-3, 2], 6, 3),  # a negative count: no live node
    ([2**31 - 1, 7], None, 6, 3),  # a prefix far past the table
    ([3, 4], None, 0, 3),  # an empty cache
    ([3, 4], None, 6, 0),  # an empty table
]


def outside_contract_case(prefixes, counts, num_blocks, max_blocks):
    """``(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes)`` for an OUTSIDE_CONTRACT entry."""
    generator = torch.Generator().manual_seed(19)
    q = torch.randn(2, 5, 4, 64, generator=generator).half()
    k_cache, v_cache = torch.randn(2, 6, 8, 2, 64, generator=generator).half()[:, :num_blocks]
    tables = torch.arange(6, dtype=torch.int32).view(2, 3)[:, :max_blocks]
    mask = sk.build_tree(torch.tensor([[-1, 0, 0, 1, 2]] * 2, dtype=torch.int32)).mask
    num_nodes = None if counts is None else torch.tensor(counts, dtype=torch.int32)
    return q, k_cache, v_cache, tables, torch.tensor(prefixes, dtype=torch.int32), mask, num_nodes


def long_context_case():
    """``(inputs, tree_bits, num_nodes)``: a 397-position prefix over 50 shuffled 8-slot blocks (split tests)."""
    generator = torch.Generator().manual_seed(5)
    prefix_lens = torch.tensor([397], dtype=torch.int32)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, 1, 7, 8, 2, 64, torch.float16, 8, prefix_lens
    )
    assert block_tables.shape[1] == 51
    return (q, k_cache, v_cache, block_tables, prefix_lens), ancestor_bits(generator, 1, 7), num_nodes


def check_in_a_cuda_graph(backend, device):
    """No host read on ``backend``'s path: one request over a long prefix (it
    splits, so both launches are captured) is replayed with new prefix
    lengths and queries."""
    generator = torch.Generator().manual_seed(17)
    prefix_lens = torch.tensor([3000], dtype=torch.int32)
    q, k_cache, v_cache, block_tables, prefix_lens, _ = make_inputs(
        generator, 1, 8, 32, 8, 128, torch.bfloat16, 16, prefix_lens
    )
    tree_mask = pack_bits(ancestor_bits(generator, 1, 8))
    q, k_cache, v_cache, block_tables, prefix_lens, tree_mask = (
        t.to(device) for t in (q, k_cache, v_cache, block_tables, prefix_lens, tree_mask))
    capture_stream = torch.cuda.Stream()
    with torch.cuda.stream(capture_stream):  # compile (and opt in to shared memory) outside the capture
        sk.tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, backend=backend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        out = sk.tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, backend=backend)
    for prefix in (3000, 17, 0):
        prefix_lens.fill_(prefix)
        q.normal_()
        graph.replay()
        # The kernel is deterministic: a replay equals an eager call bit for bit
        # (accuracy is the other tests' business).
        eager = sk.tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, backend=backend)
        assert torch.equal(out, eager)
