"""The CUDA compact_kv (csrc/include/specdec/compact_kv.cuh) against the reference, bit for bit.

Two ways in, each case runs both where it can:

* ``host``: ``torch.ops.specdec_C.compact_kv`` on CPU tensors runs the
  kernel's block program on the host: an emulated block of 8 std::threads,
  blocks one after another, 2 features a block (so rows split over blocks
  and long paths over tiles), with the kernel's unit widening, move table,
  last-writer rule and load-barrier-store tiles; so these cases check the
  .cuh file on machines without a GPU (not the hardware barrier);
* ``gpu``: ``sk.compact_kv(..., backend="cuda")`` launches the kernel (GPU only).

Cases come from tests/test_compact_kv.py. Whole caches are compared as
bits (every untouched slot too): for views, the tensors they view.
"""

import pytest
import torch

import specdec_kernels as sk
from conftest import extension_op_marks
from specdec_kernels.reference.compact_kv import compact_kv as reference_compact_kv
from test_compact_kv import (bad_entries_case, check_in_a_cuda_graph, make_cache, malformed_paths_case,
                             moved_bits_case, overlapping_moves_case, random_paths_case, repeated_block_cases,
                             strided_wide_path_case)

needs_op, needs_gpu, RUNNERS = extension_op_marks("compact_kv")


def copy_on(device, cache):
    """A copy of the tensor ``cache`` views (its whole storage) on ``device``, and the same view of the copy."""
    store = cache if cache._base is None else cache._base
    copy = store.to(device, copy=True)
    return copy, copy.as_strided(cache.size(), cache.stride(), cache.storage_offset() - store.storage_offset())


def bits(tensor):
    return tensor.contiguous().view(torch.uint8)


def check_against_reference(runner, k_cache, v_cache, block_tables, prefix_lens, accepted_nodes):
    """The CUDA program leaves both caches' storage bit-equal to the reference's."""
    (want_k_store, want_k), (want_v_store, want_v) = copy_on("cpu", k_cache), copy_on("cpu", v_cache)
    reference_compact_kv(want_k, want_v, block_tables, prefix_lens, accepted_nodes)
    assert not (torch.equal(bits(want_k), bits(k_cache)) and torch.equal(bits(want_v), bits(v_cache))), (
        "the case moves nothing")
    if runner == "host":
        (got_k_store, got_k), (got_v_store, got_v) = copy_on("cpu", k_cache), copy_on("cpu", v_cache)
        torch.ops.specdec_C.compact_kv(got_k, got_v, block_tables, prefix_lens, accepted_nodes)
    else:
        (got_k_store, got_k), (got_v_store, got_v) = copy_on("cuda", k_cache), copy_on("cuda", v_cache)
        sk.compact_kv(got_k, got_v, block_tables.cuda(), prefix_lens.cuda(), accepted_nodes.cuda(), backend="cuda")
    assert torch.equal(bits(got_k_store.cpu()), bits(want_k_store)), "k_cache"
    assert torch.equal(bits(got_v_store.cpu()), bits(want_v_store)), "v_cache"


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8,
                                   torch.complex128])
def test_overlapping_moves(dtype, runner):
    # Destinations that are other moves' sources; elements of 1 to 16 bytes
    # (2 heads of 8 dims: the unit widens to 16 bytes, or stays the element).
    check_against_reference(runner, *overlapping_moves_case(dtype))


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_random_paths(index_dtype, runner):
    k_cache, v_cache, block_tables, prefix_lens, accepted_nodes = random_paths_case(index_dtype)
    # Index tensors each in their own width.
    check_against_reference(runner, k_cache, v_cache, block_tables.to(index_dtype), prefix_lens.to(torch.int64),
                            accepted_nodes)


@pytest.mark.parametrize("runner", RUNNERS)
def test_bad_entries_are_skipped(runner):
    check_against_reference(runner, *bad_entries_case())


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size", [1, 8, 16, 256])
def test_malformed_paths(block_size, index_dtype, runner):
    # Swaps, repeats, reversed paths, paths past the table.
    check_against_reference(runner, *malformed_paths_case(block_size, index_dtype))


@pytest.mark.parametrize("runner", RUNNERS)
def test_positions_that_overflow_are_skipped(runner):
    # prefix + node wraps around int64 as torch adds: negative, so skipped.
    k_cache, v_cache, block_tables, prefix_lens, accepted_nodes = bad_entries_case()
    accepted_nodes = accepted_nodes.to(torch.int64)
    accepted_nodes[0, 1] = 2**62
    prefix_lens = prefix_lens.to(torch.int64)
    prefix_lens[1] = 2**62 + 2**61
    check_against_reference(runner, k_cache, v_cache, block_tables, prefix_lens, accepted_nodes)


