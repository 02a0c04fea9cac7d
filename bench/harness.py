"""Shared benchmark machinery: timing, copy bandwidth, minimum bytes, output.

Every ``bench/bench_<op>.py`` defines the sizes and the bytes its op must move;
this module times the providers, measures the device's copy bandwidth in the
same run, and writes the results. Used by ``python -m specdec_kernels bench``
and by each script run on its own (``python bench/bench_chain_verify.py``).

A bench module provides::

    OP = "chain_verify"                  # the op's name
    BATCH_KEY = "B"                      # x axis of the time-vs-batch plot
    SERIES_KEYS = ("inputs",)            # config keys that get their own plot line
    NOTES = [...]                        # how the minimum bytes are counted
    MIN_BYTES_BASIS = "..."              # optional: "measured ..." when they depend on the outputs
    TARGETS = [dict(...), ...]           # optional: the target shapes (--targets; bench/gpu_check.sh)
    configs(settings) -> list[dict]      # the sweep
    providers(settings) -> list[str]     # "reference", "triton", "cuda", peers
    Case(config, settings)               # one config: .make_inputs(i), .set_bytes(inputs),
                                         # .call(provider, inputs), .min_bytes(inputs, ref_out),
                                         # .same(ref_out, out) or .check(provider, inputs),
                                         # optional .supports(provider), .flops(inputs),
                                         # .graph_skip_reason(provider) (not capturable: why),
                                         # .UNCOMPARED (providers with their own random numbers)

Timing (see .library METHOD.md for the reasoning):

* GPU: median of per-call CUDA events around the eager call (this includes
  the host-side Python cost whenever the host is the bottleneck), and the
  median of CUDA-graph replays of a graph that runs the op once per input
  set, divided by the number of sets (launch gaps removed).
* Inputs rotate among several sets whose combined minimum bytes exceed the
  cache several times, so repeated runs do not measure a warm L2.
* CPU: median wall time per call; reference only (the Triton interpreter is
  a correctness tool, not a performance path).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
# The checkout holding bench/ (a run from the repository or an editable install); None when installed
# as specdec_kernels._bench, whose parent is the package, not a git checkout of it.
CHECKOUT = REPO_ROOT if (REPO_ROOT / "setup.py").is_file() else None
# Results go to bench/results/ of the checkout, else to this folder under the working directory.
INSTALLED_OUTPUT = "specdec_bench_results"
OPS = ("chain_verify", "tree_verify", "build_tree", "tree_attention", "compact_kv")
KERNEL_BACKENDS = ("reference", "triton", "cuda")
GRAPH_EAGER_SECONDS = 0.05  # eager work captured in one graph, at most
TINY_ENV = "SPECDEC_BENCH_TINY"  # "1": smallest sizes and fewest repetitions (for tests)

CPU_NOTE = (
    "CPU run: reference backend only. Triton under TRITON_INTERPRET=1 is a correctness tool, "
    "not a performance path, so it is not timed here."
)


# --------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """What one run measures and how long it may spend per measurement."""

    device: torch.device
    quick: bool = False
    tiny: bool = False
    targets: bool = False  # each op's TARGETS instead of its sweep (tiny sizes still win)
    providers: tuple[str, ...] | None = None  # None: every provider that can run
    time_budget_s: float = 0.3  # per timing loop
    min_reps: int = 5
    max_reps: int = 2000
    max_sets: int = 128
    memory_budget_bytes: int = 16 << 30
    cache_bytes: int = 0  # L2 (GPU) or last-level cache (CPU)
    notes: list[str] = field(default_factory=list)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def make_settings(device: str | None = None, quick: bool = False, tiny: bool | None = None,
                  providers=None, targets: bool = False) -> Settings:
    if tiny is None:
        tiny = os.environ.get(TINY_ENV, "0") not in ("", "0")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    settings = Settings(device=device, quick=quick, tiny=tiny, targets=targets,
                        providers=tuple(providers) if providers else None)
    settings.cache_bytes = cache_size_bytes(device)
    if device.type == "cuda":
        settings.time_budget_s = 0.15 if quick else 0.4
        settings.max_sets = 256
        free, _ = torch.cuda.mem_get_info(device)
        settings.memory_budget_bytes = min(24 << 30, free // 3)
    else:
        settings.time_budget_s = 0.25 if quick else 0.6
        settings.min_reps = 3
        settings.max_reps = 200
        settings.max_sets = 4
        settings.memory_budget_bytes = 512 << 20
        settings.notes.append(CPU_NOTE)
    if tiny:
        settings.time_budget_s = 0.02
        settings.min_reps = 2
        settings.max_reps = 20
        settings.max_sets = 2
        settings.memory_budget_bytes = 64 << 20
    return settings


def cache_size_bytes(device: torch.device) -> int:
    """L2 size of the GPU, or the largest CPU cache (sysfs), or 32 MiB when unknown."""
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return int(size) or (50 << 20)
    largest = 0
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            largest = max(largest, int(digits) * scale)
    return largest or (32 << 20)


# --------------------------------------------------------------------------- environment


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def git_commit() -> tuple[str, bool | None]:
    """``(commit, dirty)`` of the checkout holding bench/, or ``SPECDEC_COMMIT`` / "unknown"."""
    if CHECKOUT is None:
        return os.environ.get("SPECDEC_COMMIT", "unknown"), None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True,
                                timeout=10)
        if commit.returncode == 0:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=CHECKOUT,
                                    capture_output=True, text=True, timeout=10)
            return commit.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("SPECDEC_COMMIT", "unknown"), None


def environment(settings: Settings, copy_bandwidth: dict) -> dict:
    import specdec_kernels

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # pragma: no cover - depends on the machine
        triton_version = None
    commit, dirty = git_commit()
    return {
        "device": str(settings.device),
        "device_name": device_name(settings.device),
        "cpu_threads": torch.get_num_threads(),
        "package_version": specdec_kernels.__version__,
        "commit": commit,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "cuda_extension": specdec_kernels.cuda_extension_available(),
        "python": platform.python_version(),
        "quick": settings.quick,
        "tiny": settings.tiny,
        "cache_bytes": settings.cache_bytes,
        "copy_bandwidth": copy_bandwidth,
    }


# --------------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(settings: Settings) -> dict:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    if settings.is_cuda:
        size = (256 << 20) if settings.tiny else (1 << 30)
    else:
        size = (16 << 20) if settings.tiny else (128 << 20)
    source = torch.empty(size // 4, dtype=torch.float32, device=settings.device)
    source.uniform_()  # never time on zeros
    destination = torch.empty_like(source)
    times = _time_calls(lambda _: destination.copy_(source), [None], settings, min_reps=10)
    median = statistics.median(times)
    return {"bytes_moved": 2 * size, "median_s": median, "gbps": 2 * size / median / 1e9,
            "method": "torch copy_ of a %d MiB float32 buffer, read + write counted" % (size >> 20)}


def _time_calls(fn, input_sets, settings: Settings, min_reps: int | None = None) -> list[float]:
    """Per-call seconds of ``fn(input_sets[i % n])``: CUDA events on a GPU, wall clock on a CPU."""
    count = len(input_sets)
    device = settings.device
    fn(input_sets[0])  # first call: compilation, allocation
    synchronize(device)
    start = time.perf_counter()
    probes = min(3 if device.type == "cuda" else 1, count)
    for index in range(probes):
        fn(input_sets[index % count])
    synchronize(device)
    estimate = max((time.perf_counter() - start) / probes, 1e-7)
    reps = int(min(settings.max_reps, max(min_reps or settings.min_reps, settings.time_budget_s / estimate)))
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for index in range(reps):
            starts[index].record()
            fn(input_sets[index % count])
            ends[index].record()
        torch.cuda.synchronize(device)
        return [begin.elapsed_time(end) * 1e-3 for begin, end in zip(starts, ends)]
    times = []
    for index in range(reps):
        begin = time.perf_counter()
        fn(input_sets[index % count])
        times.append(time.perf_counter() - begin)
    return times


def time_eager(fn, input_sets, settings: Settings) -> tuple[float, int]:
    """``(median seconds per call, repetitions)``."""
    times = _time_calls(fn, input_sets, settings)
    return statistics.median(times), len(times)


def time_graph(fn, input_sets, settings: Settings, eager_s: float) -> tuple[float | None, int, int | str]:
    """``(median seconds per call, replays, sets in the graph or error)`` from CUDA-graph replay.

    The graph calls the op once on each of the first input sets (so replays
    rotate through them too); a replay's time is divided by that number. An
    op that takes long eagerly (the reference: many small kernels) gets fewer
    sets, so a graph holds about ``GRAPH_EAGER_SECONDS`` of eager work: such
    ops are bound by launches or arithmetic, not by a warm cache. Returns
    ``(None, 0, reason)`` when the call cannot be captured (e.g. a host sync);
    on success the third value is the number of sets in the graph.
    """
    if not settings.is_cuda:
        return None, 0, "no CUDA"
    device = settings.device
    input_sets = input_sets[: max(1, min(len(input_sets), int(GRAPH_EAGER_SECONDS / max(eager_s, 1e-9))))]
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for inputs in input_sets[:3]:
                fn(inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        # Capture on the warmed-up stream: per-stream workspaces already exist, nothing is allocated inside.
        with torch.cuda.graph(graph, stream=side):
            for inputs in input_sets:
                fn(inputs)
        graph.replay()
        torch.cuda.synchronize(device)
    except Exception as error:  # capture refused: the call syncs or allocates on the host
        torch.cuda.synchronize(device)
        return None, 0, f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize(device)
    estimate = max(time.perf_counter() - start, 1e-7)
    reps = int(min(settings.max_reps, max(settings.min_reps, settings.time_budget_s / estimate)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for index in range(reps):
        starts[index].record()
        graph.replay()
        ends[index].record()
    torch.cuda.synchronize(device)
    times = [begin.elapsed_time(end) * 1e-3 / len(input_sets) for begin, end in zip(starts, ends)]
    del graph
    return statistics.median(times), reps, len(input_sets)


def rotation_count(min_bytes: float, set_bytes: int, settings: Settings) -> int:
    """Input sets to rotate through so that their minimum bytes are 4x the cache."""
    wanted = math.ceil(4 * settings.cache_bytes / max(min_bytes, 1.0))
    affordable = max(1, settings.memory_budget_bytes // max(set_bytes, 1))
    return int(max(1, min(wanted, affordable, settings.max_sets)))


# --------------------------------------------------------------------------- providers


def backend_providers(op_name: str, settings: Settings) -> list[str]:
    """The package's backends that can run ``op_name`` on the device (reference only on a CPU)."""
    if not settings.is_cuda:
        return ["reference"]
    from specdec_kernels import _backend

    available = []
    for backend in KERNEL_BACKENDS:
        try:
            _backend.resolve(op_name, backend, settings.device)
        except RuntimeError:
            continue
        available.append(backend)
    return available


