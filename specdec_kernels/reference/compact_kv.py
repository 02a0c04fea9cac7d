"""Reference (plain PyTorch) in-place compaction of the accepted path's KV.

This module defines what ``sk.compact_kv`` does: gather every source first,
then scatter, so overlapping moves behave as if all reads came before any
write.
"""

from __future__ import annotations

import torch


def _locate(
    position: torch.Tensor, block_tables: torch.Tensor, num_blocks: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(block_id, slot, stored)`` of cache positions ``[B, N]``.

    ``block_id`` is clamped into ``[0, num_blocks)`` so it can always index;
    ``stored`` is false where the position is negative, its block-table column
    is past the table, or the block id is outside ``[0, num_blocks)``.
    """
    max_blocks = block_tables.shape[1]
    column = torch.div(position, block_size, rounding_mode="floor")
    slot = position - column * block_size
    column_ok = (column >= 0) & (column < max_blocks)
    block_id = block_tables.to(torch.int64).gather(1, column.clamp(0, max(max_blocks - 1, 0)))
    stored = column_ok & (block_id >= 0) & (block_id < num_blocks)
    return block_id.clamp(0, max(num_blocks - 1, 0)), slot, stored


def compact_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
) -> None:
    """Move the K/V of each accepted node next to the prefix, in place.

    For request ``b`` and every ``d`` before the first negative entry of
    ``accepted_nodes[b]``, the K/V at position
    ``prefix_lens[b] + accepted_nodes[b, d]`` moves to position
    ``prefix_lens[b] + d``. All sources are read before anything is written,
    so overlapping moves (``[0, 2, 3]`` moves 2 -> 1 and 3 -> 2) are safe.

    Defined outcomes for bad values: a move whose source or destination maps
    outside the block table (negative position, column ``>= max_blocks``) or
    to a block id outside ``[0, num_blocks)`` is skipped; any negative entry
    terminates the path, and entries after it are ignored. Two moves that
    land on the same cache slot (only possible when block tables share or
    repeat blocks) resolve as if applied in order of ``(b, d)``: the last wins.

    Parameters
    ----------
    k_cache, v_cache : Tensor
        Paged cache, modified in place.
    block_tables, prefix_lens : Tensor
        int32 (int64 accepted).
    accepted_nodes : Tensor
        Node indices of the accepted path, ``-1``-padded (``tree_verify``'s
        first output), int32 or int64.

    Shape:
        - k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``
        - block_tables: ``[B, max_blocks]``; prefix_lens: ``[B]``
        - accepted_nodes: ``[B, N]``

    Example
    -------
    >>> k_cache = torch.arange(8.0).view(1, 8, 1, 1)
    >>> v_cache = k_cache.clone()
    >>> block_tables = torch.tensor([[0]], dtype=torch.int32)
    >>> prefix_lens = torch.tensor([2], dtype=torch.int32)
    >>> accepted = torch.tensor([[0, 2, 3, -1]], dtype=torch.int32)
    >>> compact_kv(k_cache, v_cache, block_tables, prefix_lens, accepted)
    >>> k_cache.flatten().tolist()
    [0.0, 1.0, 2.0, 4.0, 5.0, 5.0, 6.0, 7.0]
    """
    num_blocks, block_size = k_cache.shape[:2]
    if accepted_nodes.numel() == 0 or num_blocks == 0 or block_tables.shape[1] == 0:
        return
    device = k_cache.device
    accepted = accepted_nodes.to(device=device, dtype=torch.int64)
    prefix = prefix_lens.to(device=device, dtype=torch.int64)[:, None]
    depth = torch.arange(accepted.shape[1], device=device)

    on_path = torch.cumsum((accepted < 0).to(torch.int64), dim=1) == 0
    src_block, src_slot, src_ok = _locate(prefix + accepted, block_tables, num_blocks, block_size)
    dst_block, dst_slot, dst_ok = _locate(
        (prefix + depth).expand_as(accepted), block_tables, num_blocks, block_size
    )
    moves = on_path & src_ok & dst_ok

    src_block, src_slot = src_block[moves], src_slot[moves]
    dst_block, dst_slot = dst_block[moves], dst_slot[moves]
    # Flattened order of `moves` is (b, d) order. Keep only the last move into
    # each destination slot, so the scatter has no duplicate indices (whose
    # winner index_put_ leaves unspecified).
    destination = dst_block * block_size + dst_slot
    order = torch.sort(destination, stable=True).indices
    sorted_destination = destination[order]
    last_of_run = torch.ones_like(order, dtype=torch.bool)
    last_of_run[:-1] = sorted_destination[1:] != sorted_destination[:-1]
    keep = order[last_of_run]

    for cache in (k_cache, v_cache):
        sources = cache[src_block[keep], src_slot[keep]]  # a copy: all reads first
        cache[dst_block[keep], dst_slot[keep]] = sources
