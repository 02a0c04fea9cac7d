"""Reference (plain PyTorch) tree metadata: ancestor bit masks, depths, positions.

This module defines what ``sk.build_tree`` computes; every other backend must
match it bit for bit.
"""

from __future__ import annotations

import torch

MASK_WORD_BITS = 32


def pack_mask_words(bits: torch.Tensor) -> torch.Tensor:
    """Pack a boolean ``[..., N]`` tensor into int32 words ``[..., ceil(N/32)]``.

    Bit ``j % 32`` of word ``j // 32`` holds ``bits[..., j]``. The words are
    built in int64 and folded into int32 two's complement, so bit 31 (node 31,
    63, ...) comes out as a negative word rather than overflowing.
    """
    num_bits = bits.shape[-1]
    num_words = (num_bits + MASK_WORD_BITS - 1) // MASK_WORD_BITS
    padded = torch.zeros(
        (*bits.shape[:-1], num_words * MASK_WORD_BITS), dtype=torch.int64, device=bits.device
    )
    padded[..., :num_bits] = bits.to(torch.int64)
    weights = torch.ones(MASK_WORD_BITS, dtype=torch.int64, device=bits.device) << torch.arange(
        MASK_WORD_BITS, device=bits.device
    )
    words = (padded.view(*bits.shape[:-1], num_words, MASK_WORD_BITS) * weights).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def validate_parents(parents: torch.Tensor, num_nodes: torch.Tensor | None) -> torch.Tensor | None:
    """Host-side check of a tree's structure (synchronises); ``ValueError`` on the first problem.

    Checks, for every request ``b`` with ``n_b`` nodes (``N`` when
    ``num_nodes`` is None): ``1 <= n_b <= N``; ``parents[b, 0] == -1``;
    ``0 <= parents[b, i] < i`` for ``1 <= i < n_b`` (so no cycles). Entries at
    or past ``n_b`` are not checked. The message names the argument and the
    offending request and node. Returns the bool ``[B, N]`` mask of checked
    non-root nodes (``1 <= i < n_b``), or ``None`` when ``N == 0``.
    """
    batch_size, tree_size = parents.shape
    device = parents.device
    if num_nodes is None:
        counts = torch.full((batch_size,), tree_size, dtype=torch.int64, device=device)
    else:
        counts = num_nodes.to(device=device, dtype=torch.int64)
        bad = (counts < 1) | (counts > tree_size)
        if bool(bad.any()):
            request = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"`num_nodes` must lie in [1, N] = [1, {tree_size}]; "
                f"request {request} has {int(counts[request])}"
            )
    if tree_size == 0:
        return None
    bad_root = parents[:, 0] != -1
    if bool(bad_root.any()):
        request = int(bad_root.nonzero()[0, 0])
        raise ValueError(
            f"`parents` must hold -1 at the root (node 0); request {request} node 0 "
            f"has {int(parents[request, 0])}"
        )
    nodes = torch.arange(tree_size, device=device).view(1, -1)
    used = (nodes >= 1) & (nodes < counts.view(-1, 1))
    parent_ids = parents.to(torch.int64)
    bad_parent = used & ((parent_ids < 0) | (parent_ids >= nodes))
    if bool(bad_parent.any()):
        request, node = (int(i) for i in bad_parent.nonzero()[0])
        raise ValueError(
            f"`parents` must satisfy 0 <= parents[b, i] < i (topological order); "
            f"request {request} node {node} has parent {int(parents[request, node])}"
        )
    return used


def build_tree(
    parents: torch.Tensor,
    num_nodes: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ancestor masks, depths and rotary positions of a batch of draft trees.

    Node ``i`` of request ``b`` is *reachable* iff ``i == 0`` and
    ``num_nodes[b] >= 1``, or ``1 <= i < num_nodes[b]``,
    ``0 <= parents[b, i] < i`` and its parent is reachable. ``parents[b, 0]``
    is not read. Unreachable nodes (padding at or past ``num_nodes[b]``, a
    node whose parent is out of ``[0, i)``, and every descendant of such a
    node) get an all-zero mask row and depth ``-1``: that is the defined
    outcome for a malformed tree, never an error.

    Parameters
    ----------
    parents : Tensor
        Parent node index of each node, int32 (int64 accepted).
    num_nodes : Tensor or None
        Nodes in use per request; ``None`` means ``N`` for every request.
    prefix_lens : Tensor or None
        Committed tokens before each tree; ``None`` means 0.

    Returns
    -------
    mask : Tensor
        int32; bit ``j % 32`` of word ``j // 32`` in row ``i`` is set iff node
        ``j`` is node ``i`` or one of its ancestors (reachable nodes only).
    depth : Tensor
        int32; the root has depth 0, unreachable nodes -1.
    positions : Tensor
        int64, ``prefix_lens[b] + depth[b, i]`` for every node (so ``-1``
        depth gives ``prefix_lens[b] - 1``).

    Shape:
        - parents: ``[B, N]``
        - num_nodes, prefix_lens: ``[B]``
        - mask: ``[B, N, ceil(N / 32)]``; depth, positions: ``[B, N]``

    Example
    -------
    >>> parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)
    >>> mask, depth, positions = build_tree(parents)
    >>> mask[0, :, 0].tolist(), depth[0].tolist()
    ([1, 3, 5, 11], [0, 1, 1, 2])
    """
    batch_size, tree_size = parents.shape
    device = parents.device
    parents = parents.to(torch.int64)
    if num_nodes is None:
        node_limit = torch.full((batch_size,), tree_size, dtype=torch.int64, device=device)
    else:
        node_limit = num_nodes.to(device=device, dtype=torch.int64)

    # ancestors[b, i, j]: node j is node i or an ancestor of node i. Rows are
    # filled in topological order, so a parent's row is final when read.
    ancestors = torch.zeros(batch_size, tree_size, tree_size, dtype=torch.bool, device=device)
    depth = torch.full((batch_size, tree_size), -1, dtype=torch.int64, device=device)
    if tree_size > 0:
        root_ok = node_limit >= 1
        ancestors[:, 0, 0] = root_ok
        depth[:, 0] = torch.where(root_ok, 0, -1)
    for node in range(1, tree_size):
        parent = parents[:, node]
        # The clamp only keeps the gathers in bounds; `reachable` discards
        # whatever a clamped index reads.
        safe_parent = parent.clamp(0, node - 1)
        parent_depth = depth.gather(1, safe_parent[:, None])[:, 0]
        reachable = (node < node_limit) & (parent >= 0) & (parent < node) & (parent_depth >= 0)
        parent_row = ancestors[torch.arange(batch_size, device=device), safe_parent]
        ancestors[:, node] = parent_row & reachable[:, None]
        ancestors[:, node, node] = reachable
        depth[:, node] = torch.where(reachable, parent_depth + 1, -1)

    if prefix_lens is None:
        prefix = torch.zeros(batch_size, dtype=torch.int64, device=device)
    else:
        prefix = prefix_lens.to(device=device, dtype=torch.int64)
    positions = prefix[:, None] + depth
    return pack_mask_words(ancestors), depth.to(torch.int32), positions