def unavailable_backends(op_name: str, settings: Settings) -> dict[str, str]:
    """Why each package backend is not timed, for the JSON notes."""
    reasons = {}
    if not settings.is_cuda:
        return {backend: "not timed on a CPU" for backend in KERNEL_BACKENDS if backend != "reference"}
    from specdec_kernels import _backend

    for backend in KERNEL_BACKENDS:
        try:
            _backend.resolve(op_name, backend, settings.device)
        except RuntimeError as error:
            reasons[backend] = str(error)
    return reasons


def missing_providers(module, settings: Settings, available: list[str]) -> dict[str, str]:
    """Why each provider asked for with ``--providers`` but absent from ``available`` gives no rows."""
    reasons = {}
    for provider in settings.providers or ():
        if provider in available:
            continue
        if provider in KERNEL_BACKENDS:
            reasons[provider] = unavailable_backends(module.OP, settings).get(provider, "not available")
        elif provider == "flashinfer" and hasattr(module, "_flashinfer"):
            if importlib.util.find_spec("flashinfer") is None:
                reasons[provider] = "not installed"
            elif not settings.is_cuda:
                reasons[provider] = f"needs a GPU (the device is {settings.device})"
            else:
                reasons[provider] = "installed but failed to import"
        else:
            reasons[provider] = f"{module.OP} has no such provider"
    return reasons


