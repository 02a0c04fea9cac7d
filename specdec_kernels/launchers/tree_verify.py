"""Launchers for tree_verify: the Triton kernel (configuration, workspace, one launch) and the CUDA extension
(one block per request, or the same split plan for small batches, csrc/tree_verify.cu)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _faults, _workspace
from ._shapes import (cdiv, device_capability, device_guard, multiprocessor_count, next_power_of_2, older_triton,
                      unit_last_stride)
from .._verify_options import VerifyOptions
from ._options import LOGPROBS_FLAGS, triton_arguments, triton_flags
from .chain_verify import CHUNK_SIZE, search_block

# GPU: 8 warps, tiles of 1024 elements (4 per thread): the vocabulary tile
# is one sampler chunk (or the whole vocabulary below one), the node tile
# holds the parents the next-child search scans (N <= 1024 is one tile).
# A rejection pass holds p, q, three int64 weights and float64 products per
# element: with 4 warps (8 elements a thread) it spilled at 96 and at 128
# registers. ptxas given a cap keeps the values live across the division
# slow-path calls in registers; uncapped it spilled 4-16 bytes there
# (python -m specdec_kernels._kernels.aot reports registers and spills).
# One request per program: with 2-8 requests a program the walk state
# spilled 20-1700 bytes below 1024 tokens, so packing small vocabularies
# waits for a leaner state layout.
NUM_WARPS = 8
MAX_REGISTERS = 128
TILE = 1024
MAX_ROWS = 1
MAX_CHUNK_TILE = 1024
# Interpreter (CPU): programs run one after another, so tiles are wide and
# many requests share a program; the node tile stays at 64 so that trees of
# a few hundred nodes cross tiles in the tests.
INTERPRETER_TILE = 32768
INTERPRETER_MAX_BLOCK_N = 64
INTERPRETER_SEARCH_TILE = 1 << 20
# Small batches split each request's vocabulary passes over several programs
# (kernels/tree_verify_stages.py): on a GPU about one program per SM in all;
# under the interpreter as if there were INTERPRETER_MULTIPROCESSORS SMs, at
# most INTERPRETER_MAX_SPLITS slices, so that the tests cross slices.
INTERPRETER_MULTIPROCESSORS = 8
INTERPRETER_MAX_SPLITS = 3
STAGE_WORDS = 16  # int64 words of a stage record (kernels/tree_verify_stages.py)
# A request has a stage record per node (its rejections, the nodes it enters and the sample): trees
# above this size keep the one-program plan, which bounds the records to
# about 66 * 1026 * 128 bytes (8.7 MB) on an H200.
MAX_SPLIT_TREE_NODES = 1024


class LaunchConfig(NamedTuple):
    rows: int  # requests per program
    block_n: int
    block_v: int  # one chunk, or the whole vocabulary below a chunk
    num_chunks: int
    chunk_tile: int
    search_block: int  # vocabulary tile of the top-k/top-p search
    replay_slots: int  # split plan: rejections a node can have (< N), rounded up to a power of two; else 1
    num_splits: int  # programs per request (1: a program walks whole requests)
    chunks_per_split: int  # sampler chunks per slice of the vocabulary


def vocabulary_splits(batch_size: int, vocab_size: int, multiprocessors: int | None,
                      tree_size: int | None = None) -> tuple[int, int]:
    """``(splits, chunks_per_split)``: slices of whole sampler chunks per request; ``None``: the interpreter.

    A split pays an L2 round trip per stage (a rejection or the sample), so
    it is used only when the batch alone leaves SMs idle: ``B * splits``
    stays within one program per SM; and only for trees of at most
    ``MAX_SPLIT_TREE_NODES`` nodes.
    """
    num_chunks = cdiv(vocab_size, CHUNK_SIZE)
    if tree_size is not None and tree_size > MAX_SPLIT_TREE_NODES:
        return 1, num_chunks
    if multiprocessors is None:
        wanted = min(INTERPRETER_MAX_SPLITS, INTERPRETER_MULTIPROCESSORS // max(batch_size, 1))
    else:
        wanted = multiprocessors // max(batch_size, 1)
    wanted = min(wanted, num_chunks)
    if wanted <= 1:
        return 1, num_chunks
    chunks_per_split = cdiv(num_chunks, wanted)
    return cdiv(num_chunks, chunks_per_split), chunks_per_split


def split_batch_bound(multiprocessors: int | None) -> int:
    """The largest batch :func:`vocabulary_splits` may split (the stage records cover that many requests)."""
    if multiprocessors is None:
        return INTERPRETER_MULTIPROCESSORS // 2 if INTERPRETER_MAX_SPLITS > 1 else 0
    return multiprocessors // 2


def launch_config(batch_size: int, tree_size: int, vocab_size: int, interpreter: bool = False,
                  multiprocessors: int | None = None) -> LaunchConfig:
    """How to launch; ``multiprocessors`` (GPU) sizes the split, the interpreter has its own."""
    tile = INTERPRETER_TILE if interpreter else TILE
    num_chunks = cdiv(vocab_size, CHUNK_SIZE)
    block_v = min(next_power_of_2(vocab_size), CHUNK_SIZE)
    num_splits, chunks_per_split = vocabulary_splits(
        batch_size, vocab_size, None if interpreter else (multiprocessors or 1), tree_size)
    rows = max(1, min(tile // block_v, next_power_of_2(batch_size)))
    if not interpreter or num_splits > 1:
        rows = min(rows, MAX_ROWS)
    block_n = max(1, min(next_power_of_2(tree_size), tile // rows))
    if interpreter:
        block_n = min(block_n, INTERPRETER_MAX_BLOCK_N)
    chunk_tile = max(1, min(next_power_of_2(num_chunks), MAX_CHUNK_TILE // rows))
    if not interpreter and older_triton():
        chunk_tile = max(chunk_tile, OLDER_TRITON_MIN_CHUNK_TILE)
    # The search's [rows, candidates, search_block] tile: the GPU's budget (the other tiles'), or wide
    # under the interpreter, where fewer, larger steps are faster.
    search_tile = TILE if tile <= TILE else INTERPRETER_SEARCH_TILE
    replay_slots = next_power_of_2(max(tree_size - 1, 1)) if num_splits > 1 else 1
    return LaunchConfig(rows, block_n, block_v, num_chunks, chunk_tile, search_block(block_v, search_tile, rows),
                        replay_slots, num_splits, chunks_per_split)


# Under Triton before 3.9 (the GPU machines' 3.6), where these spilled at 8 warps and 128 registers: split
# launches that truncate take up to 168 registers (60-112 bytes spilled at 128; at 160 still 12 bytes at
# V = 32000 on sm_80; split launches have at most one program an SM, so the cap costs no resident program);
# programs whose vocabulary and node tiles both hold fewer than 256 elements take a warp per 32 elements of
# the larger, at least 2 (B = 256, N = 8: V = 100 spilled 488-512 bytes at 8 warps, V = 40 272-392 bytes at
# 4 and V = 64 16 bytes at 4; none at 4, 2 and 2; at N = 1024 V = 100 spilled 120 bytes at 2 warps, none at 8).
# Triton 3.6 also fails to lower the sampler's chunk scan (tl.cumsum over a [1, 1] tile, ScanOpToLLVM
# assertion) at vocabulary tiles of 512 and 1024 elements with one chunk (256 < V <= 1024): tiles of two
# chunks compile. The chunk sums and counts are integers over masked tiles (kernels/sampling.py), so the
# chunk tile changes no result.
# On sm_80 Triton 3.6 also spilled 8 bytes at 128 registers in launches of logits with a draft once a
# candidate could be deterministic (the point-mass flag of contract v1.3: B = 64, N = 32, V = 32000 split and
# B = 256, N = 8, V = 1000); none at the cap below, and none on sm_90a at 128.
OLDER_TRITON_MIN_CHUNK_TILE = 2
OLDER_TRITON_SPLIT_TRUNCATION_REGISTERS = 168
OLDER_TRITON_SM80_LOGITS_DRAFT_REGISTERS = 168
OLDER_TRITON_MIN_WARPS = 2


def launch_options(config: LaunchConfig, truncate: bool, logits_with_draft: bool = False,
                   capability: int = 90) -> dict:
    """The GPU launch's ``num_warps`` and ``maxnreg`` for ``config`` under the installed Triton, on a GPU of
    compute ``capability`` (``80``: sm_80)."""
    warps, registers = NUM_WARPS, MAX_REGISTERS
    if older_triton():
        if config.num_splits > 1 and truncate:
            registers = OLDER_TRITON_SPLIT_TRUNCATION_REGISTERS
        elif logits_with_draft and capability < 90:
            registers = OLDER_TRITON_SM80_LOGITS_DRAFT_REGISTERS
        widest_tile = max(config.rows * config.block_v, config.block_n)
        warps = max(OLDER_TRITON_MIN_WARPS, min(NUM_WARPS, widest_tile // 32))
    return {"num_warps": warps, "maxnreg": registers}


def scratch_rows(has_draft: bool, draft_sampling: str) -> int:
    """Scratch rows per request: ``p``, and ``q`` when a rejection removes the drawn token from it."""
    return 2 if has_draft and draft_sampling == "without_replacement" else 1


def triton_workspace_specs(batch_size: int, tree_size: int, vocab_size: int, multiprocessors: int | None,
                           rows: int = 2) -> dict[str, tuple[int, torch.dtype]]:
    """The workspace of one launch, ``{name: (numel, dtype)}``, in the kernel's parameter order.

    ``rows`` is :func:`scratch_rows` (2 covers every call); ``multiprocessors``
    ``None`` means the interpreter. Every size is non-decreasing in ``B``,
    ``N`` and ``V``, so reserving for the largest call covers the smaller
    ones. The stage records of split requests (``N + 2`` records per request,
    for at most :func:`split_batch_bound` requests, trees of at most
    ``MAX_SPLIT_TREE_NODES`` nodes) are counters: every call
    leaves them at zero, a wait that gave up included
    (``specdec_kernels/_faults.py``).
    """
    num_chunks = cdiv(vocab_size, CHUNK_SIZE)
    split_requests = min(batch_size, split_batch_bound(multiprocessors))
    stages = min(tree_size, MAX_SPLIT_TREE_NODES) + 2
    return {
        "tree_verify.scratch": (batch_size * rows * vocab_size, torch.float32),
        "tree_verify.chunk_total": (batch_size * num_chunks, torch.int64),
        "tree_verify.chunk_pick": (batch_size * num_chunks, torch.int32),
        "tree_verify.stage_counters": (max(1, split_requests * stages * STAGE_WORDS), torch.int64),
    }


def allocate_outputs(target):
    """``accepted_nodes [B, N]``, ``output_token_ids [B, N]`` and ``num_accepted [B]``, int32, uninitialised."""
    batch_size, tree_size, _ = target.shape
    options = dict(dtype=torch.int32, device=target.device)
    return (torch.empty((batch_size, tree_size), **options), torch.empty((batch_size, tree_size), **options),
            torch.empty((batch_size,), **options))


def triton_tree_verify(tree_token_ids, parents, target, draft, num_nodes, temperature, logits, draft_sampling,
                       *bundle_tail, **named):
    """The schema's arguments: ``temperature``, ``logits``, ``*bundle_tail`` and ``**named`` are
    ``_verify_options.VerifyOptions``'s fields (``draft_sampling`` sits among them in the schema)."""
    from .._kernels.tree_verify import _tree_verify_kernel

    options = VerifyOptions(temperature, logits, *bundle_tail, **named)
    batch_size, tree_size, vocab_size = target.shape
    device = target.device
    outputs = allocate_outputs(target)
    if options.logprobs is not None:
        outputs += (torch.empty((batch_size, tree_size), dtype=torch.float32, device=device),)
    accepted_nodes, output, num_accepted = outputs[:3]
    if batch_size == 0:
        return outputs
    # The kernel takes row strides and assumes unit stride along the vocabulary.
    target, draft, num_nodes = (unit_last_stride(tensor) for tensor in (target, draft, num_nodes))
    options = options.tensors_mapped(unit_last_stride)
    multiprocessors = multiprocessor_count(device) if device.type == "cuda" else None
    config = launch_config(batch_size, tree_size, vocab_size, interpreter=multiprocessors is None,
                           multiprocessors=multiprocessors)
    rows = scratch_rows(draft is not None, draft_sampling)
    truncate = options.truncates
    guard = device_guard(device)
    with guard:
        scratch = _workspace.buffers(device, triton_workspace_specs(batch_size, tree_size, vocab_size,
                                                                    multiprocessors, rows))
        errors = _faults.error_counters(device)
        placeholder = target
        grid = (cdiv(batch_size, config.rows) * config.num_splits,)
        _tree_verify_kernel[grid](
            tree_token_ids, parents, target, placeholder if draft is None else draft,
            placeholder if num_nodes is None else num_nodes, *triton_arguments(options, placeholder),
            accepted_nodes, output, num_accepted, outputs[-1] if options.logprobs else placeholder,
            *scratch.values(), errors, _faults.give_up_role(), _workspace.launch_stamp(),
            batch_size, tree_size, vocab_size, config.num_chunks, config.num_splits, config.chunks_per_split,
            tree_token_ids.stride(0), tree_token_ids.stride(1), parents.stride(0), parents.stride(1),
            target.stride(0), target.stride(1),
            0 if draft is None else draft.stride(0), 0 if draft is None else draft.stride(1),
            accepted_nodes.stride(0), output.stride(0),
            HAS_DRAFT=draft is not None, HAS_NUM_NODES=num_nodes is not None, REMOVE_DRAWN=rows == 2,
            SCRATCH_ROWS=rows, **triton_flags(options), SPLIT=config.num_splits > 1, SEARCH_BLOCK=config.search_block,
            LOGPROBS=LOGPROBS_FLAGS[options.logprobs],
            ROWS=config.rows, BLOCK_N=config.block_n, BLOCK_V=config.block_v, CHUNK_TILE=config.chunk_tile,
            REPLAY_SLOTS=config.replay_slots, enable_fp_fusion=False,
            **(launch_options(config, truncate, options.logits and draft is not None, device_capability(device))
               if device.type == "cuda" else {"num_warps": NUM_WARPS}),
        )
    return outputs


