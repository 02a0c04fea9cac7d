"""Build script for specdec_kernels.

The package itself is pure Python (PyTorch reference + Triton kernels). The
optional CUDA extension ``specdec_kernels._C`` is built when ``nvcc`` is
found:

* ``csrc/*.cu`` are compiled by nvcc through a small ninja file in the build
  temp directory (``torch.utils.cpp_extension.BuildExtension`` refuses ``.cu``
  sources when torch itself has no CUDA, as on the CPU-only CI machines);
* their objects are linked with ``csrc/bindings.cpp`` into a ``CppExtension``
  against ``libcudart``.

Environment:

``SPECDEC_BUILD_CUDA``    ``0`` skips the extension, ``1`` requires it (fails
                          when nvcc is missing); unset: build it when nvcc is found.
``CUDA_HOME``             CUDA toolkit (else ``CUDA_PATH``, the ``nvcc`` on
                          ``PATH``, then ``/usr/local/cuda``).
``TORCH_CUDA_ARCH_LIST``  target architectures, default ``"8.0;9.0a"``; an
                          entry ``X.Y+PTX`` also embeds PTX for that arch.
``MAX_JOBS``              parallel compile jobs (nvcc and the C++ step).

``-Xptxas -v`` prints each kernel's registers and spills in the build log
(``pip install -v``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"
DEFAULT_ARCH_LIST = "8.0;9.0a"

PACKAGES = sorted(
    {"specdec_kernels", "specdec_kernels.ops", "specdec_kernels.reference", "specdec_kernels._kernels"}
    | set(find_packages(include=["specdec_kernels", "specdec_kernels.*"]))
)


def _notice(message: str) -> None:
    print(f"specdec_kernels setup: {message}", file=sys.stderr, flush=True)


def _find_cuda_home() -> Path | None:
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


def _gencode_flags(arch_list: str) -> list[str]:
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


def _find_ninja() -> list[str] | None:
    for candidate in (shutil.which("ninja"), str(Path(sys.executable).parent / "ninja")):
        if candidate and Path(candidate).exists():
            return [candidate]
    try:
        import ninja  # noqa: F401  (the PyPI package ships the binary)
    except ImportError:
        return None
    return [sys.executable, "-m", "ninja"]


def _compile_cuda(sources: list[Path], build_dir: Path, cuda_home: Path) -> list[str]:
    """Compile ``sources`` with nvcc via ninja; returns the object paths."""
    build_dir.mkdir(parents=True, exist_ok=True)
    nvcc = cuda_home / "bin" / "nvcc"
    flags = [
        "-O3",
        "-std=c++17",
        "-Xcompiler",
        "-fPIC",
        # Host code (rng_fill_host etc.) must round like the device code:
        # no contraction of a * b + c into an FMA.
        "-Xcompiler",
        "-ffp-contract=off",
        "-Xptxas",
        "-v",
        "-lineinfo",
        f"-I{CSRC / 'include'}",
        *_gencode_flags(os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCH_LIST),
    ]
    if os.environ.get("CXX"):
        flags.append(f"-ccbin={os.environ['CXX']}")
    objects = [build_dir / (source.stem + ".o") for source in sources]
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {shlex.quote(str(nvcc))}",
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

    jobs = os.environ.get("MAX_JOBS") or str(max(1, os.cpu_count() or 1))
    ninja = _find_ninja()
    if ninja is None:
        raise RuntimeError("building the CUDA extension needs ninja (pip install ninja)")
    # -v prints each nvcc command; ptxas -v output (registers, spills) follows it.
    subprocess.run([*ninja, "-v", "-C", str(build_dir), "-j", jobs], check=True)
    return [str(obj) for obj in objects]


def _ninja_escape(path: Path) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _cuda_extension_plan() -> tuple[list, dict]:
    """``(ext_modules, cmdclass)`` for the CUDA extension, or empty when it is skipped."""
    mode = os.environ.get("SPECDEC_BUILD_CUDA", "").strip()
    if mode not in ("", "0", "1"):
        raise ValueError(f"SPECDEC_BUILD_CUDA must be 0 or 1, got {mode!r}")
    if mode == "0":
        _notice("SPECDEC_BUILD_CUDA=0: skipping the CUDA extension (reference and Triton backends only)")
        return [], {}
    cuda_home = _find_cuda_home()
    if cuda_home is None:
        if mode == "1":
            raise RuntimeError("SPECDEC_BUILD_CUDA=1 but nvcc was not found (set CUDA_HOME)")
        _notice("nvcc not found: skipping the CUDA extension (reference and Triton backends only)")
        return [], {}

    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as error:
        if mode == "1":
            raise
        _notice(f"torch is not importable ({error}; install with --no-build-isolation): skipping the CUDA extension")
        return [], {}

    cuda_lib = next(
        (cuda_home / name for name in ("lib64", "lib", "targets/x86_64-linux/lib") if (cuda_home / name).is_dir()),
        cuda_home / "lib64",
    )
    cuda_sources = sorted(CSRC.glob("*.cu"))

    class BuildExtensionWithNvcc(BuildExtension):
        """BuildExtension that first compiles ``csrc/*.cu`` with nvcc and links the objects."""

        def build_extensions(self):
            objects = _compile_cuda(cuda_sources, Path(self.build_temp).resolve() / "nvcc", cuda_home)
            for extension in self.extensions:
                extension.extra_objects = [*extension.extra_objects, *objects]
            super().build_extensions()

    extension = CppExtension(
        name="specdec_kernels._C",
        sources=["csrc/bindings.cpp"],
        include_dirs=[str(CSRC / "include"), str(cuda_home / "include")],
        library_dirs=[str(cuda_lib)],
        libraries=["cudart"],
        extra_compile_args={"cxx": ["-O3", "-ffp-contract=off"]},
        extra_link_args=[f"-Wl,-rpath,{cuda_lib}"],
        # Relinks when a .cu or header changes (setuptools compares mtimes).
        depends=[str(path) for path in [*cuda_sources, *(CSRC / "include").rglob("*.cuh")]],
    )
    _notice(f"building the CUDA extension with {cuda_home / 'bin' / 'nvcc'}")
    return [extension], {"build_ext": BuildExtensionWithNvcc}


ext_modules, cmdclass = _cuda_extension_plan()

setup(
    name="specdec_kernels",
    version="0.1.0",
    description="Fused GPU kernels for speculative decoding (PyTorch reference, Triton, CUDA)",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir={"specdec_kernels._kernels": "kernels"},
    install_requires=["torch", "numpy"],
    # The Triton kernels are tested with 3.6 (the GPU image) through 3.9 (CI):
    # their release ordering and AOT checks are verified on that range only.
    extras_require={"triton": ["triton>=3.6,<3.10"], "test": ["pytest", "scipy", "triton>=3.6,<3.10"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