def op_configs(module, settings: Settings) -> list[dict]:
    """The sizes to run: the op's ``TARGETS`` under ``--targets`` (except with tiny sizes), else its sweep."""
    if settings.targets and not settings.tiny:
        if not hasattr(module, "TARGETS"):
            raise SystemExit(f"{module.OP} has no target shapes (TARGETS in bench_{module.OP}.py)")
        return list(module.TARGETS)
    return module.configs(settings)


def config_label(config: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in config.items())


# --------------------------------------------------------------------------- shared inputs


def branching_tree(num_nodes: int, widths=(4, 2, 2, 1)) -> list[int]:
    """Parents of a draft tree in breadth-first (topological) order.

    A node at depth ``d`` gets ``widths[min(d, len(widths) - 1)]`` children,
    until ``num_nodes`` nodes exist: wide near the root, chains further down,
    the shape tree drafters (SpecInfer, Sequoia, EAGLE) produce.
    """
    parents, depth, frontier = [-1], [0], [0]
    while len(parents) < num_nodes and frontier:
        next_frontier = []
        for node in frontier:
            for _ in range(widths[min(depth[node], len(widths) - 1)]):
                if len(parents) == num_nodes:
                    break
                parents.append(node)
                depth.append(depth[node] + 1)
                next_frontier.append(len(parents) - 1)
        frontier = next_frontier
    return parents