def cuda_workspace_specs(batch_size: int, tree_size: int, vocab_size: int,
                         multiprocessors: int | None) -> dict[str, tuple[int, torch.dtype]]:
    """Scratch the CUDA kernel needs for one call, as ``{name: (numel, dtype)}`` for ``_workspace.buffers``.

    ``workspace`` (int64), per request: three words per 1024-token chunk
    (the final sample's chunk totals and candidates), rounded up to even,
    then two float32 rows of ``V`` rounded up to 4 (the base target and
    proposal rows, written at a second rejection at a node, never in the
    split plan) — the layout of ``csrc/include/specdec/tree_verify.cuh``.
    Its contents need not be initialised. ``stages`` (int64): the split
    plan's stage records, 16 words each, ``N + 1`` per request (trees of
    at most ``MAX_SPLIT_TREE_NODES`` nodes) for at
    most :func:`split_batch_bound` requests (``multiprocessors`` ``None``:
    the host, with the interpreter's constants). Zero-initialised once by
    ``_workspace.buffers`` and left at zero by every call. Every size is
    non-decreasing in ``B``, ``N`` and ``V``, so a reservation for the
    largest sizes serves every smaller call.
    """
    slot_words = cdiv(3 * cdiv(vocab_size, CHUNK_SIZE), 2) * 2
    row_floats = cdiv(vocab_size, 4) * 4
    split_requests = min(batch_size, split_batch_bound(multiprocessors))
    stages = min(tree_size, MAX_SPLIT_TREE_NODES) + 1
    return {"tree_verify_cuda.workspace": (batch_size * (slot_words + row_floats), torch.int64),
            "tree_verify_cuda.stages": (max(1, STAGE_WORDS * split_requests * stages), torch.int64)}


