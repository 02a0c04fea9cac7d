#!/usr/bin/env bash
# Sourced by .ci/run and scripts/main.sh: creates a fresh virtual environment
# in $SPECDEC_VENV (default .venv), installs the pinned toolchain, builds and
# installs the package (the CUDA extension when nvcc is found), and prints the
# ptxas register/spill lines of the CUDA kernels. Leaves the venv activated.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPECDEC_VENV:-$repo_root/.venv}"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

echo "== venv at $venv =="
# Remade from scratch each time, but only a venv this script made (it leaves a marker): a user's own
# environment at that path is never deleted.
marker="$venv/.made-by-specdec-setup-env"
if [ -e "$venv" ] && [ ! -e "$marker" ]; then
    echo "FAILED: $venv exists and was not made by scripts/setup_env.sh; move it, or set SPECDEC_VENV to another path" >&2
    exit 1
fi
rm -rf "$venv"
python3.11 -m venv "$venv"
touch "$marker"
# shellcheck disable=SC1091
source "$venv/bin/activate"
# torch first, pinned: the CPU wheel lies on local disk; a bare `torch`
# requirement could resolve to a multi-GB CUDA build. triton is pinned so the
# ahead-of-time compile report is reproducible.
python -m pip install -q torch==2.13.0
# pytest-timeout: every test has a time limit (pyproject.toml), so a hang fails one test and prints where it stopped.
python -m pip install -q setuptools wheel triton==3.9.0 numpy scipy pytest pytest-xdist==3.8.0 pytest-timeout==2.4.0 \
    ninja matplotlib tqdm
# transformers: examples/paged_speculative.py and its test (tests/test_paged_example.py).
python -m pip install -q transformers==5.24.0
python -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"

echo "== build and install (pip install --no-build-isolation -v -e .) =="
build_log="$venv/build.log"
if ! (cd "$repo_root" && python -m pip install --no-build-isolation -v -e .) >"$build_log" 2>&1; then
    tail -n 200 "$build_log"
    echo "FAILED: pip install --no-build-isolation -e ." >&2
    exit 1
fi
grep -E 'specdec_kernels setup:' "$build_log" | sort -u || true

echo "== ptxas (CUDA extension): registers and spills per kernel =="
grep -E 'Compiling entry function|registers|spill' "$build_log" | sed 's/^ *//' || echo "(none: the CUDA extension was not built)"