# Widths per depth giving EAGLE-like trees (top-k 4-8 near the root, depth
# 4-6) at the benchmarked sizes; N = 8 is two children a level, depth 4.
EAGLE_WIDTHS = {8: (2, 1), 32: (4, 2, 1), 64: (8, 2, 1), 256: (8, 4, 2, 1)}


def eagle_tree(num_nodes: int) -> list[int]:
    """:func:`branching_tree` with the EAGLE-like widths of ``num_nodes`` (the default widths otherwise)."""
    widths = EAGLE_WIDTHS.get(num_nodes)
    return branching_tree(num_nodes) if widths is None else branching_tree(num_nodes, widths)


def children_lists(parents: list[int]) -> list[list[int]]:
    children = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    return children


# --------------------------------------------------------------------------- the sweep


def run_op(module, settings: Settings, copy_gbps: float, progress=None) -> tuple[list[dict], dict]:
    """Time every provider of one op over its sweep; ``(rows, op_info)``."""
    providers = [p for p in module.providers(settings) if settings.providers is None or p in settings.providers]
    configs = op_configs(module, settings)
    info = {
        "providers": providers,
        "not_timed": unavailable_backends(module.OP, settings),
        "no_rows": missing_providers(module, settings, providers),
        "min_bytes_basis": getattr(module, "MIN_BYTES_BASIS", "input-independent"),
        "notes": list(getattr(module, "NOTES", [])),
        "configs": configs,
    }
    rows = []
    try:
        _run_configs(module, settings, copy_gbps, providers, configs, rows, progress)
    except KeyboardInterrupt:  # a time limit (timeout -s INT) or ^C: keep the rows measured so far
        synchronize_quietly(settings.device)
        info["interrupted"] = True
    return rows, info


