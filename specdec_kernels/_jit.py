"""Build the CUDA extension into a per-user cache when the install did not build it.

An isolated build (``pip install .``, ``pip wheel .``, ``python -m build``)
has no torch, so ``setup.py`` cannot build ``specdec_kernels._C`` there; the
wheel carries the sources instead (``specdec_kernels/_csrc``).
``python -m specdec_kernels build`` (:func:`build_and_load`) compiles them
with the recipe ``setup.py`` uses (``_cuda_build``) into a per-user cache,
and later processes load that build (:func:`load_built`). Nothing compiles
by itself: an op call never starts a build (it takes minutes, and would
stall a serving process without a word); until the build exists,
``backend="auto"`` uses Triton.

The cache directory is keyed by a hash of the sources, the torch and Python
versions, the target architectures and the nvcc version, so a changed source
or an upgraded torch needs a new build, and a build is reused by every
process that matches it (a file lock serialises concurrent builds of one key).

Environment: ``SPECDEC_CACHE_DIR`` (default ``$XDG_CACHE_HOME/specdec_kernels``
or ``~/.cache/specdec_kernels``) holds the builds; ``TORCH_CUDA_ARCH_LIST``
(default: the architectures of the visible GPUs), ``MAX_JOBS``, ``CUDA_HOME``
as for ``setup.py``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from . import _cuda_build

CACHE_ENV = "SPECDEC_CACHE_DIR"
LIBRARY_NAME = "specdec_C"
_LOG_TAIL_LINES = 30

logger = logging.getLogger("specdec_kernels")


BUILD_COMMAND = _cuda_build.BUILD_COMMAND


class JitUnavailable(RuntimeError):
    """The extension cannot be built or loaded here; the message says why."""


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdec_kernels"


def gpu_arch_list() -> str:
    """``TORCH_CUDA_ARCH_LIST``, else the visible GPUs' architectures (``9.0a`` on sm_90, as setup.py's default)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    import torch

    if not torch.cuda.is_available():
        return _cuda_build.DEFAULT_ARCH_LIST
    capabilities = sorted({torch.cuda.get_device_capability(index) for index in range(torch.cuda.device_count())})
    return ";".join(f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "") for major, minor in capabilities)


