#!/usr/bin/env bash
# One check on a GPU machine (one H200, 16 cores) inside 9 minutes: build the CUDA extension for sm_90a, run
# the hazard checks (bench/hazards.py, each in its own process under `timeout`, so a hang is a failure), the
# GPU test subset (tests/gpu_tests.txt) and the benchmarks at the target shapes, then print a summary.
#
#   bench/gpu_check.sh [--dry-run] OUT
#
# --dry-run runs every stage's commands on the CPU at tiny sizes (Triton under TRITON_INTERPRET=1, the CUDA
# extension's host path, the reference) with the package already installed in the active environment, and no
# build; .ci/run calls it so that this script cannot rot. The test stage then only collects the subset
# (pytest -m gpu --collect-only: a line of tests/gpu_tests.txt that matches nothing fails it); CI runs the
# tests themselves.
#
# Stage plan. The script reads its limits from these lines (tests/test_gpu_check.py checks that they sum to
# under 540 s), each stage runs under its limit (SIGINT 10 s before it, then SIGKILL) and writes its file under
# OUT when it ends. A failed stage is recorded and the next one runs, except the build: without the extension
# there is nothing to check, and a second build would start again from scratch.
#
#   stage                  limit  why
#   env                     20 s  nvidia-smi and a first (cold) import of torch and triton: about 5-10 s
#   build                  100 s  pip install -e . for sm_90a only on 16 cores: ninja compiles the six .cu files
#                                 at once, so the longest bounds it. chain_verify.cu is about 65 s of one core
#                                 unsplit (cicc 20 s, ptxas 35 s for its 12 kernels, host 10 s; measured on the
#                                 CPU machine); ptxas splits over the kernels (--split-compile, the same SASS),
#                                 which leaves about 35 s; then the bindings (7 s each, in parallel), the link
#                                 and pip: about 50 s in all
#   tree_split_busy_gpu     40 s  first and alone: the split plan under a busy GPU and in a graph; 2 Triton
#                                 compiles (5-9 s each), CUDA init, 4 reference calls: about 25 s
#   graph_replay            55 s  alone, so that its us/call is undisturbed: 4 Triton compiles, 200-call graphs
#   hazards                 90 s  the other twelve checks at once, each in its own process under this limit (the
#                                 slowest: torch.compile at 4 batch sizes, about 60 s, the fuzz, time-boxed
#                                 at 25 s a backend, and the example's decoding loop, skipped without
#                                 transformers); meanwhile the benchmark's Triton kernels compile into
#                                 Triton's cache (bench --compile-only, in the background until the end of the
#                                 tests at the latest), so that the bench stage times instead of compiling
#   tests                  130 s  pytest -m gpu on 12 workers: about 85 Triton specialisations at 5-9 s are
#                                 35-65 s over the workers (no test compiles more than 5), plus their start
#                                 and collection (15 s) and the runs
#   bench                   90 s  the target shapes (--targets: chain_verify, tree_verify, build_tree,
#                                 tree_attention), about 45 (size, provider) rows of short timing loops (--quick):
#                                 about 60 s; at its limit (SIGINT) it writes the rows it has
#
# Files, 8 at most: OUT/build.log (nvidia-smi, versions, the build with ptxas registers and spills),
# OUT/hazards.log, OUT/tests.log, OUT/bench.log (the compile warm-up's lines first), OUT/results/ (results.json,
# results.csv, history.jsonl: the format of bench/results/), OUT/summary.txt (also printed). The exit status is
# that of the first failing stage. PYTHON picks the interpreter.
set -uo pipefail

dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
    dry_run=1
    shift
fi
out="${1:?usage: bench/gpu_check.sh [--dry-run] OUT}"
mkdir -p "$out/results"
out="$(cd "$out" && pwd)"
script="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "$script")/.."

python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
lanes=$(nproc)  # hazard checks at once
if [ "$dry_run" -eq 1 ]; then
    export TRITON_INTERPRET=1 OMP_NUM_THREADS=1  # the kernels run on the CPU; spinning OpenMP threads oversubscribe
    hazard_options=(--dry-run)
    bench_options=(--tiny --device cpu)
    test_options=(--collect-only)
    workers=$lanes
else
    unset TRITON_INTERPRET  # kernels run on the GPU here
    export TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=$lanes SPECDEC_BUILD_CUDA=1
    hazard_options=(--fuzz-seconds 25)  # per backend: the fuzz's share of the hazards' 90 s
    bench_options=()
    # A hung test becomes one failure (its worker is replaced) rather than the stage's timeout.
    test_options=()
    "$python" -c "import pytest_timeout" 2>/dev/null && test_options=(--timeout=90 --timeout-method=thread)
    workers=12  # 4 of the 16 cores left for ptxas, the warm-up and the controller
fi
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# The stage plan's limits, read from the header above: limit[STAGE] seconds.
declare -A limit
while read -r stage seconds; do
    limit[$stage]=$seconds
