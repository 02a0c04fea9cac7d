#!/usr/bin/env bash
# Every standard install, checked in a scratch venv (too slow for CI: a real
# first-use compile of the CUDA extension takes minutes on 2 cores).
#
#   bash scripts/check_installs.sh [WORKDIR]      (default: a fresh mktemp -d)
#
# 1. `pip wheel .` and `python -m build` in build isolation: a pure-Python
#    wheel and an sdist, and the build log says why the extension was not built.
# 2. That wheel installed in a venv with the CPU torch: `python -m
#    specdec_kernels bench --help` runs outside the checkout; the version equals
#    the installed metadata's.
# 3. setup.py with nvcc but without ninja: it installs and says so.
# 4. The first-use build (specdec_kernels._jit) from the installed wheel into a
#    temporary cache: the library loads, registers every op for CPU, CUDA and
#    Meta, runs a host-path op, links no shared libcudart; a second process
#    reuses the cache without compiling.
# TORCH_CUDA_ARCH_LIST (default here: 9.0a, one arch to halve the compile) and
# MAX_JOBS are honoured.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${1:-$(mktemp -d)}"
mkdir -p "$work"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}"
step() { echo "== $*"; }
fail() { echo "FAILED: $*" >&2; exit 1; }

step "scratch venv at $work/venv (torch==2.13.0 CPU, build; ninja comes after the no-ninja check)"
python3.11 -m venv --clear "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q torch==2.13.0 build

step "pip wheel . (isolated)"
rm -rf "$work/wheels" && mkdir -p "$work/wheels"
(cd "$repo" && "$py" -m pip wheel --no-deps -v -w "$work/wheels" .) >"$work/pip-wheel.log" 2>&1 \
    || { tail -n 40 "$work/pip-wheel.log"; fail "pip wheel ."; }
grep -h 'specdec_kernels setup:' "$work/pip-wheel.log" | sort -u
grep -q 'torch is not importable in the build environment' "$work/pip-wheel.log" \
    || fail "the isolated build's log does not say why the extension was not built"
wheel="$(ls "$work"/wheels/specdec_kernels-*-py3-none-any.whl)"
echo "$wheel"

step "python -m build (isolated: sdist, then a wheel from it)"
(cd "$repo" && "$py" -m build --outdir "$work/dist" .) >"$work/build.log" 2>&1 \
    || { tail -n 40 "$work/build.log"; fail "python -m build"; }
ls "$work/dist"
sdist_members="$(tar tzf "$work"/dist/specdec_kernels-*.tar.gz)"
for member in csrc/bindings/module.cpp csrc/bindings/common.h csrc/chain_verify.cu csrc/include/specdec/sampling.cuh kernels/chain_verify.py \
              bench/harness.py LICENSE; do
    grep -q "/$member\$" <<<"$sdist_members" || fail "sdist lacks $member"
done

step "install the wheel; bench --help and the version, outside the checkout"
"$py" -m pip install -q --no-deps --force-reinstall "$wheel"
(cd "$work" && "$py" -m specdec_kernels bench --help | head -n 3)
(cd "$work" && "$py" -c "import importlib.metadata as m, specdec_kernels as sk, sys
assert sk.__file__.startswith('$work'), sk.__file__
assert sk.__version__ == m.version('specdec_kernels'), (sk.__version__, m.version('specdec_kernels'))
print('version', sk.__version__, '| extension installed:', sk.cuda_extension_available())")

step "setup.py with nvcc but without ninja: installs, says so"
nvcc_dir="$(dirname "$(command -v nvcc)")"
(cd "$repo" && env -u SPECDEC_BUILD_CUDA PATH="$nvcc_dir" "$py" -c "
import runpy, setuptools, shutil, sys
setuptools.setup = lambda **kwargs: print('ext_modules:', [e.name for e in kwargs['ext_modules']])
assert shutil.which('ninja') is None
runpy.run_path('setup.py', run_name='__main__')") 2>&1 | tee "$work/no-ninja.log"
grep -q 'ninja was not found' "$work/no-ninja.log" && grep -q 'ext_modules: \[\]' "$work/no-ninja.log" \
    || fail "without ninja setup.py did not skip the extension with a notice"

"$py" -m pip install -q ninja
step "first-use build from the installed wheel (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=${MAX_JOBS:-all})"
export SPECDEC_CACHE_DIR="$work/cache"
rm -rf "$SPECDEC_CACHE_DIR"
check_loaded='
import time, torch, specdec_kernels as sk
from specdec_kernels import _jit
start = time.perf_counter()
library = _jit.build_and_load()
print(f"loaded {library} in {time.perf_counter() - start:.1f} s")
for op in ("rng_fill", "chain_verify", "build_tree", "compact_kv", "tree_verify"):
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specdec_C::{op}", key), (op, key)
parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)
print("host build_tree mask:", torch.ops.specdec_C.build_tree(parents, None, None)[0].tolist())
'
(cd "$work" && "$py" -c "$check_loaded") 2>&1 | tee "$work/jit-first.log"
library="$(grep -o '^loaded [^ ]*' "$work/jit-first.log" | cut -d' ' -f2)"
readelf -d "$library" | grep -E 'NEEDED|RPATH|RUNPATH'
if readelf -d "$library" | grep -qE 'libcudart|RPATH|RUNPATH'; then fail "the first-use build links a shared libcudart"; fi
(cd "$work" && "$py" -c "$check_loaded") 2>&1 | tee "$work/jit-second.log"
grep -q 'compiling the CUDA extension' "$work/jit-second.log" && fail "the second process compiled again"
echo "OK: all install checks passed ($work)"
