"""Fused, exact kernels for speculative decoding.

``import specdec_kernels as sk``; the ops are ``sk.chain_verify``,
``sk.chain_verify_packed``, ``sk.tree_verify``, ``sk.build_tree``,
``sk.tree_attention`` and ``sk.compact_kv`` (the API: docs/api.md),
also registered as ``torch.ops.specdec.<name>``. Engines' own
layouts: ``sk.adapters`` (``sk.adapters.sglang.eagle_tree_verify``).
"""

from . import _checkout

_checkout.install()  # before any import of the kernels (see _checkout.py)

from . import adapters  # noqa: E402
from ._extension import cuda_extension_available
from ._faults import kernel_errors
from .ops.build_tree import TreeInfo, build_tree
from .ops.chain_verify import chain_verify
from .ops.chain_verify_packed import chain_verify_packed
from .ops.compact_kv import compact_kv
from .ops.tree_attention import tree_attention
from .ops.tree_verify import tree_verify
from .ops.workspace import reserve_workspace
from .tree_mask import tree_mask_dense, tree_mask_flashinfer

__version__ = "0.2.0"

__all__ = [
    "TreeInfo",
    "adapters",
    "build_tree",
    "chain_verify",
    "chain_verify_packed",
    "compact_kv",
    "cuda_extension_available",
    "kernel_errors",
    "reserve_workspace",
    "tree_attention",
    "tree_mask_dense",
    "tree_mask_flashinfer",
    "tree_verify",
]
