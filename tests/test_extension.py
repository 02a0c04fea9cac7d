"""The compiled extension specdec_kernels._C: built where nvcc exists, loads, registers its ops.

Loading needs no GPU (the CPU-only CI machines build and load it), so a
broken build fails here rather than silently falling back to Triton.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec_kernels._cuda_build import find_ninja
from specdec_kernels._extension import cuda_extension_available, extension_error, extension_ops

# Every op csrc/bindings/ registers under torch.ops.specdec_C; add new ones here.
EXPECTED_OPS = ("rng_fill", "chain_verify", "chain_verify_packed", "build_tree", "compact_kv", "tree_verify",
                "tree_attention")

not_built = pytest.mark.skipif(not cuda_extension_available(), reason=f"CUDA extension not built: {extension_error()}")


def _nvcc() -> str | None:
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            candidate = Path(os.environ[variable]) / "bin" / "nvcc"
            return str(candidate) if candidate.exists() else None
    return shutil.which("nvcc")


def test_extension_is_built_where_nvcc_exists():
    if os.environ.get("SPECDEC_BUILD_CUDA") == "0":
        pytest.skip("SPECDEC_BUILD_CUDA=0: the extension is not built on purpose")
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: the extension is optional")
    if find_ninja() is None:
        pytest.skip("ninja not found: setup.py skips the extension (pip install ninja)")
    assert cuda_extension_available(), (
        f"nvcc is at {nvcc} but specdec_kernels._C did not load: {extension_error()} "
        "(reinstall with `pip install --no-build-isolation -v -e .` and read the build log, "
        "or set SPECDEC_BUILD_CUDA=0 to build without it)"
    )


def test_error_is_reported_exactly_when_not_loaded():
    error = extension_error()
    assert (error is None) == cuda_extension_available()
    assert error is None or "specdec_kernels._C" in error


@not_built
def test_registers_every_op():
    missing = set(EXPECTED_OPS) - extension_ops()
    assert not missing, f"ops missing from torch.ops.specdec_C: {sorted(missing)} (registered: {sorted(extension_ops())})"


@not_built
@pytest.mark.parametrize("op_name", EXPECTED_OPS)
@pytest.mark.parametrize("dispatch_key", ["CPU", "CUDA", "Meta"])
def test_every_op_has_a_kernel_for(op_name, dispatch_key):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specdec_C::{op_name}", dispatch_key)


def test_loading_does_not_touch_cuda():
    code = (
        "import torch\n"
        "from specdec_kernels._extension import cuda_extension_available, extension_ops\n"
        "cuda_extension_available(); extension_ops()\n"
        "assert not torch.cuda.is_initialized(), 'loading the extension initialised CUDA'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
