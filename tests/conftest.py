"""Decides the device once, before anything imports Triton; marks the GPU check's subset.

Without a GPU, ``TRITON_INTERPRET=1`` is set so every Triton kernel runs on
CPU tensors; with one, the tests run on ``cuda`` and the interpreter stays
off. Set ``SPECDEC_TEST_DEVICE`` to force one.

``tests/gpu_tests.txt`` lists the tests ``bench/gpu_check.sh`` runs on a GPU
(``pytest -m gpu``): each is marked ``gpu`` here. Under ``-m gpu`` a line that
names a missing file, or a collected file but none of its tests, is an error,
so the list cannot shrink silently when tests are renamed.
"""

import os
import re
from pathlib import Path

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


GPU_TESTS = Path(__file__).with_name("gpu_tests.txt")
REPO_ROOT = Path(__file__).resolve().parents[1]


def gpu_test_patterns() -> list[str]:
    """The lines of ``tests/gpu_tests.txt``: node ids where ``*`` matches any text; ``#`` starts a comment."""
    lines = (line.split("#", 1)[0].strip() for line in GPU_TESTS.read_text().splitlines())
    return [line for line in lines if line]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: the GPU check's subset (tests/gpu_tests.txt; pytest -m gpu)")


def pytest_collection_modifyitems(config, items):
    patterns = {pattern: re.compile(".*".join(map(re.escape, pattern.split("*")))) for pattern in gpu_test_patterns()}
    matched, collected_files = set(), set()
    for item in items:
        # Relative to the repository, whatever the rootdir and the working directory.
        file = Path(item.path).resolve().relative_to(REPO_ROOT).as_posix()
        node_id = file + item.nodeid[item.nodeid.index("::"):] if "::" in item.nodeid else file
        collected_files.add(file)
        for pattern, regex in patterns.items():
            if regex.fullmatch(node_id):
                item.add_marker(pytest.mark.gpu)
                matched.add(pattern)
    if "gpu" not in (config.option.markexpr or ""):
        return
    stale = [pattern for pattern in patterns if pattern not in matched and (
        pattern.split("::")[0] in collected_files or not (REPO_ROOT / pattern.split("::")[0]).is_file())]
    if stale:
        raise pytest.UsageError(f"{GPU_TESTS.name}: no test matches " + ", ".join(stale))
