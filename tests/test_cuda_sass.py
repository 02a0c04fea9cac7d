"""Machine-code checks of the CUDA extension's SASS.

* No compare-and-swap retry loops. sm_80 and sm_90a have no 64-bit add for
  shared memory: ptxas lowers one to an ``ATOMS.CAST.SPIN`` loop (load, add,
  compare-and-swap, retry while another lane changed the word), which
  serialises the lanes that hit the same word. truncation.cuh's radix
  histograms had 864 such sites; they add with 32-bit atomics now
  (csrc/include/specdec/split_word_bins.cuh).
* The tensor-core tree attention (tree_attention_mma.cuh) is fed as a
  tensor-core kernel: its fragments come from shared memory by ``ldmatrix``
  (``LDSM``), and its instantiation for 16-byte aligned heads copies Q, K
  and V by ``cp.async`` (``LDGSTS``) only, with no element-wise global load
  (``LDG.E.U16``; Q was loaded so, one element and a 64-bit division at a
  time, and V's fragments took four ``LDS.U16`` a mma).

Both disassemble the built ``specdec_kernels/_C*.so`` once, with the
``cuobjdump`` in Triton's wheel, and name the kernels that fail. They skip
when the extension is not built or no cuobjdump is found (CI has both). The
disassembly is about 290 MB of text, read as a stream: about 25 s.
"""

import importlib.util
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

FORBIDDEN = "ATOMS.CAST.SPIN"
TENSOR_CORE_ATTENTION = "tree_attention_mma_kernel"
# The kLoads16Bytes = true instantiation (Itanium mangling of a bool template argument after the head dim).
LOADS_16_BYTES = re.compile(r"tree_attention_mma_kernelI.*Li\d+ELb1E")
ATTENTION_ARCHS = ("sm_80", "sm_90a")
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")


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


class _Sass:
    """What the checks need from one pass over the disassembly."""

    def __init__(self):
        self.library: Path | None = None
        self.sites: Counter = Counter()  # FORBIDDEN per (arch, kernel)
        self.kernels = 0
        self.attention_opcodes: dict[tuple[str, str], Counter] = {}  # (arch, kernel) -> opcode counts


def _scan(cuobjdump: Path, library: Path) -> _Sass:
    sass = _Sass()
    sass.library = library
    arch = function = "?"
    opcodes = None  # the counter of the current kernel when it is a tensor-core tree attention
    with subprocess.Popen([str(cuobjdump), "-sass", str(library)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as process:
        for line in process.stdout:
            if FORBIDDEN in line:
                sass.sites[(arch, function)] += 1
            elif "Function :" in line:
                function = line.split("Function :", 1)[1].strip()
                sass.kernels += 1
                opcodes = None
                if TENSOR_CORE_ATTENTION in function:
                    opcodes = sass.attention_opcodes.setdefault((arch, function), Counter())
                continue
            elif "code for sm_" in line:
                arch = line.split("code for", 1)[1].strip()
                opcodes = None
            if opcodes is not None and (match := _OPCODE.match(line)):
                opcodes[match.group(1)] += 1
        stderr = process.stderr.read()
    assert process.returncode == 0, f"{cuobjdump} -sass {library} failed ({process.returncode}): {stderr}"
    return sass


@pytest.fixture(scope="module")
def extension_sass() -> _Sass:
    library = _extension_path()
    if library is None or not library.is_file():
        pytest.skip("specdec_kernels._C is not built")
    cuobjdump = _cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (Triton's backends/nvidia/bin or the CUDA toolkit's)")
    sass = _scan(cuobjdump, library)
    assert sass.kernels > 0, f"{cuobjdump} -sass {library} listed no kernel: nothing was checked"
    return sass


def test_no_compare_and_swap_loops_in_extension_sass(extension_sass):
    sites = extension_sass.sites
    if sites:
        keys = sorted(sites)
        names = _demangled([function for _, function in keys])
        report = "\n".join(f"  {sites[key]:4d}  {key[0]}  {name}" for key, name in zip(keys, names))
        pytest.fail(f"{sum(sites.values())} {FORBIDDEN} sites (compare-and-swap retry loops, e.g. a 64-bit "
                    f"shared-memory atomicAdd; use 32-bit atomics as split_word_bins.cuh does) in "
                    f"{extension_sass.library.name}:\n{report}", pytrace=False)


def _count(opcodes: Counter, test) -> int:
    return sum(count for opcode, count in opcodes.items() if test(opcode))


def test_tensor_core_tree_attention_loads_fragments_by_ldmatrix_and_q_by_cp_async(extension_sass):
    kernels = {key: opcodes for key, opcodes in extension_sass.attention_opcodes.items()
               if key[0] in ATTENTION_ARCHS}
    assert kernels, (f"no {TENSOR_CORE_ATTENTION} in the {'/'.join(ATTENTION_ARCHS)} code of "
                     f"{extension_sass.library.name}: nothing was checked")
    failures = []
    for arch in sorted({arch for arch, _ in kernels}):
        wide = [function for (code, function) in kernels if code == arch and LOADS_16_BYTES.search(function)]
        if not wide:
            failures.append(f"{arch}: no instantiation for 16-byte aligned heads (kLoads16Bytes = true)")
        for function in sorted(function for code, function in kernels if code == arch):
            opcodes = kernels[(arch, function)]
            ldmatrix = _count(opcodes, lambda op: op.startswith("LDSM"))
            if ldmatrix == 0:
                failures.append(f"{arch} {function}: no LDSM (fragments not loaded by ldmatrix)")
            if function in wide:
                element_loads = _count(opcodes, lambda op: op.startswith("LDG") and ".U16" in op)
                copies = _count(opcodes, lambda op: op.startswith("LDGSTS"))
                if element_loads or not copies:
                    failures.append(f"{arch} {function}: {element_loads} LDG*.U16 (element-wise loads of Q, K "
                                    f"or V) and {copies} LDGSTS (cp.async); expected none and some")
    if failures:
        pytest.fail("the tensor-core tree attention is not fed by ldmatrix and cp.async:\n  "
                    + "\n  ".join(failures), pytrace=False)
