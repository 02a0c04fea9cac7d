"""Triton kernel for ``compact_kv``: move the accepted path's K/V next to the prefix, in place.

One program per (request ``b``, block of ``BLOCK_F`` features of a cache
row, a feature being one ``(head, dim)`` element of ``Hkv * D``). A program
loads the ``[BLOCK_N, BLOCK_F]`` tile of every move's source (``BLOCK_N``
covers the whole path width ``N``), waits at a CTA barrier, then stores the
tile to the destinations; K, then V.

Why this is race-free and equal to the reference (reference/compact_kv.py,
"all sources are read before anything is written; among moves into one slot
the last ``(b, d)`` wins"):

1. Within one program every read precedes every write: the loads of the
   whole tile are issued before ``tl.debug_barrier()`` (``bar.sync``), which
   orders every thread's earlier memory accesses before any thread's later
   ones; the stores come after it. So a destination that is also the source
   of another move of the same request (``[0, 2, 3]``: 2 -> 1, 3 -> 2; or any
   malformed path, a swap ``[1, 0]`` included) is read before it is written,
   whatever the order of the path.
2. Programs of one request touch disjoint features (columns of a cache row),
   so they never read or write the same element.
3. Two moves of one request into the same slot (only when its block table
   repeats a block id) would be one store instruction with two values for
   one address; the kernel drops every move that a later move of the same
   request overwrites (same block id, and a destination ``j * block_size``
   positions further, hence the same slot), so the last ``d`` wins. After
   that each slot has at most one writer; a writer whose source is its
   destination would store the slot's own value (read before any write),
   so it is skipped: the reference's outcome, without the bandwidth of the
   path's prefix that is already in place (the root at least).
4. Requests whose block tables are disjoint touch disjoint slots, so the
   programs of different requests do not interact and the result is the
   reference's. **Not reproduced:** requests that share a block which one
   of them writes. The reference then reads every request's sources before
   any request writes and lets the last ``b`` win; a kernel would need a
   grid-wide barrier between the reads and the writes (unsafe without
   guaranteed co-residency, and not runnable under the interpreter) or a
   second launch through a scratch copy. Engines never share a block that a
   tree step writes (shared prefix blocks are read-only), so that case has
   no defined outcome here: the elements written are each some move's value.

Defined outcomes for bad values, as in the reference: any negative entry
ends the path; a move whose source or destination position is negative,
maps past the block table, or to a block id outside ``[0, num_blocks)`` is
skipped. Block-table reads are masked to columns in ``[0, max_blocks)`` and
cache accesses to valid moves, so no value reads or writes out of bounds.
The launcher views the caches as same-width integers, so a move copies bits.
Offsets that multiply a stride are 64-bit.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _locate(position, valid, table_row, stride_table_m, max_blocks, num_blocks, block_size):
    """``(block_id, slot, stored)`` of int64 cache positions, as the reference's ``_locate``."""
    stored = valid & (position >= 0)
    column = tl.where(stored, position, 0) // block_size
    stored = stored & (column < max_blocks)
    block = tl.load(table_row + column * stride_table_m, mask=stored, other=-1).to(tl.int64)
    stored = stored & (block >= 0) & (block < num_blocks)
    return block, position - column * block_size, stored


@triton.jit
def _moves(depth, on_path, accepted_row, stride_accepted_n, prefix, table_row, stride_table_m, max_blocks,
           num_blocks, block_size):
    """``(source block, source slot, destination block, destination slot, move)`` of path entries ``depth``.

    Only entries where ``on_path`` holds are read.
    """
    node = tl.load(accepted_row + depth.to(tl.int64) * stride_accepted_n, mask=on_path, other=0).to(tl.int64)
    src_block, src_slot, src_ok = _locate(prefix + node, on_path, table_row, stride_table_m, max_blocks,
                                          num_blocks, block_size)
    dst_block, dst_slot, dst_ok = _locate(prefix + depth.to(tl.int64), on_path, table_row, stride_table_m,
                                          max_blocks, num_blocks, block_size)
    return src_block, src_slot, dst_block, dst_slot, on_path & src_ok & dst_ok


@triton.jit
def _move_tile(cache_ptr, src_block, src_slot, dst_block, dst_slot, move, heads, dims, features_ok,
               stride_block, stride_slot, stride_head, stride_dim):
    feature_offsets = heads.to(tl.int64) * stride_head + dims.to(tl.int64) * stride_dim
    source_rows = cache_ptr + (src_block * stride_block + src_slot * stride_slot)
    destination_rows = cache_ptr + (dst_block * stride_block + dst_slot * stride_slot)
    tile_mask = move[:, None] & features_ok[None, :]
    rows = tl.load(source_rows[:, None] + feature_offsets[None, :], mask=tile_mask)
    # Every read of this program before any write (see the module docstring).
    tl.debug_barrier()
    tl.store(destination_rows[:, None] + feature_offsets[None, :], rows, mask=tile_mask)


@triton.jit
def _compact_kv_kernel(
    k_cache_ptr, v_cache_ptr, block_tables_ptr, prefix_lens_ptr, accepted_ptr,
    path_width, num_blocks, block_size, max_blocks, head_dim, num_features,
    stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
    stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
    stride_table_b, stride_table_m, stride_prefix, stride_accepted_b, stride_accepted_n,
    BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    features = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    features_ok = features < num_features
    heads = features // head_dim
    dims = features - heads * head_dim
    depth = tl.arange(0, BLOCK_N)
    accepted_row = accepted_ptr + request * stride_accepted_b
    table_row = block_tables_ptr + request * stride_table_b
    prefix = tl.load(prefix_lens_ptr + request * stride_prefix).to(tl.int64)

    # The path ends at its first negative entry.
    in_width = depth < path_width
    nodes = tl.load(accepted_row + depth.to(tl.int64) * stride_accepted_n, mask=in_width, other=0)
    path_length = tl.min(tl.where(in_width & (nodes < 0), depth, path_width), axis=0)
    src_block, src_slot, dst_block, dst_slot, move = _moves(
        depth, depth < path_length, accepted_row, stride_accepted_n, prefix, table_row, stride_table_m,
        max_blocks, num_blocks, block_size)

    # Moves into one slot: same block id, destinations j * block_size apart.
    # Last d wins: drop a move that a later one overwrites. The loop runs
    # only when the path spans more than a block.
    overwritten = tl.zeros([BLOCK_N], dtype=tl.int1)
    for step in range(1, tl.cdiv(path_length, block_size)):
        later = depth + step * block_size
        _, _, later_block, _, later_move = _moves(
            later, later < path_length, accepted_row, stride_accepted_n, prefix, table_row, stride_table_m,
            max_blocks, num_blocks, block_size)
        overwritten = overwritten | (later_move & (later_block == dst_block))
    # Now each slot has at most one writer; one that copies a slot onto
    # itself (the root, an accepted prefix already in place) changes nothing.
    in_place = (src_block == dst_block) & (src_slot == dst_slot)
    move = move & ~overwritten & ~in_place

    _move_tile(k_cache_ptr, src_block, src_slot, dst_block, dst_slot, move, heads, dims, features_ok,
               stride_k_block, stride_k_slot, stride_k_head, stride_k_dim)
    _move_tile(v_cache_ptr, src_block, src_slot, dst_block, dst_slot, move, heads, dims, features_ok,
               stride_v_block, stride_v_slot, stride_v_head, stride_v_dim)
