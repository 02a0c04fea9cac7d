#!/usr/bin/env bash
# Every standard install, each run for real in a scratch venv (too slow for CI: builds and compiles take minutes
# on 2 cores; tests/test_packaging.py does the quick parts in CI).
#
#   bash scripts/check_installs.sh [WORKDIR]      (default: a fresh mktemp -d)
#
# 1. Isolated builds: `pip wheel .` (the log says why the extension was not built) and `python -m build`
#    (an sdist carrying the sources, tests and examples, and a wheel from it).
# 2. Each install, into the same venv after removing the previous one: `pip install .`, `pip install -e .`,
#    the sdist, the wheel, and `pip install --no-build-isolation .` (which builds the extension). After each:
#    the version outside the checkout equals the installed metadata's, and from the checkout's root the
#    package imports with its Triton kernels (reference and Triton agree on a call) and, after the
#    no-build-isolation install, the installed extension.
# 3. The sdist's tests collect on the CPU, and its packaging tests pass there.
# 4. setup.py with nvcc but without ninja: it installs and says so.
# 5. `python -m specdec_kernels build` after the isolated wheel's install: it compiles into a temporary cache,
#    says so with its time, the library loads and registers every op for CPU, CUDA and Meta, links no shared
#    libcudart; a second run reuses the cache without compiling.
# TORCH_CUDA_ARCH_LIST (default here: 9.0a, one arch to halve the compiles) and MAX_JOBS are honoured.
# SPECDEC_CHECK_COMPILES=0 skips the two steps that compile the extension (the no-build-isolation install
# then builds without it, SPECDEC_BUILD_CUDA=0).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${1:-$(mktemp -d)}"
mkdir -p "$work"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}"
compiles="${SPECDEC_CHECK_COMPILES:-1}"
step() { echo "== $*"; }
fail() { echo "FAILED: $*" >&2; exit 1; }

step "scratch venv at $work/venv (torch==2.13.0 CPU, triton, build; ninja comes after the no-ninja check)"
python3.11 -m venv --clear "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q torch==2.13.0 triton==3.9.0 numpy scipy build setuptools wheel pytest

step "pip wheel . (isolated)"
rm -rf "$work/wheels" && mkdir -p "$work/wheels"
(cd "$repo" && "$py" -m pip wheel --no-deps -v -w "$work/wheels" .) >"$work/pip-wheel.log" 2>&1 \
    || { tail -n 40 "$work/pip-wheel.log"; fail "pip wheel ."; }
grep -h 'specdec_kernels setup:' "$work/pip-wheel.log" | sort -u
grep -q 'torch is not importable in the build environment' "$work/pip-wheel.log" \
    || fail "the isolated build's log does not say why the extension was not built"
grep -q 'python -m specdec_kernels build' "$work/pip-wheel.log" \
    || fail "the isolated build's log does not name the command that builds the extension"
wheel="$(ls "$work"/wheels/specdec_kernels-*-py3-none-any.whl)"
echo "$wheel"

step "python -m build (isolated: sdist, then a wheel from it)"
(cd "$repo" && "$py" -m build --outdir "$work/dist" .) >"$work/build.log" 2>&1 \
    || { tail -n 40 "$work/build.log"; fail "python -m build"; }
ls "$work/dist"
sdist="$(ls "$work"/dist/specdec_kernels-*.tar.gz)"
sdist_members="$(tar tzf "$sdist")"
for member in csrc/bindings/module.cpp csrc/include/specdec/sampling.cuh kernels/chain_verify.py bench/harness.py \
              tests/test_paged_example.py examples/paged_speculative.py LICENSE; do
    grep -q "/$member\$" <<<"$sdist_members" || fail "sdist lacks $member"
done

