"""The CUDA tree_attention (csrc/include/specdec/tree_attention.cuh, tree_attention_mma.cuh) against float64 and the
reference.

Two ways in, each case runs both where it can:

* ``host``: ``torch.ops.specdec_C.tree_attention`` on CPU tensors runs the
  kernel's block program on the host, blocks one after another, then the
  merge of the splits. 16-bit inputs at D = 64 and 128 run the tensor-core
  program on 2 std::threads, each a warp holding its 32 lanes (32-row and
  32-key tiles; the mma.sync fragments and quad reductions emulated by
  warp_mma.cuh); the rest the SIMT program on an emulated block of 8
  std::threads (2 warps of 4 lanes, so 4-key tiles and row tiles of 8 to 32
  rows). Either way it shares the kernel's tiling, index math, masking,
  online softmax and merge (not the hardware shuffles, barriers, tensor-core
  summation order or FMA contraction), so these cases check the .cuh files
  on machines without a GPU;
* ``gpu``: ``sk.tree_attention(..., backend="cuda")`` launches the kernel
  (GPU only).

Cases come from tests/test_tree_attention.py (shared with the Triton tests);
the tolerance is its rule: the error against float64 at most twice the
naive same-dtype path's, and, for 16-bit outputs, within one output ulp of
the reference.
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import extension_op_marks
from test_compact_kv_cuda import copy_on
from test_tree_attention import (ODD_SIZES, OUTSIDE_CONTRACT, against_reference, ancestor_bits, bad_block_ids_case,
                                 check_bad_block_ids_outcome, check_error, check_in_a_cuda_graph,
                                 check_rows_that_see_nothing_are_zero, long_context_case, make_inputs,
                                 nan_in_every_prefix, narrow_table_case, odd_size_case, outside_contract_case,
                                 pack_bits, strided_case, unread_slots_case)

needs_op, needs_gpu, RUNNERS = extension_op_marks("tree_attention")


def run(runner, q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes=None, scale=None,
        num_splits=None):
    """The CUDA kernel's output on the CPU: the host program, or the kernel through the public op."""
    if runner == "host":
        return torch.ops.specdec_C.tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask,
                                                  num_nodes, scale, num_splits or 0)
    # Views stay views of a copy of their whole storage (strides, offsets and alignment as on the CPU).
    tensors = [copy_on("cuda", t)[1] for t in (q, k_cache, v_cache, block_tables, prefix_lens, tree_mask)]
    counts = None if num_nodes is None else copy_on("cuda", num_nodes)[1]
    if num_splits is not None:
        from specdec_kernels.launchers.tree_attention import cuda_tree_attention

        return cuda_tree_attention(*tensors, counts, scale, num_splits).cpu()
    return sk.tree_attention(*tensors, num_nodes=counts, scale=scale, backend="cuda").cpu()


def check(runner, inputs, tree_bits, num_nodes, scale, num_splits=None):
    """Runs the case, checks it against float64 and the reference; returns ``(out, float64 attention)``."""
    tree_mask = pack_bits(tree_bits)
    out = run(runner, *inputs, tree_mask, num_nodes, scale, num_splits)
    exact = check_error(out, inputs, tree_bits, num_nodes, scale)
    if out.dtype != torch.float32:  # float32: the float64 bound above is the tighter test
        against_reference(out, inputs, tree_mask, num_nodes, scale, "cpu")
    return out, exact


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("batch_size,tree_size,num_q_heads,num_kv_heads,head_dim,block_size,prefixes,dtype",
                         ODD_SIZES)
def test_odd_sizes(batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, block_size, prefixes, dtype, runner):
    inputs, tree_bits, num_nodes = odd_size_case(batch_size, tree_size, num_q_heads, num_kv_heads, head_dim,
                                                 block_size, prefixes, dtype)
    check(runner, inputs, tree_bits, num_nodes, head_dim**-0.5)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_dtype_and_head_dim(head_dim, dtype, runner):
    # Hq = 8 Hkv: a row tile holds several nodes' query heads; prefix 11 is
    # not a multiple of the 8-slot blocks.
    generator = torch.Generator().manual_seed(head_dim + 7 * dtype.itemsize)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, 2, 5, 8, 1, head_dim, dtype, 8, torch.tensor([11, 0], dtype=torch.int32))
    tree_bits = ancestor_bits(generator, 2, 5)
    check(runner, (q, k_cache, v_cache, block_tables, prefix_lens), tree_bits, num_nodes, 0.3)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("block_size", [1, 2, 8, 64, 256])
