"""Reading SASS: ``cuobjdump`` output parsed, loops found, one iteration of a loop measured.

The machine-independent half of the static model (``bench/sass_model.py`` holds the H200's constants and the
targets). Used on sm_90a code; the encodings read here (control bits, load widths, matrix shapes) are Volta's
and later.

* Loops are natural loops of the control-flow graph: basic blocks split at branch targets and after branches,
  an edge to a block that dominates its source closes a loop, whose body is every block that reaches the edge
  without passing the head (so a loop whose blocks the compiler placed far apart, such as a spin-wait with its
  poll out of line, is one loop). Loops inside a loop are nested.
* One iteration is measured along one path from the head back to it (:func:`iteration_path`): the path whose
  global-load bytes per thread are the closest to what the scenario reads (the most, when not given), then the
  best by a per-selector weight (the fewest instructions last). That is the streaming fast path: it keeps every
  load of the rows the scenario reads and leaves out branches it does not take (the logits or truncation code
  compiled into a CUDA loop, the scalar tail beside a vector load, a draft row read only after a rejection).
  ``CALL`` counts as one instruction (the callee is an out-of-line slow path).
* A selector picks the hot loop among the loops (:data:`SELECTORS`).
* :func:`iteration_latency` simulates one warp issuing the path twice, from the compiler's stall counts and
  scoreboard waits.
"""

import collections
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path


def cuobjdump() -> str:
    """Triton's cuobjdump (``triton/backends/nvidia/bin``), else one on PATH; ``RuntimeError`` if neither."""
    try:
        import triton
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if found is None:
        raise RuntimeError("no cuobjdump: install Triton (its package carries one) or the CUDA toolkit")
    return found


def run_cuobjdump(*args: str, cwd: str | None = None) -> str:
    return subprocess.run([cuobjdump(), *args], check=True, capture_output=True, text=True, cwd=cwd).stdout


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str  # "" or e.g. "@!P0"
    opcode: str  # with modifiers, e.g. "LDG.E.128"
    operands: str
    control: int  # the high 64 bits of the instruction word: stall, scoreboards, wait mask

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def modifiers(self) -> list[str]:
        return self.opcode.split(".")[1:]

    # Volta+ control bits (bits 41-57 of the high word): stall cycles, the scoreboard this instruction sets
    # when its result is ready (write) or its operands are read (read), 7 = none, and the scoreboards it waits on.
    @property
    def stall(self) -> int:
        return (self.control >> 41) & 0xF

    @property
    def write_scoreboard(self) -> int:
        return (self.control >> 46) & 0x7

    @property
    def read_scoreboard(self) -> int:
        return (self.control >> 49) & 0x7

    @property
    def wait_mask(self) -> int:
        return (self.control >> 52) & 0x3F


_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*0x[0-9a-f]+\s*\*/\s*$")
_HIGH = re.compile(r"^\s+/\*\s*(0x[0-9a-f]+)\s*\*/\s*$")
_FUNCTION = re.compile(r"^\s+Function : (\S+)")


def parse_sass(text: str) -> dict[str, list[Instruction]]:
    """``cuobjdump -sass`` output as ``{function: [Instruction]}``."""
    functions: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if match := _FUNCTION.match(line):
            current = functions.setdefault(match.group(1), [])
        elif current is not None and (match := _LINE.match(line)):
            high = _HIGH.match(lines[index + 1]) if index + 1 < len(lines) else None
            text, predicate = match.group(2), ""
            if text.startswith("@"):
                predicate, text = text.split(None, 1)
            opcode, _, operands = text.partition(" ")
            current.append(Instruction(int(match.group(1), 16), predicate, opcode, operands.strip(),
                                       int(high.group(1), 16) if high else 0))
    return functions


@dataclasses.dataclass
class Function:
    name: str
    instructions: list[Instruction]
    registers: int
    shared_bytes: int  # static (CUDA) or total (Triton) shared memory per CTA
    threads: int  # threads per CTA


def resource_usage(cubin: str) -> dict[str, tuple[int, int]]:
    """``{function: (registers, static shared bytes)}`` from ``cuobjdump -res-usage``."""
    usage, name = {}, None
    for line in run_cuobjdump("-res-usage", cubin).splitlines():
        if match := re.match(r"\s*Function (\S+):", line):
            name = match.group(1)
        elif name and (match := re.search(r"REG:(\d+).*SHARED:(\d+)", line)):
            usage[name] = (int(match.group(1)), int(match.group(2)))
    return usage