@pytest.mark.parametrize("runner", RUNNERS)
def test_repeated_block_in_one_table_last_move_wins(runner):
    for case in repeated_block_cases():
        check_against_reference(runner, *case)


@pytest.mark.parametrize("runner", RUNNERS)
def test_strided_caches_and_a_wide_path(runner):
    # Views of wider caches (K and V with different strides), strided index
    # tensors; a 1024-move path takes tiles of one feature.
    check_against_reference(runner, *strided_wide_path_case())


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("offset", [1, 2, 4])
def test_misaligned_views_copy_narrower_units(offset, runner):
    # Views that start 1, 2 or 4 float16 elements into their storage: 16-byte
    # units no longer tile the rows, so the copy falls back to 2, 4 or 8 bytes.
    generator = torch.Generator().manual_seed(10 + offset)
    k_store, v_store, tables = make_cache(generator, 3, 4, torch.float16, 2, 16 + offset)
    prefix_lens = torch.tensor([1, 4, 0], dtype=torch.int32)
    accepted = torch.tensor([[0, 1, 3, 4, 6], [0, 2, 3, 7, 9], [0, 4, 5, -1, -1]], dtype=torch.int32)
    check_against_reference(runner, k_store[..., offset:], v_store[..., offset:], tables, prefix_lens, accepted)


@pytest.mark.parametrize("runner", RUNNERS)
def test_moves_bits(runner):
    check_against_reference(runner, *moved_bits_case())


@needs_op
def test_host_checks_name_the_argument():
    generator = torch.Generator().manual_seed(11)
    k_cache, v_cache, tables = make_cache(generator, 2, 3, torch.float16)
    prefix = torch.tensor([1, 2], dtype=torch.int32)
    accepted = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)
    op = torch.ops.specdec_C.compact_kv
    with pytest.raises(ValueError, match=r"`accepted_nodes` must have at most 1024 columns"):
        op(k_cache, v_cache, tables, prefix, torch.zeros((2, 1025), dtype=torch.int32))
    with pytest.raises(TypeError, match=r"`v_cache` must be Half \(the dtype of `k_cache`\), got Float"):
        op(k_cache, v_cache.float(), tables, prefix, accepted)
    with pytest.raises(ValueError, match=r"`v_cache` must have shape .* \(the shape of `k_cache`\)"):
        op(k_cache, v_cache[:, :2], tables, prefix, accepted)
    with pytest.raises(ValueError, match=r"`block_tables` must have shape \[B, max_blocks\] with B = 2"):
        op(k_cache, v_cache, tables[:1], prefix, accepted)
    with pytest.raises(ValueError, match=r"`prefix_lens` must have shape \[B\] = \[2\], got \[3\]"):
        op(k_cache, v_cache, tables, torch.zeros(3, dtype=torch.int32), accepted)
    with pytest.raises(TypeError, match=r"`accepted_nodes` must be Int or Long, got Float"):
        op(k_cache, v_cache, tables, prefix, accepted.float())
    with pytest.raises(ValueError, match=r"`k_cache` must have shape \[num_blocks, block_size, Hkv, D\]"):
        op(k_cache[0], v_cache[0], tables, prefix, accepted)


@needs_op
def test_registration_opcheck_and_meta():
    generator = torch.Generator().manual_seed(12)
    k_cache, v_cache, tables = make_cache(generator, 2, 3, torch.float32)
    args = (k_cache, v_cache, tables, torch.tensor([1, 2], dtype=torch.int32),
            torch.tensor([[0, 2, 3], [0, 1, 4]], dtype=torch.int64))
    torch.library.opcheck(torch.ops.specdec_C.compact_kv.default, args)
    meta = [arg.to("meta") for arg in args]
    assert torch.ops.specdec_C.compact_kv(*meta) is None


@needs_gpu
def test_auto_picks_cuda_on_gpu_tensors():
    from specdec_kernels import _backend

    assert _backend.resolve("compact_kv", "auto", torch.device("cuda")) == "cuda"


@needs_gpu
def test_cuda_compact_kv_in_a_cuda_graph(device):
    check_in_a_cuda_graph("cuda", device)
