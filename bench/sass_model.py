"""A static performance model: each kernel's hot loop read from its SASS, and a predicted H200 time per target.

No GPU is needed. The Triton kernels are compiled ahead of time for sm_90a
through ``kernels/aot.py`` (its variant builders, fed the target shape, so the
variant is the one the launcher picks on a 132-SM H200); the CUDA kernels are
read from the sm_90a cubin inside the built extension ``specdec_kernels/_C*.so``.
Both are disassembled with the ``cuobjdump`` that ships inside Triton's pip
package. Everything is re-read on every run: no instruction count is stored.

Run: ``python bench/sass_model.py --out bench/results/sass_model.md`` (also
writes the ``.json`` beside it; TRITON_INTERPRET must be unset). ``--quick``
analyses only build_tree (the test's check).

How the hot loop is found (``bench/sass_loops.py`` holds the details)
---------------------------------------------------------------------
Loops are the natural loops of each kernel's control-flow graph. One
iteration is measured along one path from the loop head back to it: the path
whose global-load bytes per thread are the closest to what the scenario reads
in one iteration (e.g. two 1024-token rows of fp32 over 128 threads: 64 B),
then the fewest instructions. That is the streaming fast path: every load of
the rows the scenario reads, and none of the branches it does not take (the
logits or truncation code compiled into a CUDA loop, the scalar tail beside a
vector load, a draft row read only after a rejection). A loop nested in the
hot loop counts ``nested_trips`` times per iteration (0 by default: e.g. the
per-rejection replay in the tree sampler runs zero times without rejections).
A selector per target then picks the loop:

* ``sampler``: the vocabulary pass of the verifiers: loops with a prefix scan
  (``SHFL.UP``, the sampler's per-chunk scan) and plain global loads (workspace
  reads are ``.STRONG``); the load bytes closest to the scenario's, then the
  fewest instructions (on the path, the scan is preferred over a reduction);
* ``walk``: build_tree's parent walk: the load bytes closest to one parent;
* ``mma``: tree attention's key-tile loop: the most matrix FLOPs, then the
  fewest instructions (the prefix loop, which reads no mask words); the CUDA
  kernel read is the instantiation for aligned heads, whose copies are all
  16-byte cp.async (the element-wise one is for unaligned views).

The chosen loop (head and back-edge addresses) and the other loops the
selector could take are printed, to be checked against ``cuobjdump -sass``.

The model (per target, per backend)
-----------------------------------
prediction = max(issue time, memory time, latency floor), each per the busiest
SM (``m = ceil(programs / 132)`` programs of the grid):

* issue: ``m x iterations x warps x`` the loop's busiest resource per iteration:
  dispatch (4 warp-instructions per cycle per SM), each execution pipe at its
  rate (``PIPES``), shared-memory bytes (128 B per cycle) and the tensor cores
  (FLOPs at the measured rate);
* memory: the bytes the target must read (each row once) over the measured
  copy bandwidth;
* latency floor: ``launches x LAUNCH`` + ``round trips x L2`` (the dependent
  global steps of the kernel's design: arrival counters, waits, gathers, read
  from the kernel docstrings and listed per target) + ``ceil(m / resident) x
  iterations x`` one iteration's latency. That latency is a one-warp
  simulation of the path over two iterations: the compiler's stall counts plus,
  where an instruction waits on a scoreboard, the latency of what set it
  (``LATENCY_CYCLES``; a load of the streamed rows costs DRAM latency unless
  it was issued early enough). A loop that never stalls on its own loads
  pays one DRAM latency for its first load, issued before the loop.

Code outside the hot loop is counted only through its round trips (the
Philox calls, the finishing program's scans are not), issue and memory are
assumed to overlap fully, and L2 hits are not modelled beyond the latency
table: the model is a floor-style estimate, not a simulator.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the bench scripts import one another by plain name
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_loops as sass  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------
# Constants of the machine. Measured ones come from /work/.library/device/KINDS.md
# (an H200 of this workplace, 2026-10-28 and 2026-11-04); the rest are leads.
SMS = 132  # KINDS.md: PyTorch reported 132 multiprocessors (also the launchers' H200_MULTIPROCESSORS)
CLOCK_HZ = 1.98e9  # KINDS.md: nvidia-smi read SM 1980 MHz just after the matrix products (boost clock)
COPY_BYTES_PER_S = 4.3e12  # KINDS.md: device-to-device copy, bytes read + written (datasheet: 4.8e12)
TENSOR_FLOPS = {  # dense bf16 matrix rate
    "HGMMA": 788e12,  # KINDS.md: 8192^3 bf16 matmul through PyTorch, random data (datasheet: ~990e12)
    # mma.sync on sm_90: not Hopper's full-rate path (HOPPER.md); assumed 2/3 of the wgmma rate (a lead:
    # published Hopper microbenchmarks put mma.sync at roughly 60-70% of wgmma).
    "HMMA": 788e12 * 2 / 3,
}
DISPATCH_PER_SM = 4.0  # warp-instructions per cycle per SM: one per scheduler, four schedulers
# Execution pipes, warp-instructions per cycle per SM: the CUDA C++ Programming Guide's arithmetic throughput
# table for compute capability 9.0 (results per cycle per SM / 32 lanes). Opcodes not listed count only
# against dispatch.
PIPES = {
    "fp32": (4.0, {"FFMA", "FADD", "FMUL", "HFMA2", "HADD2", "HMUL2"}),  # 128 / cycle
    "int": (2.0, {"IADD3", "IADD", "LOP3", "LOP", "ISETP", "SHF", "SHL", "SHR", "SEL", "LEA", "IMNMX", "VIMNMX",
                  "IABS", "PRMT", "FSETP", "FSEL", "FMNMX", "PLOP3", "BMSK", "SGXT", "MOV", "VIADD"}),  # 64
    "imad": (2.0, {"IMAD", "IMUL"}),  # 64 / cycle, on the FMA-heavy pipe
    "fp64": (2.0, {"DADD", "DMUL", "DFMA", "DSETP", "DMNMX"}),  # 64 / cycle
    "xu": (0.5, {"MUFU", "F2I", "I2F", "F2F", "I2I", "FRND", "POPC", "FLO", "BREV"}),  # 16 / cycle
    "shfl": (1.0, {"SHFL"}),  # 32 / cycle
}
SHARED_BYTES_PER_CYCLE = 128  # 32 banks x 4 bytes per cycle per SM (no bank conflicts assumed)
LAUNCH_S = 1.5e-6  # per kernel in a replayed graph of back-to-back kernels (bench/harness.py time_graph): a lead
# Latencies in cycles at CLOCK_HZ. Leads from published Hopper pointer-chase microbenchmarks (Luo et al.,
# arXiv:2402.13499: L1 ~40, L2 ~260, shared ~30 cycles); DRAM is an assumed latency under streaming load
# (~500 ns, about twice the idle pointer-chase latency).
LATENCY_CYCLES = {"l1": 40, "l2": 260, "dram": 500e-9 * CLOCK_HZ, "shared": 30, "other": 20, "barrier": 20}
REGISTERS_PER_SM, SHARED_PER_SM, MAX_WARPS_PER_SM, MAX_CTAS_PER_SM = 65536, 228 * 1024, 64, 32
SHARED_RESERVED_PER_CTA = 1024  # the driver reserves 1 KB of shared memory per CTA (sm_80+)

# ---------------------------------------------------------------------------
# Issue cost of one iteration on an H200 SM.


def pipe_of(instruction: sass.Instruction) -> str | None:
    return next((pipe for pipe, (_, opcodes) in PIPES.items() if instruction.base in opcodes), None)


def issue_cycles_per_warp(path: list[sass.Instruction]) -> tuple[float, str]:
    """``(cycles, resource)``: the busiest of dispatch, the pipes and shared-memory bandwidth, per warp of one
    iteration (a CTA of ``w`` warps costs ``w`` times as much of its SM)."""
    pipes = collections.Counter(pipe_of(ins) for ins in path)
    resources = {"dispatch": len(path) / DISPATCH_PER_SM,
                 "shared memory": sum(map(sass.shared_bytes, path)) * 32 / SHARED_BYTES_PER_CYCLE}
    resources.update({f"{pipe} pipe": pipes[pipe] / rate for pipe, (rate, _) in PIPES.items()})
    bound_by = max(resources, key=resources.get)
    return resources[bound_by], bound_by


# ---------------------------------------------------------------------------
# Getting the kernels: Triton through kernels/aot.py, CUDA from the extension.


def _aot():
    try:
        from specdec_kernels._kernels import aot
    except ImportError:  # a checkout without the editable install
        sys.path.insert(0, str(REPO_ROOT))
        from kernels import aot
    return aot


# aot.py's shape lists and variant builders per kernel family; a builder reads its lists when called.
_FAMILIES = {
    "chain_verify": (("CHAIN_VERIFY_SHAPES", "CHAIN_VERIFY_SAMPLING_SHAPES"), "chain_verify_variants"),
    "tree_verify": (("TREE_VERIFY_SHAPES", "TREE_VERIFY_SAMPLING_SHAPES"), "tree_verify_variants"),
    "build_tree": (("BUILD_TREE_SHAPES",), "build_tree_variants"),
    "tree_attention": (("TREE_ATTENTION_SHAPES",), "tree_attention_variants"),
}


def triton_function(family: str, shape: tuple, workdir: str) -> tuple[str, sass.Function]:
    """``(variant name, Function)``: aot.py's first variant for ``shape`` (its own shape-tuple format),
    compiled for sm_90a as aot.py compiles it."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter replaces compilation")
    import triton
    from triton.backends.compiler import GPUTarget

    aot = _aot()
    lists, builder = _FAMILIES[family]
    saved = {name: getattr(aot, name) for name in lists}
    try:
        for name in lists:
            setattr(aot, name, (shape,) if name == lists[0] else ())
        name, kernel, signature, constexprs, options, attrs = getattr(aot, builder)()[0]
    finally:
        for key, value in saved.items():
            setattr(aot, key, value)
    capability = aot.TARGETS[0][0]  # 90: sm_90a
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    if callable(options):  # aot.py's per-target options (tree_attention_variants)
        options = options(capability)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    path = os.path.join(workdir, re.sub(r"\W+", "_", name) + ".cubin")
    with open(path, "wb") as handle:
        handle.write(compiled.asm["cubin"])
    (function,) = sass.disassemble(path).values()
    function.shared_bytes = max(function.shared_bytes, compiled.metadata.shared)
    function.threads = function.threads or compiled.metadata.num_warps * 32
    return name, function


