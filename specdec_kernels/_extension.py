"""The optional compiled extension ``specdec_kernels._C``.

``setup.py`` builds it at install time when nvcc, ninja and torch are there
(``pip install --no-build-isolation``); otherwise ``python -m specdec_kernels
build`` compiles the same sources into a per-user cache (``_jit.py``), and
the first call that needs the CUDA backend on a GPU loads that build. No
call compiles anything. Loading it registers the raw ops under
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
REBUILD = "rebuild it for this torch: pip install --no-build-isolation . from the checkout"


def not_built_reason() -> str:
    from ._cuda_build import BUILD_COMMAND

    return (f"{EXTENSION_MODULE} is not built: run {BUILD_COMMAND} (needs nvcc and ninja), or "
            "install with pip install --no-build-isolation . (setup.py builds it when nvcc and ninja are found "
            "and SPECDEC_BUILD_CUDA is not 0)")


@functools.lru_cache(maxsize=None)
def _import_installed() -> str | None:
    """Import the installed extension once; ``None`` on success, else why it failed."""
    try:
        import torch  # noqa: F401  (the extension links against libtorch: load it first)

        importlib.import_module(EXTENSION_MODULE)
    except ModuleNotFoundError as error:
        if error.name != EXTENSION_MODULE:
            return f"{EXTENSION_MODULE} failed to load: {type(error).__name__}: {error} ({REBUILD})"
        return not_built_reason()
    except Exception as error:  # an ImportError/OSError from the loader: undefined symbol, missing libcudart
        return f"{EXTENSION_MODULE} failed to load: {type(error).__name__}: {error} ({REBUILD})"
    return None


_first_use = threading.Lock()
_cached: dict[str, str | None] = {}  # "error": None once a cached build (python -m specdec_kernels build) loaded


def _load() -> str | None:
    """``None`` when the extension is loaded (installed, or a cached build), else why not."""
    error = _import_installed()
    if error is None or "error" not in _cached:
        return error
    if _cached["error"] is None:
        return None
    return f"{error}; {_cached['error']}"


def ensure_loaded() -> str | None:
    """:func:`extension_error` after loading the cached build when the install lacks the extension.

    Called by the backend choice for CUDA tensors only (a GPU is there, so
    the cache key can name its architectures); tried once per process.
    Never compiles: ``python -m specdec_kernels build`` does that.
    """
    if _import_installed() is None or ("error" in _cached and _cached["error"] is None):
        return None  # the common case, on every CUDA call: no lock
    with _first_use:
        if "error" not in _cached:
            from . import _jit

            try:
                _jit.load_built()
                _cached["error"] = None
            except Exception as error:  # JitUnavailable, or the loader's error on a cached build
                _cached["error"] = str(error)
                logging.getLogger("specdec_kernels").warning(
                    "specdec_kernels: no CUDA extension, so backend='auto' uses Triton (build it with %s): %s",
                    _jit.BUILD_COMMAND, error)
    return _load()


def cuda_extension_available() -> bool:
    """Whether ``specdec_kernels._C`` loaded (its ops are registered under ``torch.ops.specdec_C``).

    This says nothing about a GPU being present: the extension also loads,
    and its CPU (host) implementations run, on a machine without one. When
    the install did not build it, this is ``False`` until the first CUDA call
    (``backend="cuda"``, or ``"auto"``, on GPU tensors) loaded the build that
    ``python -m specdec_kernels build`` made.

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