def _max_threads(cubin: str) -> dict[str, int]:
    """``{function: threads}`` from each function's EIATTR_MAX_THREADS (``__launch_bounds__``, Triton's maxntid)."""
    threads, name, pending = {}, None, False
    for line in run_cuobjdump("-elf", cubin).splitlines():
        if match := re.match(r"^\.nv\.info\.(\S+)", line):
            name = match.group(1)
        elif "EIATTR_MAX_THREADS" in line:
            pending = True
        elif pending and "Value:" in line:
            x, y, z = (int(value, 16) for value in line.split("Value:")[1].split()[:3])
            threads[name], pending = x * y * z, False
    return threads


def disassemble(cubin: str, function: str | None = None) -> dict[str, Function]:
    """The functions of a cubin file (only ``function`` when given: much faster on the extension's cubins)."""
    sass = parse_sass(run_cuobjdump("-sass", *(["-fun", function] if function else []), cubin))
    usage, threads = resource_usage(cubin), _max_threads(cubin)
    return {name: Function(name, code, *usage.get(name, (0, 0)), threads.get(name, 0))
            for name, code in sass.items()}


def demangle(name: str) -> str:
    filt = shutil.which("c++filt")
    if filt is None or not name.startswith("_Z"):
        return name
    return subprocess.run([filt, name], capture_output=True, text=True).stdout.strip() or name


# ---------------------------------------------------------------------------
# Loops and the path through one iteration: basic blocks, dominators, natural loops.

_TRANSFERS = {"BRA", "EXIT", "RET", "KILL"}  # end a basic block (CALL returns; BRX/JMP do not occur here)


def branch_target(instruction: Instruction) -> int | None:
    if instruction.base != "BRA":
        return None
    match = re.search(r"0x([0-9a-f]+)\s*$", instruction.operands)
    return int(match.group(1), 16) if match else None


def conditional(instruction: Instruction) -> bool:
    """May fall through: a predicate, or a condition operand (``BRA.U !UP0, 0x..``, ``BRA.DIV UR4, 0x..``)."""
    return instruction.predicate not in ("", "@PT") or "," in instruction.operands


@dataclasses.dataclass
class Cfg:
    code: list[Instruction]
    starts: list[int]  # block b is code[starts[b]:ends[b]]
    ends: list[int]
    successors: list[list[int]]

    def block(self, b: int) -> list[Instruction]:
        return self.code[self.starts[b]:self.ends[b]]


def build_cfg(code: list[Instruction]) -> Cfg:
    index = {ins.address: position for position, ins in enumerate(code)}
    leaders = {0}
    for position, ins in enumerate(code):
        target = branch_target(ins)
        if target in index:
            leaders.add(index[target])
        if ins.base in _TRANSFERS:
            leaders.add(position + 1)
    starts = sorted(leader for leader in leaders if leader < len(code))
    ends = starts[1:] + [len(code)]
    block_at = {start: b for b, start in enumerate(starts)}
    successors = []
    for b, end in enumerate(ends):
        last, out = code[end - 1], []
        target = branch_target(last)
        if target in index and last.predicate != "@!PT":
            out.append(block_at[index[target]])
        if (last.base not in _TRANSFERS or conditional(last)) and end < len(code):
            out.append(b + 1)
        successors.append(out)
    return Cfg(code, starts, ends, successors)


def _reverse_postorder(successors: list[list[int]], entry: int, allowed=None) -> list[int]:
    """Reverse postorder of the blocks reachable from ``entry`` (within ``allowed``); edges back to a block on
    the DFS stack are ignored, so the order is topological for the rest."""
    order, seen, stack = [], {entry}, [(entry, iter(successors[entry]))]
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            order.append(node)
        elif child not in seen and (allowed is None or child in allowed):
            seen.add(child)
            stack.append((child, iter(successors[child])))
    return order[::-1]


def dominators(cfg: Cfg) -> dict[int, int]:
    """Immediate dominators of the blocks reachable from the entry (Cooper, Harvey and Kennedy's iteration)."""
    order = _reverse_postorder(cfg.successors, 0)
    rank = {b: position for position, b in enumerate(order)}
    predecessors = collections.defaultdict(list)
    for b in order:
        for successor in cfg.successors[b]:
            predecessors[successor].append(b)
    idom = {0: 0}

    def intersect(a: int, b: int) -> int:
        while a != b:
            while rank[a] > rank[b]:
                a = idom[a]
            while rank[b] > rank[a]:
                b = idom[b]
        return a

    changed = True
    while changed:
        changed = False
        for b in order[1:]:
            done = [p for p in predecessors[b] if p in idom]
            new = done[0]
            for p in done[1:]:
                new = intersect(p, new)
            if idom.get(b) != new:
                idom[b], changed = new, True
    return idom


