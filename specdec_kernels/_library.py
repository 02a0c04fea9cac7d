"""The ``torch.ops.specdec`` namespace: every schema in one place.

``define`` + ``impl`` rather than ``@torch.library.custom_op``: the latter
adds Python wrapping on every call, and these ops run thousands of times per
second at decode time. Each op is implemented once for CPU and once for
CUDA by a dispatcher that runs the backend chosen on the host
(``_backend.resolve``), so ``backend=`` survives ``torch.compile`` as a plain
string argument. Seeds and offsets travel as an optional tensor plus an int:
a tensor is read by the kernel (fresh numbers on every CUDA-graph replay),
an int is a launch constant.
"""

from __future__ import annotations

from typing import Callable

import torch

NAMESPACE = "specdec"

SCHEMAS = {
    "chain_verify": (
        "chain_verify(Tensor draft_token_ids, Tensor target, Tensor? draft, Tensor? num_draft_tokens, "
        "Tensor? temperature, bool logits, Tensor? seed_tensor, int seed, Tensor? offset_tensor, int offset, "
        "str backend) -> (Tensor, Tensor)"
    ),
    "tree_verify": (
        "tree_verify(Tensor tree_token_ids, Tensor parents, Tensor target, Tensor? draft, Tensor? num_nodes, "
        "Tensor? temperature, bool logits, str draft_sampling, Tensor? seed_tensor, int seed, "
        "Tensor? offset_tensor, int offset, str backend) -> (Tensor, Tensor, Tensor)"
    ),
    "build_tree": (
        "build_tree(Tensor parents, Tensor? num_nodes, Tensor? prefix_lens, str backend) -> (Tensor, Tensor, Tensor)"
    ),
    "tree_attention": (
        "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor prefix_lens, "
        "Tensor tree_mask, Tensor? num_nodes, float scale, str backend) -> Tensor"
    ),
    "compact_kv": (
        "compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_tables, Tensor prefix_lens, "
        "Tensor accepted_nodes, str backend) -> ()"
    ),
}

_library = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    _library.define(_schema)


def register(op_name: str, implementations: dict[str, Callable], fake: Callable) -> None:
    """Register ``op_name``'s backends (keyed by backend name) and its fake.

    Every implementation takes the schema's arguments except the trailing
    ``backend``.
    """

    def dispatch(*args):
        *arguments, backend = args
        return implementations[backend](*arguments)

    _library.impl(op_name, dispatch, "CPU")
    _library.impl(op_name, dispatch, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{op_name}", lib=_library)(fake)


def op(op_name: str):
    """The registered op, ``torch.ops.specdec.<op_name>``."""
    return getattr(torch.ops.specdec, op_name)
