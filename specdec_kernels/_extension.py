"""The optional compiled extension ``specdec_kernels._C``.

``setup.py`` builds it when ``nvcc`` is found. Loading it registers the raw
ops under ``torch.ops.specdec_C`` (``csrc/bindings.cpp``); the package works
without it (reference and Triton backends). The import is tried once, on the
first question asked here, and never touches CUDA: loading the library only
links ``libcudart``, and registration creates no CUDA context.
"""

from __future__ import annotations

import functools
import importlib

EXTENSION_MODULE = "specdec_kernels._C"
EXTENSION_NAMESPACE = "specdec_C"


@functools.lru_cache(maxsize=None)
def _load() -> str | None:
    """Import the extension once; ``None`` on success, else why it failed."""
    try:
        import torch  # noqa: F401  (the extension links against libtorch: load it first)

        importlib.import_module(EXTENSION_MODULE)
    except ModuleNotFoundError as error:
        if error.name != EXTENSION_MODULE:
            return f"{EXTENSION_MODULE} failed to load: {type(error).__name__}: {error}"
        return (
            f"{EXTENSION_MODULE} is not built (setup.py builds it when nvcc is found and "
            "SPECDEC_BUILD_CUDA is not 0; reinstall with `pip install --no-build-isolation -e .`)"
        )
    except Exception as error:  # an ImportError/OSError from the loader: undefined symbol, missing libcudart
        return f"{EXTENSION_MODULE} failed to load: {type(error).__name__}: {error}"
    return None


def cuda_extension_available() -> bool:
    """Whether ``specdec_kernels._C`` loaded (its ops are registered under ``torch.ops.specdec_C``).

    This says nothing about a GPU being present: the extension also loads,
    and its CPU (host) implementations run, on a machine without one.

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