def test_block_sizes(block_size, runner):
    generator = torch.Generator().manual_seed(block_size)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(
        generator, 2, 6, 4, 2, 64, torch.float16, block_size, torch.tensor([37, 3], dtype=torch.int32))
    check(runner, (q, k_cache, v_cache, block_tables, prefix_lens), ancestor_bits(generator, 2, 6), num_nodes, 0.125)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("num_splits", [1, 3, 200])
def test_long_context_in_shuffled_blocks_any_split(num_splits, runner):
    """The 397-position prefix merged from 1, 3 or 200 splits (200: more
    splits than 4-key prefix tiles on the host, so some splits see nothing
    and must not count)."""
    inputs, tree_bits, num_nodes = long_context_case()
    check(runner, inputs, tree_bits, num_nodes, 0.125, num_splits)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128), (torch.float32, 64),
                                            (torch.bfloat16, 256)])
@pytest.mark.parametrize("num_splits", [3, 40])
def test_merge_in_the_last_block_gives_the_bits_of_the_merge_launch(num_splits, dtype, head_dim, runner,
                                                                     monkeypatch):
    """With merge counters the tensor-core program's (16-bit, D = 64/128) last split of each block merges
    its rows (one launch): the same merge in the same order as the second launch, so the same bits, and the
    counters end at zero. The SIMT program (float32, D = 256) ignores them and merges by the second launch.
    Two requests with Hq = 8 Hkv over 40 nodes, so several row tiles each."""
    from specdec_kernels import _workspace
    from specdec_kernels.launchers import tree_attention as launcher

    generator = torch.Generator().manual_seed(head_dim + num_splits)
    inputs = make_inputs(generator, 2, 40, 8, 1, head_dim, dtype, 8, torch.tensor([397, 150], dtype=torch.int32))
    tensors = (*inputs[:5], pack_bits(ancestor_bits(generator, 2, 40)), inputs[5])
    second_launch = run(runner, *tensors, 0.125, num_splits)
    if runner == "host":
        counters = torch.zeros(launcher.cuda_merge_counters(2, 40, 8, 1), dtype=torch.int32)
        for _ in range(2):  # the second call starts from the counters the first left
            merged = torch.ops.specdec_C.tree_attention(*tensors, 0.125, num_splits, counters)
            assert torch.equal(merged, second_launch)
        assert not counters.any()
        return
    monkeypatch.setattr(launcher, "MERGE_IN_KERNEL", True)
    for _ in range(2):
        assert torch.equal(run(runner, *tensors, 0.125, num_splits), second_launch)
    counters = [buffer for key, buffer in _workspace._buffers.items() if key[0] == "tree_attention_cuda.merge_counter"]
    assert counters and all(not buffer.any() for buffer in counters)


