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

from . import _backend

NAMESPACE = "specdec"

# Defaults make direct calls work with the public functions' leading
# arguments, e.g. ``torch.ops.specdec.chain_verify(ids, target, draft, seed=3)``.
SCHEMAS = {
    "chain_verify": (
        "chain_verify(Tensor draft_token_ids, Tensor target, Tensor? draft=None, Tensor? num_draft_tokens=None, "
        "Tensor? temperature=None, bool logits=False, Tensor? seed_tensor=None, int seed=0, "
        "Tensor? offset_tensor=None, int offset=0, Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, "
        "Tensor? bonus_token_ids=None, str backend=\"auto\") -> (Tensor, Tensor)"
    ),
    "chain_verify_packed": (
        "chain_verify_packed(Tensor draft_token_ids, Tensor cu_num_draft_tokens, Tensor target, Tensor? draft, "
        "int max_num_draft_tokens, Tensor? temperature=None, bool logits=False, Tensor? seed_tensor=None, "
        "int seed=0, Tensor? offset_tensor=None, int offset=0, Tensor? top_k=None, Tensor? top_p=None, "
        "Tensor? min_p=None, Tensor? bonus_token_ids=None, str backend=\"auto\") -> (Tensor, Tensor)"
    ),
    "tree_verify": (
        "tree_verify(Tensor tree_token_ids, Tensor parents, Tensor target, Tensor? draft=None, "
        "Tensor? num_nodes=None, Tensor? temperature=None, bool logits=False, "
        "str draft_sampling=\"without_replacement\", Tensor? seed_tensor=None, int seed=0, "
        "Tensor? offset_tensor=None, int offset=0, Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, "
        "Tensor? bonus_token_ids=None, str backend=\"auto\") -> (Tensor, Tensor, Tensor)"
    ),
    "build_tree": (
        "build_tree(Tensor parents, Tensor? num_nodes=None, Tensor? prefix_lens=None, str backend=\"auto\") "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "tree_attention": (
        "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor prefix_lens, "
        "Tensor tree_mask, Tensor? num_nodes=None, float? scale=None, str backend=\"auto\") -> Tensor"
    ),
    "compact_kv": (
        "compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_tables, Tensor prefix_lens, "
        "Tensor accepted_nodes, str backend=\"auto\") -> ()"
    ),
}

_library = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    _library.define(_schema)


def register(op_name: str, implementations: dict[str, Callable], fake: Callable) -> None:
    """Register ``op_name``'s backends (keyed by backend name) and its fake.

    Every implementation takes all the schema's arguments except the
    trailing ``backend``. The public functions pass a resolved backend; a
    direct ``torch.ops.specdec`` call may omit trailing arguments (the
    dispatcher passes only those given) or say ``"auto"``.
    """
    defaults = [argument.default_value for argument in getattr(torch.ops.specdec, op_name).default._schema.arguments]

    def dispatch(*args):
        *arguments, backend = (*args, *defaults[len(args):])
        if backend not in implementations:
            device = next(value.device for value in arguments if isinstance(value, torch.Tensor))
            backend = _backend.resolve(op_name, backend, device)
        return implementations[backend](*arguments)

    _library.impl(op_name, dispatch, "CPU")
    _library.impl(op_name, dispatch, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{op_name}", lib=_library)(fake)


def op(op_name: str):
    """The registered op, ``torch.ops.specdec.<op_name>``."""
    return getattr(torch.ops.specdec, op_name)
