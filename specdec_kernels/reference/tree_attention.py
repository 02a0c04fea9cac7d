"""Reference (plain PyTorch) attention of draft-tree queries over a paged KV cache.

This module defines what ``sk.tree_attention`` computes. It gathers the
cache densely and runs a masked softmax in float32; the kernels must agree
with it to within their dtype's rounding.
"""

from __future__ import annotations

import torch


def visible_keys(
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    num_nodes: torch.Tensor | None,
    num_blocks: int,
    block_size: int,
    num_positions: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which cache positions the op reads, which of them each node sees, and where they live.

    Returns ``(read [B, L] bool, visible [B, N, L] bool, block_ids [B, L]
    int64, slots [L] int64)`` for positions ``0 .. L-1``. A request reads its
    prefix and the keys of its live nodes (``prefix_lens[b] + j``, ``j <
    num_nodes[b]``) where they are stored: ``block_ids`` is clamped into
    ``[0, num_blocks)`` so it can index the cache directly, and ``read`` is
    false wherever the unclamped id (or the block-table column) was invalid.
    Padding nodes are nobody's ancestors: mask bits for them are ignored.
    """
    batch_size, tree_size, _ = tree_mask.shape
    max_blocks = block_tables.shape[1]
    device = tree_mask.device
    position = torch.arange(num_positions, device=device)
    column = position // block_size
    slots = position % block_size
    block_ids = block_tables.to(torch.int64).gather(
        1, column.clamp(max=max_blocks - 1).expand(batch_size, num_positions)
    )
    stored = (column < max_blocks) & (block_ids >= 0) & (block_ids < num_blocks)

    node = torch.arange(tree_size, device=device)
    live_nodes = torch.full((batch_size, 1), tree_size, dtype=torch.int64, device=device)
    if num_nodes is not None:
        live_nodes = num_nodes.to(device=device, dtype=torch.int64)[:, None].clamp(max=tree_size)
    prefix = prefix_lens.to(device=device, dtype=torch.int64)[:, None]
    tree_index = position - prefix  # [B, L]: node j = s - prefix_lens[b]
    in_prefix = tree_index < 0
    in_tree = (tree_index >= 0) & (tree_index < live_nodes)
    read = stored & (in_prefix | in_tree)
    safe_index = tree_index.clamp(0, max(tree_size - 1, 0))
    words = tree_mask.gather(2, (safe_index // 32)[:, None, :].expand(-1, tree_size, -1))
    # Arithmetic shift of a negative word still leaves the wanted bit at bit 0.
    tree_bit = ((words >> (safe_index % 32)[:, None, :]) & 1).bool()

    live = node[None, :] < live_nodes  # [B, N]
    visible = read[:, None, :] & live[:, :, None] & (in_prefix[:, None, :] | tree_bit)
    return read, visible, block_ids.clamp(0, max(num_blocks - 1, 0)), slots


def gathered_positions(prefix_lens: torch.Tensor, tree_size: int, capacity: int) -> int:
    """How many cache positions (from 0) the reference gathers; the rest are invisible to every node.

    Positions past the block table's ``capacity`` are masked, so the span
    stops there. On the CPU it also stops after the longest request's tree
    block (reading ``prefix_lens.max()`` there is free), so memory follows
    the prefixes, not a table sized for the longest context. On any other
    device that read would synchronise with the host and break CUDA-graph
    capture: the span is the capacity, from shapes alone (the same outputs,
    the extra positions being invisible; memory then scales with the table).
    """
    if prefix_lens.numel() == 0:
        return 0
    if prefix_lens.device.type != "cpu":
        return capacity
    return max(0, min(int(prefix_lens.max()) + tree_size, capacity))


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    num_nodes: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of every tree node over its prefix and its ancestors.

    Node ``i`` of request ``b`` attends to every cache position
    ``< prefix_lens[b]`` and to position ``prefix_lens[b] + j`` iff bit ``j``
    of ``tree_mask[b, i]`` is set (``j < N``). Position ``s`` lives at block
    ``block_tables[b, s // block_size]``, slot ``s % block_size``.

    The op reads the cache at the prefix and at the live nodes' own
    positions (``prefix_lens[b] + j``, ``j < num_nodes[b]``), nothing else:
    the slots of padding nodes and of positions past the tree may hold
    anything, NaN included, without changing the output. Padding nodes are
    nobody's ancestors (mask bits for them are ignored).

    Defined outcomes for bad values (nothing is ever read out of bounds): a
    position whose block-table column is ``>= max_blocks``, or whose block id
    is outside ``[0, num_blocks)``, is masked out; rows of nodes at or past
    ``num_nodes[b]`` are zero; a row that sees no key is zero.

    Parameters
    ----------
    q : Tensor
        Queries, float16, bfloat16 or float32.
    k_cache, v_cache : Tensor
        Paged cache; query head ``h`` reads KV head ``h // (Hq // Hkv)``.
    block_tables, prefix_lens, tree_mask : Tensor
        int32 (int64 accepted); ``tree_mask`` is ``TreeInfo.mask``.
    num_nodes : Tensor or None
        Live nodes per request; ``None`` means all ``N``.
    scale : float or None
        Softmax scale; ``None`` means ``D ** -0.5``.

    Returns
    -------
    Tensor
        The attention output in ``q.dtype``, computed in float32.

    Shape:
        - q, out: ``[B, N, Hq, D]``
        - k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``
        - block_tables: ``[B, max_blocks]``; prefix_lens, num_nodes: ``[B]``
        - tree_mask: ``[B, N, ceil(N / 32)]``

    Example
    -------
    >>> q = torch.randn(1, 2, 4, 64)
    >>> k_cache = v_cache = torch.randn(4, 16, 2, 64)
    >>> block_tables = torch.tensor([[2, 0]], dtype=torch.int32)
    >>> prefix_lens = torch.tensor([20], dtype=torch.int32)
    >>> tree_mask = torch.tensor([[[1], [3]]], dtype=torch.int32)
    >>> tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask).shape
    torch.Size([1, 2, 4, 64])
    """
    batch_size, tree_size, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    if scale is None:
        scale = head_dim**-0.5
    group = num_q_heads // num_kv_heads

    num_positions = gathered_positions(prefix_lens, tree_size, max_blocks * block_size)
    if num_positions == 0 or num_blocks == 0 or tree_size == 0:
        return torch.zeros_like(q)

    read, visible, block_ids, slots = visible_keys(
        block_tables, prefix_lens, tree_mask, num_nodes, num_blocks, block_size, num_positions
    )
    # What the op does not read is zero: whatever sits in those slots (the
    # unwritten keys of padding nodes, another request's) cannot reach the
    # output, not even as 0 * NaN.
    read = read[:, :, None, None]
    keys = torch.where(read, k_cache[block_ids, slots].float(), 0.0)  # [B, L, Hkv, D]
    values = torch.where(read, v_cache[block_ids, slots].float(), 0.0)
    # GQA without repeating K/V: query heads grouped as [Hkv, group].
    queries = q.float().view(batch_size, tree_size, num_kv_heads, group, head_dim)

    scores = torch.einsum("bnkgd,blkd->bkgnl", queries, keys) * scale
    visible = visible[:, None, None]  # [B, 1, 1, N, L]
    row_max = scores.masked_fill(~visible, float("-inf")).amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.where(visible, torch.exp(scores - row_max), torch.zeros_like(scores))
    denominator = weights.sum(-1, keepdim=True)  # 0 exactly when nothing is visible
    weights = weights / torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    out = torch.einsum("bkgnl,blkd->bnkgd", weights, values)
    # A row that sees nothing (padding nodes among them) is exactly zero, not 0 * NaN.
    seen = (denominator > 0).permute(0, 3, 1, 2, 4)  # [B, N, Hkv, group, 1]
    out = torch.where(seen, out, torch.zeros_like(out))
    # Contiguous, as the kernels write it (the einsum and the select keep a head-major layout).
    return out.reshape(batch_size, tree_size, num_q_heads, head_dim).to(q.dtype).contiguous()