@needs_op
def test_merge_counters_too_few_are_rejected():
    generator = torch.Generator().manual_seed(3)
    inputs = make_inputs(generator, 2, 40, 8, 1, 64, torch.float32, 8, torch.tensor([397, 150], dtype=torch.int32))
    tensors = (*inputs[:5], pack_bits(ancestor_bits(generator, 2, 40)), inputs[5])
    too_few = torch.zeros(2 * 40 * 8 // 32 - 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"`merge_counters` must be a contiguous \[M\] tensor with M >= .* = 20"):
        torch.ops.specdec_C.tree_attention(*tensors, 0.125, 3, too_few)
    with pytest.raises(TypeError, match="`merge_counters`"):
        torch.ops.specdec_C.tree_attention(*tensors, 0.125, 3, too_few.long())


@needs_op
def test_the_host_launcher_splits_by_itself():
    """num_splits=0 is the launcher's choice: on the host a pretend 4-block
    machine, so this context's 2 (request, KV head) blocks take 2 splits
    (and the 408-position table allows up to 13 of 32 keys)."""
    inputs, tree_bits, num_nodes = long_context_case()
    tree_mask = pack_bits(tree_bits)
    chosen = run("host", *inputs, tree_mask, num_nodes, 0.125)
    assert torch.equal(chosen, run("host", *inputs, tree_mask, num_nodes, 0.125, 2))
    assert not torch.equal(chosen, run("host", *inputs, tree_mask, num_nodes, 0.125, 1))


@pytest.mark.parametrize("runner", RUNNERS)
def test_arbitrary_mask_bits(runner):
    # Every bit position matters, bit 31 of each word (a negative int32) too.
    generator = torch.Generator().manual_seed(7)
    q, k_cache, v_cache, block_tables, prefix_lens, _ = make_inputs(generator, 2, 64, 2, 1, 64, torch.float16)
    tree_bits = torch.rand(2, 64, 64, generator=generator) < 0.5
    tree_bits[:, :, 31] = True
    tree_bits[:, 5, :] = False
    tree_bits[:, 5, 63] = True  # node 5 sees the prefix and node 63 only
    check(runner, (q, k_cache, v_cache, block_tables, prefix_lens), tree_bits, None, 0.1)


@pytest.mark.parametrize("runner", RUNNERS)
def test_bad_block_ids_are_masked(runner):
    inputs, tree_bits, num_nodes = bad_block_ids_case()
    out, exact = check(runner, inputs, tree_bits, num_nodes, 0.125)
    check_bad_block_ids_outcome(out, exact, num_nodes)


@pytest.mark.parametrize("runner", RUNNERS)
def test_positions_past_the_table_are_never_read(runner):
    inputs, tree_bits, num_nodes = narrow_table_case()
    check(runner, inputs, tree_bits, num_nodes, 0.125)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("prefixes,counts,num_blocks,max_blocks", OUTSIDE_CONTRACT)
def test_values_outside_the_contract_have_the_reference_outcome(prefixes, counts, num_blocks, max_blocks, runner):
    *tensors, num_nodes = outside_contract_case(prefixes, counts, num_blocks, max_blocks)
    out = run(runner, *tensors, num_nodes)
    against_reference(out, tensors[:5], tensors[5], num_nodes, None, "cpu")


# float16: the tensor-core program; float32: the SIMT program. 3 splits: the partial states and their merge.
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_slots_the_op_does_not_read_never_reach_the_output(num_splits, dtype, runner):
    clean, poisoned, tree_bits, num_nodes = unread_slots_case(dtype)
    tree_mask = pack_bits(tree_bits)
    out = run(runner, *poisoned, tree_mask, num_nodes, 0.125, num_splits)
    assert torch.equal(out, run(runner, *clean, tree_mask, num_nodes, 0.125, num_splits))
    check_error(out, clean, tree_bits, num_nodes, 0.125)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_rows_that_see_nothing_are_zero_whatever_the_cache_holds(num_splits, dtype, runner):
    clean, _, tree_bits, num_nodes = unread_slots_case(dtype)
    out = run(runner, *nan_in_every_prefix(clean), pack_bits(tree_bits), num_nodes, 0.125, num_splits)
    check_rows_that_see_nothing_are_zero(out, num_nodes)


@pytest.mark.parametrize("runner", RUNNERS)
def test_strided_views_are_read_in_place(runner):
    """Every input a view with padded strides, q's last dim too: read through
    the strides, the same bits as dense copies."""
    views, dense = strided_case()
    out = run(runner, *views)
    assert torch.equal(out, run(runner, *dense))
    against_reference(out, dense[:5], dense[5], dense[6], None, "cpu")


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("layout", ["one element into the storage", "every other element"])
def test_caches_not_read_16_bytes_at_a_time(layout, runner):
    """Caches whose heads are not 16-byte aligned or not contiguous are read
    element by element: the same bits as the 16-byte loads of dense copies."""
    inputs, tree_bits, num_nodes = odd_size_case(*ODD_SIZES[2])
    q, k_cache, v_cache, block_tables, prefix_lens = inputs
    tree_mask = pack_bits(tree_bits)

    def relaid(cache):
        if layout == "every other element":
            store = torch.zeros(*cache.shape[:-1], 2 * cache.shape[-1], dtype=cache.dtype)
            store[..., ::2] = cache
            return store[..., ::2]
        store = torch.zeros(cache.numel() + 1, dtype=cache.dtype)
        store[1:] = cache.flatten()
        return store[1:].view(cache.shape)

    element_wise = run(runner, q, relaid(k_cache), relaid(v_cache), block_tables, prefix_lens, tree_mask, num_nodes)
    assert torch.equal(element_wise, run(runner, *inputs, tree_mask, num_nodes))


@pytest.mark.parametrize("runner", RUNNERS)
def test_int64_index_tensors(runner):
    inputs, tree_bits, num_nodes = odd_size_case(*ODD_SIZES[2])
    q, k_cache, v_cache, block_tables, prefix_lens = inputs
    tree_mask = pack_bits(tree_bits)
    wide = run(runner, q, k_cache, v_cache, block_tables.long(), prefix_lens.long(), tree_mask, num_nodes.long())
    assert torch.equal(wide, run(runner, *inputs, tree_mask, num_nodes))


def bad_input_cases():
    q = torch.zeros(1, 2, 4, 64, dtype=torch.float16)
    cache = torch.zeros(3, 8, 2, 64, dtype=torch.float16)
    tables = torch.zeros(1, 3, dtype=torch.int32)
    lens = torch.zeros(1, dtype=torch.int32)
    mask = torch.ones(1, 2, 1, dtype=torch.int32)
    good = dict(q=q, k_cache=cache, v_cache=cache, block_tables=tables, prefix_lens=lens, tree_mask=mask)
    yield dict(good, q=torch.zeros(1, 2, 4, 96, dtype=torch.float16)), ValueError, r"`q` must have a head dimension"
    yield dict(good, q=q.double()), TypeError, r"`q` must be Float, BFloat16 or Half, got Double"
    yield dict(good, k_cache=cache.bfloat16()), TypeError, r"`k_cache` must be Half \(the dtype of `q`\)"
    yield dict(good, v_cache=cache[:, :4]), ValueError, r"`v_cache` must have shape \[3, 8, 2, 64\]"
    yield dict(good, k_cache=torch.zeros(3, 12, 2, 64, dtype=torch.float16),
               v_cache=torch.zeros(3, 12, 2, 64, dtype=torch.float16)), ValueError, r"power-of-two block size"
    yield dict(good, k_cache=torch.zeros(3, 8, 3, 64, dtype=torch.float16),
               v_cache=torch.zeros(3, 8, 3, 64, dtype=torch.float16)), ValueError, r"Hq % Hkv == 0"
    yield dict(good, tree_mask=torch.ones(1, 2, 2, dtype=torch.int32)), ValueError, \
        r"`tree_mask` must have shape \[B, N, ceil\(N/32\)\] = \[1, 2, 1\], got \[1, 2, 2\]"
    yield dict(good, tree_mask=mask.long()), TypeError, r"`tree_mask` must be Int"
    yield dict(good, block_tables=tables.float()), TypeError, r"`block_tables` must be Int or Long"
    yield dict(good, prefix_lens=torch.zeros(2, dtype=torch.int32)), ValueError, r"`prefix_lens` must have shape \[B\]"


@needs_op
@pytest.mark.parametrize("arguments,error,message", list(bad_input_cases()))
def test_bad_inputs_are_rejected_with_the_argument_named(arguments, error, message):
    with pytest.raises(error, match=message):
        torch.ops.specdec_C.tree_attention(**arguments)


@needs_op
def test_registration_opcheck_and_meta():
    generator = torch.Generator().manual_seed(12)
    q, k_cache, v_cache, block_tables, prefix_lens, num_nodes = make_inputs(generator, 2, 3, 4, 2, 64, torch.float16)
    tree_mask = pack_bits(ancestor_bits(generator, 2, 3))
    args = (q, k_cache, v_cache, block_tables, prefix_lens.long(), tree_mask, num_nodes, 0.125, 2)
    torch.library.opcheck(torch.ops.specdec_C.tree_attention.default, args)
    meta = torch.ops.specdec_C.tree_attention(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    assert meta.shape == q.shape and meta.dtype == q.dtype and meta.device.type == "meta"


@needs_gpu
def test_auto_keeps_triton_on_gpu_tensors():
    from specdec_kernels import _backend

    assert _backend.resolve("tree_attention", "cuda", torch.device("cuda")) == "cuda"
    expected = "triton" if _backend.available("tree_attention", "triton", torch.device("cuda")) else "cuda"
    assert _backend.resolve("tree_attention", "auto", torch.device("cuda")) == expected


@needs_gpu
def test_captured_in_a_cuda_graph_with_a_split():
    check_in_a_cuda_graph("cuda", torch.device("cuda"))