@dataclasses.dataclass(frozen=True)
class Loop:
    head: int  # block ids
    body: frozenset
    head_address: int
    latch_address: int  # the last branch back to the head

    def contains(self, other: "Loop") -> bool:
        return other.body < self.body


def find_loops(cfg: Cfg) -> list[Loop]:
    """Natural loops (an edge to a block that dominates its source closes one), one per head, by address."""
    idom = dominators(cfg)

    def dominates(a: int, b: int) -> bool:
        while b != a and b != 0:
            b = idom[b]
        return b == a

    predecessors = collections.defaultdict(list)
    for b in idom:
        for successor in cfg.successors[b]:
            predecessors[successor].append(b)
    latches = collections.defaultdict(list)
    for b in idom:
        for successor in cfg.successors[b]:
            if dominates(successor, b):
                latches[successor].append(b)
    loops = []
    for head, tails in latches.items():
        body, work = {head}, list(tails)
        while work:
            b = work.pop()
            if b not in body:
                body.add(b)
                work.extend(predecessors[b])
        latch = max(cfg.code[cfg.ends[t] - 1].address for t in tails)
        loops.append(Loop(head, frozenset(body), cfg.code[cfg.starts[head]].address, latch))
    return sorted(loops, key=lambda loop: loop.head_address)


def _nested(loop: Loop, loops: list[Loop]) -> list[Loop]:
    """The loops directly inside ``loop``."""
    inside = [inner for inner in loops if loop.contains(inner)]
    return [inner for inner in inside if not any(other.contains(inner) for other in inside)]


def iteration_path(cfg: Cfg, loop: Loop, loops: list[Loop], weigh, expected_bytes: float | None,
                   nested_trips: int = 0) -> list[Instruction]:
    """The instructions of one iteration along one path through the loop (module docstring).

    ``weigh(instruction)`` gives ``(global-load bytes, *secondary)``. The path's load bytes are the closest to
    ``expected_bytes`` (per thread; the most when ``None``), then its secondary sums are the greatest (compared
    in order). A loop nested inside is one node: its own best path, ``nested_trips`` times (0: not counted).
    """
    nested = _nested(loop, loops)
    representative = {b: b for b in loop.body}
    for inner in nested:
        representative.update({b: inner.head for b in inner.body})
    collapsed = {inner.head: (iteration_path(cfg, inner, loops, weigh, None, nested_trips) * nested_trips
                              if nested_trips else []) for inner in nested}
    edges, completes = collections.defaultdict(set), set()
    for b in loop.body:
        for successor in cfg.successors[b]:
            if successor == loop.head:
                completes.add(representative[b])
            elif successor in loop.body and representative[successor] != representative[b]:
                edges[representative[b]].add(representative[successor])
    nodes = set(representative.values())
    successors = collections.defaultdict(list, {node: sorted(edges[node]) for node in nodes})
    order = _reverse_postorder(successors, loop.head, nodes)
    rank = {node: position for position, node in enumerate(order)}
    width = len(weigh(cfg.code[cfg.starts[loop.head]])) - 1

    def cost(node: int) -> tuple[int, tuple]:
        weights = [weigh(ins) for ins in (collapsed[node] if node in collapsed else cfg.block(node))]
        return sum(w[0] for w in weights), tuple(sum(w[i] for w in weights) for i in range(1, width + 1))

    # Dynamic programming in topological order, one state per (node, load bytes so far): the greatest secondary.
    best: dict[int, dict[int, tuple[tuple, tuple | None]]] = {loop.head: {0: ((0,) * width, None)}}
    finished = []
    for node in order:
        node_bytes, node_secondary = cost(node)
        for loaded, (secondary, _) in list(best.get(node, {}).items()):
            total = loaded + node_bytes
            score = tuple(a + b for a, b in zip(secondary, node_secondary))
            if node in completes:
                finished.append((total, score, node, loaded))
            for successor in successors[node]:
                if rank.get(successor, -1) <= rank[node]:
                    continue  # an edge of an irreducible cycle: dropped
                states = best.setdefault(successor, {})
                if total not in states or score > states[total][0]:
                    states[total] = (score, (node, loaded))
    if not finished:
        return []

    def preference(candidate):
        total, score, _, _ = candidate
        closeness = -abs(total - expected_bytes) if expected_bytes is not None else total
        return closeness, total, score

    _, _, node, loaded = max(finished, key=preference)
    path = []
    while node is not None:
        path.append(node)
        node, loaded = best[node][loaded][1] or (None, None)
    return [ins for node in reversed(path) for ins in (collapsed[node] if node in collapsed else cfg.block(node))]


