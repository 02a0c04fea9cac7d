"""Build script for specdec_kernels: the optional CUDA extension ``specdec_kernels._C``.

Metadata lives in pyproject.toml. The package itself is pure Python (PyTorch
reference + Triton kernels); the extension is compiled here, at install time,
when nvcc and ninja are found and torch is importable in the build
environment (``pip install --no-build-isolation``; CI and scripts/setup_env.sh
do that). An isolated build (``pip install .``, ``pip wheel .``,
``python -m build``) has no torch: it builds a pure-Python wheel that carries
the CUDA sources, and ``python -m specdec_kernels build`` compiles them
after the install instead (``specdec_kernels/_jit.py``). The recipe, shared by both, is in
``specdec_kernels/_cuda_build.py``.

Environment:

``SPECDEC_BUILD_CUDA``    ``0`` skips the extension, ``1`` requires it (fails
                          when nvcc, ninja or torch is missing); unset: build it
                          when all three are there, else say why not and go on.
``CUDA_HOME``, ``TORCH_CUDA_ARCH_LIST`` (default ``"8.0;9.0a"``), ``MAX_JOBS``, ``CXX``:
                          see ``specdec_kernels/_cuda_build.py``.

``-Xptxas -v`` prints each kernel's registers and spills in the build log
(``pip install -v``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"


def _load_recipe():
    """``specdec_kernels/_cuda_build.py``, by path: importing the package would need torch."""
    spec = importlib.util.spec_from_file_location("_specdec_cuda_build", ROOT / "specdec_kernels" / "_cuda_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _notice(message: str) -> None:
    print(f"specdec_kernels setup: {message}", file=sys.stderr, flush=True)


def _first_use(recipe) -> str:
    return (f"backend='auto' uses Triton until it is built; build it once after installing with "
            f"`{recipe.BUILD_COMMAND}` (needs nvcc and ninja; minutes)")


def _cuda_extension_plan() -> tuple[list, dict]:
    """``(ext_modules, cmdclass)`` for the CUDA extension, or empty when it is skipped."""
    mode = os.environ.get("SPECDEC_BUILD_CUDA", "").strip()
    if mode not in ("", "0", "1"):
        raise ValueError(f"SPECDEC_BUILD_CUDA must be 0 or 1, got {mode!r}")
    recipe = _load_recipe()
    if mode == "0":
        _notice("SPECDEC_BUILD_CUDA=0: not building the CUDA extension now; " + _first_use(recipe))
        return [], {}
    cuda_home = recipe.find_cuda_home()
    ninja = recipe.find_ninja()
    missing = "nvcc was not found (set CUDA_HOME)" if cuda_home is None else \
        "ninja was not found (pip install ninja)" if ninja is None else None
    if missing is None:
        try:
            from torch.utils.cpp_extension import BuildExtension, CppExtension
        except ImportError as error:
            missing = (f"torch is not importable in the build environment ({error}): pip builds in an isolated "
                       "environment unless given --no-build-isolation")
    if missing is not None:
        if mode == "1":
            raise RuntimeError(f"SPECDEC_BUILD_CUDA=1 but {missing}")
        _notice(f"not building the CUDA extension: {missing}; {_first_use(recipe)}")
        return [], {}

    arch_list = recipe.arch_list()

    class BuildExtensionWithNvcc(BuildExtension):
        """BuildExtension that first compiles ``csrc/*.cu`` with nvcc and links the objects."""

        def build_extensions(self):
            objects = recipe.compile_cuda(CSRC, Path(self.build_temp).resolve() / "nvcc", cuda_home, arch_list,
                                          ninja)
            for extension in self.extensions:
                extension.extra_objects = [*extension.extra_objects, *objects]
            super().build_extensions()

    extension = CppExtension(
        name="specdec_kernels._C",
        sources=[path.relative_to(ROOT).as_posix() for path in recipe.binding_sources(CSRC)],
        include_dirs=[str(CSRC / "include"), str(cuda_home / "include")],
        extra_compile_args={"cxx": recipe.CXX_FLAGS},
        extra_link_args=recipe.link_flags(cuda_home),
        # Relinks when a .cu or header changes (setuptools compares mtimes).
        depends=[str(path) for path in recipe.all_sources(CSRC)],
    )
    _notice(f"building the CUDA extension with {cuda_home / 'bin' / 'nvcc'} for TORCH_CUDA_ARCH_LIST={arch_list}")
    return [extension], {"build_ext": BuildExtensionWithNvcc}


ext_modules, cmdclass = _cuda_extension_plan()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
