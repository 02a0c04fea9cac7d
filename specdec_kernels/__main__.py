"""Command line: ``python -m specdec_kernels bench|demo``.

``bench`` runs the benchmark scripts of the repository checkout
(``bench/bench_<op>.py``, next to the package: the package is installed
editable from the repository); ``demo`` runs speculative decoding end to end
on built-in synthetic models (``specdec_kernels/demo.py``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

BENCH_DIR_ENV = "SPECDEC_BENCH_DIR"


def bench_dir() -> Path:
    """The checkout's ``bench/`` folder (or ``$SPECDEC_BENCH_DIR``); ``SystemExit`` with a reason if absent."""
    import specdec_kernels

    override = os.environ.get(BENCH_DIR_ENV)
    candidate = Path(override) if override else Path(specdec_kernels.__file__).resolve().parents[1] / "bench"
    if not (candidate / "harness.py").is_file():
        raise SystemExit(
            f"specdec_kernels bench: no benchmark scripts at {candidate} (looked for harness.py). The benchmarks "
            "live in the repository's bench/ folder, outside the package: install the package editable from a "
            f"checkout (pip install --no-build-isolation -e .) or point {BENCH_DIR_ENV} at that folder."
        )
    return candidate


def _bench(args) -> int:
    folder = bench_dir()
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    harness = importlib.import_module("harness")
    ops = args.op or harness.OPS
    providers = args.providers.split(",") if args.providers else None
    output = args.output if args.output is not None else folder / "results"
    harness.run(ops, device=args.device, quick=args.quick, tiny=args.tiny, providers=providers, output=output)
    return 0


def _demo(args) -> int:
    from . import demo

    demo.run(demo.DemoConfig.from_args(args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specdec_kernels", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="benchmark the ops (all backends that can run here)")
    bench.add_argument("--op", action="append",
                       choices=("chain_verify", "tree_verify", "build_tree", "tree_attention", "compact_kv"),
                       help="op to benchmark (repeatable; default: every op)")
    bench.add_argument("--quick", action="store_true", help="a short sweep")
    bench.add_argument("--output", default=None, help="results folder (default: bench/results/ of the checkout)")
    bench.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    bench.add_argument("--providers", default=None,
                       help="comma-separated subset of reference,triton,cuda,flashinfer (default: all that run)")
    bench.add_argument("--tiny", action="store_true", default=None,
                       help="smallest sizes and fewest repetitions, for tests (also SPECDEC_BENCH_TINY=1)")
    bench.set_defaults(handler=_bench)

    from . import demo

    demo_parser = commands.add_parser("demo", help="speculative decoding end to end on synthetic models")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(handler=_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
