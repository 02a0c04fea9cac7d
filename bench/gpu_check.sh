#!/usr/bin/env bash
# One check on a GPU machine, in under 10 minutes: build the CUDA extension,
# run the whole test suite on CUDA, run the hazard checks (bench/hazards.py,
# each in its own process under `timeout`, so a hang is a failure), run the
# quick benchmark sweep, print a short summary table last.
#
#   bench/gpu_check.sh OUTDIR
#
# Writes 8 files at most, none deeper than OUTDIR/results/:
#   OUTDIR/build.log   nvidia-smi, versions, the build (ptxas registers/spills)
#   OUTDIR/tests.log   python -m pytest -q tests (the conftest picks CUDA), then the
#                      hazard checks' PASS/FAIL lines
#   OUTDIR/bench.log   python -m specdec_kernels bench --quick
#   OUTDIR/results/    results.json, results.csv, history.jsonl, time_vs_batch.png, roofline.png
#
# A failing stage is recorded and the next one still runs; the exit status is
# that of the first failing stage. Stage limits (seconds) can be changed with
# BUILD_TIMEOUT, TESTS_TIMEOUT, HAZARDS_TIMEOUT (the whole hazard stage) and
# BENCH_TIMEOUT; PYTHON picks the interpreter.
set -uo pipefail

out="${1:?usage: bench/gpu_check.sh OUTDIR}"
mkdir -p "$out/results"
out="$(cd "$out" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONUNBUFFERED=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset TRITON_INTERPRET  # kernels run on the GPU here
build_timeout="${BUILD_TIMEOUT:-130}"
tests_timeout="${TESTS_TIMEOUT:-170}"
hazards_timeout="${HAZARDS_TIMEOUT:-130}"
bench_timeout="${BENCH_TIMEOUT:-120}"

started=$(date +%s)
stage_seconds() { echo $(( $(date +%s) - $1 )); }

# ---- build --------------------------------------------------------------
t0=$(date +%s)
{
    echo "== $(date -u +%FT%TZ) gpu_check on $(hostname)"
    nvidia-smi || true
    "$python" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
    command -v nvcc && nvcc --version | tail -n 2
    echo "== pip install --no-build-isolation --no-deps --no-index -e . (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
} >"$out/build.log" 2>&1
build_status=0
SPECDEC_BUILD_CUDA=1 timeout "$build_timeout" "$python" -m pip install --no-build-isolation --no-deps --no-index \
    -v -e . >>"$out/build.log" 2>&1 || build_status=$?
if [ "$build_status" -ne 0 ]; then
    # pip may refuse an editable install (read-only site-packages, old pip): build in place instead.
    echo "== pip failed ($build_status): python setup.py build_ext --inplace" >>"$out/build.log"
    build_status=0
    SPECDEC_BUILD_CUDA=1 timeout "$build_timeout" "$python" setup.py build_ext --inplace >>"$out/build.log" 2>&1 \
        || build_status=$?
fi
extension="$("$python" -c "import specdec_kernels as sk, specdec_kernels._extension as e; print('loaded' if sk.cuda_extension_available() else 'NOT loaded: ' + str(e.extension_error()))" 2>&1 | tail -n 1)"
echo "== extension: $extension" >>"$out/build.log"
build_seconds=$(stage_seconds "$t0")

# ---- tests --------------------------------------------------------------
t0=$(date +%s)
tests_status=0
timeout "$tests_timeout" "$python" -m pytest -q -p no:cacheprovider tests >"$out/tests.log" 2>&1 || tests_status=$?
tests_summary="$(grep -E '(passed|failed|error|skipped|no tests ran)' "$out/tests.log" | tail -n 1)"
[ "$tests_status" -eq 124 ] && tests_summary="TIMED OUT after ${tests_timeout}s; last: ${tests_summary}"
tests_seconds=$(stage_seconds "$t0")

