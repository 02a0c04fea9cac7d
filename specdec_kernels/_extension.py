"""The optional compiled extension ``specdec_kernels._C``.

``setup.py`` builds it at install time when nvcc, ninja and torch are there
(``pip install --no-build-isolation``); otherwise the first call that needs
the CUDA backend on a GPU compiles the same sources into a per-user cache
(``_jit.py``). Loading it registers the raw ops under
``torch.ops.specdec_C`` (``csrc/bindings/``); the package works without
it (reference and Triton backends). The installed module is tried once, on
the first question asked here, and never touches CUDA: loading the library
registers ops and creates no CUDA context.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading

EXTENSION_MODULE = "specdec_kernels._C"
EXTENSION_NAMESPACE = "specdec_C"


@functools.lru_cache(maxsize=None)
def _import_installed() -> str | None:
    """Import the installed extension once; ``None`` on success, else why it failed."""
    try:
        import torch  # noqa: F401  (the extension links against libtorch: load it first)

        importlib.import_module(EXTENSION_MODULE)
    except ModuleNotFoundError as error:
        if error.name != EXTENSION_MODULE:
            return f"{EXTENSION_MODULE} failed to load: {type(error).__name__}: {error}"
        return (
            f"{EXTENSION_MODULE} is not built (setup.py builds it when nvcc and ninja are found, torch is "
            "importable at build time (pip install --no-build-isolation) and SPECDEC_BUILD_CUDA is not 0; "
            "else the first CUDA call on a GPU compiles it)"
        )
    except Exception as error:  # an ImportError/OSError from the loader: undefined symbol, missing libcudart
        return f"{EXTENSION_MODULE} failed to load: {type(error).__name__}: {error}"
    return None


_first_use = threading.Lock()
_compiled: dict[str, str | None] = {}  # "error": None once the first-use build loaded, else why it failed


def _load() -> str | None:
    """``None`` when the extension is loaded (installed, or compiled on first use), else why not."""
    error = _import_installed()
    if error is None or "error" not in _compiled:
        return error
    if _compiled["error"] is None:
        return None
    return f"{error}; compiling it on first use failed: {_compiled['error']}"


def ensure_loaded() -> str | None:
    """:func:`extension_error` after compiling the extension on first use if the install lacks it.

    Called by the backend choice for CUDA tensors only (a GPU is there):
    the first call may take minutes (once per user and source version; the
    build is cached), and is tried once per process.
    """
    if _import_installed() is None or ("error" in _compiled and _compiled["error"] is None):
        return None  # the common case, on every CUDA call: no lock
    with _first_use:
        if "error" not in _compiled:
            from . import _jit

            try:
                _jit.build_and_load()
                _compiled["error"] = None
            except Exception as error:  # JitUnavailable, or the loader's error on a cached build
                _compiled["error"] = str(error)
                logging.getLogger("specdec_kernels").warning(
                    "specdec_kernels: no CUDA extension (backend='auto' uses Triton instead): %s", error)
    return _load()


def cuda_extension_available() -> bool:
    """Whether ``specdec_kernels._C`` loaded (its ops are registered under ``torch.ops.specdec_C``).

    This says nothing about a GPU being present: the extension also loads,
    and its CPU (host) implementations run, on a machine without one. When
    the install did not build it, this is ``False`` until the first CUDA call
    compiled it (``backend="cuda"``, or ``"auto"``, on GPU tensors).

    Examples
    --------
    >>> from specdec_kernels._extension import cuda_extension_available
    >>> isinstance(cuda_extension_available(), bool)
    True
    """
    return _load() is None


def extension_error() -> str | None:
    """Why the extension did not load, or ``None`` when it did."""
    return _load()


@functools.lru_cache(maxsize=None)
def extension_ops() -> frozenset[str]:
    """Names of the ops registered under ``torch.ops.specdec_C`` (empty when not loaded).

    Read once: the extension registers every op when it loads, and listing
    the dispatcher's ops takes about 2.5 ms (3600 ops), which
    ``backend="auto"`` on CUDA tensors would otherwise pay on every call.

    Examples
    --------
    >>> from specdec_kernels._extension import cuda_extension_available, extension_ops
    >>> not cuda_extension_available() or "rng_fill" in extension_ops()
    True
    """
    if _load() is not None:
        return frozenset()
    import torch

    prefix = EXTENSION_NAMESPACE + "::"
    return frozenset(
        name[len(prefix) :].split(".")[0] for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix)
    )
