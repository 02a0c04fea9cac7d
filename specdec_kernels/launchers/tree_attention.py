"""Launchers for tree_attention: the Triton kernels (configuration, outputs, one launch, two with a KV split) and
the CUDA extension.

A split context is merged by a second, small launch by default, rather than
by the last split program to finish (``MERGE_IN_KERNEL``, both backends):
the second launch needs no arrival counters kept at zero between calls (so
no persistent workspace, nothing to reserve before CUDA-graph capture). Both
forms merge the splits in the same order, so they give the same bits. Which
is faster, one launch more against the last program's serial merge, has not
been measured: no GPU was available; ``bench/bench_tree_attention.py`` times
both (providers ``triton-merge-in-kernel`` and ``cuda-merge-in-kernel``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _workspace
from ._shapes import (cdiv, device_capability, device_guard, multiprocessor_count, next_power_of_2, older_triton,
                      unit_last_stride)

LOG2_E = 1.4426950408889634

# Row tiles hold (node, query head) pairs; the accumulator and the query
# tile are BLOCK_M x D. Compiled for sm_90a (Triton 3.9, python -m
# specdec_kernels._kernels.aot), 128 x 64-key tiles at D = 128 spill 80-112
# bytes with 8 warps, and 64 x 64 at D = 128 spills 72-80 bytes with 4; with
# 8 warps, 64-key tiles up to 64 x 128 (rows x D) and 32-key tiles up to
# 128 x 128 take 150-233 registers on sm_90a and 128-255 on sm_80, without
# spills.
NUM_WARPS = 8
GPU_MAX_BLOCK_M = {64: 128, 128: 128, 256: 64}
WIDE_KEY_TILE_MAX_ELEMENTS = 64 * 128
MIN_BLOCK_M = 16  # tl.dot's smallest tile side
# Splits: about two programs per SM, each split at least this many prefix
# keys. Both are starting points, not yet measured on hardware.
PROGRAMS_PER_MULTIPROCESSOR = 2
GPU_MIN_SPLIT_KEYS = 512
MAX_SPLITS = 64
MERGE_NUM_WARPS = 4
MERGE_ROWS = 16  # rows merged at a time (per program of the merge launch); at most MIN_BLOCK_M
# True: the last split program of a tile merges it (one launch; counters in
# the workspace, so a CUDA-graph capture needs them reserved), on both
# backends. False: a second launch merges. Triton merges in the kernel only
# for row tiles of up to MERGE_IN_KERNEL_MAX_TILE (BLOCK_M x D) elements: at
# 64 x 128, 128 x 64 and 64 x 256 it spilled 4-156 bytes (the small tiles of
# short trees, where a long context is split most, are below it).
MERGE_IN_KERNEL = False
MERGE_IN_KERNEL_MAX_TILE = 32 * 128


# sm_8x under Triton before 3.9 (the GPU machines' 3.6): at Triton's default of 3 stages its 255-register
# compiles spilled 4 bytes (128 x 64 rows x D, 64 x 256) and 40 bytes (128 x 128, still 48 at 2 stages). Row
# tiles of at least 64 x 128 elements take 2 stages, 128 x 128 one: none spills. Smaller tiles, sm_90a and
# Triton 3.9 keep the default.
OLDER_TRITON_SM80_TWO_STAGE_TILE = 64 * 128
OLDER_TRITON_SM80_ONE_STAGE_TILE = (128, 128)  # (rows, D)


def launch_options(config: "LaunchConfig", head_dim: int, capability: int) -> dict:
    """The GPU launch's options (``num_warps``; ``num_stages`` where the default spills) on a device of compute
    capability ``capability`` (``10 * major + minor``) under the installed Triton."""
    options = {"num_warps": NUM_WARPS}
    if capability // 10 == 8 and older_triton() and config.block_m * head_dim >= OLDER_TRITON_SM80_TWO_STAGE_TILE:
        options["num_stages"] = 1 if (config.block_m, head_dim) == OLDER_TRITON_SM80_ONE_STAGE_TILE else 2
    return options


def merges_in_kernel(config: "LaunchConfig", head_dim: int) -> bool:
    """Whether a split launch merges in its last program (else a second launch merges)."""
    return (MERGE_IN_KERNEL and config.num_splits > 1
            and config.block_m * head_dim <= MERGE_IN_KERNEL_MAX_TILE)


# Interpreter (CPU): programs run one after another, so small key tiles and
# a pretend 4-program machine make tests cross tiles and splits.
INTERPRETER_BLOCK_N = 16
INTERPRETER_PROGRAMS = 4
INTERPRETER_MIN_SPLIT_KEYS = 32


class LaunchConfig(NamedTuple):
    block_m: int
    block_n: int
    row_tiles: int
    num_splits: int


def launch_config(batch_size: int, max_nodes: int, group: int, num_kv_heads: int, head_dim: int, capacity: int,
                  multiprocessors: int | None) -> LaunchConfig:
    """How to launch; ``multiprocessors=None`` means the interpreter.

    ``capacity`` is the block table's span in positions (``max_blocks *
    block_size``), the longest prefix the shapes allow: the split count
    comes from shapes only, so choosing it reads nothing on the device.
    """
    rows = max_nodes * group
    if multiprocessors is None:
        max_block_m, block_n = 128, INTERPRETER_BLOCK_N
        wanted_programs, min_split_keys = INTERPRETER_PROGRAMS, INTERPRETER_MIN_SPLIT_KEYS
    else:
        max_block_m, block_n = GPU_MAX_BLOCK_M[head_dim], None
        wanted_programs, min_split_keys = PROGRAMS_PER_MULTIPROCESSOR * multiprocessors, GPU_MIN_SPLIT_KEYS
    block_m = max(MIN_BLOCK_M, min(next_power_of_2(rows), max_block_m))
    if block_n is None:
        block_n = 64 if block_m * head_dim <= WIDE_KEY_TILE_MAX_ELEMENTS else 32
    row_tiles = cdiv(rows, block_m)
    programs = batch_size * num_kv_heads * row_tiles
    num_splits = max(1, min(cdiv(wanted_programs, programs), cdiv(capacity, min_split_keys), MAX_SPLITS))
    return LaunchConfig(block_m, block_n, row_tiles, num_splits)


def triton_tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, scale,
                          num_splits=None):
    """``out [B, N, Hq, D]``; ``num_splits`` overrides the configuration's (tests use it).

    The op has checked shapes and dtypes, and that the block size is a power of two.
    """
    from .._kernels.tree_attention import _tree_attention_kernel, _tree_attention_merge_kernel

    batch_size, max_nodes, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    out = torch.empty((batch_size, max_nodes, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if scale is None:  # a direct torch.ops.specdec call may leave it out
        scale = head_dim**-0.5
    device = q.device
    interpreter = device.type != "cuda"
    config = launch_config(batch_size, max_nodes, num_q_heads // num_kv_heads, num_kv_heads, head_dim,
                           max_blocks * block_size, None if interpreter else multiprocessor_count(device))
    if num_splits is not None:
        config = config._replace(num_splits=num_splits)
    q, k_cache, v_cache, tree_mask = (unit_last_stride(t) for t in (q, k_cache, v_cache, tree_mask))
    split = config.num_splits > 1
    partial_rows = batch_size * max_nodes * num_q_heads * config.num_splits if split else 0
    partial_acc = torch.empty((partial_rows, head_dim), dtype=torch.float32, device=device)
    partial_max = torch.empty((partial_rows,), dtype=torch.float32, device=device)
    partial_sum = torch.empty((partial_rows,), dtype=torch.float32, device=device)
    placeholder = prefix_lens
    tiles = batch_size * num_kv_heads * config.row_tiles
    merge_last = merges_in_kernel(config, head_dim)
    guard = device_guard(device)
    with guard:
        counters = (_workspace.buffers(device, {"tree_attention.merge_counter": (tiles, torch.int32)})
                    ["tree_attention.merge_counter"] if merge_last else placeholder)
        _tree_attention_kernel[(tiles, config.num_splits)](
            q, k_cache, v_cache, block_tables, prefix_lens, tree_mask,
            placeholder if num_nodes is None else num_nodes,
            out, partial_acc, partial_max, partial_sum, counters,
            scale * LOG2_E,
            max_nodes, num_q_heads // num_kv_heads, num_q_heads, num_kv_heads, config.row_tiles, config.num_splits,
            num_blocks, max_blocks, block_size.bit_length() - 1,
            q.stride(0), q.stride(1), q.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), block_tables.stride(1), prefix_lens.stride(0),
            tree_mask.stride(0), tree_mask.stride(1), 0 if num_nodes is None else num_nodes.stride(0),
            HAS_NUM_NODES=num_nodes is not None, SPLIT=split, MERGE_LAST=merge_last, FLOAT32_TILES=interpreter,
            HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, MERGE_ROWS=MERGE_ROWS,
            **({"num_warps": NUM_WARPS} if interpreter
               else launch_options(config, head_dim, device_capability(device))),
        )
        if split and not merge_last:
            num_rows = batch_size * max_nodes * num_q_heads
            _tree_attention_merge_kernel[(cdiv(num_rows, MERGE_ROWS),)](
                out, partial_acc, partial_max, partial_sum, num_rows, config.num_splits,
                HEAD_DIM=head_dim, BLOCK_R=MERGE_ROWS, num_warps=MERGE_NUM_WARPS,
            )
    return out



# The fewest rows of a CUDA tensor-core program's tile (csrc/include/specdec/tree_attention.cuh,
# kTreeAttentionMinTileRows), the program that merges in its last split: counters for
# B * Hkv * ceil(N * Hq / Hkv / 32) programs cover any of its plans. The SIMT program (float32, D = 256,
# GPUs before sm_80) always merges by a second launch.
CUDA_MIN_TILE_ROWS = 32


def cuda_merge_counters(batch_size: int, max_nodes: int, num_q_heads: int, num_kv_heads: int) -> int:
    """int32 merge counters a CUDA call needs to merge its splits in the kernel (at least one)."""
    return max(1, batch_size * num_kv_heads * cdiv(max_nodes * (num_q_heads // num_kv_heads), CUDA_MIN_TILE_ROWS))


def cuda_tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, scale,
                        num_splits=None):
    """The extension's kernels (csrc/include/specdec/tree_attention.cuh and tree_attention_mma.cuh): one
    launch, two with a KV split unless ``MERGE_IN_KERNEL`` and the tensor-core program runs.

    It reads every input through its strides and allocates the output; the
    split count comes from shapes and the device's cached SM count (in
    csrc/tree_attention.cu), or ``num_splits`` (tests force it).
    """
    counters = None
    if MERGE_IN_KERNEL:
        batch_size, max_nodes, num_q_heads, _ = q.shape
        words = cuda_merge_counters(batch_size, max_nodes, num_q_heads, k_cache.shape[2])
        counters = _workspace.buffers(q.device, {"tree_attention_cuda.merge_counter": (words, torch.int32)})[
            "tree_attention_cuda.merge_counter"]
    return torch.ops.specdec_C.tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes,
                                              scale, 0 if num_splits is None else num_splits, counters)