done < <(sed -n 's/^#   \([a-z_]\+\) \+\([0-9]\+\) s  .*/\1 \2/p' "$script")
for stage in env build tree_split_busy_gpu graph_replay hazards tests bench; do
    [ -n "${limit[$stage]:-}" ] || { echo "gpu_check.sh: no limit for stage $stage in the header" >&2; exit 2; }
done

# limited SECONDS LOG COMMAND...: COMMAND under `timeout`, its output appended to LOG, no stdin. SIGINT first,
# so that pytest and the benchmark write what they have; SIGKILL 10 s later for a process stuck in a kernel.
# The status is the command's, or 124 / 137 when it ran out of time.
limited() {
    local seconds=$1 log=$2
    shift 2
    timeout -s INT -k 10 "$(( seconds - 10 ))" "$@" </dev/null >>"$log" 2>&1
}
outcome() {  # STATUS: ok, TIMED OUT or FAIL (status)
    case "$1" in
        0) echo ok ;;
        124 | 137) echo "TIMED OUT" ;;
        *) echo "FAIL ($1)" ;;
    esac
}
first_failure=0
record() {  # STATUS: keeps the first nonzero one for the exit status
    [ "$first_failure" -eq 0 ] && first_failure=$1
    return 0
}
summary=()  # one line per stage: name, outcome, seconds, note

# ---- env and build ------------------------------------------------------
stage_start=$SECONDS
{
    echo "== $(date -u +%FT%TZ) gpu_check$([ "$dry_run" -eq 1 ] && echo ' --dry-run') on $(hostname), $(nproc) cores"
    command -v nvidia-smi >/dev/null && nvidia-smi
    command -v nvcc >/dev/null && nvcc --version | tail -n 2
} >"$out/build.log" 2>&1
env_status=0
limited "${limit[env]}" "$out/build.log" "$python" -c "
import torch, triton
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| gpu',
      torch.cuda.get_device_name() if torch.cuda.is_available() else None)
try:
    import flashinfer
    print('flashinfer', flashinfer.__version__)
except Exception as error:
    print('flashinfer: not importable,', type(error).__name__, error)
" || env_status=$?
summary+=("$(printf '%-8s %-10s %4ss' env "$(outcome $env_status)" $((SECONDS - stage_start)))")
record $env_status

stage_start=$SECONDS
build_status=0
if [ "$dry_run" -eq 1 ]; then
    echo "== dry run: no build; the package installed in the active environment is used" >>"$out/build.log"
else
    echo "== pip install --no-build-isolation --no-deps --no-index -v -e . (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST," \
        "MAX_JOBS=$MAX_JOBS)" >>"$out/build.log"
    limited "${limit[build]}" "$out/build.log" "$python" -m pip install --no-build-isolation --no-deps --no-index -v -e . \
        || build_status=$?
fi
extension="$("$python" -c "import specdec_kernels as sk, specdec_kernels._extension as e; \
print('loaded' if sk.cuda_extension_available() else 'NOT loaded: ' + str(e.extension_error()))" 2>&1 | tail -n 1)"
echo "== extension: $extension" >>"$out/build.log"
summary+=("$(printf '%-8s %-10s %4ss  %s' build "$(outcome $build_status)" $((SECONDS - stage_start)) \
    "extension $extension")")
if [ "$dry_run" -eq 1 ] && [ "$extension" != loaded ]; then
    hazard_options+=(--backends triton)  # a CPU machine without nvcc: nothing runs the extension's host path
elif [ "$build_status" -ne 0 ] || [ "$extension" != loaded ]; then
    # No second build: a timed-out one would only start again from scratch.
    {
        echo "== gpu_check stopped after the build ($SECONDS s; files in $out)"
        printf '%s\n' "${summary[@]}"
        echo "-- end of build.log:"
        tail -n 30 "$out/build.log"
    } | tee "$out/summary.txt"
    exit $(( build_status != 0 ? build_status : 1 ))
fi

# ---- hazards ------------------------------------------------------------
hazard() {  # CHECK SECONDS: one check in its own process; output to $scratch/CHECK.log, status to CHECK.status
    local status=0 started=$SECONDS
    : >"$scratch/$1.log"
    limited "$2" "$scratch/$1.log" "$python" bench/hazards.py "$1" "${hazard_options[@]}" || status=$?
    [ "$status" -eq 124 ] || [ "$status" -eq 137 ] && echo "FAIL $1: TIMED OUT after $2 s (a hang?)" >>"$scratch/$1.log"
    echo "-- $1: $((SECONDS - started)) s of its $2 s, exit status $status" >>"$scratch/$1.log"
    echo "$status" >"$scratch/$1.status"
}
stage_start=$SECONDS
hazard tree_split_busy_gpu "${limit[tree_split_busy_gpu]}"
hazard graph_replay "${limit[graph_replay]}"
# The benchmark's kernels compile in the background from here to the end of the tests at the latest.
limited $(( limit[hazards] + limit[tests] )) "$scratch/warm-up.log" "$python" -m specdec_kernels bench --compile-only \
    --targets --op chain_verify --op tree_verify --op build_tree --op tree_attention "${bench_options[@]}" &
