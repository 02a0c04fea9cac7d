"""bench/gpu_check.sh: its stage plan fits the GPU machine's 9 minutes, it runs every hazard check, its dry run
wrote every file, and the shapes it benchmarks and checks are the ones meant.

.ci/run runs ``bench/gpu_check.sh --dry-run`` before the suite and names its output folder in
``SPECDEC_GPU_CHECK_OUT``; the test of that output is skipped without it.
"""

import importlib
import json
import os
import re
import sys
from pathlib import Path

import pytest

import specdec_kernels

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "bench" / "gpu_check.sh"
# The plan's lines, as the script reads them (its `sed` pattern): "#   STAGE   SECONDS s  why".
PLAN_LINE = re.compile(r"^#   ([a-z_]+) +([0-9]+) s  ", re.MULTILINE)
STAGES = ("env", "build", "tree_split_busy_gpu", "graph_replay", "hazards", "tests", "bench")
TARGET_OPS = ("chain_verify", "tree_verify", "build_tree", "tree_attention")


def load_bench_module(name):
    """``bench/<name>.py``, imported as the bench scripts import one another (by plain name)."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO_ROOT / "bench"))


def test_stage_plan_sums_to_under_nine_minutes():
    limits = {stage: int(seconds) for stage, seconds in PLAN_LINE.findall(SCRIPT.read_text())}
    assert tuple(limits) == STAGES
    assert sum(limits.values()) < 9 * 60, limits
    # Each stage's command gets SIGINT at its limit minus 10 s, SIGKILL at the limit.
    assert min(limits.values()) > 10, limits


def test_the_script_reads_the_limit_of_every_stage_and_only_those():
    used = set(re.findall(r"limit\[([a-z_]+)\]", SCRIPT.read_text()))
    assert used == set(STAGES)


def test_every_hazard_check_runs():
    text = SCRIPT.read_text()
    parallel = re.search(r"parallel_checks=\(([^)]*)\)", text).group(1).split()
    alone = re.findall(r"^hazard ([a-z_]+) ", text, re.MULTILINE)
    assert alone == ["tree_split_busy_gpu", "graph_replay"]  # first, each alone
    hazards = load_bench_module("hazards")
    assert sorted(alone + parallel) == sorted(hazards.CHECKS)


def test_logits_busy_gpu_takes_the_two_wave_plan_on_an_h200():
    """Several vocabulary slices per row with logits: the plan whose second wave waits for the first."""
    from specdec_kernels.launchers import chain_verify as launcher

    batch_size, max_drafts, vocab_size = load_bench_module("hazards").LOGITS_BUSY_SHAPES
    config = launcher.launch_config(batch_size, max_drafts + 1, vocab_size, multiprocessors=132)
    assert config.num_splits == 3 and config.rows == 1


def test_benchmark_targets_are_sizes_of_their_sweeps():
    harness = load_bench_module("harness")
    settings = harness.make_settings("cpu", quick=True, tiny=True)
    for op, module in harness.load_modules(TARGET_OPS).items():
        assert module.TARGETS, op
        keys = set(module.configs(settings)[0])
        for config in module.TARGETS:
            assert set(config) == keys, (op, config)
            module.Case(config, settings)  # the case accepts it


def test_dry_run_wrote_every_file():
    folder = os.environ.get("SPECDEC_GPU_CHECK_OUT")
    if not folder:
        pytest.skip("no dry run to look at: .ci/run sets SPECDEC_GPU_CHECK_OUT after bench/gpu_check.sh --dry-run")
    folder = Path(folder)
    files = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())
    assert files == ["bench.log", "build.log", "hazards.log", "results/history.jsonl", "results/results.csv",
                     "results/results.json", "summary.txt", "tests.log"]  # 8: what a GPU machine sends back
    assert all((folder / name).stat().st_size > 0 for name in files)
    hazards = load_bench_module("hazards")
    log = (folder / "hazards.log").read_text()
    for check in hazards.CHECKS:
        for backend in ("triton", "cuda") if specdec_kernels.cuda_extension_available() else ("triton",):
            assert re.search(rf"^PASS {check} {backend}: ", log, re.MULTILINE), (check, backend)
    assert "tests collected" in (folder / "tests.log").read_text()
    results = json.loads((folder / "results" / "results.json").read_text())
    assert {row["op"] for row in results["rows"]} == set(TARGET_OPS)
    assert not results["interrupted"] and not any("error" in row for row in results["rows"])
    assert "gpu_check --dry-run summary" in (folder / "summary.txt").read_text()
