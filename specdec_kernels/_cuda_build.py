"""The one recipe that compiles the CUDA extension, for ``setup.py`` and for the first-use build.

``setup.py`` builds ``specdec_kernels._C`` at install time when torch is
importable there (``pip install --no-build-isolation``); otherwise
``specdec_kernels._jit`` compiles the same sources with the same flags into a
per-user cache at the first CUDA call. Both use the functions below.

This module imports nothing from torch or from the package at module level:
``setup.py`` loads it by path, in a build environment that may have no torch.

* ``csrc/*.cu`` are compiled by nvcc through a small generated ninja file
  (``torch.utils.cpp_extension`` refuses ``.cu`` sources when torch itself
  has no CUDA, as on the CPU-only CI machines);
* their objects are linked with ``csrc/bindings/*.cpp`` against the *static*
  CUDA runtime: the extension never loads a second shared ``libcudart``
  (of this toolkit's CUDA version) next to the one torch loads, and needs no
  ``RUNPATH`` into the toolkit.

Environment: ``CUDA_HOME`` (else ``CUDA_PATH``, the ``nvcc`` on ``PATH``, then
``/usr/local/cuda``), ``TORCH_CUDA_ARCH_LIST`` (``"8.0;9.0a"``-style; an
entry ``X.Y+PTX`` also embeds PTX), ``MAX_JOBS`` (parallel compile jobs),
``CXX`` (host compiler).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

# The command that builds the extension after an install that did not (_jit.py); every message names it.
BUILD_COMMAND = "python -m specdec_kernels build"
DEFAULT_ARCH_LIST = "8.0;9.0a"
# Host code (rng_fill_host etc.) must round like the device code: no
# contraction of a * b + c into an FMA.
CXX_FLAGS = ["-O3", "-ffp-contract=off"]
# cudart_static needs dl, rt and pthread from the system.
CUDA_LIBRARIES = ["cudart_static", "dl", "rt", "pthread"]


def source_dir(package_dir: Path) -> Path | None:
    """The CUDA sources: ``specdec_kernels/_csrc`` when installed, else the checkout's ``csrc/``."""
    for candidate in (package_dir / "_csrc", package_dir.parent / "csrc"):
        if (candidate / "bindings" / "module.cpp").is_file():
            return candidate
    return None


def cuda_sources(csrc: Path) -> list[Path]:
    return sorted(csrc.glob("*.cu"))


def binding_sources(csrc: Path) -> list[Path]:
    """The torch.library bindings, compiled by the host compiler against torch (one file per op)."""
    return sorted((csrc / "bindings").glob("*.cpp"))


def all_sources(csrc: Path) -> list[Path]:
    """Every file the extension is compiled from (the first-use cache is keyed by their contents)."""
    return [*cuda_sources(csrc), *binding_sources(csrc), *sorted((csrc / "bindings").glob("*.h")),
            *sorted((csrc / "include").rglob("*.cuh"))]


def find_cuda_home() -> Path | None:
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            home = Path(os.environ[variable])
            return home if (home / "bin" / "nvcc").exists() else None
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        # /usr/local/bin/nvcc may be a wrapper script rather than a link.
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for home in candidates:
        if (home / "bin" / "nvcc").exists() and (home / "include" / "cuda_runtime_api.h").exists():
            return home
    return None


def cuda_library_dir(cuda_home: Path) -> Path:
    return next(
        (cuda_home / name for name in ("lib64", "lib", "targets/x86_64-linux/lib") if (cuda_home / name).is_dir()),
        cuda_home / "lib64",
    )


def find_ninja() -> list[str] | None:
    for candidate in (shutil.which("ninja"), str(Path(sys.executable).parent / "ninja")):
        if candidate and Path(candidate).exists():
            return [candidate]
    try:
        import ninja  # noqa: F401  (the PyPI package ships the binary)
    except ImportError:
        return None
    return [sys.executable, "-m", "ninja"]