def cuda_tree_verify(tree_token_ids, parents, target, draft, num_nodes, temperature, logits, draft_sampling,
                     *bundle_tail, **named):
    """The schema's arguments: ``temperature``, ``logits``, ``*bundle_tail`` and ``**named`` are
    ``_verify_options.VerifyOptions``'s fields (``draft_sampling`` sits among them in the schema)."""
    options = VerifyOptions(temperature, logits, *bundle_tail, **named)
    batch_size, tree_size, vocab_size = target.shape
    device = target.device
    accepted_nodes, output, num_accepted = allocate_outputs(target)
    if batch_size == 0:
        return accepted_nodes, output, num_accepted
    if parents.dtype == torch.int64:
        # The kernel reads int32 parents. Clamping keeps every outcome: a
        # parent outside [0, i) stays outside it, so its node stays unreachable.
        parents = parents.clamp(-(2**31), 2**31 - 1).to(torch.int32)
    # The Triton kernel's split plan (vocabulary_splits): on the host (CPU
    # tensors, the block program emulated) with the interpreter's constants.
    multiprocessors = multiprocessor_count(device) if device.type == "cuda" else None
    num_splits, _ = vocabulary_splits(batch_size, vocab_size, multiprocessors, tree_size)
    workspace, stages = _workspace.buffers(
        device, cuda_workspace_specs(batch_size, tree_size, vocab_size, multiprocessors)).values()
    torch.ops.specdec_C.tree_verify(
        tree_token_ids, parents, target, draft, num_nodes, options.temperature, options.logits, draft_sampling,
        options.seed_tensor, options.seed, options.offset_tensor, options.offset, workspace, accepted_nodes, output,
        num_accepted, *options.parameters, stages, num_splits,
        errors=_faults.error_counters(device), fault_role=_faults.give_up_role(), stamp=_workspace.launch_stamp(),
    )
    return accepted_nodes, output, num_accepted
