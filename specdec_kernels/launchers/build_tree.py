"""Launchers for build_tree: the Triton kernel (configuration, outputs, one launch) and the CUDA extension."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._shapes import cdiv, device_guard, next_power_of_2

# A program's tile is BLOCK_NODES x BLOCK_WORDS int32 words: at most 1024,
# 8 per thread of 4 warps. N <= 64 (the EAGLE range) is one program per
# request (64 x 2 words); N = 1024 is 32 programs of 32 nodes x 32 words.
MAX_TILE = 1024
MAX_BLOCK_NODES = 128
NUM_WARPS = 4
# Interpreter (CPU): programs run one after another at milliseconds per
# step, so tiles are wide; N = 1024 still spans 4 node blocks, so tests
# cross blocks.
INTERPRETER_MAX_TILE = 1 << 14
INTERPRETER_MAX_BLOCK_NODES = 256


class LaunchConfig(NamedTuple):
    block_nodes: int
    block_words: int
    node_blocks: int


def launch_config(max_nodes: int, interpreter: bool = False) -> LaunchConfig:
    num_words = cdiv(max_nodes, 32)
    block_words = next_power_of_2(num_words)
    max_tile, max_block_nodes = ((INTERPRETER_MAX_TILE, INTERPRETER_MAX_BLOCK_NODES) if interpreter
                                 else (MAX_TILE, MAX_BLOCK_NODES))
    block_nodes = max(1, min(next_power_of_2(max_nodes), max_tile // block_words, max_block_nodes))
    return LaunchConfig(block_nodes, block_words, cdiv(max_nodes, block_nodes))


def triton_build_tree(parents, num_nodes, prefix_lens):
    from .._kernels.build_tree import _build_tree_kernel

    batch_size, max_nodes = parents.shape
    device = parents.device
    num_words = cdiv(max_nodes, 32)
    mask = torch.empty((batch_size, max_nodes, num_words), dtype=torch.int32, device=device)
    depth = torch.empty((batch_size, max_nodes), dtype=torch.int32, device=device)
    positions = torch.empty((batch_size, max_nodes), dtype=torch.int64, device=device)
    if batch_size == 0 or max_nodes == 0:
        return mask, depth, positions
    config = launch_config(max_nodes, interpreter=device.type != "cuda")
    placeholder = parents
    guard = device_guard(device)
    with guard:
        _build_tree_kernel[(batch_size, config.node_blocks)](
            parents, placeholder if num_nodes is None else num_nodes,
            placeholder if prefix_lens is None else prefix_lens,
            mask, depth, positions,
            max_nodes, num_words,
            parents.stride(0), parents.stride(1),
            0 if num_nodes is None else num_nodes.stride(0), 0 if prefix_lens is None else prefix_lens.stride(0),
            HAS_NUM_NODES=num_nodes is not None, HAS_PREFIX=prefix_lens is not None,
            BLOCK_NODES=config.block_nodes, BLOCK_WORDS=config.block_words,
            num_warps=NUM_WARPS,
        )
    return mask, depth, positions


def cuda_build_tree(parents, num_nodes, prefix_lens):
    """The extension's kernel (csrc/include/specdec/build_tree.cuh): one launch, outputs allocated by the op."""
    return torch.ops.specdec_C.build_tree(parents, num_nodes, prefix_lens)