def arch_list() -> str:
    return os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCH_LIST


def max_jobs() -> str:
    return os.environ.get("MAX_JOBS") or str(max(1, os.cpu_count() or 1))


def gencode_flags(arch_list: str) -> list[str]:
    """``-gencode`` flags for a TORCH_CUDA_ARCH_LIST such as ``"8.0;9.0a"`` or ``"9.0+PTX"``."""
    flags = []
    for entry in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        if not entry:
            continue
        name, with_ptx = (entry[: -len("+PTX")], True) if entry.endswith("+PTX") else (entry, False)
        major, dot, minor = name.partition(".")
        if not (dot and major.isdigit() and minor[:1].isdigit()):
            raise ValueError(f"TORCH_CUDA_ARCH_LIST: cannot read {entry!r} (expected e.g. '8.0', '9.0a', '9.0+PTX')")
        arch = major + minor
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        if with_ptx:
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
    if not flags:
        raise ValueError("TORCH_CUDA_ARCH_LIST is empty")
    return flags


def nvcc_flags(csrc: Path, arch_list: str) -> list[str]:
    flags = [
        "-O3",
        "-std=c++17",
        "-Xcompiler",
        "-fPIC",
        "-Xcompiler",
        "-ffp-contract=off",
        # Registers and spills of every kernel, in the build log.
        "-Xptxas",
        "-v",
        "-lineinfo",
        f"-I{csrc / 'include'}",
        *gencode_flags(arch_list),
    ]
    if os.environ.get("CXX"):
        flags.append(f"-ccbin={os.environ['CXX']}")
    return flags


def ptxas_split_flags(cuda_home: Path) -> list[str]:
    """``-Xptxas --split-compile=0`` where this toolkit's ptxas has the option: it assembles a file's kernels on
    all cores instead of one after another. chain_verify.cu's 12 kernels were about 35 of its 65 s on one core
    (sm_90a), the longest file of the build; the machine code is the same (SASS of every csrc/*.cu compared at
    sm_90a, CUDA 13.0). Not nvcc's own ``-split-compile``: that also splits cicc's optimisation, and it changed
    the SASS."""
    try:
        usage = subprocess.run([str(cuda_home / "bin" / "ptxas"), "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return ["-Xptxas", "--split-compile=0"] if "--split-compile" in usage else []


def compile_cuda(csrc: Path, build_dir: Path, cuda_home: Path, arch_list: str, ninja: list[str],
                 log=None) -> list[str]:
    """Compile ``csrc/*.cu`` with nvcc via ninja into ``build_dir``; returns the object paths.

    ``log``: a file for the compiler output (default: this process's stdout,
    which is pip's build log). Raises ``subprocess.CalledProcessError``.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = cuda_sources(csrc)
    objects = [build_dir / (source.stem + ".o") for source in sources]
    flags = [*nvcc_flags(csrc, arch_list), *ptxas_split_flags(cuda_home)]
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {shlex.quote(str(cuda_home / 'bin' / 'nvcc'))}",
        f"flags = {' '.join(shlex.quote(flag) for flag in flags)}",
        "rule nvcc",
        "  command = $nvcc --generate-dependencies-with-compile --dependency-output $out.d $flags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = NVCC $out",
        "",
    ]
    for source, obj in zip(sources, objects):
        lines.append(f"build {_ninja_escape(obj)}: nvcc {_ninja_escape(source)}")
    (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")
    # -v prints each nvcc command; ptxas -v output (registers, spills) follows it.
    subprocess.run([*ninja, "-v", "-C", str(build_dir), "-j", max_jobs()], check=True, stdout=log,
                   stderr=subprocess.STDOUT if log is not None else None)
    return [str(obj) for obj in objects]


def link_flags(cuda_home: Path) -> list[str]:
    return [f"-L{cuda_library_dir(cuda_home)}", *(f"-l{library}" for library in CUDA_LIBRARIES)]


def _ninja_escape(path: Path) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")
