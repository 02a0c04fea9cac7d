"""``sk.build_tree``: validate, allocate, dispatch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _backend, _library, _validation
from ..launchers.build_tree import cuda_build_tree, triton_build_tree
from ..reference import build_tree as reference

OP_NAME = "build_tree"


class TreeInfo(NamedTuple):
    """Tree metadata for attention and rotary embeddings.

    mask : int32 ``[B, N, ceil(N/32)]``
        Bit ``j % 32`` of word ``j // 32`` in row ``i``: node ``j`` is ``i``
        or an ancestor of ``i``.
    depth : int32 ``[B, N]``
        Root 0; ``-1`` for padding and unreachable nodes.
    positions : int64 ``[B, N]``
        ``prefix_lens[b] + depth``.
    """

    mask: torch.Tensor
    depth: torch.Tensor
    positions: torch.Tensor


def build_tree(parents, *, num_nodes=None, prefix_lens=None, backend="auto", validate=False):
    """Ancestor bitmask, depth and positions of draft trees in one call.

    Parameters
    ----------
    parents : Tensor, int32 or int64 ``[B, N]``
        ``parents[b, 0] == -1``, ``0 <= parents[b, i] < i``. Node 0 is the
        root whatever its entry says (only ``validate`` looks at it); any other
        node whose parent is outside ``[0, i)``, and its descendants, are
        treated as padding.
    num_nodes : Tensor, int32 or int64 ``[B]``, optional
        Nodes per request; nodes at or past it are padding (a count below 1
        leaves every node padding, one above ``N`` means ``N``).
    prefix_lens : Tensor, int32 or int64 ``[B]``, optional
        Committed tokens before the tree (default 0).
    backend : {"auto", "reference", "triton", "cuda"}
    validate : bool
        Check the values on the host first (synchronises) and raise
        ``ValueError`` naming the argument, request and node for a root whose
        parent is not ``-1``, a parent outside ``[0, i)`` for ``1 <= i < n_b``
        or a count outside ``[1, N]``.

    Returns
    -------
    TreeInfo

    Examples
    --------
    >>> import torch, specdec_kernels as sk
    >>> info = sk.build_tree(torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32))
    >>> info.mask[0, :, 0].tolist(), info.depth[0].tolist()
    ([1, 3, 5, 11], [0, 1, 1, 2])
    """
    if not isinstance(parents, torch.Tensor):
        raise TypeError(f"{OP_NAME}: `parents` must be a torch.Tensor; got {type(parents).__name__}")
    check = _validation.Checker(OP_NAME, parents.device)
    check.tensor("parents", parents, (None, None), _validation.TOKEN_DTYPES, "[B, N]")
    batch_size, max_nodes = parents.shape
    if max_nodes < 1:
        check.fail(f"`parents` must have shape [B, N] with N >= 1; got {list(parents.shape)}")
    check.optional_tensor("num_nodes", num_nodes, (batch_size,), _validation.TOKEN_DTYPES, "[B]")
    check.optional_tensor("prefix_lens", prefix_lens, (batch_size,), _validation.TOKEN_DTYPES, "[B]")
    resolved = _backend.resolve(OP_NAME, backend, parents.device)
    if validate:
        try:
            reference.validate_parents(parents, num_nodes)
        except ValueError as error:
            check.fail(str(error))
    return TreeInfo(*_library.run(OP_NAME, parents, num_nodes, prefix_lens, resolved))


def _fake(parents, *args):
    batch_size, max_nodes = parents.shape
    words = (max_nodes + 31) // 32
    return (
        parents.new_empty((batch_size, max_nodes, words), dtype=torch.int32),
        parents.new_empty((batch_size, max_nodes), dtype=torch.int32),
        parents.new_empty((batch_size, max_nodes), dtype=torch.int64),
    )


_library.register(OP_NAME, {"reference": reference.build_tree, "triton": triton_build_tree, "cuda": cuda_build_tree},
                  _fake)