def extension_path() -> Path | None:
    """The built extension next to the package, if any."""
    try:
        import specdec_kernels
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        import specdec_kernels
    return next(iter(sorted(Path(specdec_kernels.__file__).parent.glob("_C*.so"))), None)


def cuda_function(extension: Path, source: str, mangled_part: str, workdir: str) -> sass.Function:
    """The sm_90a SASS of the kernel of ``csrc/<source>.cu`` whose mangled name contains ``mangled_part``."""
    cubin = f"{source}.sm_90a.cubin"
    if not os.path.exists(os.path.join(workdir, cubin)):
        sass.run_cuobjdump("-xelf", cubin, str(extension.resolve()), cwd=workdir)
    path = os.path.join(workdir, cubin)
    names = [name for name in sass.resource_usage(path) if mangled_part in name]
    if len(names) != 1:
        raise RuntimeError(f"{cubin}: {len(names)} kernels match {mangled_part!r}: {names}")
    return sass.disassemble(path, names[0])[names[0]]


# ---------------------------------------------------------------------------
# Targets: the scenario of each (shapes, grid, the bytes that must be read, the design's round trips).


@dataclasses.dataclass
class Case:
    target: str  # the issue's target row
    scenario: str
    backend: str  # "triton" or "cuda"
    kernel: str  # variant name or demangled CUDA kernel
    function: sass.Function
    selector: str
    programs: int  # CTAs in the grid
    iterations: int  # hot-loop iterations of the busiest program
    elements_per_iteration: float  # vocabulary elements (verifiers), KV elements (attention), steps (walk)
    element: str  # what an element is
    required_bytes: float  # each input the target must read, once
    # The design's dependent global steps outside the hot loop, one L2 round trip each: (how many, what).
    round_trips: list[tuple[int, str]]
    stream_latency: str  # latency of the hot loop's plain loads: "dram", "l2" or "l1"
    # Global-load bytes per thread that one iteration of the scenario reads; None: the most (attention: the
    # 16-byte cp.async path, not the element-wise fallback for unaligned caches, which loads fewer per iteration).
    expected_bytes: float | None
    launches: int = 1
    nested_trips: int = 0  # iterations of each loop nested in the hot loop, per hot-loop iteration
    # The loads that stream the rows or tiles (at stream_latency); other plain loads (block tables) are L2 hits.
    stream_bases: tuple = ("LDG", "LD", "LDGSTS")
    flops: float = 0.0  # attention: the useful matrix FLOPs
    goal: str = ""
    meets: object = None  # prediction dict -> bool


