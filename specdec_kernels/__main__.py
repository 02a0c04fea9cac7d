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


def _bench(args, options: list[str]) -> int:
    """Hand the options to the checkout's ``bench/harness.py``, which owns them (``bench --help`` lists them)."""
    folder = bench_dir()
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module("harness").main(options, prog="python -m specdec_kernels bench")


def _demo(args, options: list[str]) -> int:
    from . import demo

    demo.run(demo.DemoConfig.from_args(args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specdec_kernels", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    # The benchmark's options are defined once, in bench/harness.py.
    bench = commands.add_parser("bench", add_help=False,
                                help="benchmark the ops (all backends that can run here); see bench --help")
    bench.set_defaults(handler=_bench)

    from . import demo

    demo_parser = commands.add_parser("demo", help="speculative decoding end to end on synthetic models")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(handler=_demo)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, options = parser.parse_known_args(argv)
    if options and args.handler is not _bench:
        parser.error(f"unrecognized arguments: {' '.join(options)}")
    return args.handler(args, options)


if __name__ == "__main__":
    raise SystemExit(main())
