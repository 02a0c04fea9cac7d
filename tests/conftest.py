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
