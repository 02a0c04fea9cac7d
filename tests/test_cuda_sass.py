"""No compare-and-swap retry loops in the CUDA extension's machine code.

sm_80 and sm_90a have no 64-bit add for shared memory: ptxas lowers one to
an ``ATOMS.CAST.SPIN`` loop (load, add, compare-and-swap, retry while another
lane changed the word), which serialises the lanes that hit the same word.
truncation.cuh's radix histograms had 864 such sites; they add with 32-bit
atomics now (csrc/include/specdec/split_word_bins.cuh). This test
disassembles the built ``specdec_kernels/_C*.so`` with the ``cuobjdump`` in
Triton's wheel and fails on any such instruction, naming the kernels.

Skips when the extension is not built or no cuobjdump is found (CI has
both). The disassembly is about 290 MB of text, read as a stream: about 25 s.
"""

import importlib.util
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

FORBIDDEN = "ATOMS.CAST.SPIN"


def _extension_path() -> Path | None:
    spec = importlib.util.find_spec("specdec_kernels._C")
    return Path(spec.origin) if spec is not None and spec.origin else None


def _cuobjdump() -> Path | None:
    """Triton's copy (pinned with triton, on every CI machine), else the CUDA toolkit's."""
    spec = importlib.util.find_spec("triton")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(root) / "backends" / "nvidia" / "bin" / "cuobjdump"
        if candidate.is_file():
            return candidate
    from specdec_kernels._cuda_build import find_cuda_home

    cuda_home = find_cuda_home()
    candidate = cuda_home / "bin" / "cuobjdump" if cuda_home is not None else None
    return candidate if candidate is not None and candidate.is_file() else None


def _demangled(names: list[str]) -> list[str]:
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None:
        return names
    result = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True, check=False)
    lines = result.stdout.splitlines()
    return lines if result.returncode == 0 and len(lines) == len(names) else names


def _forbidden_sites(cuobjdump: Path, library: Path) -> tuple[Counter, int]:
    """(sites per (arch, kernel), number of kernels disassembled)."""
    sites: Counter = Counter()
    kernels = 0
    arch = function = "?"
    with subprocess.Popen([str(cuobjdump), "-sass", str(library)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as process:
        for line in process.stdout:
            if FORBIDDEN in line:
                sites[(arch, function)] += 1
            elif "Function :" in line:
                function = line.split("Function :", 1)[1].strip()
                kernels += 1
            elif "code for sm_" in line:
                arch = line.split("code for", 1)[1].strip()
        stderr = process.stderr.read()
    assert process.returncode == 0, f"{cuobjdump} -sass {library} failed ({process.returncode}): {stderr}"
    return sites, kernels


def test_no_compare_and_swap_loops_in_extension_sass():
    library = _extension_path()
    if library is None or not library.is_file():
        pytest.skip("specdec_kernels._C is not built")
    cuobjdump = _cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (Triton's backends/nvidia/bin or the CUDA toolkit's)")
    sites, kernels = _forbidden_sites(cuobjdump, library)
    assert kernels > 0, f"{cuobjdump} -sass {library} listed no kernel: nothing was checked"
    if sites:
        keys = sorted(sites)
        names = _demangled([function for _, function in keys])
        report = "\n".join(f"  {sites[key]:4d}  {key[0]}  {name}" for key, name in zip(keys, names))
        pytest.fail(f"{sum(sites.values())} {FORBIDDEN} sites (compare-and-swap retry loops, e.g. a 64-bit "
                    f"shared-memory atomicAdd; use 32-bit atomics as split_word_bins.cuh does) in {library.name}:\n"
                    f"{report}", pytrace=False)
