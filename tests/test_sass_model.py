"""The static SASS model (bench/sass_model.py, bench/sass_loops.py): its parser finds loops and counts loads.

One hand-written SASS listing checks the parser and the loop analysis with no tool at all; then the model's
``--quick`` run (build_tree: the Triton kernel compiled ahead of time for sm_90a, and the extension's CUDA kernel
when it is built) in a subprocess, because this process may have ``TRITON_INTERPRET=1`` set.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Longer than the suite's 300 s a test (pyproject.toml): its fixture compiles the kernels in a subprocess of up
# to 300 s.
pytestmark = pytest.mark.timeout(600)

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPT = BENCH / "sass_model.py"


def _sass_loops():
    if str(BENCH) not in sys.path:  # the bench scripts import one another by plain name
        sys.path.insert(0, str(BENCH))
    import sass_loops

    return sass_loops


# A loop at 0x0020-0x0060 (one vector load, a branch around a cold block without loads) inside a kernel that
# exits at 0x0080; the second hex word of each instruction is its control word (stall 1, no scoreboards).
LISTING = """
\t\tFunction : toy_kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;          /* 0x00000a0000017a02 */
                                                                   /* 0x000fc20000000f00 */
        /*0010*/                   MOV R2, RZ ;                    /* 0x000000ff00027202 */
                                                                   /* 0x000fc20000000f00 */
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;  /* 0x0000000402047981 */
                                                                   /* 0x000fc20000000f00 */
        /*0030*/              @P1  BRA 0x50 ;                      /* 0x0000000000001947 */
                                                                   /* 0x000fc20003800000 */
        /*0040*/                   FADD R0, R4, R5 ;               /* 0x0000000504007221 */
                                                                   /* 0x000fc20000000000 */
        /*0050*/                   IADD3 R2, R2, 0x10, RZ ;        /* 0x0000001002027810 */
                                                                   /* 0x000fc20007ffe0ff */
        /*0060*/              @P0  BRA 0x20 ;                      /* 0x0000000000000947 */
                                                                   /* 0x000fc20003800000 */
        /*0070*/                   STG.E [R2.64], R0 ;             /* 0x0000000002007986 */
                                                                   /* 0x000fc2000c101904 */
        /*0080*/                   EXIT ;                          /* 0x000000000000794d */
                                                                   /* 0x000fc20003800000 */
"""


def test_parser_finds_the_loop_and_its_load():
    model = _sass_loops()
    (code,) = model.parse_sass(LISTING).values()
    assert [ins.opcode for ins in code][:3] == ["MOV", "MOV", "LDG.E.128"]
    cfg = model.build_cfg(code)
    (loop,) = model.find_loops(cfg)
    assert (loop.head_address, loop.latch_address) == (0x20, 0x60)
    stats = model.loop_stats(cfg, loop, [loop], "walk", None)
    # The fast path skips the FADD (no load on it): LDG, BRA, IADD3, BRA.
    assert [ins.address for ins in stats.path] == [0x20, 0x30, 0x50, 0x60]
    assert stats.body_instructions == 5 and stats.load_bytes == 16
    assert stats.counts["LDG.E.128"] == 1


@pytest.fixture(scope="module")
def quick_report():
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").is_file():
        pytest.skip("Triton's package carries no cuobjdump")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True,
                            env=environment, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _check_walk(report: dict):
    assert report["loops"] >= 1
    assert report["path_instructions"] > 0
    assert report["load_bytes"] >= 4  # an int32 parent per node and step, at least
    assert any(opcode.startswith("LDG") for opcode in report["loads"])
    prediction = report["prediction"]
    assert 0 < prediction["latency_floor_us"] <= prediction["predicted_us"] < 1000


def test_triton_build_tree_hot_loop(quick_report):
    _check_walk(quick_report["triton"])


def test_cuda_build_tree_hot_loop(quick_report):
    if "cuda" not in quick_report:
        pytest.skip("the CUDA extension is not built")
    _check_walk(quick_report["cuda"])