# ---- hazards: one process per check, each under its own limit ----------
t0=$(date +%s)
hazards_status=0
hazards_failed=""
echo "== hazard checks (bench/hazards.py)" >>"$out/tests.log"
for check in graph_replay grow_after_capture graphs_out_of_order two_streams small_vocabularies \
             stride_overflow logits_busy_gpu tree_split_busy_gpu compile_reduce_overhead throughput fuzz; do
    left=$(( hazards_timeout - $(stage_seconds "$t0") ))
    limit=$(( left < 60 ? left : 60 ))
    [ "$check" = fuzz ] && limit=$left  # the fuzz, last, gets what is left
    if [ "$limit" -lt 5 ]; then
        echo "SKIP $check: the hazard stage's ${hazards_timeout}s are spent" >>"$out/tests.log"
        hazards_failed="$hazards_failed $check(skipped)"; hazards_status=1
        continue
    fi
    check_status=0
    timeout "$limit" "$python" bench/hazards.py "$check" >>"$out/tests.log" 2>&1 || check_status=$?
    if [ "$check_status" -ne 0 ]; then
        [ "$check_status" -eq 124 ] && echo "FAIL $check: TIMED OUT after ${limit}s (a hang)" >>"$out/tests.log"
        hazards_failed="$hazards_failed $check"; hazards_status=1
    fi
done
hazards_seconds=$(stage_seconds "$t0")

# ---- benchmarks ---------------------------------------------------------
t0=$(date +%s)
bench_status=0
timeout "$bench_timeout" "$python" -m specdec_kernels bench --quick --output "$out/results" >"$out/bench.log" 2>&1 \
    || bench_status=$?
bench_seconds=$(stage_seconds "$t0")

# ---- summary (last) -----------------------------------------------------
echo
echo "== gpu_check summary ($(stage_seconds "$started") s; logs in $out)"
printf '%-8s %-6s %5ss  %s\n' build "$([ $build_status -eq 0 ] && echo ok || echo FAIL)" "$build_seconds" "extension $extension"
printf '%-8s %-6s %5ss  %s\n' tests "$([ $tests_status -eq 0 ] && echo ok || echo FAIL)" "$tests_seconds" "$tests_summary"
printf '%-8s %-6s %5ss  %s\n' hazards "$([ $hazards_status -eq 0 ] && echo ok || echo FAIL)" "$hazards_seconds" \
    "failed:${hazards_failed:- none}"
printf '%-8s %-6s %5ss  %s\n' bench "$([ $bench_status -eq 0 ] && echo ok || echo FAIL)" "$bench_seconds" "$out/results"
grep -E '^(PASS|FAIL|SKIP) ' "$out/tests.log" || true
if [ "$tests_status" -ne 0 ]; then
    echo "-- failing tests:"
    grep -E '^(FAILED|ERROR) ' "$out/tests.log" | head -n 15 || tail -n 5 "$out/tests.log"
fi
if [ -f "$out/results/results.json" ]; then
    "$python" - "$out/results/results.json" <<'EOF'
import json, statistics, sys

results = json.load(open(sys.argv[1]))
env = results["environment"]
print(f"-- {env['device_name']}: copy {env['copy_bandwidth']['gbps']:.0f} GB/s; per op and provider over the quick sweep:")
print(f"{'op':15s} {'provider':10s} {'rows':>4s} {'fail':>4s} {'best us':>9s} {'max GB/s':>9s} {'max %copy':>9s} "
      f"{'med x ref':>9s} {'mismatch':>8s}")
groups = {}
for row in results["rows"]:
    groups.setdefault((row["op"], row["provider"]), []).append(row)
for (op, provider), rows in groups.items():
    good = [r for r in rows if "error" not in r]
    speedups = [r["speedup"] for r in good if r.get("speedup")]
    mismatches = sum(1 for r in good if r.get("matches_reference") is False)
    best = f"{min(r['time_us'] for r in good):.1f}" if good else "-"
    gbps = f"{max(r['gbps'] for r in good):.1f}" if good else "-"
    copy = f"{100 * max(r['copy_fraction'] for r in good):.1f}" if good else "-"
    speedup = f"{statistics.median(speedups):.2f}" if speedups else "-"
    print(f"{op:15s} {provider:10s} {len(rows):4d} {len(rows) - len(good):4d} {best:>9s} {gbps:>9s} {copy:>9s} "
          f"{speedup:>9s} {mismatches:8d}")
EOF
else
    echo "-- no results.json; end of bench.log:"
    tail -n 15 "$out/bench.log"
fi

for status in "$build_status" "$tests_status" "$hazards_status" "$bench_status"; do
    [ "$status" -ne 0 ] && exit "$status"
done
exit 0
