"""Decides the device once, before anything imports Triton.

Without a GPU, ``TRITON_INTERPRET=1`` is set so every Triton kernel runs on
CPU tensors; with one, the tests run on ``cuda`` and the interpreter stays
off. Set ``SPECDEC_TEST_DEVICE`` to force one.
"""

import os

import pytest
import torch

DEVICE = os.environ.get("SPECDEC_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

ALL_BACKENDS = ("reference", "triton", "cuda")


@pytest.fixture
def device():
    return torch.device(DEVICE)


def backend_or_skip(op_name: str, backend: str, device: str = DEVICE) -> str:
    """``backend`` if it can run ``op_name`` on ``device`` (the test device by default), else skip saying why."""
    from specdec_kernels import _backend

    try:
        _backend.resolve(op_name, backend, torch.device(device))
    except RuntimeError as error:
        pytest.skip(str(error))
    return backend


def extension_op_marks(op_name: str):
    """``(needs_op, needs_gpu, runners)`` for the tests of the extension's ``op_name``.

    ``needs_op`` skips unless the extension loaded and registers the op (its
    host path runs on CPU tensors); ``needs_gpu`` also needs a GPU;
    ``runners`` parametrizes a test over ``"host"`` and ``"gpu"`` with them.
    """
    from specdec_kernels._extension import cuda_extension_available, extension_error, extension_ops

    has_op = cuda_extension_available() and op_name in extension_ops()
    needs_op = pytest.mark.skipif(
        not has_op, reason=f"CUDA extension without {op_name}: {extension_error() or 'op not registered'}")
    needs_gpu = pytest.mark.skipif(
        not (has_op and torch.cuda.is_available()), reason=f"needs a GPU and the CUDA extension with {op_name}")
    return needs_op, needs_gpu, [pytest.param("host", marks=needs_op), pytest.param("gpu", marks=needs_gpu)]


@pytest.fixture(autouse=True)
def no_kernel_faults():
    """Every test ends with no fault counted by the kernels: a wait that gives up under the interpreter or on
    the CUDA extension's host path (where nothing runs concurrently) means a broken invariant. Tests that force
    faults (tests/test_faults.py) read and reset the counts themselves."""
    yield
    import specdec_kernels as sk

    for device in sorted({"cpu", DEVICE}):
        counts = {kind: count for kind, count in sk.kernel_errors(device).items() if count}
        assert not counts, f"the kernels counted faults on {device}: {counts}"