# ---------------------------------------------------------------------------
# What one iteration does.


_WIDTHS = {"128": 16, "64": 8, "U8": 1, "S8": 1, "U16": 2, "S16": 2}


def _width(instruction: Instruction) -> int:
    return next((_WIDTHS[m] for m in instruction.modifiers if m in _WIDTHS), 4)


def global_load_bytes(instruction: Instruction) -> int:
    """Bytes per thread of a global load (LDG, LD, LDGSTS: cp.async), else 0."""
    return _width(instruction) if instruction.base in ("LDG", "LD", "LDGSTS") else 0


def plain_load(instruction: Instruction) -> bool:
    """A global load of an input, not a workspace read that bypasses L1 (``.STRONG``: ld.cg, acquire)."""
    return global_load_bytes(instruction) > 0 and "STRONG" not in instruction.modifiers


def shared_bytes(instruction: Instruction) -> int:
    return _width(instruction) if instruction.base in ("LDS", "STS", "LDSM", "ATOMS") else 0


def mma_flops(instruction: Instruction) -> tuple[str, int]:
    """``(kind, FLOPs per warp-instruction)`` of a matrix instruction, else ``("", 0)``.

    HMMA.MxNxK is one warp's; HGMMA.MxNxK is a warpgroup's (4 warps), each warp issuing it.
    """
    hmma = re.match(r"HMMA\.(\d\d)(\d)(\d+)\.", instruction.opcode)  # HMMA.16816: m16 n8 k16; HMMA.1688
    if hmma:
        return "HMMA", 2 * int(hmma.group(1)) * int(hmma.group(2)) * int(hmma.group(3))
    hgmma = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)\.", instruction.opcode)
    if hgmma:
        return "HGMMA", 2 * int(hgmma.group(1)) * int(hgmma.group(2)) * int(hgmma.group(3)) // 4
    return "", 0


def _producer_latency(instruction: Instruction, latency: dict, stream_bases: tuple) -> float:
    """Cycles until the result an instruction's write scoreboard guards is ready."""
    if plain_load(instruction) and instruction.base in stream_bases:
        return latency["stream"]
    if instruction.base in ("LDG", "LD", "ATOMG", "ATOM", "RED", "REDG", "LDGSTS"):
        return latency["l2"]  # workspace reads (.STRONG) and atomics are L2 round trips
    if instruction.base in ("LDS", "LDSM", "ATOMS", "SHFL", "STS"):
        return latency["shared"]
    return latency["other"]


def iteration_latency(path: list[Instruction], latency: dict, stream_bases: tuple = ("LDG", "LD", "LDGSTS")
                      ) -> tuple[float, bool]:
    """``(cycles, stalls on its own loads)`` of one iteration for a lone warp, in steady state.

    ``latency`` (cycles): ``stream`` for the plain global loads of ``stream_bases`` (the rows or tiles
    streamed), ``l2`` for the other global accesses, ``shared`` for shared memory and shuffles, ``other`` for
    any other scoreboard, ``barrier`` per ``BAR``. The path is issued twice and the second pass timed, so loads
    issued an iteration ahead (prefetch) cost nothing; "stalls on its own loads" means that the second pass
    waited for a streamed load it issued itself. Stall counts are the compiler's fixed latencies, and a
    scoreboard wait costs what is left of its producer's latency. ``DEPBAR`` (cp.async groups) is not waited
    on: pipelined copies are assumed to arrive in time.
    """
    now, ready, producer = 0.0, [0.0] * 6, [None] * 6
    waits_on_own_loads, second_start = False, 0.0
    for round_ in (0, 1):
        if round_ == 1:
            second_start = now
        for ins in path:
            waited = [board for board in range(6) if ins.wait_mask >> board & 1]
            for board in waited:
                if ready[board] > now and producer[board] is not None:
                    kind, issued_round = producer[board]
                    waits_on_own_loads |= round_ == 1 and issued_round == 1 and kind == "stream"
                now = max(now, ready[board])
            if ins.base == "BAR":
                now += latency["barrier"]
            if ins.write_scoreboard < 6:
                ready[ins.write_scoreboard] = now + _producer_latency(ins, latency, stream_bases)
                streamed = plain_load(ins) and ins.base in stream_bases
                producer[ins.write_scoreboard] = ("stream" if streamed else "other", round_)
            if ins.read_scoreboard < 6:
                ready[ins.read_scoreboard] = now + latency["other"]
                producer[ins.read_scoreboard] = ("read", round_)
            now += max(ins.stall, 1)
    return now - second_start, waits_on_own_loads


