"""Every Triton kernel compiles for real GPUs (sm_90a, sm_80) without spills.

The interpreter runs kernels that could never lower to a GPU; this catches
them on a CPU-only machine. The compile runs in a subprocess because this
process has ``TRITON_INTERPRET=1`` set (the interpreter replaces compilation).
"""

import os
import subprocess
import sys

import pytest

# Longer than the suite's 300 s a test (pyproject.toml): compiles every Triton kernel for sm_90a and sm_80 in a
# subprocess of up to 600 s.
pytestmark = pytest.mark.timeout(900)


def test_kernels_compile_for_gpus_without_spills():
    pytest.importorskip("triton")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "specdec_kernels._kernels.aot"], capture_output=True,
                            text=True, env=environment, timeout=600)
    print(result.stdout)
    report = os.environ.get("SPECDEC_AOT_REPORT")
    if report:  # .ci/run prints it after the suite
        with open(report, "w") as file:
            file.write(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    from specdec_kernels._kernels.aot import (BUILD_TREE_SHAPES, CHAIN_VERIFY_LOGPROBS_SHAPES,
                                              CHAIN_VERIFY_SAMPLING_SHAPES, CHAIN_VERIFY_SHAPES,
                                              COMPACT_KV_SHAPES, EAGLE_GREEDY_SHAPES, EAGLE_OUTPUTS_SHAPES,
                                              EAGLE_PARENTS_SHAPES, FLASHINFER_COUNTERS_SHAPES, TARGETS,
                                              VLLM_V2_OUTPUTS_SHAPES, VLLM_V2_PREPARE_SHAPES,
                                              TREE_VERIFY_LOGPROBS_SHAPES, TREE_VERIFY_SAMPLING_SHAPES,
                                              TREE_VERIFY_SHAPES,
                                              fault_counters_variants, tree_attention_variants)

    lines = [line for line in result.stdout.splitlines() if "registers" in line]
    shapes = (CHAIN_VERIFY_SHAPES, CHAIN_VERIFY_SAMPLING_SHAPES, CHAIN_VERIFY_LOGPROBS_SHAPES, TREE_VERIFY_SHAPES,
              TREE_VERIFY_SAMPLING_SHAPES, TREE_VERIFY_LOGPROBS_SHAPES, BUILD_TREE_SHAPES, COMPACT_KV_SHAPES,
              EAGLE_PARENTS_SHAPES, EAGLE_OUTPUTS_SHAPES, EAGLE_GREEDY_SHAPES, VLLM_V2_PREPARE_SHAPES,
              VLLM_V2_OUTPUTS_SHAPES, FLASHINFER_COUNTERS_SHAPES)
    # tree_attention compiles its merge kernel too for the shapes that split.
    variants = sum(map(len, shapes)) + len(tree_attention_variants()) + len(fault_counters_variants())
    assert len(lines) == variants * len(TARGETS)
    assert all("0 B spill stores, 0 B spill loads" in line for line in lines)


def test_launch_options_by_triton_version(monkeypatch):
    """Options the launchers choose by Triton version: Triton 3.9's are the tuned ones, older Triton (the GPU
    machines' 3.6) takes the ones its AOT compile needs (CI compiles with both)."""
    triton = pytest.importorskip("triton")
    from specdec_kernels.launchers import _shapes
    from specdec_kernels.launchers import chain_verify as chain
    from specdec_kernels.launchers import tree_attention as attention
    from specdec_kernels.launchers import tree_verify as tree

    small = tree.launch_config(256, 8, 100, multiprocessors=132)
    split = tree.launch_config(8, 64, 128256, multiprocessors=132)
    wide = attention.launch_config(32, 64, 8, 8, 128, 8192, 132)  # 128 x 128 (rows x D)
    narrow = attention.launch_config(1, 8, 4, 8, 128, 32768, 132)  # 32 x 128
    assert (small.block_v, split.num_splits > 1, wide.block_m, narrow.block_m) == (128, True, 128, 32)
    for older in (False, True):
        for module in (chain, tree, attention):
            monkeypatch.setattr(module, "older_triton", lambda older=older: older)
        assert (chain.num_warps(True), chain.num_warps(False)) == (16 if older else 8, 4)  # the walk and staged
        assert tree.launch_options(small, False) == {"num_warps": 4 if older else 8, "maxnreg": 128}
        assert tree.launch_options(split, True) == {"num_warps": 8, "maxnreg": 168 if older else 128}
        assert tree.launch_options(split, False) == {"num_warps": 8, "maxnreg": 128}
        assert tree.launch_options(split, False, True, 80) == {"num_warps": 8, "maxnreg": 168 if older else 128}
        assert tree.launch_options(split, False, True, 90) == {"num_warps": 8, "maxnreg": 128}
        # Triton 3.6 cannot lower a one-chunk sampler tile at V = 1000 (integer sums: no result changes).
        assert tree.launch_config(256, 8, 1000, multiprocessors=132).chunk_tile == (2 if older else 1)
        assert tree.launch_config(256, 8, 1000, interpreter=True).chunk_tile == 1
        assert attention.launch_options(wide, 128, 80) == {"num_warps": 8, **({"num_stages": 1} if older else {})}
        assert attention.launch_options(wide, 128, 90) == {"num_warps": 8}
        assert attention.launch_options(narrow, 128, 80) == {"num_warps": 8}
    assert _shapes.older_triton() == (tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9))
