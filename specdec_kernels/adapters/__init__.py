"""Adapters from engines' own verification layouts to the package's ops.

``sk.adapters.sglang``: SGLang's EAGLE trees (linked lists of children and
siblings, outputs indexed by flattened token position) onto ``sk.tree_verify``.
"""

from . import sglang

__all__ = ["sglang"]
