"""``sk.tree_attention``: validate, allocate, dispatch."""

from __future__ import annotations

import torch

from .. import _backend, _library, _validation
from ..launchers.tree_attention import cuda_tree_attention, triton_tree_attention
from ..reference import tree_attention as reference

OP_NAME = "tree_attention"
HEAD_DIMS = (64, 128, 256)


def tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, *, num_nodes=None, scale=None,
                   backend="auto"):
    """Attention of tree nodes over a paged KV cache, with the tree mask inside.

    Node ``i`` of request ``b`` attends to every position ``< prefix_lens[b]``
    and to ``prefix_lens[b] + j`` iff bit ``j`` of its mask row is set.

    Parameters
    ----------
    q : Tensor ``[B, N, Hq, D]``
        float16 or bfloat16 (float32 too on the reference and CUDA backends).
    k_cache, v_cache : Tensor ``[num_blocks, block_size, Hkv, D]``
        Paged cache, dtype of ``q``; ``Hq % Hkv == 0``; ``D`` in {64, 128, 256} on the kernels, any on the
        reference. Only the prefix and the live nodes' keys (``prefix_lens[b] + j``, ``j < num_nodes[b]``) are
        read: padding nodes' slots may hold anything, NaN included.
    block_tables : Tensor, int32 or int64 ``[B, max_blocks]``
        Position ``s`` lives in block ``block_tables[b, s // block_size]``.
        Positions past the table or in blocks outside the cache are masked out.
    prefix_lens : Tensor, int32 or int64 ``[B]``
    tree_mask : Tensor, int32 ``[B, N, ceil(N/32)]``
        ``TreeInfo.mask``.
    num_nodes : Tensor, int32 or int64 ``[B]``, optional
        Rows at or past it are zero.
    scale : float, optional
        Default ``D ** -0.5``.
    backend : {"auto", "reference", "triton", "cuda"}
        ``"auto"`` on CUDA tensors picks Triton (the CUDA kernel has not been timed against it yet), and for
        float32, which the Triton kernel refuses, CUDA (else the reference).

    Returns
    -------
    Tensor ``[B, N, Hq, D]``, dtype of ``q``.

    Examples
    --------
    >>> import torch, specdec_kernels as sk
    >>> q = torch.randn(1, 2, 4, 64)
    >>> cache = torch.randn(3, 16, 2, 64)
    >>> tables = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    >>> lens = torch.tensor([5], dtype=torch.int32)
    >>> mask = sk.build_tree(torch.tensor([[-1, 0]], dtype=torch.int32)).mask
    >>> sk.tree_attention(q, cache, cache, tables, lens, mask).shape
    torch.Size([1, 2, 4, 64])
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{OP_NAME}: `q` must be a torch.Tensor; got {type(q).__name__}")
    check = _validation.Checker(OP_NAME, q.device)
    check.tensor("q", q, (None, None, None, None), _validation.FLOAT_DTYPES, "[B, N, Hq, D]")
    batch_size, max_nodes, query_heads, head_dim = q.shape
    check.tensor("k_cache", k_cache, (None, None, None, head_dim), (q.dtype,), "[num_blocks, block_size, Hkv, D]")
    check.tensor("v_cache", v_cache, tuple(k_cache.shape), (q.dtype,), "[num_blocks, block_size, Hkv, D]",
                 sizes_from="k_cache")
    kv_heads = k_cache.shape[2]
    if kv_heads < 1 or query_heads % kv_heads != 0:
        check.fail(f"query heads must be a multiple of KV heads (Hq % Hkv == 0); got Hq = {query_heads}, "
                   f"Hkv = {kv_heads}")
    check.tensor("block_tables", block_tables, (batch_size, None), _validation.TOKEN_DTYPES, "[B, max_blocks]")
    check.tensor("prefix_lens", prefix_lens, (batch_size,), _validation.TOKEN_DTYPES, "[B]")
    words = (max_nodes + 31) // 32
    check.tensor("tree_mask", tree_mask, (batch_size, max_nodes, words), (torch.int32,), "[B, N, ceil(N/32)]")
    check.optional_tensor("num_nodes", num_nodes, (batch_size,), _validation.TOKEN_DTYPES, "[B]")
    if scale is None:
        scale = head_dim**-0.5
    resolved = _backend.resolve(OP_NAME, backend, q.device)
    if backend == "auto":
        resolved = _auto_choice(resolved, q)
    if resolved == "triton" and q.dtype == torch.float32:
        check.fail("the triton kernel takes float16 or bfloat16 `q` (float32 tiles spill on GPUs); got float32: use "
                   "backend 'cuda' or 'reference'", TypeError)
    block_size = k_cache.shape[1]
    if resolved != "reference" and head_dim not in HEAD_DIMS:
        check.fail(f"the {resolved} kernel needs `q` with a head dimension D in {HEAD_DIMS} (the reference takes "
                   f"any); got D = {head_dim}")
    if resolved != "reference" and block_size & (block_size - 1):
        check.fail(f"the {resolved} kernel needs a power-of-two block size (`k_cache.shape[1]`); got {block_size}")
    return _library.run(
        OP_NAME, q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, float(scale), resolved
    )


def _reference(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return reference.tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, scale)


def _fake(q, *args):
    return torch.empty_like(q)


def _auto_choice(resolved, q, *args):
    """``auto``'s backend for ``q``: float32 tiles spill kilobytes of registers in the Triton kernel on GPUs
    (``python -m specdec_kernels._kernels.aot`` with a float32 shape), so float32 takes the CUDA kernel's SIMT
    program, else the reference."""
    if resolved == "triton" and q.dtype == torch.float32:
        return "cuda" if _backend.available(OP_NAME, "cuda", q.device) else "reference"
    return resolved


_library.register(OP_NAME, {"reference": _reference, "triton": triton_tree_attention, "cuda": cuda_tree_attention},
                  _fake, _auto_choice)