@dataclasses.dataclass
class LoopStats:
    loop: Loop
    body_instructions: int  # static, every path, nested loops excluded
    path: list[Instruction]
    load_bytes: int  # global-load bytes per thread on the path
    plain_load_bytes: int
    mma_kind: str
    mma_flops_per_warp: int
    counts: collections.Counter  # opcode (with modifiers) -> count on the path

    @property
    def instructions(self) -> int:
        return len(self.path)

    def histogram(self, keep) -> str:
        items = [(opcode, n) for opcode, n in self.counts.items() if keep(opcode)]
        return ", ".join(f"{opcode} x{n}" for opcode, n in sorted(items, key=lambda item: (-item[1], item[0]))) or "-"


def loop_stats(cfg: Cfg, loop: Loop, loops: list[Loop], selector: str, expected_bytes: float | None,
               nested_trips: int = 0) -> LoopStats:
    path = iteration_path(cfg, loop, loops, PATH_WEIGHTS[selector], expected_bytes, nested_trips)
    inner = set().union(*(nested.body for nested in _nested(loop, loops)))
    body_instructions = sum(len(cfg.block(b)) for b in loop.body - inner)
    mma = [mma_flops(ins) for ins in path if mma_flops(ins)[1]]
    return LoopStats(loop, body_instructions, path, sum(map(global_load_bytes, path)),
                     sum(global_load_bytes(ins) for ins in path if plain_load(ins)), mma[0][0] if mma else "",
                     sum(flops for _, flops in mma),
                     collections.Counter(ins.opcode for ins in path))


def has_scan(stats: LoopStats) -> bool:
    return any(opcode.startswith("SHFL.UP") for opcode in stats.counts)


def _is_scan(ins: Instruction) -> int:
    return int(ins.opcode.startswith("SHFL.UP"))


# Per selector: what the iteration path weighs (load bytes first, then the rest, compared in order; -1 per
# instruction prefers the shortest) and how the loop is chosen: eligible, then the key, greatest first.
PATH_WEIGHTS = {
    "sampler": lambda ins: (global_load_bytes(ins), _is_scan(ins), -1),  # through the scan, not a reduction
    "walk": lambda ins: (global_load_bytes(ins), -1),
    "mma": lambda ins: (global_load_bytes(ins), mma_flops(ins)[1], -1),
}


def _closeness(loaded: int, expected: float | None) -> float:
    return -abs(loaded - expected) if expected is not None else loaded


SELECTORS = {
    "sampler": lambda s, expected: (has_scan(s) and s.plain_load_bytes > 0,
                                    _closeness(s.plain_load_bytes, expected), -s.instructions),
    "walk": lambda s, expected: (s.load_bytes > 0, _closeness(s.load_bytes, expected), -s.instructions),
    "mma": lambda s, expected: (s.mma_flops_per_warp > 0, s.mma_flops_per_warp, -s.instructions),
}


def hot_loop(function: Function, selector: str, expected_bytes: float | None = None, nested_trips: int = 0
             ) -> tuple[LoopStats, list[LoopStats]]:
    """The selected loop and every loop's stats (for the printout). ``expected_bytes``: the global-load bytes
    per thread one iteration of the scenario reads (e.g. two rows x 4 elements x 4 bytes); ``nested_trips``:
    how often a loop nested in it runs per iteration in the scenario."""
    cfg = build_cfg(function.instructions)
    loops = find_loops(cfg)
    stats = [loop_stats(cfg, loop, loops, selector, expected_bytes, nested_trips) for loop in loops]
    candidates = [s for s in stats if SELECTORS[selector](s, expected_bytes)[0]]
    if not candidates:
        raise RuntimeError(f"{demangle(function.name)}: no loop fits the {selector!r} selector "
                           f"({len(loops)} loops)")
    return max(candidates, key=lambda s: SELECTORS[selector](s, expected_bytes)), stats


def kernel_atomics(function: Function) -> str:
    """Atomic kinds anywhere in the kernel; shared-memory compare-and-swap loops flagged."""
    counts = collections.Counter(ins.opcode for ins in function.instructions
                                 if ins.base in ("ATOM", "ATOMG", "RED", "REDG", "ATOMS"))
    text = ", ".join(f"{opcode} x{n}" for opcode, n in sorted(counts.items())) or "none"
    spins = sum(n for opcode, n in counts.items() if opcode.startswith("ATOMS.CAST.SPIN"))
    return f"{text} ({spins} ATOMS.CAST.SPIN: compare-and-swap loops)" if spins else text