def build_key(csrc: Path, cuda_home: Path, arch_list: str) -> str:
    """Hash of everything the compiled library depends on."""
    import torch

    digest = hashlib.sha256()
    for path in _cuda_build.all_sources(csrc):
        digest.update(path.relative_to(csrc).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    nvcc_version = subprocess.run([str(cuda_home / "bin" / "nvcc"), "--version"], capture_output=True, text=True,
                                  check=False).stdout
    for part in (torch.__version__, str(torch.version.cuda), str(torch._C._GLIBCXX_USE_CXX11_ABI),
                 sys.implementation.cache_tag, arch_list, str(cuda_home), nvcc_version,
                 " ".join([*_cuda_build.CXX_FLAGS, *_cuda_build.CUDA_LIBRARIES])):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def _build_directory(arch_list: str | None) -> tuple[Path, Path, Path, list[str] | None, str]:
    """``(directory, csrc, cuda_home, ninja, arch_list)`` of the build matching this install and machine."""
    csrc = _cuda_build.source_dir(Path(__file__).resolve().parent)
    if csrc is None:
        raise JitUnavailable("the CUDA sources are not installed (specdec_kernels/_csrc is missing): reinstall "
                             "specdec_kernels")
    cuda_home = _cuda_build.find_cuda_home()
    if cuda_home is None:
        raise JitUnavailable("nvcc was not found to build it (install a CUDA toolkit or set CUDA_HOME, then run "
                             f"{BUILD_COMMAND})")
    arch_list = arch_list or gpu_arch_list()
    directory = cache_root() / f"cuda-{build_key(csrc, cuda_home, arch_list)[:24]}"
    return directory, csrc, cuda_home, _cuda_build.find_ninja(), arch_list


def _library(directory: Path) -> Path:
    return directory / "torch" / f"{LIBRARY_NAME}.so"


def _complete(directory: Path) -> Path:
    return directory / "complete"  # written after a build that loaded: a crashed build is redone


def _load(directory: Path) -> Path:
    import torch

    torch.ops.load_library(str(_library(directory)))
    return _library(directory)


def load_built(arch_list: str | None = None) -> Path:
    """Load the cached build made by :func:`build_and_load` for this install; its path. Never compiles.

    Raises :class:`JitUnavailable` when there is none, naming the command that makes it.
    """
    directory = _build_directory(arch_list)[0]
    if not _complete(directory).exists():
        raise JitUnavailable(f"no build of it for this install in {cache_root()}: run {BUILD_COMMAND} (a few "
                             "minutes, once; needs nvcc and ninja), or install with pip install "
                             "--no-build-isolation .")
    return _load(directory)


def build_and_load(arch_list: str | None = None, report=logger.warning) -> Path:
    """Compile the extension into the cache unless it is there, load it; its path.

    ``report`` gets a line when a compile starts and one when it ends, with
    its time. Raises :class:`JitUnavailable` saying why when it cannot (no
    sources, nvcc or ninja missing, the compiler failed: the message ends
    with the build log's tail and its path).
    """
    directory, csrc, cuda_home, ninja, arch_list = _build_directory(arch_list)
    if ninja is None:
        raise JitUnavailable(f"ninja was not found to build it (pip install ninja, then run {BUILD_COMMAND})")
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory.with_suffix(".lock")):
        if not _complete(directory).exists():
            start = time.perf_counter()
            report(f"specdec_kernels: compiling the CUDA extension (TORCH_CUDA_ARCH_LIST={arch_list}, "
                   f"MAX_JOBS={os.environ.get('MAX_JOBS', 'all cores')}) into {directory}; this takes minutes once")
            _build(csrc, directory, cuda_home, arch_list, ninja)
            _complete(directory).write_text(str(_library(directory)) + "\n")
            report(f"specdec_kernels: the CUDA extension is compiled and loaded in "
                   f"{time.perf_counter() - start:.0f} s ({_library(directory)})")
            return _library(directory)
    return _load(directory)


def _build(csrc: Path, directory: Path, cuda_home: Path, arch_list: str, ninja: list[str]) -> None:
    """nvcc objects, then ``torch.utils.cpp_extension.load`` links them with the binding (and loads the result)."""
    from torch.utils import cpp_extension

    log_path = directory / "build.log"
    with log_path.open("w") as log:
        try:
            objects = _cuda_build.compile_cuda(csrc, directory / "nvcc", cuda_home, arch_list, ninja, log=log)
        except (OSError, subprocess.CalledProcessError) as error:
            raise JitUnavailable(f"nvcc failed ({error}): {_tail(log_path)}") from None
    (directory / "torch").mkdir(exist_ok=True)
    try:
        cpp_extension.load(
            name=LIBRARY_NAME,
            sources=[str(path) for path in _cuda_build.binding_sources(csrc)],
            extra_cflags=_cuda_build.CXX_FLAGS,
            extra_ldflags=[*objects, *_cuda_build.link_flags(cuda_home)],
            extra_include_paths=[str(csrc / "include"), str(cuda_home / "include")],
            build_directory=str(directory / "torch"),
            is_python_module=False,
        )
    except Exception as error:  # the compiler's or the loader's error: report it, never fall over
        raise JitUnavailable(f"building or loading {directory / 'torch'} failed: {type(error).__name__}: "
                             f"{_last_lines(str(error))}") from None


@contextlib.contextmanager
def _locked(path: Path):
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _tail(log_path: Path) -> str:
    return f"{_last_lines(log_path.read_text(errors='replace'))} (full log: {log_path})"


def _last_lines(text: str) -> str:
    return "\n".join(text.strip().splitlines()[-_LOG_TAIL_LINES:])
