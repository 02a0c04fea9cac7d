"""Command line: ``python -m specdec_kernels bench|demo|build``.

``bench`` runs the benchmarks (``bench/bench_<op>.py`` of the checkout,
installed as ``specdec_kernels._bench``); ``demo`` runs speculative decoding
end to end on built-in synthetic models (``specdec_kernels/demo.py``);
``build`` compiles the CUDA extension into the per-user cache when the
install did not build it (``specdec_kernels/_jit.py``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path


def bench_dir() -> Path:
    """The benchmark scripts' folder; ``SystemExit`` with a reason if absent.

    Installed: ``specdec_kernels/_bench`` (an editable install maps it to the
    checkout's ``bench/``). With only the checkout on ``PYTHONPATH``: its ``bench/``.
    """
    import specdec_kernels

    spec = importlib.util.find_spec("specdec_kernels._bench")
    candidates = [Path(spec.origin).parent] if spec is not None and spec.origin else []
    candidates.append(Path(specdec_kernels.__file__).resolve().parents[1] / "bench")
    for candidate in candidates:
        if (candidate / "harness.py").is_file():
            return candidate
    raise SystemExit(
        "specdec_kernels bench: no benchmark scripts (looked for harness.py in "
        f"{' and '.join(str(path) for path in candidates)}): this install of specdec_kernels lacks its "
        "specdec_kernels._bench package; reinstall it (pip install specdec_kernels, or pip install . from a checkout)"
    )


def _bench(args, options: list[str]) -> int:
    """Hand the options to ``harness.py``, which owns them (``bench --help`` lists them)."""
    folder = bench_dir()
    # The scripts import one another by plain name (they also run alone from the checkout's bench/).
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module("harness").main(options, prog="python -m specdec_kernels bench")


def _demo(args, options: list[str]) -> int:
    from . import demo

    demo.run(demo.DemoConfig.from_args(args))
    return 0


def _build_extension(args, options: list[str]) -> int:
    from . import _extension, _jit

    if _extension.extension_error() is None:
        print(f"specdec_kernels: the installed CUDA extension loads; nothing to build ({_extension.EXTENSION_MODULE})")
        return 0
    try:
        library = _jit.build_and_load(args.arch_list, report=print)
    except _jit.JitUnavailable as error:
        print(f"specdec_kernels build: {error}", file=sys.stderr)
        return 1
    print(f"specdec_kernels: the CUDA extension is ready ({library}); backend='auto' uses it on GPU tensors")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specdec_kernels", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    # The benchmark's options are defined once, in harness.py.
    bench = commands.add_parser("bench", add_help=False,
                                help="benchmark the ops (all backends that can run here); see bench --help")
    bench.set_defaults(handler=_bench)

    from . import demo

    demo_parser = commands.add_parser("demo", help="speculative decoding end to end on synthetic models")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(handler=_demo)

    build = commands.add_parser("build", help="compile the CUDA extension once, when the install did not "
                                              "(pip install . without --no-build-isolation)")
    build.add_argument("--arch-list", default=None,
                       help="TORCH_CUDA_ARCH_LIST for the build (default: the variable, else the visible GPUs')")
    build.set_defaults(handler=_build_extension)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, options = parser.parse_known_args(argv)
    if options and args.handler is not _bench:
        parser.error(f"unrecognized arguments: {' '.join(options)}")
    return args.handler(args, options)


if __name__ == "__main__":
    raise SystemExit(main())