def _run_configs(module, settings: Settings, copy_gbps: float, providers: list[str], configs: list[dict],
                 rows: list[dict], progress) -> None:
    """``run_op``'s sweep: appends each config's rows to ``rows`` as it ends."""
    for config in configs:
        try:
            case, first, reference_out, input_sets, min_bytes, details = _prepare(module, config, settings)
        except Exception as error:  # e.g. out of memory at the largest size: record it, go on
            message = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            rows.extend({"op": module.OP, "provider": provider, **config, "config": config_label(config),
                         "error": f"preparing the inputs: {message}"} for provider in providers)
            if progress is not None:
                progress.update(len(providers))
            synchronize_quietly(settings.device)
            if settings.is_cuda:
                torch.cuda.empty_cache()
            continue
        count = len(input_sets)
        flops = case.flops(first) if hasattr(case, "flops") else None
        cold = count * min_bytes >= 2 * settings.cache_bytes
        config_rows = []
        for provider in providers:
            if hasattr(case, "supports") and not case.supports(provider):
                if progress is not None:
                    progress.update(1)
                continue
            row = {"op": module.OP, "provider": provider, **config, "config": config_label(config),
                   "min_bytes": int(round(min_bytes)), "n_sets": count, "cold_cache": cold, **details}
            try:
                if provider == "reference" or provider in getattr(case, "UNCOMPARED", ()):
                    matches = None
                elif hasattr(case, "check"):  # in-place ops compare on fresh copies
                    matches = case.check(provider, first)
                else:
                    matches = case.same(reference_out, case.call(provider, first))
                synchronize(settings.device)
                row["matches_reference"] = None if matches is None else bool(matches)
                eager, reps = time_eager(lambda inputs: case.call(provider, inputs), input_sets, settings)
                row.update(eager_us=eager * 1e6, eager_reps=reps)
                skip = case.graph_skip_reason(provider) if hasattr(case, "graph_skip_reason") else None
                if skip is None:
                    graph, graph_reps, graph_info = time_graph(lambda inputs: case.call(provider, inputs),
                                                               input_sets, settings, eager)
                else:
                    graph, graph_reps, graph_info = None, 0, skip
                row.update(graph_us=None if graph is None else graph * 1e6, graph_reps=graph_reps)
                if graph is not None:
                    row["graph_sets"] = graph_info
                elif settings.is_cuda:
                    row["graph_error"] = graph_info
                best = graph if graph is not None else eager
                row.update(time_us=best * 1e6, time_kind="graph" if graph is not None else "eager",
                           gbps=min_bytes / best / 1e9, copy_fraction=min_bytes / best / 1e9 / copy_gbps)
                if flops:
                    row.update(flops=flops, tflops=flops / best / 1e12)
            except Exception as error:  # record, continue with the next provider
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
                synchronize_quietly(settings.device)
            config_rows.append(row)
            if progress is not None:
                progress.update(1)
        _add_speedups(config_rows)
        rows.extend(config_rows)
        del input_sets, first, reference_out  # free the device memory before the next size
        if settings.is_cuda:
            torch.cuda.empty_cache()


def _prepare(module, config: dict, settings: Settings):
    """The case, its input sets (enough to rotate), the reference output on the first, the minimum bytes."""
    case = module.Case(config, settings)
    first = case.make_inputs(0)
    reference_out = case.call("reference", first)
    synchronize(settings.device)
    first_bytes, detail = case.min_bytes(first, reference_out)
    count = rotation_count(first_bytes, case.set_bytes(first), settings)
    input_sets = [first] + [case.make_inputs(index) for index in range(1, count)]
    measured = [(first_bytes, detail)]
    for inputs in input_sets[1:4]:  # min bytes depend on the inputs (e.g. accepted counts)
        measured.append(case.min_bytes(inputs, case.call("reference", inputs)))
    min_bytes = statistics.fmean(value for value, _ in measured)
    details = _merge_details([extra for _, extra in measured])
    return case, first, reference_out, input_sets, min_bytes, details


def synchronize_quietly(device: torch.device) -> None:
    try:
        synchronize(device)
    except Exception:  # pragma: no cover - a failed kernel may poison the context
        pass


def _merge_details(details: list[dict]) -> dict:
    merged = {}
    for key in details[0]:
        values = [d[key] for d in details if key in d]
        merged[key] = statistics.fmean(values) if all(isinstance(v, (int, float)) for v in values) else values[0]
    return merged


