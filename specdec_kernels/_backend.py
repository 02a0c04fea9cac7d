"""Backend resolution: which implementation runs a call, or why none can.

Resolved on the host from metadata only (device type, what is built), before
the registered op is called, so a wrong request fails early with a reason.
"""

from __future__ import annotations

import functools
import os

import torch

from . import _extension

BACKENDS = ("auto", "reference", "triton", "cuda")

# Ops with a Triton kernel (kernels/<op>.py) and with a CUDA kernel in the
# extension (csrc/<op>.cu); every op has a reference.
TRITON_OPS = frozenset(
    {"chain_verify", "chain_verify_packed", "tree_verify", "build_tree", "compact_kv", "tree_attention"})

# Ops whose CUDA kernel backend="auto" passes over for Triton: tree_attention's
# is a SIMT kernel (CUDA cores, no tensor cores) that has not been timed
# against its Triton kernel on a GPU. backend="cuda" runs it.
AUTO_PREFERS_TRITON = frozenset({"tree_attention"})


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as error:  # pragma: no cover - depends on the machine
        return f"{type(error).__name__}: {error}"
    return None


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``: a GPU, or the CPU under ``TRITON_INTERPRET=1``.

    For kernels that are not ops of their own (the adapters' conversions), run
    beside an op whose backend was resolved by :func:`resolve`.
    """
    if triton_import_error() is not None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and triton_interpreter_enabled())


def _triton_unavailable(op_name: str, device: torch.device) -> str | None:
    if op_name not in TRITON_OPS:
        return f"there is no Triton kernel for {op_name} yet: use backend='reference'"
    if triton_import_error() is not None:
        return f"triton cannot be imported ({triton_import_error()}): pip install triton"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpreter_enabled():
        return None
    return (
        f"Triton runs on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1 set before triton is "
        f"imported; the tensors are on {device}: move them to a GPU, set TRITON_INTERPRET=1, or use "
        "backend='reference'"
    )


def _cuda_unavailable(op_name: str, device: torch.device) -> str | None:
    # On GPU tensors a missing extension is looked for in the per-user build cache; nothing compiles here.
    error = _extension.ensure_loaded() if device.type == "cuda" else _extension.extension_error()
    if error is not None:
        return f"the CUDA extension specdec_kernels._C is not built or failed to load ({error})"
    if op_name not in _extension.extension_ops():
        return f"the CUDA extension has no kernel for {op_name} yet: use backend='triton' or 'reference'"
    if device.type != "cuda":
        return f"the CUDA backend needs CUDA tensors; the tensors are on {device}: move them to a GPU, or use " \
            "backend='reference'"
    return None


_WHY_UNAVAILABLE = {"reference": lambda *_: None, "triton": _triton_unavailable, "cuda": _cuda_unavailable}


def available(op_name: str, backend: str, device: torch.device) -> bool:
    """Whether ``backend`` (not ``"auto"``) can run ``op_name`` on ``device``."""
    return _WHY_UNAVAILABLE[backend](op_name, device) is None


def resolve(op_name: str, backend: str, device: torch.device, implemented=None) -> str:
    """The concrete backend for ``backend`` on ``device``; ``RuntimeError`` says why not. ``"auto"`` chooses
    among ``implemented`` (default: every backend), the backends of a feature that has not landed on all."""
    if backend not in BACKENDS:
        raise ValueError(f"{op_name}: `backend` must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "reference"
        order = ("triton", "cuda") if op_name in AUTO_PREFERS_TRITON else ("cuda", "triton")
        return next((name for name in order if (implemented is None or name in implemented)
                     and _WHY_UNAVAILABLE[name](op_name, device) is None), "reference")
    reason = _WHY_UNAVAILABLE[backend](op_name, device)
    if reason is not None:
        raise RuntimeError(f"{op_name}: backend {backend!r} cannot run: {reason}")
    return backend
