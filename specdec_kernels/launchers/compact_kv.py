"""Launchers for compact_kv: the Triton kernel (configuration and one launch, in place) and the CUDA extension."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._shapes import cdiv, device_guard, next_power_of_2

# A program holds a [BLOCK_N, BLOCK_F] tile of one cache (BLOCK_N the path
# width): 1024 elements, 4 per thread of 8 warps, with their 64-bit
# addresses (python -m specdec_kernels._kernels.aot reports the registers).
# With 4 warps the 1024-node path tile took 168 registers on sm_90a and
# spilled 28 bytes under Triton 3.6 (the GPU machines' version).
MAX_TILE = 1024
NUM_WARPS = 8
# Interpreter (CPU): programs run one after another, so tiles are wide.
INTERPRETER_MAX_TILE = 1 << 16

# Caches are moved as integers of the same width: a move copies bits
# (NaN payloads included) and needs no float arithmetic under the interpreter.
_BITS_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class LaunchConfig(NamedTuple):
    block_n: int
    block_f: int
    feature_blocks: int


def launch_config(path_width: int, num_features: int, interpreter: bool = False) -> LaunchConfig:
    max_tile = INTERPRETER_MAX_TILE if interpreter else MAX_TILE
    block_n = next_power_of_2(path_width)
    block_f = max(1, min(next_power_of_2(num_features), max_tile // block_n))
    return LaunchConfig(block_n, block_f, cdiv(num_features, block_f))


def triton_compact_kv(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes):
    from .._kernels.compact_kv import _compact_kv_kernel

    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    batch_size, path_width = accepted_nodes.shape
    max_blocks = block_tables.shape[1]
    num_features = num_kv_heads * head_dim
    if batch_size == 0 or path_width == 0 or num_blocks == 0 or block_size == 0 or max_blocks == 0 \
            or num_features == 0:
        return
    as_int = _BITS_AS_INT[k_cache.element_size()]
    k_bits, v_bits = k_cache.view(as_int), v_cache.view(as_int)
    device = k_cache.device
    config = launch_config(path_width, num_features, interpreter=device.type != "cuda")
    guard = device_guard(device)
    with guard:
        _compact_kv_kernel[(batch_size, config.feature_blocks)](
            k_bits, v_bits, block_tables, prefix_lens, accepted_nodes,
            path_width, num_blocks, block_size, max_blocks, head_dim, num_features,
            *k_bits.stride(), *v_bits.stride(),
            block_tables.stride(0), block_tables.stride(1), prefix_lens.stride(0),
            accepted_nodes.stride(0), accepted_nodes.stride(1),
            BLOCK_N=config.block_n, BLOCK_F=config.block_f,
            num_warps=NUM_WARPS,
        )


def cuda_compact_kv(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes):
    """The extension's kernel (csrc/include/specdec/compact_kv.cuh): one launch, in place.

    It moves the caches' bits in units of up to 16 bytes itself, so the caches
    are passed as they are; paths are at most 1024 entries wide.
    """
    torch.ops.specdec_C.compact_kv(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes)