def _add_speedups(rows: list[dict]) -> None:
    reference = next((row for row in rows if row["provider"] == "reference" and "error" not in row), None)
    for row in rows:
        if reference is None or "error" in row:
            continue
        row["speedup_eager"] = reference["eager_us"] / row["eager_us"]
        if row.get("graph_us") and reference.get("graph_us"):
            row["speedup_graph"] = reference["graph_us"] / row["graph_us"]
        row["speedup"] = row.get("speedup_graph", row["speedup_eager"])


# --------------------------------------------------------------------------- output

TABLE_COLUMNS = (
    ("op", "op", "{}"),
    ("config", "config", "{}"),
    ("provider", "provider", "{}"),
    ("eager_us", "eager us", "{:.1f}"),
    ("graph_us", "graph us", "{:.1f}"),
    ("min_bytes", "min MB", None),
    ("gbps", "GB/s", "{:.1f}"),
    ("copy_fraction", "%copy", None),
    ("speedup", "x ref", "{:.2f}"),
    ("matches_reference", "same", None),
)


def _cell(row: dict, key: str, fmt) -> str:
    if key == "provider" and "error" in row:
        return f"{row['provider']} (failed)"
    value = row.get(key)
    if value is None:
        return "-"
    if key == "min_bytes":
        return f"{value / 1e6:.3f}"
    if key == "copy_fraction":
        return f"{100 * value:.1f}"
    if key == "matches_reference":
        return "yes" if value else "NO"
    return fmt.format(value)


