"""Host-side cost of a public call with tiny tensors: checks, dispatch and launch path, without the kernel.

Decode-time ops run thousands of times a second, so the Python work around
each launch matters. For each case this prints, in microseconds per call
(the fastest of several timed loops of many calls, as ``timeit`` reports:
slower loops measure interference, not the code; CPU time of the calling
thread, so that other processes on a busy machine count less):

* ``public, stubbed``: ``sk.<op>(...)`` (``backend="auto"``) with the
  implementation of the backend it resolves to swapped for a stub that returns precomputed outputs
  (``_library.IMPLEMENTATIONS``): the argument checks, backend resolution
  and the package's dispatch function, which the public function calls
  directly in plain eager mode (``_library.run``). This is the number to
  keep small (target: under 10 us).
* ``torch.ops, stubbed``: ``torch.ops.specdec.<op>.default(...)`` with the same
  stub and the resolved backend: the torch dispatcher and the package's
  dispatch function, without the public checks; what a direct ``torch.ops``
  call pays, and the public call under a dispatch mode or the profiler.
* ``public``: the real call (kernel included, or on a CPU the reference),
  for scale; on a GPU the host time per call, synchronised once per loop
  (kernels that run longer than their launch do not show here).

Usage::

    python bench/bench_call_overhead.py [--device cpu|cuda] [--calls 5000] [--out DIR]

``--out`` appends one JSON line (results and environment) to
``DIR/call_overhead.jsonl``. Timings are not asserted anywhere: they depend
on the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import time
from pathlib import Path

import torch

import harness
import specdec_kernels as sk
from specdec_kernels import _backend, _library, _validation

REPEATS = 7


def chain_case(device: torch.device, seed) -> dict:
    generator = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(1, 3, 8, generator=generator), -1).to(device)
    draft = torch.softmax(torch.randn(1, 2, 8, generator=generator), -1).to(device)
    ids = torch.randint(0, 8, (1, 2), generator=generator).to(device)
    seed_tensor, seed_int, offset_tensor, offset_int = _validation.split_random_state(seed, 3)
    return dict(
        op="chain_verify",
        public=lambda: sk.chain_verify(ids, target, draft, seed=seed, offset=3),
        direct=lambda backend: _library.op("chain_verify")(ids, target, draft, None, None, False, seed_tensor,
                                                           seed_int, offset_tensor, offset_int, backend=backend),
    )


def tree_case(device: torch.device, seed) -> dict:
    generator = torch.Generator().manual_seed(1)
    parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32, device=device)
    tokens = torch.tensor([[5, 1, 2, 3]], device=device)
    target = torch.softmax(torch.randn(1, 4, 8, generator=generator), -1).to(device)
    seed_tensor, seed_int, offset_tensor, offset_int = _validation.split_random_state(seed, 3)
    return dict(
        op="tree_verify",
        public=lambda: sk.tree_verify(tokens, parents, target, seed=seed, offset=3),
        direct=lambda backend: _library.op("tree_verify")(tokens, parents, target, None, None, None, False,
                                                          "without_replacement", seed_tensor, seed_int,
                                                          offset_tensor, offset_int, backend=backend),
    )


CASES = {
    "chain_verify, int seed": lambda device: chain_case(device, 7),
    "chain_verify, seed=None": lambda device: chain_case(device, None),
    "tree_verify, int seed": lambda device: tree_case(device, 7),
    "tree_verify, seed=None": lambda device: tree_case(device, None),
}


@contextlib.contextmanager
def stubbed(op_name: str, backend: str, outputs):
    """Replace ``backend``'s implementation of ``op_name`` by one that returns ``outputs``."""
    implementations = _library.IMPLEMENTATIONS[op_name]
    original = implementations[backend]
    implementations[backend] = lambda *arguments: outputs
    try:
        yield
    finally:
        implementations[backend] = original


def microseconds_per_call(fn, calls: int, device: torch.device) -> float:
    for _ in range(min(calls, 200)):
        fn()
    harness.synchronize(device)
    loops = []
    for _ in range(REPEATS):
        begin = time.thread_time_ns()
        for _ in range(calls):
            fn()
        harness.synchronize(device)
        loops.append((time.thread_time_ns() - begin) / calls / 1000)
    return min(loops)


def measure(device: torch.device, calls: int) -> list[dict]:
    rows = []
    for name, make in CASES.items():
        case = make(device)
        # The public call says backend="auto", as an engine would; the stub
        # replaces the backend that it resolves to.
        backend = _backend.resolve(case["op"], "auto", device)
        public = case["public"]
        direct = lambda: case["direct"](backend)  # noqa: E731
        row = dict(case=name, backend=backend)
        with stubbed(case["op"], backend, public()):
            row["public_stubbed_us"] = microseconds_per_call(public, calls, device)
            row["direct_stubbed_us"] = microseconds_per_call(direct, calls, device)
        # The real call is much slower on a CPU (the reference computes); fewer calls keep it short.
        row["public_us"] = microseconds_per_call(public, max(1, calls // 50) if device.type == "cpu" else calls,
                                                 device)
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    header = f"{'case':<26}{'backend':<11}{'public, stubbed':>17}{'torch.ops, stubbed':>20}{'public':>12}"
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(f"{row['case']:<26}{row['backend']:<11}{row['public_stubbed_us']:>14.2f} us"
                     f"{row['direct_stubbed_us']:>17.2f} us{row['public_us']:>9.1f} us")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=5000, help="calls per timed loop")
    parser.add_argument("--out", type=Path, help="append the results to OUT/call_overhead.jsonl")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = measure(device, args.calls)
    print(format_rows(rows))
    if args.out is not None:
        commit, dirty = harness.git_commit()
        record = dict(rows=rows, device=str(device), device_name=harness.device_name(device),
                      package_version=sk.__version__, commit=commit, dirty=dirty, torch=torch.__version__,
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "call_overhead.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
