"""Triton kernels for ``tree_attention``: flash-attention over a paged KV cache with the tree mask inside.

``_tree_attention_kernel``: one program per (request, KV head, row tile,
KV split). The rows of a tile are ``(node, query head)`` pairs of one
request whose query heads share the KV head, node-major: row ``r`` is node
``r // group``, query head ``kv_head * group + r % group``. So every K/V
tile a program loads serves all its nodes and query heads at once; when
``N * group`` fits one row tile (``launchers/tree_attention.py``) the cache
is streamed once per request and KV head. Above that each row tile streams
it; the row tiles of a (request, KV head) are consecutive program ids, so
they are scheduled together and can share it through L2 (not yet measured).

Keys come in two ranges. The prefix (positions ``< prefix_lens[b]``) is
visible to every live node: no mask bit is read there. Split ``s`` of ``S``
takes the ``s``-th of ``S`` equal, ``BLOCK_N``-aligned slices of it. The
tree block (positions ``prefix_lens[b] + j``, ``j < N``) belongs to the last
split, which reads the packed ancestor words of its rows once per tile.

Online softmax in base 2 (the scale is premultiplied by ``log2(e)``): each
program keeps the running row maximum, row sum and unnormalised output.
With one split it writes the normalised output; with more it writes its
partial state, and the splits are combined by :func:`_merge_rows`: in a
second launch (``_tree_attention_merge_kernel``), or with ``MERGE_LAST`` by
the last split program of the tile to arrive at its counter in the
workspace (one launch; it puts the counter back to zero). No program waits
for another. Both forms run the same merge, splits in order, so they give
the same bits.

Defined outcomes (the reference's, reference/tree_attention.py): only the
prefix and the live nodes' keys are read (a padding node's slot may hold
anything); a key whose block-table column is past ``max_blocks`` or whose
block id lies outside ``[0, num_blocks)`` is invisible and never read; rows
of nodes at or past ``num_nodes[b]`` and rows that see no key are zero.
Offsets that multiply a stride are 64-bit.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_keys(k_head_ptr, v_head_ptr, table_row_ptr, positions, in_range, num_blocks, max_blocks, block_size_log2,
               stride_table_m, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
               HEAD_DIM: tl.constexpr, FLOAT32_TILES: tl.constexpr):
    """``K^T [HEAD_DIM, BLOCK_N]``, ``V [BLOCK_N, HEAD_DIM]`` and which of the positions are stored.

    Block ids are gathered per position, so a tile may span several cache
    blocks (block sizes below ``BLOCK_N``) or part of one.
    """
    dims = tl.arange(0, HEAD_DIM)
    column = positions >> block_size_log2
    in_table = in_range & (positions >= 0) & (column < max_blocks)
    block = tl.load(table_row_ptr + column * stride_table_m, mask=in_table, other=-1)
    stored = in_table & (block >= 0) & (block < num_blocks)
    block = block.to(tl.int64)
    slot = positions & ((1 << block_size_log2) - 1)
    k = tl.load(k_head_ptr + (block * stride_k_block + slot * stride_k_slot)[None, :] + dims[:, None],
                mask=stored[None, :], other=0.0)
    v = tl.load(v_head_ptr + (block * stride_v_block + slot * stride_v_slot)[:, None] + dims[None, :],
                mask=stored[:, None], other=0.0)
    if FLOAT32_TILES:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v, stored


@triton.jit
def _scores(q, k, scale_log2):
    """``q k^T`` in base-2 units. ieee: float32 tiles (the interpreter's, or a float32 cache) are multiplied
    exactly rather than in TF32; 16-bit tiles ignore it."""
    return tl.dot(q, k, input_precision="ieee") * scale_log2


@triton.jit
def _online_softmax_step(scores, v, acc, row_max, row_sum):
    """Fold one key tile's ``scores`` (``-inf`` where a key is invisible) into the running
    ``(acc, row_max, row_sum)`` of every row.

    A row that has seen no visible key keeps ``row_max = -inf``; its
    exponentials are taken against 0 instead, so they are 0, not NaN.
    """
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    weights = tl.exp2(scores - safe_max[:, None])
    rescale = tl.exp2(row_max - safe_max)
    row_sum = row_sum * rescale + tl.sum(weights, 1)
    acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
    return acc, new_max, row_sum


@triton.jit
def _normalised(acc, total):
    """``acc / total`` per row, and exactly 0 for a row that saw no key (``total == 0``), whatever ``acc`` holds
    (a select, not a product: ``0 * NaN`` is NaN).

    div_rn: ``/`` lowers to an approximate division on GPUs.
    """
    seen = total > 0.0
    inverse = tl.math.div_rn(tl.zeros_like(total) + 1.0, tl.where(seen, total, 1.0))
    return tl.where(seen[:, None], acc * inverse[:, None], 0.0)


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, prefix_lens_ptr, tree_mask_ptr, num_nodes_ptr,
    out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, merge_counter_ptr,
    scale_log2,
    max_nodes, group, num_q_heads, num_kv_heads, row_tiles, num_splits,
    num_blocks, max_blocks, block_size_log2,
    stride_q_b, stride_q_n, stride_q_h,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_table_b, stride_table_m, stride_prefix,
    stride_mask_b, stride_mask_n, stride_num_nodes,
    HAS_NUM_NODES: tl.constexpr, SPLIT: tl.constexpr, MERGE_LAST: tl.constexpr, FLOAT32_TILES: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MERGE_ROWS: tl.constexpr,
):
    program = tl.program_id(0)
    split = tl.program_id(1)
    row_tile = program % row_tiles
    kv_head = (program // row_tiles) % num_kv_heads
    request = (program // row_tiles // num_kv_heads).to(tl.int64)

    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    node = rows // group
    head = kv_head * group + rows % group
    in_tree = node < max_nodes
    live_nodes = max_nodes
    if HAS_NUM_NODES:
        live_nodes = tl.minimum(tl.load(num_nodes_ptr + request * stride_num_nodes), max_nodes)
    live = node < live_nodes
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + request * stride_q_b + (node.to(tl.int64) * stride_q_n + head.to(tl.int64) * stride_q_h)[:, None]
                + dims[None, :], mask=live[:, None], other=0.0)  # a padding node's query is never read
    if FLOAT32_TILES:
        q = q.to(tl.float32)

    k_head_ptr = k_cache_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head_ptr = v_cache_ptr + kv_head.to(tl.int64) * stride_v_head
    table_row_ptr = block_tables_ptr + request * stride_table_b
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    keys = tl.arange(0, BLOCK_N)

    # Prefix: a prefix past the table's capacity is invisible there anyway;
    # clamping bounds the loop for any prefix_lens value.
    prefix = tl.load(prefix_lens_ptr + request * stride_prefix).to(tl.int64)
    capacity = max_blocks.to(tl.int64) << block_size_log2
    prefix_end = tl.maximum(tl.minimum(prefix, capacity), 0)
    per_split = tl.cdiv(tl.cdiv(prefix_end, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    stop = tl.minimum(start + per_split, prefix_end)
    for tile_start in range(start, stop, BLOCK_N):
        positions = tile_start + keys
        k, v, stored = _load_keys(k_head_ptr, v_head_ptr, table_row_ptr, positions, positions < stop, num_blocks,
                                  max_blocks, block_size_log2, stride_table_m, stride_k_block, stride_k_slot,
                                  stride_v_block, stride_v_slot, HEAD_DIM, FLOAT32_TILES)
        # A prefix key is visible to every row or to none: one select per score on the key's mask (padding
        # nodes' rows see the prefix too; their state is cleared after the loops). A bias of 0 or -inf per key
        # added to the scores saves the select but spilled 16 bytes on sm_80 at 128 x 128 (rows x D).
        scores = tl.where(stored[None, :], _scores(q, k, scale_log2), float("-inf"))
        acc, row_max, row_sum = _online_softmax_step(scores, v, acc, row_max, row_sum)

    # Tree block: node j's key is at prefix + j; row i sees it iff bit j of
    # its mask row is set (bit 31 reads back from a negative int32 as well).
    # Only live nodes' keys are read: a padding node's slot may hold anything.
    if split == num_splits - 1:
        mask_rows_ptr = tree_mask_ptr + request * stride_mask_b + node.to(tl.int64) * stride_mask_n
        for tree_start in range(0, live_nodes, BLOCK_N):
            tree_index = tree_start + keys
            in_range = tree_index < live_nodes
            k, v, stored = _load_keys(k_head_ptr, v_head_ptr, table_row_ptr, prefix + tree_index, in_range,
                                      num_blocks, max_blocks, block_size_log2, stride_table_m, stride_k_block,
                                      stride_k_slot, stride_v_block, stride_v_slot, HEAD_DIM, FLOAT32_TILES)
            words = tl.load(mask_rows_ptr[:, None] + (tree_index // 32)[None, :],
                            mask=live[:, None] & in_range[None, :], other=0)
            ancestor = ((words >> (tree_index % 32)[None, :]) & 1) != 0
            visible = stored[None, :] & ancestor  # a padding row's mask words were not read: 0
            scores = tl.where(visible, _scores(q, k, scale_log2), float("-inf"))
            acc, row_max, row_sum = _online_softmax_step(scores, v, acc, row_max, row_sum)

    # Rows of padding nodes: no key. A zero sum is a zero output and a -inf max no weight in a merge of splits,
    # whatever acc holds (_normalised selects), so acc is left as it is.
    row_max = tl.where(live, row_max, float("-inf"))
    row_sum = tl.where(live, row_sum, 0.0)

    # out and the partial states are the launcher's contiguous buffers,
    # indexed by (request, node, query head) row.
    row_offsets = (request * max_nodes + node) * num_q_heads + head
    if SPLIT:
        partial = row_offsets * num_splits + split
        tl.store(partial_acc_ptr + partial[:, None] * HEAD_DIM + dims[None, :], acc, mask=in_tree[:, None])
        tl.store(partial_max_ptr + partial, row_max, mask=in_tree)
        tl.store(partial_sum_ptr + partial, row_sum, mask=in_tree)
        if MERGE_LAST:
            tl.debug_barrier()  # every thread's partial state stored before the release
            if tl.atomic_add(merge_counter_ptr + program, 1, sem="acq_rel") == num_splits - 1:
                # MERGE_ROWS rows at a time: a merge accumulator of the whole tile beside the
                # tile's own state spilled at 128 x 64 and 64 x 256.
                for first in range(0, BLOCK_M, MERGE_ROWS):
                    merged = row_tile * BLOCK_M + first + tl.arange(0, MERGE_ROWS)
                    merged_node = merged // group
                    merged_rows = (request * max_nodes + merged_node) * num_q_heads + kv_head * group + merged % group
                    _merge_rows(out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, merged_rows,
                                merged_node < max_nodes, num_splits, HEAD_DIM)
                tl.atomic_xchg(merge_counter_ptr + program, 0, sem="relaxed")
    else:
        out = _normalised(acc, row_sum)
        tl.store(out_ptr + row_offsets[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=in_tree[:, None])


@triton.jit
def _merge_rows(out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, rows, in_range, num_splits,
                HEAD_DIM: tl.constexpr):
    """Combine the ``num_splits`` partial states of each (request, node, query head) row in ``rows`` (int64).

    Split ``s``'s output is ``acc_s / sum_s`` with weights ``2^(max_s - M) sum_s``
    (``M`` the largest ``max_s``); splits that saw nothing have ``max_s = -inf``
    and weight 0, and a row no split saw is zero. The splits are added in
    order, whoever merges; the states were written by other programs, so they
    are read from L2 (``.cg``).
    """
    dims = tl.arange(0, HEAD_DIM)
    partial = rows * num_splits
    row_max = tl.full(rows.shape, float("-inf"), tl.float32)
    for split in range(0, num_splits):
        row_max = tl.maximum(row_max, tl.load(partial_max_ptr + partial + split, mask=in_range,
                                              other=float("-inf"), cache_modifier=".cg"))
    base = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.zeros(rows.shape, tl.float32)
    acc = tl.zeros([rows.shape[0], HEAD_DIM], tl.float32)
    for split in range(0, num_splits):
        weight = tl.exp2(tl.load(partial_max_ptr + partial + split, mask=in_range, other=float("-inf"),
                                 cache_modifier=".cg") - base)
        total += weight * tl.load(partial_sum_ptr + partial + split, mask=in_range, other=0.0, cache_modifier=".cg")
        acc += weight[:, None] * tl.load(partial_acc_ptr + (partial + split)[:, None] * HEAD_DIM + dims[None, :],
                                         mask=in_range[:, None], other=0.0, cache_modifier=".cg")
    out = _normalised(acc, total)
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=in_range[:, None])


@triton.jit
def _tree_attention_merge_kernel(out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, num_rows, num_splits,
                                 HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    """The second launch of a split context: ``BLOCK_R`` (request, node, query head) rows per program."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    _merge_rows(out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, rows, rows < num_rows, num_splits,
                HEAD_DIM)