# After an install: the version outside the checkout, then the checkout's root (its own Python and kernels,
# the installed extension when the install built one).
check_installed() {
    local expect_extension="$1"
    (cd "$work" && "$py" -c "import importlib.metadata as m, specdec_kernels as sk
assert sk.__version__ == m.version('specdec_kernels'), (sk.__version__, m.version('specdec_kernels'))
print('  outside the checkout:', sk.__file__, 'version', sk.__version__, '| extension:', sk.cuda_extension_available())")
    (cd "$repo" && TRITON_INTERPRET=1 "$py" -c "import torch, specdec_kernels as sk, specdec_kernels._kernels as k
assert k.__file__.startswith('$repo/'), k.__file__
target = torch.softmax(torch.randn(2, 3, 40), -1); draft = torch.softmax(torch.randn(2, 2, 40), -1)
ids = torch.multinomial(draft.reshape(-1, 40), 1).reshape(2, 2)
runs = [sk.chain_verify(ids, target, draft, seed=1, backend=b) for b in ('reference', 'triton')]
assert all(torch.equal(a, b) for a, b in zip(*runs))
assert sk.cuda_extension_available() or not $expect_extension, sk._extension.extension_error()
print('  from the checkout root: kernels', k.__file__, '| extension:', sk.cuda_extension_available())")
}
install_and_check() {
    local name="$1" expect_extension="$2"; shift 2
    step "$name"
    "$py" -m pip uninstall -q -y specdec_kernels >/dev/null 2>&1 || true
    (cd "$repo" && "$py" -m pip install --no-deps "$@") >"$work/install.log" 2>&1 \
        || { tail -n 40 "$work/install.log"; fail "$name"; }
    check_installed "$expect_extension"
}
install_and_check "pip install . (isolated)" False .
install_and_check "pip install -e . (isolated)" False -e .
install_and_check "pip install the sdist" False "$sdist"
install_and_check "pip install the wheel" False "$wheel"
"$py" -m pip install -q ninja
if [ "$compiles" = 1 ]; then
    install_and_check "pip install --no-build-isolation . (builds the extension)" True --no-build-isolation .
else
    SPECDEC_BUILD_CUDA=0 install_and_check "pip install --no-build-isolation . (SPECDEC_BUILD_CUDA=0)" False \
        --no-build-isolation .
fi

step "the sdist's tests collect, and its packaging tests pass, on the CPU"
rm -rf "$work/sdist" && mkdir -p "$work/sdist" && tar xzf "$sdist" -C "$work/sdist"
sdist_root="$(ls -d "$work"/sdist/specdec_kernels-*)"
"$py" -m pip install -q "$sdist_root" >/dev/null
(cd "$sdist_root" && "$py" -m pytest -q --collect-only tests | tail -n 1)
(cd "$sdist_root" && "$py" -m pytest -q -p no:cacheprovider tests/test_packaging.py -k "version or says_why or never_deletes")

step "setup.py with nvcc but without ninja: installs, says so"
"$py" -m pip uninstall -q -y ninja
nvcc_dir="$(dirname "$(command -v nvcc)")"
(cd "$repo" && env -u SPECDEC_BUILD_CUDA PATH="$nvcc_dir" "$py" -c "
import runpy, setuptools, shutil, sys
setuptools.setup = lambda **kwargs: print('ext_modules:', [e.name for e in kwargs['ext_modules']])
assert shutil.which('ninja') is None
runpy.run_path('setup.py', run_name='__main__')") 2>&1 | tee "$work/no-ninja.log"
grep -q 'ninja was not found' "$work/no-ninja.log" && grep -q 'ext_modules: \[\]' "$work/no-ninja.log" \
    || fail "without ninja setup.py did not skip the extension with a notice"
"$py" -m pip install -q ninja

if [ "$compiles" != 1 ]; then
    echo "OK: the install checks passed, without the compiles (SPECDEC_CHECK_COMPILES=0; $work)"
    exit 0
fi
step "python -m specdec_kernels build from the installed wheel (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=${MAX_JOBS:-all})"
"$py" -m pip uninstall -q -y specdec_kernels && "$py" -m pip install -q --no-deps "$wheel"
export SPECDEC_CACHE_DIR="$work/cache"
rm -rf "$SPECDEC_CACHE_DIR"
(cd "$work" && "$py" -m specdec_kernels build) 2>&1 | tee "$work/build-first.log"
grep -q 'compiling the CUDA extension' "$work/build-first.log" || fail "the build did not say it compiles"
grep -qE 'compiled and loaded in [0-9]+ s' "$work/build-first.log" || fail "the build did not report its time"
check_loaded='
import torch
from specdec_kernels import _jit
library = _jit.load_built()
print("loaded", library)
for op in ("rng_fill", "chain_verify", "build_tree", "compact_kv", "tree_verify", "tree_attention"):
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specdec_C::{op}", key), (op, key)
parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)
print("host build_tree mask:", torch.ops.specdec_C.build_tree(parents, None, None)[0].tolist())
'
(cd "$work" && "$py" -c "$check_loaded") 2>&1 | tee "$work/load.log"
library="$(grep -o '^loaded [^ ]*' "$work/load.log" | cut -d' ' -f2)"
readelf -d "$library" | grep -E 'NEEDED|RPATH|RUNPATH'
if readelf -d "$library" | grep -qE 'libcudart|RPATH|RUNPATH'; then fail "the build links a shared libcudart"; fi
(cd "$work" && "$py" -m specdec_kernels build) 2>&1 | tee "$work/build-second.log"
grep -q 'compiling the CUDA extension' "$work/build-second.log" && fail "the second build compiled again"
echo "OK: all install checks passed ($work)"
