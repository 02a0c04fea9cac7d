"""Triton kernel for ``build_tree``: ancestor bit masks, depths and positions.

One program per (request, block of ``BLOCK_NODES`` nodes). Every node walks
up its parent chain on its own, so the work spreads over nodes and no node
waits for another: a walk takes at most ``depth + 1`` steps (``<= N``, since a
parent is below its child, and a step that leaves ``[0, cur)`` stops it).
Each step ORs the current ancestor's bit into the node's ``[BLOCK_WORDS]``
row of int32 mask words; the row is stored only if the walk reached the root.

Defined outcomes (the reference's, reference/build_tree.py): node ``i`` is
reachable iff ``i < num_nodes[b]`` and every parent on its chain lies in
``[0, child)``; unreachable nodes get a zero mask row and depth ``-1``.
``parents[b, 0]`` is never read; a parent is read only for ``0 < cur < N``,
so no value causes an out-of-bounds access. Offsets that multiply a stride
are 64-bit.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _build_tree_kernel(
    parents_ptr, num_nodes_ptr, prefix_lens_ptr,
    mask_ptr, depth_ptr, positions_ptr,
    max_nodes, num_words,
    stride_parents_b, stride_parents_n, stride_num_nodes, stride_prefix,
    HAS_NUM_NODES: tl.constexpr, HAS_PREFIX: tl.constexpr,
    BLOCK_NODES: tl.constexpr, BLOCK_WORDS: tl.constexpr,
):
    request = tl.program_id(0)
    nodes = tl.program_id(1) * BLOCK_NODES + tl.arange(0, BLOCK_NODES)
    words = tl.arange(0, BLOCK_WORDS)
    in_tree = nodes < max_nodes
    if HAS_NUM_NODES:
        # Compared in the input's width: a count outside [1, N] acts as the
        # reference's clamp would (<= 0: nothing, >= N: every node).
        limit = tl.load(num_nodes_ptr + request.to(tl.int64) * stride_num_nodes)
        in_tree = in_tree & (nodes.to(limit.dtype) < limit)
    parents_row = parents_ptr + request.to(tl.int64) * stride_parents_b

    current = nodes
    alive = in_tree & (current > 0)  # still climbing
    reached = in_tree & (current == 0)  # walk ended at the root
    depth = tl.zeros([BLOCK_NODES], dtype=tl.int32)
    one = tl.full([BLOCK_NODES, BLOCK_WORDS], 1, dtype=tl.int32)
    # Bit 31 of a word comes out as a negative int32 (two's complement), as
    # the reference packs it.
    row = tl.where(words[None, :] == (current // 32)[:, None], one << (current % 32)[:, None], 0)
    while tl.max(alive.to(tl.int32), axis=0) > 0:
        parent = tl.load(parents_row + current.to(tl.int64) * stride_parents_n, mask=alive, other=-1)
        valid = alive & (parent >= 0) & (parent < current.to(parent.dtype))
        current = tl.where(valid, parent.to(tl.int32), current)
        depth = tl.where(valid, depth + 1, depth)
        row = row | tl.where(valid[:, None] & (words[None, :] == (current // 32)[:, None]),
                             one << (current % 32)[:, None], 0)
        reached = reached | (valid & (current == 0))
        alive = valid & (current > 0)

    row = tl.where(reached[:, None], row, 0)
    depth = tl.where(reached, depth, -1)
    node_offsets = request.to(tl.int64) * max_nodes + nodes
    tl.store(mask_ptr + node_offsets[:, None] * num_words + words[None, :], row,
             mask=(nodes < max_nodes)[:, None] & (words < num_words)[None, :])
    tl.store(depth_ptr + node_offsets, depth, mask=nodes < max_nodes)
    if HAS_PREFIX:
        prefix = tl.load(prefix_lens_ptr + request.to(tl.int64) * stride_prefix).to(tl.int64)
    else:
        prefix = 0
    tl.store(positions_ptr + node_offsets, prefix + depth.to(tl.int64), mask=nodes < max_nodes)
