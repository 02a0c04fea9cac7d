"""Every "backend cannot run" error names what fixes it (a command, a variable, or another backend)."""

import pytest
import torch

from specdec_kernels import _backend, _extension


def _reason(backend: str, op_name: str, device: str) -> str:
    with pytest.raises(RuntimeError) as error:
        _backend.resolve(op_name, backend, torch.device(device))
    return str(error.value)


def test_triton_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    message = _reason("triton", "chain_verify", "cpu")
    assert "set TRITON_INTERPRET=1" in message and "backend='reference'" in message


def test_triton_missing(monkeypatch):
    monkeypatch.setattr(_backend, "triton_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    assert "pip install triton" in _reason("triton", "chain_verify", "cpu")


def test_op_without_a_triton_kernel(monkeypatch):
    monkeypatch.setattr(_backend, "TRITON_OPS", frozenset())
    assert "use backend='reference'" in _reason("triton", "chain_verify", "cpu")


def test_cuda_extension_not_built(monkeypatch):
    monkeypatch.setattr(_extension, "_import_installed", lambda: _extension.not_built_reason())
    monkeypatch.setattr(_extension, "_cached", {})
    assert "python -m specdec_kernels build" in _reason("cuda", "chain_verify", "cpu")


def test_cuda_backend_on_cpu_tensors():
    if not _extension.cuda_extension_available():
        pytest.skip("the extension is not built here")
    with pytest.raises(RuntimeError, match="move them to a GPU, or use backend='reference'"):
        _backend.resolve("chain_verify", "cuda", torch.device("cpu"))