warm_up=$!
parallel_checks=(two_streams logits_busy_gpu stride_overflow small_vocabularies grow_after_capture
                 graphs_out_of_order concurrent_graphs throughput compile_reduce_overhead fuzz forced_give_up
                 damaged_workspace paged_decoding)
check_pids=()
for check in "${parallel_checks[@]}"; do
    while [ "$(jobs -pr | wc -l)" -ge "$lanes" ]; do wait -n; done  # the warm-up holds a lane too
    hazard "$check" "${limit[hazards]}" &
    check_pids+=($!)
done
wait "${check_pids[@]}"
: >"$out/hazards.log"
hazards_failed=()
for check in tree_split_busy_gpu graph_replay "${parallel_checks[@]}"; do
    cat "$scratch/$check.log" >>"$out/hazards.log"
    [ "$(cat "$scratch/$check.status")" -eq 0 ] || hazards_failed+=("$check")
done
hazards_status=$(( ${#hazards_failed[@]} > 0 ))
summary+=("$(printf '%-8s %-10s %4ss  %s' hazards "$(outcome $hazards_status)" $((SECONDS - stage_start)) \
    "failed: ${hazards_failed[*]:-none}")")
record $hazards_status

# ---- tests --------------------------------------------------------------
stage_start=$SECONDS
tests_status=0
: >"$out/tests.log"
limited "${limit[tests]}" "$out/tests.log" "$python" -m pytest -m gpu -n "$workers" -p no:cacheprovider -q -rfE \
    --durations=15 "${test_options[@]}" tests || tests_status=$?
tests_note="$(grep -E '(passed|failed|error|skipped|no tests ran|collected)' "$out/tests.log" | tail -n 1)"
summary+=("$(printf '%-8s %-10s %4ss  %s' tests "$(outcome $tests_status)" $((SECONDS - stage_start)) "$tests_note")")
record $tests_status

# ---- bench --------------------------------------------------------------
wait "$warm_up"
warm_up_status=$?
{ echo "== compile warm-up (status $warm_up_status)"; cat "$scratch/warm-up.log"; echo "== bench"; } >"$out/bench.log"
stage_start=$SECONDS
bench_status=0
limited "${limit[bench]}" "$out/bench.log" "$python" -m specdec_kernels bench --targets --quick --no-plots \
    --op chain_verify --op tree_verify --op build_tree --op tree_attention --output "$out/results" \
    "${bench_options[@]}" || bench_status=$?
summary+=("$(printf '%-8s %-10s %4ss  %s' bench "$(outcome $bench_status)" $((SECONDS - stage_start)) \
    "$(tail -n 1 "$out/bench.log")")")
record $bench_status

# ---- summary (last) -----------------------------------------------------
{
    echo "== gpu_check$([ "$dry_run" -eq 1 ] && echo ' --dry-run') summary ($SECONDS s; files in $out)"
    printf '%s\n' "${summary[@]}"
    grep -hE '^(PASS|FAIL|SKIP) ' "$out/hazards.log"
    grep -E '^(FAILED|ERROR) ' "$out/tests.log" | head -n 15
    if [ -f "$out/results/results.json" ]; then
        "$python" - "$out/results/results.json" <<'EOF'
import json, sys

results = json.load(open(sys.argv[1]))
env = results["environment"]
print(f"-- {env['device_name']}: copy {env['copy_bandwidth']['gbps']:.0f} GB/s"
      f"{'; INTERRUPTED at its limit' if results.get('interrupted') else ''}; the target shapes:")
print(f"{'op':15s} {'config':58s} {'provider':22s} {'us':>9s} {'kind':5s} {'GB/s':>7s} {'%copy':>6s} {'same':>4s}")
for row in results["rows"]:
    config = row["config"].replace(" sampling=none", "").replace(" layout=padded", "")
    if "error" in row:
        print(f"{row['op']:15s} {config:58s} {row['provider']:22s} FAILED: {row['error'][:60]}")
        continue
    same = {True: "yes", False: "NO", None: "-"}[row.get("matches_reference")]
    print(f"{row['op']:15s} {config:58s} {row['provider']:22s} {row['time_us']:9.1f} {row['time_kind']:5s} "
          f"{row['gbps']:7.1f} {100 * row['copy_fraction']:6.1f} {same:>4s}")
EOF
    else
        echo "-- no results.json; end of bench.log:"
        tail -n 15 "$out/bench.log"
    fi
} 2>&1 | tee "$out/summary.txt"
exit "$first_failure"
