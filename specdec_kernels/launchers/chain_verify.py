"""Launchers for chain_verify: the Triton kernel (configuration, workspace, one launch) and the CUDA extension."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .. import _workspace

GPU_TILE = 1024  # elements per program per loop iteration
# One-request programs get up to 128 registers: left to itself ptxas picks
# 64-96 and spills a few bytes in the logits and one-hot variants
# (python -m specdec_kernels._kernels.aot shows the report).
GPU_MAX_REGISTERS = 128
INTERPRETER_TILE = 32768
INTERPRETER_MAX_BLOCK_V = 256
INTERPRETER_MAX_SPLITS = 3


class LaunchConfig(NamedTuple):
    rows: int  # requests per program
    block_v: int  # vocabulary tile per loop iteration
    split_size: int  # vocabulary slice per program
    num_splits: int
    max_registers: int | None


def launch_config(batch_size: int, vocab_size: int, multiprocessors: int | None) -> LaunchConfig:
    """How to launch the kernel; ``multiprocessors=None`` means the interpreter.

    On a GPU a program handles one tile per loop iteration and there are
    about two programs per SM, so one request's vocabulary spreads over the
    machine; small vocabularies pack several requests into a tile. Under the
    interpreter (CPU) programs run one after another, so tiles are wide and
    many requests share a program, while tiles stay at most 256 wide so tests
    with a few hundred tokens still cross several slices.
    """
    vocab_tile = _next_power_of_2(vocab_size)
    if multiprocessors is not None:
        block_v = min(vocab_tile, GPU_TILE)
        rows = min(max(1, GPU_TILE // block_v), _next_power_of_2(batch_size))
        target_programs, max_splits = 2 * multiprocessors, vocab_size
    else:
        block_v = min(vocab_tile, INTERPRETER_MAX_BLOCK_V)
        rows = min(max(1, INTERPRETER_TILE // block_v), _next_power_of_2(batch_size))
        target_programs, max_splits = 1, INTERPRETER_MAX_SPLITS
    tiles = _cdiv(vocab_size, block_v)
    row_blocks = _cdiv(batch_size, rows)
    splits = max(1, min(tiles, max_splits, _cdiv(target_programs, row_blocks)))
    split_size = _cdiv(tiles, splits) * block_v
    max_registers = GPU_MAX_REGISTERS if multiprocessors is not None and rows == 1 else None
    return LaunchConfig(rows, block_v, split_size, _cdiv(vocab_size, split_size), max_registers)


def _next_power_of_2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _unit_last_stride(tensor):
    if tensor is None or tensor.dim() == 0 or tensor.stride(-1) == 1:
        return tensor
    return tensor.contiguous()


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def triton_chain_verify(draft_token_ids, target, draft, num_draft_tokens, temperature, logits,
                        seed_tensor, seed, offset_tensor, offset):
    from .._kernels.chain_verify import _chain_verify_kernel

    batch_size, rows_per_request, vocab_size = target.shape
    max_drafts = rows_per_request - 1
    device = target.device
    output = torch.empty((batch_size, rows_per_request), dtype=torch.int32, device=device)
    num_accepted = torch.empty((batch_size,), dtype=torch.int32, device=device)
    if batch_size == 0:
        return output, num_accepted
    # The kernel takes row strides and assumes unit stride along the last dim.
    draft_token_ids, target, draft, num_draft_tokens, temperature, seed_tensor, offset_tensor = (
        _unit_last_stride(tensor)
        for tensor in (draft_token_ids, target, draft, num_draft_tokens, temperature, seed_tensor, offset_tensor)
    )
    multiprocessors = _multiprocessor_count(device) if device.type == "cuda" else None
    rows, block_v, split_size, num_splits, max_registers = launch_config(batch_size, vocab_size, multiprocessors)
    block_k1 = _next_power_of_2(rows_per_request)
    row_blocks = _cdiv(batch_size, rows)
    slots = row_blocks * num_splits * rows
    waves = 2 if logits else 1

    # In the kernel's parameter order (race_key_ptr .. arrivals_ptr).
    scratch = _workspace.buffers(device, {
        "chain_verify.race_key": (slots, torch.float32),
        "chain_verify.race_arg": (slots, torch.int32),
        "chain_verify.fallback_key": (slots, torch.float32),
        "chain_verify.fallback_arg": (slots, torch.int32),
        "chain_verify.has_mass": (slots, torch.int32),
        "chain_verify.scan_max": (slots * block_k1, torch.float32),
        "chain_verify.scan_arg": (slots * block_k1, torch.int32),
        "chain_verify.scan_sum": (slots * block_k1, torch.float32),
        "chain_verify.scan_dmax": (slots * block_k1, torch.float32),
        "chain_verify.scan_dsum": (slots * block_k1, torch.float32),
        "chain_verify.arrivals": (row_blocks, torch.int32),
    })

    placeholder = target
    _chain_verify_kernel[(waves * row_blocks * num_splits,)](
        draft_token_ids, target, placeholder if draft is None else draft,
        placeholder if num_draft_tokens is None else num_draft_tokens,
        placeholder if temperature is None else temperature,
        placeholder if seed_tensor is None else seed_tensor, seed,
        placeholder if offset_tensor is None else offset_tensor, offset,
        output, num_accepted,
        *scratch.values(),
        batch_size, max_drafts, vocab_size, num_splits, split_size,
        draft_token_ids.stride(0), target.stride(0), target.stride(1),
        0 if draft is None else draft.stride(0), 0 if draft is None else draft.stride(1), output.stride(0),
        HAS_DRAFT=draft is not None, HAS_NUM_DRAFTS=num_draft_tokens is not None,
        HAS_TEMPERATURE=temperature is not None, LOGITS=logits,
        SEED_PER_REQUEST=seed_tensor is not None, OFFSET_FROM_TENSOR=offset_tensor is not None,
        OFFSET_PER_REQUEST=offset_tensor is not None and offset_tensor.dim() == 1,
        ROWS=rows, BLOCK_K1=block_k1, BLOCK_V=block_v,
        num_warps=4, enable_fp_fusion=False, **({} if max_registers is None else {"maxnreg": max_registers}),
    )
    return output, num_accepted


CUDA_CHUNK_SIZE = 1024  # the sampler's chunk (reference/_sampling.py CHUNK_SIZE)
CUDA_BLOCKS_PER_MULTIPROCESSOR = 2  # csrc/chain_verify.cu aims at two blocks per SM


def cuda_workspace_specs(batch_size, rows_per_request, vocab_size, logits, device):
    """Scratch the CUDA kernel needs for one call, as ``{name: (numel, dtype)}`` for ``_workspace.buffers``.

    ``workspace`` (int64): three words per 1024-token chunk of every request
    (chunk totals and candidates), then per-slice statistics, int32
    ``[B, splits, K + 1, 4]``, for as many splits per request as the launcher
    uses (about two blocks per SM on a GPU, up to 8 per batch on the host; a
    smaller workspace only means fewer, longer slices). ``arrivals`` (int32
    ``[B + 2]``): per-request arrival counters, the ticket counter and an
    error flag, zero-initialised once; every call leaves the counters at zero.
    ``logits`` does not change the sizes (greedy requests of a probability
    call use the statistics too); it is part of the signature so callers can
    reserve for exactly the call they will make.
    """
    del logits
    num_chunks = max(1, _cdiv(vocab_size, CUDA_CHUNK_SIZE))
    if torch.device(device).type == "cuda":
        target_blocks = CUDA_BLOCKS_PER_MULTIPROCESSOR * _multiprocessor_count(torch.device(device))
    else:
        target_blocks = 8
    splits = min(num_chunks, _cdiv(target_blocks, max(batch_size, 1)))
    stats_words = _cdiv(max(batch_size, 1) * splits * 4 * rows_per_request, 2) if splits > 1 else 0
    return {
        "chain_verify_cuda.workspace": (3 * batch_size * num_chunks + stats_words, torch.int64),
        "chain_verify_cuda.arrivals": (batch_size + 2, torch.int32),
    }


def cuda_chain_verify(draft_token_ids, target, draft, num_draft_tokens, temperature, logits,
                      seed_tensor, seed, offset_tensor, offset):
    batch_size, rows_per_request, vocab_size = target.shape
    device = target.device
    output = torch.empty((batch_size, rows_per_request), dtype=torch.int32, device=device)
    num_accepted = torch.empty((batch_size,), dtype=torch.int32, device=device)
    if batch_size == 0:
        return output, num_accepted
    scratch = _workspace.buffers(device, cuda_workspace_specs(batch_size, rows_per_request, vocab_size, logits,
                                                              device))
    workspace, arrivals = scratch.values()
    torch.ops.specdec_C.chain_verify(
        draft_token_ids, target, draft, num_draft_tokens, temperature, logits,
        seed_tensor, seed, offset_tensor, offset, workspace, arrivals, output, num_accepted,
    )
    return output, num_accepted
