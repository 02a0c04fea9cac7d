#!/usr/bin/env bash
# The main job: set up (fresh venv, build), then the end-to-end demo and the
# benchmark sweep. On a GPU machine the benchmark covers reference, Triton
# and CUDA; on a CPU the reference path with small sizes.
# Results (JSON, CSV, PNG) go to bench/results/ (or the first argument).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
source scripts/setup_env.sh
output="${1:-bench/results}"
python -m specdec_kernels demo
python -m specdec_kernels bench --quick --output "$output"
