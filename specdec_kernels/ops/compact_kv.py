"""``sk.compact_kv``: validate, dispatch (in place, no allocation)."""

from __future__ import annotations

import torch

from .. import _backend, _library, _validation
from ..launchers.compact_kv import cuda_compact_kv, triton_compact_kv
from ..reference import compact_kv as reference

OP_NAME = "compact_kv"
# A move copies bits, so any cache element of 1, 2, 4 or 8 bytes moves: fp8 and int8 (quantised) caches too.
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8,
                torch.uint8, torch.int16, torch.int32, torch.int64, torch.float64)


def compact_kv(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes, *, backend="auto"):
    """Move the accepted path's K/V next to the prefix, in place.

    For each request, the K/V of node ``accepted_nodes[b, d]`` (position
    ``prefix_lens[b] + accepted_nodes[b, d]``) moves to position
    ``prefix_lens[b] + d`` for every ``d`` before the first negative entry
    (``-1`` pads ``tree_verify``'s paths; any negative entry ends one). All
    sources are read before any destination is written, so overlapping moves
    are safe. Moves that fall outside the block table or the cache are skipped.
    The Triton and CUDA backends equal the reference except where two
    requests' block tables share a block that one of them writes (see
    kernels/compact_kv.py): engines never share the blocks a tree step writes.
    The CUDA backend takes paths of at most 1024 entries (``N <= 1024``).

    Parameters
    ----------
    k_cache, v_cache : Tensor ``[num_blocks, block_size, Hkv, D]``
        Any strides; one dtype of ``CACHE_DTYPES`` (bits are copied: fp8 and int8 caches too).
    block_tables : Tensor, int32 or int64 ``[B, max_blocks]``
    prefix_lens : Tensor, int32 or int64 ``[B]``
    accepted_nodes : Tensor, int32 or int64 ``[B, N]``
        ``sk.tree_verify``'s first output.
    backend : {"auto", "reference", "triton", "cuda"}

    Examples
    --------
    >>> import torch, specdec_kernels as sk
    >>> cache = torch.arange(8.0).view(1, 8, 1, 1).expand(1, 8, 1, 64).contiguous()
    >>> tables = torch.tensor([[0]], dtype=torch.int32)
    >>> sk.compact_kv(cache, cache.clone(), tables, torch.tensor([2], dtype=torch.int32),
    ...               torch.tensor([[0, 2, 3, -1]], dtype=torch.int32))
    >>> cache[0, :5, 0, 0].tolist()
    [0.0, 1.0, 2.0, 4.0, 5.0]
    """
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"{OP_NAME}: `k_cache` must be a torch.Tensor; got {type(k_cache).__name__}")
    check = _validation.Checker(OP_NAME, k_cache.device)
    check.tensor("k_cache", k_cache, (None, None, None, None), CACHE_DTYPES, "[num_blocks, block_size, Hkv, D]")
    check.tensor("v_cache", v_cache, tuple(k_cache.shape), (k_cache.dtype,), "[num_blocks, block_size, Hkv, D]")
    check.tensor("accepted_nodes", accepted_nodes, (None, None), _validation.TOKEN_DTYPES, "[B, N]")
    batch_size = accepted_nodes.shape[0]
    check.tensor("block_tables", block_tables, (batch_size, None), _validation.TOKEN_DTYPES, "[B, max_blocks]",
                 sizes_from="accepted_nodes")
    check.tensor("prefix_lens", prefix_lens, (batch_size,), _validation.TOKEN_DTYPES, "[B]",
                 sizes_from="accepted_nodes")
    resolved = _backend.resolve(OP_NAME, backend, k_cache.device)
    _library.run(OP_NAME, k_cache, v_cache, block_tables, prefix_lens, accepted_nodes, resolved)


def _fake(*args):
    return None


_library.register(OP_NAME, {"reference": reference.compact_kv, "triton": triton_compact_kv, "cuda": cuda_compact_kv},
                  _fake)