def format_table(rows: list[dict]) -> str:
    header = [title for _, title, _ in TABLE_COLUMNS]
    body = [[_cell(row, key, fmt) for key, _, fmt in TABLE_COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(text.ljust(width) for text, width in zip(header, widths))]
    lines.append("  ".join("-" * width for width in widths))
    lines.extend("  ".join(text.ljust(width) for text, width in zip(line, widths)) for line in body)
    errors = [f"  {row['op']} {row['config']} {row['provider']}: {row['error']}" for row in rows if "error" in row]
    if errors:
        lines.append("failed providers:")
        lines.extend(errors)
    return "\n".join(lines)


def write_results(results: dict, output_dir: Path, modules: dict, plots: bool = True) -> list[Path]:
    """results.json, results.csv, time_vs_batch.png and roofline.png (``plots``); one line appended to
    history.jsonl."""
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    json_path = output_dir / "results.json"
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    written.append(json_path)

    env = results["environment"]
    env_columns = {"device_name": env["device_name"], "package_version": env["package_version"],
                   "commit": env["commit"], "date": env["date"], "copy_gbps": env["copy_bandwidth"]["gbps"]}
    rows = [{**row, **env_columns} for row in results["rows"]]
    columns = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    csv_path = output_dir / "results.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: row.get(key, "") for key in columns})
    written.append(csv_path)

    with (output_dir / "history.jsonl").open("a") as handle:
        handle.write(json.dumps(results, default=str) + "\n")
    written.append(output_dir / "history.jsonl")
    if plots:
        written.extend(write_plots(results, output_dir, modules))
    return written


def _plot_rows(rows: list[dict], module, config_keys) -> tuple[dict[str, list[dict]], dict]:
    """Series of one op for the plots: config keys other than batch and series fixed at their largest value."""
    rows = [row for row in rows if "error" not in row]
    if not rows:
        return {}, {}
    chosen = {}
    for key in config_keys:
        if key != module.BATCH_KEY and key not in module.SERIES_KEYS:
            chosen[key] = sorted({row[key] for row in rows}, key=lambda v: (isinstance(v, str), v))[-1]
    series = {}
    for row in rows:
        if all(row[key] == value for key, value in chosen.items()):
            name = " ".join([row["provider"], *(f"{key}={row[key]}" for key in module.SERIES_KEYS)])
            series.setdefault(name, []).append(row)
    return {name: sorted(points, key=lambda r: r[module.BATCH_KEY]) for name, points in series.items()}, chosen


def write_plots(results: dict, output_dir: Path, modules: dict) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG plots (pip install matplotlib)", file=sys.stderr)
        return []
    ops = [op for op in results["ops"] if any(row["op"] == op for row in results["rows"])]
    if not ops:
        return []
    env = results["environment"]
    written = []
    for filename, key, ylabel, title in (
        ("time_vs_batch.png", "time_us", "median time per call (us)", "time vs batch size"),
        ("roofline.png", "copy_fraction", "fraction of copy bandwidth", "fraction of the copy-bandwidth roofline"),
    ):
        columns = min(3, len(ops))
        rows_count = math.ceil(len(ops) / columns)
        figure, axes = plt.subplots(rows_count, columns, figsize=(5.2 * columns, 4.0 * rows_count), squeeze=False)
        for axis in axes.flat[len(ops):]:
            axis.set_visible(False)
        for axis, op in zip(axes.flat, ops):
            module = modules[op]
            op_rows = [row for row in results["rows"] if row["op"] == op]
            config_keys = list(results["ops"][op]["configs"][0]) if results["ops"][op]["configs"] else []
            series, chosen = _plot_rows(op_rows, module, config_keys)
            for name, points in series.items():
                xs = [point[module.BATCH_KEY] for point in points]
                ys = [point.get(key) for point in points]
                axis.plot(xs, ys, marker="o", label=name)
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")  # references sit orders of magnitude below the kernels
            if key == "copy_fraction":
                axis.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
            fixed = ", ".join(f"{k}={v}" for k, v in chosen.items())
            axis.set_title(f"{op}" + (f"\n({fixed})" if fixed else ""), fontsize=9)
            axis.set_xlabel(f"batch size ({module.BATCH_KEY})")
            axis.set_ylabel(ylabel)
            axis.grid(True, which="both", alpha=0.3)
            if series:
                axis.legend(fontsize=7)
        figure.suptitle(f"{title}\n{env['device_name']}, specdec_kernels {env['package_version']} "
                        f"({str(env['commit'])[:10]}, {env['date'][:10]})", fontsize=9)
        figure.tight_layout()
        path = output_dir / filename
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


# --------------------------------------------------------------------------- entry point


def load_modules(ops) -> dict:
    """``{op: bench module}``, importing ``bench/bench_<op>.py`` with bench/ on ``sys.path``."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    modules = {}
    for op in ops:
        if op not in OPS:
            raise SystemExit(f"unknown op {op!r}; choose from {', '.join(OPS)}")
        modules[op] = importlib.import_module(f"bench_{op}")
    return modules


def _progress(total: int, description: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=description, unit="run", leave=False, file=sys.stderr,
                disable=not sys.stderr.isatty())


def run(ops=OPS, *, device=None, quick=False, tiny=None, providers=None, output=None, plots=True,
        targets=False) -> dict:
    """Benchmark ``ops``, print the table, write the results; returns the results dict.

    Interrupted (SIGINT, e.g. ``timeout -s INT``), it writes the rows measured
    so far, with ``"interrupted": true``."""
    settings = make_settings(device, quick, tiny, providers, targets)
    modules = load_modules(ops)
    started = time.perf_counter()
    copy = measure_copy_bandwidth(settings)
    print(f"device: {device_name(settings.device)} ({settings.device}); copy bandwidth "
          f"{copy['gbps']:.1f} GB/s (read + write); cache {settings.cache_bytes >> 20} MiB", flush=True)
    for note in settings.notes:
        print(note, flush=True)
    all_rows, op_info = [], {}
    for op, module in modules.items():
        configs = op_configs(module, settings)
        providers_here = [p for p in module.providers(settings)
                          if settings.providers is None or p in settings.providers]
        bar = _progress(len(configs) * len(providers_here), op)
        if bar is None or bar.disable:
            print(f"[{op}] {len(configs)} sizes x {len(providers_here)} providers ({', '.join(providers_here)})",
                  file=sys.stderr, flush=True)
        rows, info = run_op(module, settings, copy["gbps"], bar)
        if bar is not None:
            bar.close()
        for provider in providers_here:  # every config's Case.supports(provider) said no
            if not any(row["provider"] == provider for row in rows):
                info["no_rows"][provider] = "no benchmarked size supports it"
        for provider, reason in info["no_rows"].items():
            print(f"[{op}] no rows for {provider}: {reason}", flush=True)
        all_rows.extend(rows)
        op_info[op] = info
        if info.get("interrupted"):
            print(f"[{op}] interrupted: the rows measured so far are written, the ops after it are not run",
                  flush=True)
            break
    results = {
        "environment": environment(settings, copy),
        "notes": settings.notes,
        "ops": op_info,
        "rows": all_rows,
        "elapsed_s": time.perf_counter() - started,
        "interrupted": any(info.get("interrupted") for info in op_info.values()),
    }
    print(format_table(all_rows), flush=True)
    output_dir = Path(output) if output is not None else default_output_dir()
    written = write_results(results, output_dir, modules, plots)
    print(f"{len(all_rows)} rows in {results['elapsed_s']:.1f} s; wrote "
          + ", ".join(str(path) for path in written), flush=True)
    return results


def compile_only(ops=OPS, *, device=None, tiny=None, providers=None, targets=False) -> int:
    """Call each provider once per size on one input set, untimed, writing nothing: what a provider compiles
    on first use (Triton's JIT, into its on-disk cache) is then compiled for a later run. Returns the number of
    calls that failed (they are printed and skipped)."""
    settings = make_settings(device, True, tiny, providers, targets)
    failures = 0
    for op, module in load_modules(ops).items():
        names = [p for p in module.providers(settings) if settings.providers is None or p in settings.providers]
        for config in op_configs(module, settings):
            case = module.Case(config, settings)
            inputs = case.make_inputs(0)
            for provider in names:
                if hasattr(case, "supports") and not case.supports(provider):
                    continue
                started = time.perf_counter()
                try:
                    case.call(provider, inputs)
                    synchronize(settings.device)
                    outcome = "ok"
                except Exception as error:  # the timed run reports it again
                    synchronize_quietly(settings.device)
                    failures += 1
                    outcome = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
                print(f"[{op}] {config_label(config)} {provider}: {time.perf_counter() - started:.1f} s, {outcome}",
                      flush=True)
            del inputs
            if settings.is_cuda:
                torch.cuda.empty_cache()
    return failures


def default_output_dir() -> Path:
    return BENCH_DIR / "results" if CHECKOUT is not None else Path(INSTALLED_OUTPUT)


def add_arguments(parser: argparse.ArgumentParser, with_op: bool = True) -> None:
    if with_op:
        parser.add_argument("--op", action="append", choices=OPS,
                            help="op to benchmark (repeatable; default: all)")
    parser.add_argument("--quick", action="store_true", help="a short sweep")
    parser.add_argument("--output", default=None,
                        help=f"output folder (default: bench/results/ of the checkout, ./{INSTALLED_OUTPUT} when "
                             "installed)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--providers", default=None,
                        help="comma-separated subset of reference,triton,cuda,flashinfer")
    parser.add_argument("--tiny", action="store_true", default=None,
                        help=f"smallest sizes and fewest repetitions, for tests (also {TINY_ENV}=1)")
    parser.add_argument("--targets", action="store_true",
                        help="each op's target shapes (TARGETS in bench_<op>.py) instead of its sweep")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots (JSON, CSV and history only)")
    parser.add_argument("--compile-only", action="store_true",
                        help="call each provider once per size, untimed, writing nothing: fills the compile caches "
                             "(Triton's) for a later run")


def main(argv=None, ops=None, prog=None) -> int:
    """Command line of a single bench script (``ops`` fixed) or of all of them."""
    parser = argparse.ArgumentParser(prog=prog, description="specdec_kernels benchmarks")
    add_arguments(parser, with_op=ops is None)
    args = parser.parse_args(argv)
    selected = ops or args.op or OPS
    providers = args.providers.split(",") if args.providers else None
    if args.compile_only:
        return 1 if compile_only(selected, device=args.device, tiny=args.tiny, providers=providers,
                                 targets=args.targets) else 0
    run(selected, device=args.device, quick=args.quick, tiny=args.tiny, providers=providers, output=args.output,
        plots=not args.no_plots, targets=args.targets)
    return 0