def resident_ctas(function: sass.Function) -> int:
    """CTAs per SM by registers (allocated per warp in 256-register units), shared memory, warps and CTAs."""
    warps = max(1, function.threads // 32)
    by_registers = (REGISTERS_PER_SM // (math.ceil(max(function.registers, 1) / 8) * 8 * 32)) // warps
    by_shared = SHARED_PER_SM // (function.shared_bytes + SHARED_RESERVED_PER_CTA)
    return max(1, min(by_registers, by_shared, MAX_WARPS_PER_SM // warps, MAX_CTAS_PER_SM))


def predict(case: Case, stats: sass.LoopStats) -> dict:
    warps = max(1, case.function.threads // 32)
    per_sm = math.ceil(case.programs / SMS)
    resident = min(resident_ctas(case.function), per_sm)
    iterations = per_sm * case.iterations  # CTA-iterations on the busiest SM
    per_warp, resource = issue_cycles_per_warp(stats.path)
    issue_cycles = iterations * warps * per_warp
    bound = f"issue ({resource})"
    if stats.mma_flops_per_warp:
        rate_per_cycle = TENSOR_FLOPS[stats.mma_kind] / (SMS * CLOCK_HZ)
        tensor_cycles = iterations * warps * stats.mma_flops_per_warp / rate_per_cycle
        if tensor_cycles > issue_cycles:
            issue_cycles, bound = tensor_cycles, f"tensor ({stats.mma_kind})"
    issue_s = issue_cycles / CLOCK_HZ
    memory_s = case.required_bytes / COPY_BYTES_PER_S
    latency = {**LATENCY_CYCLES, "stream": LATENCY_CYCLES[case.stream_latency]}
    loop_cycles, waits_on_own_loads = sass.iteration_latency(stats.path, latency, case.stream_bases)
    first_load = 0.0 if waits_on_own_loads else LATENCY_CYCLES[case.stream_latency]
    serial_cycles = first_load + math.ceil(per_sm / resident) * case.iterations * loop_cycles
    launch_s = case.launches * LAUNCH_S
    trips = sum(count for count, _ in case.round_trips)
    round_trips_s = trips * LATENCY_CYCLES["l2"] / CLOCK_HZ
    floor_s = launch_s + round_trips_s + serial_cycles / CLOCK_HZ
    terms = {bound: issue_s, "memory": memory_s, "latency": floor_s}
    limit = max(terms, key=terms.get)
    predicted = terms[limit]
    return {
        "warp_instructions_per_element": stats.instructions * warps / case.elements_per_iteration,
        "load_bytes_per_element": stats.load_bytes * case.function.threads / case.elements_per_iteration,
        "issue_us": issue_s * 1e6, "memory_us": memory_s * 1e6, "latency_floor_us": floor_s * 1e6,
        "floor_launch_us": launch_s * 1e6, "floor_round_trips_us": round_trips_s * 1e6,
        "floor_loop_us": serial_cycles / CLOCK_HZ * 1e6,
        "predicted_us": predicted * 1e6, "bound": limit, "programs": case.programs, "programs_per_sm": per_sm,
        "resident_ctas_per_sm": resident, "iterations_per_program": case.iterations,
        "iteration_latency_cycles": loop_cycles, "loads_hidden": not waits_on_own_loads,
        "round_trips": trips,
        "bandwidth_share": case.required_bytes / predicted / COPY_BYTES_PER_S,
        "tensor_share": case.flops / predicted / TENSOR_FLOPS["HGMMA"] if case.flops else None,
    }


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


CHAIN_TRIPS = [(1, "num_draft_tokens, temperature, seed"), (1, "draft ids (they need the count)"),
               (1, "gathers p(t_i), q(t_i) (they need the ids)"),
               (1, "chunk results stored, then the arrival counter (acq_rel)"),
               (1, "last program: every chunk total"), (1, "last program: the chosen chunk's candidate")]
# A request split over several programs claims its words for the launch first (kernels/stage_records.py, claim).
CLAIM_TRIPS = [(1, "claim: the claim word (acquire)"), (1, "claim: the claimer's compare-and-swap"),
               (1, "claim: the claimer's resets released, seen by the others (acquire)")]


def chain_trips(splits: int) -> list[tuple[int, str]]:
    return CLAIM_TRIPS + CHAIN_TRIPS if splits > 1 else CHAIN_TRIPS
TREE_DEPTH = 6  # accepted levels without rejections: an EAGLE-style 64-node tree (assumed)


def tree_trips(depth: int) -> list[tuple[int, str]]:
    """The split plan's: a request's programs claim its records first."""
    return CLAIM_TRIPS + [
        (1, "num_nodes, temperature, seed"), (depth, "accepted levels: the next child (parents and ids tile)"),
        (depth, "accepted levels: the child's gathers p(t), q(t)"), (1, "leaf: its child search finds none"),
        (1, "take a slice of the sample stage (atomic)"), (1, "publish the slice (release)"),
        (1, "wait until every slice is published (acquire)"), (1, "first program: every chunk total"),
        (1, "first program: the chosen candidate"), (1, "end-of-call counter (atomic)")]


def chain_cases(batch: int, dtype: str, target: str, goal: str, meets, workdir: str, extension) -> list[Case]:
    """One rejection per request (the stop row and its draft row read: the residual), probabilities, int64 ids."""
    from specdec_kernels.launchers.chain_verify import CHUNK_SIZE, launch_config

    drafts, vocab, size = 4, 128256, {"fp32": 4, "bf16": 2}[dtype]
    config = launch_config(batch, drafts + 1, vocab, SMS)
    required = batch * (2 * vocab * size + drafts * (8 + 2 * size))  # two rows + ids and gathers
    scenario = f"B={batch}, K={drafts}, V={vocab}, {dtype} probabilities with a draft, one rejection per request"
    cases = []
    name, function = triton_function("chain_verify", (batch, drafts, vocab, dtype, True, False, False, False),
                                     workdir)
    rows_bytes = 2 * config.rows * CHUNK_SIZE * size  # the stop row and its draft row, one chunk of each
    cases.append(Case(target, scenario, "triton", name, function, "sampler",
                      _cdiv(batch, config.rows) * config.num_splits, config.chunks_per_split,
                      config.rows * CHUNK_SIZE, "vocabulary element", required, chain_trips(config.num_splits), "dram",
                      rows_bytes / function.threads, goal=goal, meets=meets))
    if extension:
        # csrc/chain_verify.cu (plan_chain_verify): about 2 blocks per SM, one request per block, whole chunks.
        chunks = _cdiv(vocab, CHUNK_SIZE)
        splits = min(_cdiv(2 * SMS, batch), chunks)
        per_split = _cdiv(chunks, splits)
        prob = {"fp32": "f", "bf16": "NS_8BFloat16E"}[dtype]
        function = cuda_function(extension, "chain_verify", f"chain_verify_kernelI{prob}lLb0E", workdir)
        cases.append(Case(target, scenario, "cuda", sass.demangle(function.name), function, "sampler",
                          batch * _cdiv(chunks, per_split), per_split, CHUNK_SIZE, "vocabulary element", required,
                          chain_trips(splits), "dram", 2 * CHUNK_SIZE * size / function.threads, goal=goal,
                          meets=meets))
    return cases


def tree_cases(workdir: str, extension) -> list[Case]:
    from specdec_kernels.launchers.chain_verify import CHUNK_SIZE
    from specdec_kernels.launchers.tree_verify import launch_config, vocabulary_splits

    batch, nodes, vocab = 8, 64, 128256
    target = "tree_verify B=8, N=64, V=128256"
    scenario = (f"B={batch}, N={nodes}, V={vocab}, fp32 probabilities with a draft (without replacement), "
                f"no rejections, {TREE_DEPTH} accepted levels; the final sample reads the last node's p row")
    required = batch * (vocab * 4 + TREE_DEPTH * (2 * 4 + 8) + nodes * 12)
    meets = lambda p: p["predicted_us"] <= 10  # noqa: E731
    config = launch_config(batch, nodes, vocab, multiprocessors=SMS)
    name, function = triton_function(
        "tree_verify", (batch, nodes, vocab, "fp32", True, "without_replacement", False, False), workdir)
    trips = tree_trips(TREE_DEPTH)
    cases = [Case(target, scenario, "triton", name, function, "sampler", batch * config.num_splits,
                  config.chunks_per_split, config.rows * CHUNK_SIZE, "vocabulary element", required, trips, "dram",
                  config.rows * CHUNK_SIZE * 4 / function.threads, goal="<= 10 us", meets=meets)]
    if extension:
        splits, per_split = vocabulary_splits(batch, vocab, SMS, nodes)  # the CUDA launcher's split too
        function = cuda_function(extension, "tree_verify", "tree_verify_kernelIflLb1E", workdir)
        cases.append(Case(target, scenario, "cuda", sass.demangle(function.name), function, "sampler", batch * splits,
                          per_split, CHUNK_SIZE, "vocabulary element", required, trips, "dram",
                          CHUNK_SIZE * 4 / function.threads, goal="<= 10 us", meets=meets))
    return cases


def build_tree_cases(workdir: str, extension, depths=(6, 63)) -> list[Case]:
    from specdec_kernels.launchers.build_tree import launch_config

    batch, nodes = 64, 64
    config = launch_config(nodes)
    meets = lambda p: p["predicted_us"] <= 5  # noqa: E731
    name, function = triton_function("build_tree", (nodes, "i32", "i64"), workdir)
    cuda = cuda_function(extension, "build_tree", "build_tree_kernel", workdir) if extension else None
    cases = []
    for depth in depths:
        scenario = (f"B={batch}, N={nodes}, int32 parents, deepest node at depth {depth}"
                    f"{' (a chain)' if depth == nodes - 1 else ' (an EAGLE-style tree)'}")
        required = batch * nodes * (4 + 4 * _cdiv(nodes, 32) + 4 + 8)  # parents; mask, depth, positions written
        trips = [(1, "num_nodes, prefix_lens"), (1, "first parent load (cold: L2)")]
        # The walk's later parent loads hit L1: the request's parents row is 256 bytes.
        # Each step loads one int32 parent per node: 4 bytes a thread.
        cases.append(Case("build_tree B=64", scenario, "triton", name, function, "walk",
                          batch * config.node_blocks, depth, config.block_nodes, "node step", required, trips, "l1",
                          4, goal="<= 5 us", meets=meets))
        if cuda:
            cases.append(Case("build_tree B=64", scenario, "cuda", sass.demangle(cuda.name), cuda, "walk",
                              _cdiv(batch * nodes, cuda.threads), depth, cuda.threads, "node step", required, trips,
                              "l1", 4, goal="<= 5 us", meets=meets))
    return cases


def attention_cases(workdir: str, extension, batches=(1, 8)) -> list[Case]:
    from specdec_kernels.launchers.tree_attention import launch_config

    nodes, q_heads, kv_heads, dim, context, block_size = 64, 32, 8, 128, 8192, 16
    group = q_heads // kv_heads
    meets = lambda p: p["tensor_share"] >= 0.60  # noqa: E731
    cases = []
    for batch in batches:
        scenario = (f"B={batch}, ctx {context}, N={nodes}, Hq={q_heads}, Hkv={kv_heads}, D={dim}, bf16, "
                    f"block size {block_size}")
        flops = 4.0 * batch * nodes * q_heads * context * dim  # Q K^T and P V over the prefix
        required = batch * kv_heads * (context + nodes) * dim * 2 * 2  # K and V once (row tiles share via L2)
        trips = [(1, "prefix_lens, num_nodes, block table"), (1, "first K/V tile")]
        config = launch_config(batch, nodes, group, kv_heads, dim, context, SMS)
        name, function = triton_function(
            "tree_attention", (batch, nodes, q_heads, kv_heads, dim, "bf16", block_size, context), workdir)
        keys = _cdiv(_cdiv(context, config.num_splits), config.block_n) + _cdiv(nodes, config.block_n)
        launches = 2 if config.num_splits > 1 else 1  # the merge launch
        cases.append(Case("tree_attention ctx 8k, N=64, 32:8, D=128, bf16", scenario, "triton", name, function,
                          "mma", batch * kv_heads * config.row_tiles * config.num_splits, keys,
                          config.block_n * dim * 2, "KV element", required,
                          trips + [(1, "merge launch: partial states")] * (launches - 1), "dram", None,
                          launches=launches, stream_bases=("LDGSTS",),
                          flops=flops, goal=">= 60% of 788 TFLOP/s", meets=meets))
        if extension:
            # Lb1E: the instantiation that copies Q, K and V 16 bytes at a time (contiguous, aligned heads).
            cuda = cuda_function(extension, "tree_attention", "tree_attention_mma_kernelINS_8BFloat16ELi128ELb1E",
                                 workdir)
            # csrc/tree_attention.cu: 16 rows per warp, ~2 blocks per SM, splits of at least 512 keys, at most 64.
            rows = cuda.threads // 32 * 16
            row_tiles = _cdiv(nodes * group, rows)
            splits = max(1, min(_cdiv(2 * SMS, batch * kv_heads * row_tiles), _cdiv(context, 512), 64))
            # The key-tile loop holds no nested loop: a thread's copies of a tile (2 of K and 2 of V at
            # D = 128) have a constant count and are unrolled.
            stats, _ = sass.hot_loop(cuda, "mma", None)
            key_tile = stats.mma_flops_per_warp * cuda.threads // 32 / (4 * rows * dim)  # keys per iteration
            keys = _cdiv(_cdiv(context, splits), int(key_tile)) + _cdiv(nodes, int(key_tile))
            launches = 2 if splits > 1 else 1
            cases.append(Case("tree_attention ctx 8k, N=64, 32:8, D=128, bf16", scenario, "cuda",
                              sass.demangle(cuda.name), cuda, "mma", batch * kv_heads * row_tiles * splits, keys,
                              key_tile * dim * 2,
                              "KV element", required, trips + [(1, "merge launch: partial states")] * (launches - 1),
                              "dram",
                              None, launches=launches, stream_bases=("LDGSTS",),
                              flops=flops, goal=">= 60% of 788 TFLOP/s", meets=meets))
    return cases


def all_cases(workdir: str, extension) -> list[Case]:
    b1 = lambda p: p["predicted_us"] <= 6  # noqa: E731
    wide = lambda p: p["bandwidth_share"] >= 0.75  # noqa: E731
    return (chain_cases(1, "fp32", "chain_verify B=1, K=4, V=128256, graph replay", "<= 6 us", b1, workdir,
                        extension)
            + chain_cases(64, "bf16", "chain_verify B >= 64", ">= 75% of copy bandwidth", wide, workdir, extension)
            + chain_cases(512, "bf16", "chain_verify B >= 64", ">= 75% of copy bandwidth", wide, workdir, extension)
            + tree_cases(workdir, extension) + build_tree_cases(workdir, extension)
            + attention_cases(workdir, extension))


# ---------------------------------------------------------------------------
# Report.


def row_of(case: Case) -> dict:
    stats, every = sass.hot_loop(case.function, case.selector, case.expected_bytes, case.nested_trips)
    prediction = predict(case, stats)
    keep_loads = lambda op: op.split(".")[0] in ("LDG", "LD", "LDGSTS", "LDL", "STL")  # noqa: E731
    keep_shared = lambda op: op.split(".")[0] in ("LDS", "STS", "LDSM", "ATOMS")  # noqa: E731
    keep_atomics = lambda op: op.split(".")[0] in ("ATOM", "ATOMG", "RED", "REDG", "ATOMS")  # noqa: E731
    mma = stats.histogram(lambda op: op.startswith(("HMMA", "HGMMA")))
    return {
        "target": case.target, "goal": case.goal, "scenario": case.scenario, "backend": case.backend,
        "kernel": case.kernel, "registers": case.function.registers, "threads": case.function.threads,
        "hot_loop": f"{stats.loop.head_address:#x}-{stats.loop.latch_address:#x}",
        "path_instructions": stats.instructions,
        "body_instructions": stats.body_instructions, "loops_in_kernel": len(every), "element": case.element,
        "loads": stats.histogram(keep_loads), "shared": stats.histogram(keep_shared),
        "widest_load_bytes": max(map(sass.global_load_bytes, stats.path), default=0),
        "loop_atomics": stats.histogram(keep_atomics), "kernel_atomics": sass.kernel_atomics(case.function),
        "mma": mma, "mma_flops_per_iteration": stats.mma_flops_per_warp * case.function.threads // 32,
        "candidate_loops": [f"{s.loop.head_address:#x}-{s.loop.latch_address:#x} ({s.instructions} instructions, "
                            f"{s.load_bytes} B loaded a thread)" for s in every
                            if sass.SELECTORS[case.selector](s, case.expected_bytes)[0]],
        "round_trip_steps": case.round_trips, "required_bytes": case.required_bytes, "flops": case.flops,
        **prediction, "meets_goal": bool(case.meets(prediction)),
    }


def _us(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def provenance() -> str:
    """The last commit of the kernel sources (``kernels/``, ``csrc/``) and the Triton version the SASS came from."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(REPO_ROOT), *args], text=True, capture_output=True).stdout.strip()
        except OSError:
            return ""

    commit = git("log", "-1", "--format=%h", "--", "kernels", "csrc") or "unknown"
    if git("status", "--porcelain", "--", "kernels", "csrc"):
        commit += " with uncommitted changes"
    try:
        import triton
        version = triton.__version__
    except ImportError:
        version = "none"
    return f"kernels/ and csrc/ at commit {commit}, Triton {version}"


def markdown(rows: list[dict], source: str) -> str:
    lines = ["# Static performance model: predicted from SASS, not measured", "",
             f"Generated by `python bench/sass_model.py` ({source}; its docstring has the method). Every number "
             "is read from the sm_90a SASS of the kernels and the constants below; nothing here ran on a GPU.",
             "", "## Summary", "", "| target | goal | scenario | Triton | CUDA |", "|---|---|---|---|---|"]
    scenarios = list(dict.fromkeys((row["target"], row["scenario"]) for row in rows))
    for target, scenario in scenarios:
        cells = {row["backend"]: row for row in rows if (row["target"], row["scenario"]) == (target, scenario)}
        goal = next(iter(cells.values()))["goal"]

        def cell(backend: str) -> str:
            row = cells.get(backend)
            if row is None:
                return "not built"
            share = (f", {row['tensor_share']:.0%} of tensor rate" if row["tensor_share"] is not None
                     else f", {row['bandwidth_share']:.0%} of copy BW" if "bandwidth" in goal else "")
            verdict = "meets" if row["meets_goal"] else "misses"
            return f"{_us(row['predicted_us'])} us{share} ({row['bound']}): {verdict}"

        lines.append(f"| {target} | {goal} | {scenario} | {cell('triton')} | {cell('cuda')} |")
    lines += ["", "## Constants", "",
              f"- SMs: {SMS}; clock {CLOCK_HZ / 1e9:.2f} GHz (KINDS.md: nvidia-smi after matrix products).",
              f"- Memory: {COPY_BYTES_PER_S / 1e12:.1f} TB/s measured device-to-device copy (KINDS.md; datasheet 4.8).",
              f"- Tensor: HGMMA {TENSOR_FLOPS['HGMMA'] / 1e12:.0f} TFLOP/s measured bf16 matmul (KINDS.md; "
              f"datasheet ~990); HMMA (mma.sync) {TENSOR_FLOPS['HMMA'] / 1e12:.0f} TFLOP/s, assumed 2/3 of it (lead).",
              f"- Issue: {DISPATCH_PER_SM:.0f} warp-instructions per cycle per SM; pipes (warp-instructions per "
              "cycle per SM, CUDA C++ Programming Guide throughput table, cc 9.0): "
              + ", ".join(f"{pipe} {rate:g}" for pipe, (rate, _) in PIPES.items())
              + f"; shared memory {SHARED_BYTES_PER_CYCLE} B per cycle.",
              f"- Latency floor: {LAUNCH_S * 1e6:.1f} us per launch (lead: a kernel in a replayed graph), "
              f"{LATENCY_CYCLES['l2']} cycles per L2 round trip, L1 {LATENCY_CYCLES['l1']}, shared "
              f"{LATENCY_CYCLES['shared']}, other scoreboards {LATENCY_CYCLES['other']}, barrier "
              f"{LATENCY_CYCLES['barrier']} (leads: Luo et al., arXiv:2402.13499), DRAM "
              f"{LATENCY_CYCLES['dram'] / CLOCK_HZ * 1e9:.0f} ns under load (assumed).",
              f"- Tree walk depth without rejections: {TREE_DEPTH} levels (assumed, EAGLE-style tree).", "",
              "## How to read a table", "",
              "- prediction = max(issue, memory, latency floor), per the busiest SM; the largest term names the bound.",
              "- The hot loop is given as `head-back edge` addresses of the sm_90a SASS (`cuobjdump -sass`); "
              "`path` counts one iteration along the streaming fast path (the load bytes closest to what the "
              "scenario reads, then the fewest instructions), `static body` every instruction of the loop (nested "
              "loops excluded).",
              "- Per element: warp-instructions and global-load bytes of one iteration over the elements it "
              "covers (a 1024-token chunk for the verifiers, K and V elements of a key tile for attention, one "
              "step of the program's nodes for build_tree). A predicated-off load still counts.",
              "- Latency floor = launches x launch + round trips x L2 + ceil(CTAs per SM / resident) x iterations x "
              "one iteration of a lone warp (simulated from the SASS stall counts and scoreboard waits), plus one "
              "DRAM latency for the first load when the loop never stalls on its own loads (they were issued a "
              "chunk ahead).",
              "- Not counted: code outside the hot loop except its round trips, L2 hits of the streamed rows, "
              "imbalance between programs, contention between resident CTAs beyond the issue term.", ""]
    for target, scenario in scenarios:
        lines += [f"## {target}: {scenario}", "",
                  "| | " + " | ".join(row["backend"] for row in rows if (row["target"], row["scenario"]) ==
                                      (target, scenario)) + " |",
                  "|---|" + "---|" * sum((row["target"], row["scenario"]) == (target, scenario) for row in rows)]
        group = [row for row in rows if (row["target"], row["scenario"]) == (target, scenario)]
        fields = [
            ("kernel + variant", lambda r: f"`{r['kernel']}` ({r['registers']} registers, {r['threads']} threads)"),
            ("hot loop: head-back edge (instructions: path / static body)",
             lambda r: f"{r['hot_loop']} ({r['path_instructions']} / {r['body_instructions']}; "
                       f"{r['loops_in_kernel']} loops in kernel)"),
            ("warp-instructions per element", lambda r: f"{r['warp_instructions_per_element']:.3g} per {r['element']}"),
            ("global-load bytes per element", lambda r: f"{r['load_bytes_per_element']:.3g}"),
            ("loads per iteration (per thread; most common first)",
             lambda r: f"{r['loads']} (widest {r['widest_load_bytes']} B)" if r["widest_load_bytes"] else "-"),
            ("shared-memory ops per iteration", lambda r: r["shared"]),
            ("matrix instructions per iteration",
             lambda r: f"{r['mma']} ({r['mma_flops_per_iteration'] / 1e6:.3g} MFLOP per CTA-iteration, "
                       f"{r['path_instructions'] * r['threads'] / 32 / (r['mma_flops_per_iteration'] / 1e3):.3g} "
                       "warp-instructions per kFLOP)" if r["mma_flops_per_iteration"] else "-"),
            ("atomics in the loop / kernel", lambda r: f"{r['loop_atomics']} / {r['kernel_atomics']}"),
            ("grid", lambda r: f"{r['programs']} CTAs ({r['programs_per_sm']} per SM, {r['resident_ctas_per_sm']} "
                               f"resident), {r['iterations_per_program']} hot-loop iteration(s) each"),
            ("one iteration, lone warp",
             lambda r: f"{r['iteration_latency_cycles']:.0f} cycles"
                       + (" (its loads arrive before use)" if r["loads_hidden"] else " (stalls on its own loads)")),
            ("predicted issue time", lambda r: f"{_us(r['issue_us'])} us"),
            ("predicted memory time", lambda r: f"{_us(r['memory_us'])} us ({r['required_bytes'] / 1e6:.3g} MB)"),
            ("latency floor", lambda r: f"{_us(r['latency_floor_us'])} us = {_us(r['floor_launch_us'])} launch + "
                                        f"{_us(r['floor_round_trips_us'])} ({r['round_trips']} round trips) + "
                                        f"{_us(r['floor_loop_us'])} hot loop"),
            ("prediction", lambda r: f"**{_us(r['predicted_us'])} us** ({r['bound']})"
                                     + (f", {r['tensor_share']:.0%} of tensor rate" if r["tensor_share"] is not None
                                        else f", {r['bandwidth_share']:.0%} of copy BW")),
            ("target", lambda r: r["goal"]),
            ("predicted verdict", lambda r: "meets" if r["meets_goal"] else "**misses**"),
        ]
        for label, show in fields:
            lines.append(f"| {label} | " + " | ".join(str(show(row)).replace("|", "/") for row in group) + " |")
        lines += ["", "Round trips: " + "; ".join(what if count == 1 else f"{count} x {what}"
                                                  for count, what in group[0]["round_trip_steps"]) + ".", ""]
    return "\n".join(lines) + "\n"


def constants() -> dict:
    return {"sms": SMS, "clock_hz": CLOCK_HZ, "copy_bytes_per_s": COPY_BYTES_PER_S, "tensor_flops": TENSOR_FLOPS,
            "dispatch_per_sm": DISPATCH_PER_SM, "pipes": {pipe: rate for pipe, (rate, _) in PIPES.items()},
            "shared_bytes_per_cycle": SHARED_BYTES_PER_CYCLE, "launch_s": LAUNCH_S,
            "latency_cycles": LATENCY_CYCLES, "tree_depth": TREE_DEPTH}


def quick_check(workdir: str) -> dict:
    """build_tree only (Triton, and CUDA when the extension is built): the test's check."""
    extension = extension_path()
    cases = build_tree_cases(workdir, extension, depths=(6,))
    out = {}
    for case in cases:
        stats, every = sass.hot_loop(case.function, case.selector, case.expected_bytes, case.nested_trips)
        out[case.backend] = {"loops": len(every), "hot_loop": [stats.loop.head_address, stats.loop.latch_address],
                             "loads": {op: n for op, n in stats.counts.items()
                                       if op.split(".")[0] in ("LDG", "LD", "LDGSTS")},
                             "load_bytes": stats.load_bytes, "path_instructions": stats.instructions,
                             "prediction": predict(case, stats)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="markdown report (the .json goes beside it)")
    parser.add_argument("--quick", action="store_true", help="build_tree only; print JSON (the test's check)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        if args.quick:
            print(json.dumps(quick_check(workdir)))
            return 0
        extension = extension_path()
        if extension is None:
            print("no built extension (specdec_kernels/_C*.so): CUDA rows left out", file=sys.stderr)
        rows = []
        for case in all_cases(workdir, extension):
            row = row_of(case)
            rows.append(row)
            print(f"{row['backend']:<6} {row['target']} | {row['scenario']}\n       {row['kernel']}: hot loop "
                  f"{row['hot_loop']} ({row['path_instructions']} of {row['body_instructions']} instructions), "
                  f"{_us(row['predicted_us'])} us ({row['bound']})\n       loops the {case.selector!r} selector "
                  f"could take: {'; '.join(row['candidate_loops'])}", flush=True)
    source = provenance()
    report = markdown(rows, source)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
        args.out.with_suffix(".json").write_text(
            json.dumps({"source": source, "constants": constants(), "rows": rows}, indent=1) + "\n")
    else:
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
