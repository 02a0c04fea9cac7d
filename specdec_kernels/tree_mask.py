"""``build_tree``'s packed ancestor mask in the layouts other attention kernels take.

``TreeInfo.mask`` is int32 ``[B, N, ceil(N/32)]``: bit ``j % 32`` of word
``j // 32`` in row ``i`` is set iff node ``j`` is node ``i`` or one of its
ancestors. ``sk.tree_attention`` reads it as it is; these helpers turn it
into a dense boolean mask (PyTorch SDPA, FlexAttention) or into FlashInfer's
packed custom mask (``BatchPrefillWithPagedKVCacheWrapper.plan(...,
packed_custom_mask=...)``).
"""

from __future__ import annotations

import torch

from . import _validation
from .reference.build_tree import MASK_WORD_BITS

BITS_PER_BYTE = 8


def _check_mask(op_name: str, tree_mask, num_nodes, prefix_lens=None, needs_prefix_lens=False):
    if not isinstance(tree_mask, torch.Tensor):
        raise TypeError(f"{op_name}: `tree_mask` must be a torch.Tensor; got {type(tree_mask).__name__}")
    check = _validation.Checker(op_name, tree_mask.device)
    check.tensor("tree_mask", tree_mask, (None, None, None), (torch.int32,), "[B, N, ceil(N/32)]")
    batch_size, max_nodes, num_words = tree_mask.shape
    if num_words != -(-max_nodes // MASK_WORD_BITS):
        check.fail(f"`tree_mask` must have shape [B, N, ceil(N/32)]; got {list(tree_mask.shape)}")
    check.optional_tensor("num_nodes", num_nodes, (batch_size,), _validation.TOKEN_DTYPES, "[B]")
    if needs_prefix_lens:
        check.tensor("prefix_lens", prefix_lens, (batch_size,), _validation.TOKEN_DTYPES, "[B]")


def tree_mask_dense(tree_mask: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """Unpack ``TreeInfo.mask`` into a boolean ``[B, N, N]``: ``dense[b, i, j]`` iff node ``i`` sees node ``j``.

    Runs on the mask's device without reading anything on the host (usable
    under CUDA-graph capture). With ``num_nodes``, rows and columns of
    padding nodes (``>= num_nodes[b]``) are false; ``build_tree`` already
    gives padding rows no bits.

    Parameters
    ----------
    tree_mask : Tensor, int32 ``[B, N, ceil(N/32)]``
        ``TreeInfo.mask``.
    num_nodes : Tensor, int32 or int64 ``[B]``, optional

    Returns
    -------
    Tensor, bool ``[B, N, N]``

    Shape:
        - tree_mask: ``[B, N, ceil(N / 32)]``; num_nodes: ``[B]``
        - out: ``[B, N, N]``

    Examples
    --------
    >>> import torch, specdec_kernels as sk
    >>> mask = sk.build_tree(torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)).mask
    >>> sk.tree_mask_dense(mask)[0].int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    """
    _check_mask("tree_mask_dense", tree_mask, num_nodes)
    max_nodes = tree_mask.shape[1]
    node = torch.arange(max_nodes, device=tree_mask.device)
    words = tree_mask[:, :, node // MASK_WORD_BITS]  # [B, N, N]: the word holding bit j
    # Arithmetic shift of a negative word still leaves the wanted bit at bit 0.
    dense = ((words >> (node % MASK_WORD_BITS)) & 1).bool()
    if num_nodes is not None:
        live = node[None, :] < num_nodes.to(device=tree_mask.device, dtype=torch.int64)[:, None]
        dense &= live[:, :, None] & live[:, None, :]
    return dense


def tree_mask_flashinfer(tree_mask: torch.Tensor, prefix_lens: torch.Tensor,
                         num_nodes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``TreeInfo.mask`` as FlashInfer's packed custom mask: ``(packed_custom_mask, mask_indptr)``.

    FlashInfer's batch prefill takes, per request, a row-major boolean
    ``[qo_len, kv_len]`` mask (true: attend), the requests' masks
    concatenated and each packed on its own into bytes, little-endian bit
    order (element ``k`` of a request's flattened mask is bit ``k % 8`` of
    its byte ``k // 8``; the last byte is zero-padded), and ``mask_indptr``
    ``[B+1]``, the byte offset of each request's mask. Here request ``b``'s
    queries are its ``n_b = num_nodes[b]`` tree nodes and its keys are the
    ``prefix_lens[b]`` committed positions followed by those ``n_b`` nodes,
    so the engine must plan ``qo_len = n_b`` and ``kv_len = prefix_lens[b] +
    n_b`` (the layout ``sk.tree_attention`` reads: node ``i``'s K/V at
    position ``prefix_lens[b] + i``). Node ``i``'s row is all true over the
    prefix, then its ancestor bits.

    The output's size depends on ``prefix_lens`` and ``num_nodes``, so this
    reads them on the host (one synchronisation): call it where FlashInfer's
    own ``plan`` runs, outside CUDA-graph capture.

    Parameters
    ----------
    tree_mask : Tensor, int32 ``[B, N, ceil(N/32)]``
        ``TreeInfo.mask``.
    prefix_lens : Tensor, int32 or int64 ``[B]``
    num_nodes : Tensor, int32 or int64 ``[B]``, optional
        ``None`` means ``N`` for every request.

    Returns
    -------
    packed_custom_mask : Tensor, uint8 ``[mask_indptr[-1]]``
    mask_indptr : Tensor, int32 ``[B + 1]``
        Both on ``tree_mask``'s device.

    Shape:
        - tree_mask: ``[B, N, ceil(N / 32)]``; prefix_lens, num_nodes: ``[B]``
        - packed_custom_mask: ``[sum_b ceil(n_b * (prefix_lens[b] + n_b) / 8)]``; mask_indptr: ``[B + 1]``

    Examples
    --------
    >>> import torch, specdec_kernels as sk
    >>> mask = sk.build_tree(torch.tensor([[-1, 0]], dtype=torch.int32)).mask
    >>> packed, indptr = sk.tree_mask_flashinfer(mask, torch.tensor([3], dtype=torch.int32))
    >>> [f"{byte:08b}" for byte in packed.tolist()], indptr.tolist()  # rows 11110 and 11111
    (['11101111', '00000011'], [0, 2])
    """
    _check_mask("tree_mask_flashinfer", tree_mask, num_nodes, prefix_lens, needs_prefix_lens=True)
    batch_size, max_nodes, _ = tree_mask.shape
    device = tree_mask.device
    dense = tree_mask_dense(tree_mask)
    prefixes = prefix_lens.tolist()
    counts = [max_nodes] * batch_size if num_nodes is None else num_nodes.tolist()
    bit_weights = torch.ones(BITS_PER_BYTE, dtype=torch.uint8, device=device) << torch.arange(
        BITS_PER_BYTE, dtype=torch.uint8, device=device)
    segments, offsets = [], [0]
    for b in range(batch_size):
        count = min(max(int(counts[b]), 0), max_nodes)
        prefix = max(int(prefixes[b]), 0)
        rows = torch.cat([torch.ones(count, prefix, dtype=torch.bool, device=device), dense[b, :count, :count]], 1)
        bits = rows.flatten()
        num_bytes = -(-bits.numel() // BITS_PER_BYTE)
        padded = torch.zeros(num_bytes * BITS_PER_BYTE, dtype=torch.uint8, device=device)
        padded[:bits.numel()] = bits
        segments.append((padded.view(num_bytes, BITS_PER_BYTE) * bit_weights).sum(1, dtype=torch.uint8))
        offsets.append(offsets[-1] + num_bytes)
    packed = torch.cat(segments) if segments else torch.zeros(0, dtype=torch.uint8, device=device)
    return packed, torch.tensor(offsets, dtype=torch.int32, device=device)
