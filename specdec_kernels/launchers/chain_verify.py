"""Launchers for chain_verify and chain_verify_packed: the Triton kernel (configuration, workspace, one launch) and
the CUDA extension. Both layouts run the same kernels; only how a request's rows are found differs."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _faults, _workspace
from .._verify_options import VerifyOptions
from ._options import split_words  # noqa: F401 (the seed words' rule, as tests/ import it from here)
from ._options import LOGPROBS_FLAGS, triton_arguments, triton_flags
from ._shapes import cdiv, device_guard, next_power_of_2, older_triton, unit_last_stride
from ._shapes import multiprocessor_count as _multiprocessor_count  # a module name: tests patch it

CHUNK_SIZE = 1024  # the sampler's chunk (reference/_sampling.py); a program's slice is whole chunks
# The truncation search measures 2**RADIX_BITS candidates per element
# (kernels/truncation.py): its vocabulary tile is that much narrower on GPUs.
SEARCH_CANDIDATES = 16
# Stage records of the staged plan (kernels/chain_verify_stages.py): NUM_STAGES records per request, each a
# 16-word header line and [BLOCK_K1, SEARCH_CANDIDATES, 2] int64 partials (kernels/truncation.py).
STAGES_PER_REQUEST = 20
STAGE_HEADER_WORDS = 16
# Truncating launches whose rows would be split share each row's truncation search among the programs of a
# request (the staged plan); False makes them walk whole rows, one slice per row (tests compare the two).
STAGED_TRUNCATION = True


class Limits(NamedTuple):
    """Tile bounds of a launch configuration (elements per program)."""

    tile: int  # ROWS * BLOCK_V: the vocabulary tile of one loop iteration
    decision_tile: int  # ROWS * BLOCK_K1: the acceptance tile, which holds Philox state per element
    combine_tile: int  # ROWS * BLOCK_K1 * SPLIT_TILE and ROWS * CHUNK_TILE: the finishing program's tiles
    max_splits: int | None  # None: as many as fill the GPU
    max_rows: int | None = None  # requests per program at most (None: as the tiles allow)
    search_tile: int = 1024  # the truncation search's [ROWS, SEARCH_CANDIDATES, search_block] tile


# GPU: 4 warps, 8 elements of the vocabulary tile per thread. One element
# of the acceptance tile per thread keeps every variant within 128 registers
# without spills (python -m specdec_kernels._kernels.aot prints the report);
# two per thread spilled at V = 8, K = 3 (64 rows a program, 4 B on sm_90a).
GPU_LIMITS = Limits(tile=1024, decision_tile=128, combine_tile=1024, max_splits=None)
GPU_MAX_REGISTERS = 128
# Interpreter (CPU): programs run one after another, so tiles are wide and
# many requests share a program; three slices at most, so tests with a few
# thousand tokens still cross slices.
INTERPRETER_LIMITS = Limits(tile=32768, decision_tile=1 << 20, combine_tile=1 << 20, max_splits=3,
                            search_tile=1 << 20)


def num_warps(truncate: bool) -> int:
    """4 warps; 8 with truncation, whose search and walk state spilled 12-32 bytes at 4 (sm_80, V = 128256).

    With truncation under Triton before 3.9: 16. The staged plan spilled 8-112 bytes at 8 warps and 128
    registers under Triton 3.6 (V = 128256 probabilities and packed logits, V = 151936 logits; 160 registers
    or 16 warps spill none), and 16 warps at 128 registers is one program of 512 threads an SM, the threads of
    two 8-warp programs (160 registers would leave one 8-warp program an SM). Running programs take the
    stages' slices from a counter, so with one resident program an SM none waits on a program that has not
    started. The walk spilled 104 bytes at 8 warps with ``logprobs`` (V = 128256 logits, sm_90a), and its
    warps may not depend on ``logprobs``: they set the order of a row's float32 softmax sum, so the tokens of
    logits would (a call gives the same tokens with and without scores).
    """
    if truncate and older_triton():
        return 16
    return 8 if truncate else 4


def truncation_limits(limits: Limits, gpu: bool) -> Limits:
    """Limits of the walk plan with top-k/top-p/min-p: a program reads whole rows (kernels/truncation.py), so
    one slice per row; on GPUs one request per program, as the tree kernel (with 32 requests a program at V = 8
    the walk and search state spilled 192 bytes)."""
    return limits._replace(max_splits=1, max_rows=1 if gpu else None)


def search_block(block_v: int, search_tile: int, search_rows: int) -> int:
    """The truncation search's vocabulary tile: its ``[search_rows, SEARCH_CANDIDATES, search_block]`` tile
    within ``search_tile`` elements, at most the vocabulary tile."""
    return max(1, min(block_v, search_tile // (search_rows * SEARCH_CANDIDATES)))


def stage_record_words(block_k1: int) -> int:
    """int64 words of one stage record (``record_words`` in kernels/truncation.py)."""
    return STAGE_HEADER_WORDS + block_k1 * SEARCH_CANDIDATES * 2


def truncation_config(batch_size: int, rows_per_request: int, vocab_size: int, multiprocessors: int | None,
                      limits: Limits) -> tuple[LaunchConfig, bool]:
    """``(config, staged)`` of a truncating launch.

    Where the untruncated plan splits rows (small batches, ``V > 1024``; one
    request per program, as its GPU tiles give), the staged plan keeps its
    slices and shares each truncation pass among a request's programs: at
    ``B = 1``, ``V = 128256`` the walk plan left one SM doing every pass of
    the search (about 30x the untruncated time, issue 11). Its search tile
    holds the ``K + 1`` rows of the request at once. Otherwise the walk plan.
    """
    config = launch_config(batch_size, rows_per_request, vocab_size, multiprocessors, limits._replace(max_rows=1))
    if STAGED_TRUNCATION and config.num_splits > 1:
        return config._replace(search_block=search_block(config.block_v, limits.search_tile, config.block_k1)), True
    return launch_config(batch_size, rows_per_request, vocab_size, multiprocessors,
                         truncation_limits(limits, multiprocessors is not None)), False


class LaunchConfig(NamedTuple):
    rows: int  # requests per program
    block_k1: int  # positions tile, next power of 2 of K + 1
    block_v: int  # vocabulary tile: one chunk, or the whole vocabulary when it is below a chunk
    num_chunks: int
    chunks_per_split: int  # chunks per program
    num_splits: int
    split_tile: int  # slices the finishing program combines per step
    chunk_tile: int  # chunk totals the finishing program scans per step
    max_registers: int | None
    search_block: int  # vocabulary tile of the truncation search, [rows, SEARCH_CANDIDATES, search_block]


def launch_config(batch_size: int, rows_per_request: int, vocab_size: int, multiprocessors: int | None,
                  limits: Limits | None = None) -> LaunchConfig:
    """How to launch the kernel; ``multiprocessors=None`` means the interpreter.

    A program handles one chunk per loop iteration. On a GPU there are about
    two programs per SM, so one request's vocabulary spreads over the
    machine; vocabularies below a chunk pack several requests into a tile.
    """
    if limits is None:
        limits = GPU_LIMITS if multiprocessors is not None else INTERPRETER_LIMITS
    block_k1 = next_power_of_2(rows_per_request)
    block_v = min(next_power_of_2(vocab_size), CHUNK_SIZE)
    num_chunks = cdiv(vocab_size, CHUNK_SIZE)
    rows = max(1, min(limits.tile // block_v, limits.decision_tile // block_k1, next_power_of_2(batch_size)))
    if limits.max_rows is not None:
        rows = min(rows, limits.max_rows)
    row_blocks = cdiv(batch_size, rows)
    # GPU: enough slices for about two programs per SM. Interpreter: as many
    # as the limit allows, so that tests cross slices.
    wanted = cdiv(2 * multiprocessors, row_blocks) if multiprocessors is not None else num_chunks
    splits = max(1, min(num_chunks, limits.max_splits or num_chunks, wanted))
    chunks_per_split = cdiv(num_chunks, splits)
    num_splits = cdiv(num_chunks, chunks_per_split)
    split_tile = max(1, min(next_power_of_2(num_splits), limits.combine_tile // (rows * block_k1)))
    chunk_tile = max(1, min(next_power_of_2(num_chunks), limits.combine_tile // rows))
    max_registers = GPU_MAX_REGISTERS if multiprocessors is not None else None
    return LaunchConfig(rows, block_k1, block_v, num_chunks, chunks_per_split, num_splits, split_tile, chunk_tile,
                        max_registers, search_block(block_v, limits.search_tile, rows))


class ChainPlan(NamedTuple):
    config: LaunchConfig
    staged: bool  # the staged plan: a truncating or logits request's programs share its passes through records
    walk: bool  # one program walks each request's rows (logits or truncation, one slice per row)
    waves: int  # 2: logits over several slices without stages, the normalisers in a first wave
    options: dict  # Triton's launch options (warps, register cap)


def chain_plan(batch_size: int, rows_per_request: int, vocab_size: int, multiprocessors: int | None,
               limits: Limits, logits: bool, truncate: bool) -> ChainPlan:
    """The one plan rule of a chain launch, which the launcher and ``kernels/aot.py`` both follow."""
    if truncate:
        config, staged = truncation_config(batch_size, rows_per_request, vocab_size, multiprocessors, limits)
    else:
        config, staged = launch_config(batch_size, rows_per_request, vocab_size, multiprocessors, limits), False
    walk = (logits or truncate) and config.num_splits == 1
    waves = 2 if logits and not walk and not staged else 1
    options = {"num_warps": num_warps(truncate), "enable_fp_fusion": False,
               **({} if config.max_registers is None else {"maxnreg": config.max_registers})}
    return ChainPlan(config, staged, walk, waves, options)


def triton_workspace_specs(batch_size: int, rows_per_request: int, vocab_size: int, logits: bool,
                           device: torch.device, truncate: bool = True,
                           raw_logprobs: bool = False) -> dict[str, tuple[int, torch.dtype]]:
    """The workspace one Triton launch uses, ``{name: (numel, dtype)}``, in the kernel's parameter order.

    Reserve it with ``_workspace.buffers(device, specs)`` before CUDA-graph
    capture. Every size is non-decreasing in ``B``, ``K + 1`` and ``V``, so a
    reservation for the largest sizes covers every smaller call (the slice
    count is not monotone in ``B``, so the statistics are sized by a bound).
    Chunk results are ``[B, chunks]``, statistics
    ``[B, BLOCK_K1, SPLITS]`` (``stat_sum`` twice over with ``logprobs="raw"`` of logits: the sums at ``T = 1``
    follow); the staged plan's stage records (``stage_counters``,
    ``[B, 20, 16 + 32 * BLOCK_K1]`` int64, for ``B < 2 * SMs`` at most; one
    word unless ``truncate``: only calls with ``top_k``/``top_p``/``min_p``
    use them), the counters, the row blocks' failure flags
    (``failed_row_blocks``, set by a wait that gave up,
    ``specdec_kernels/_faults.py``) and their claims (``claims``,
    ``kernels/stage_records.py``) are left at zero by every call.
    """
    multiprocessors = _multiprocessor_count(device) if device.type == "cuda" else None
    limits = GPU_LIMITS if multiprocessors is not None else INTERPRETER_LIMITS
    num_chunks = cdiv(vocab_size, CHUNK_SIZE)
    chunk_slots = batch_size * num_chunks
    # Slices per request: at most the chunks and the limit. On a GPU whose
    # tile is at most a chunk, a row of several chunks gets a program to
    # itself, and then B * cdiv(2 * SMs, B) <= B + 2 * SMs.
    max_splits = min(num_chunks, limits.max_splits or num_chunks)
    request_slices = batch_size * max_splits
    if multiprocessors is not None and limits.tile <= CHUNK_SIZE:
        request_slices = min(request_slices, batch_size + 2 * multiprocessors)
    stat_slots = next_power_of_2(rows_per_request) * request_slices
    logit_slots = stat_slots * (2 if raw_logprobs else 1) if logits else 1
    # Stage records: only a split row needs them (V > 1024), and on a GPU rows split only while B < 2 * SMs.
    staged_requests = batch_size if multiprocessors is None else min(batch_size, 2 * multiprocessors)
    if num_chunks == 1 or not truncate:
        staged_requests = 0
    stage_words = max(1, staged_requests * STAGES_PER_REQUEST * stage_record_words(next_power_of_2(rows_per_request)))
    return {
        "chain_verify.chunk_total": (chunk_slots, torch.int64),
        "chain_verify.chunk_pick": (chunk_slots, torch.int32),
        "chain_verify.stat_max": (stat_slots, torch.float32),
        "chain_verify.stat_arg": (stat_slots, torch.int32),
        "chain_verify.stat_sum": (logit_slots, torch.float32),
        "chain_verify.tickets": (3, torch.int64),  # next ticket, programs ended, the launch's claim
        "chain_verify.wave1_arrivals": (batch_size, torch.int32),
        "chain_verify.arrivals": (batch_size, torch.int32),
        "chain_verify.failed_row_blocks": (batch_size, torch.int32),
        "chain_verify.claims": (batch_size, torch.int64),  # 2 * launch stamp (+ 1 once the row block is reset)
        "chain_verify.stage_counters": (stage_words, torch.int64),
    }


def triton_chain_verify(draft_token_ids, target, draft, num_draft_tokens, *bundle, **named):
    """The schema's arguments; ``*bundle, **named``: ``_verify_options.VerifyOptions``'s fields."""
    batch_size, rows_per_request, _ = target.shape
    return _triton_launch(draft_token_ids, target, draft, num_draft_tokens, None, batch_size, rows_per_request - 1,
                          VerifyOptions(*bundle, **named))


def triton_chain_verify_packed(draft_token_ids, cu_num_draft_tokens, target, draft, max_drafts, *bundle, **named):
    """The packed layout: the kernel reads ``cu_num_draft_tokens`` and the packed rows in place (no padded copy)."""
    return _triton_launch(draft_token_ids, target, draft, None, cu_num_draft_tokens,
                          cu_num_draft_tokens.shape[0] - 1, max_drafts, VerifyOptions(*bundle, **named))


def _layout_strides(tensor):
    """``(stride to a request's row 0, stride between its rows)``: ``[B, K, V]``, or packed ``[rows, V]`` rows."""
    if tensor is None:
        return 0, 0
    return (tensor.stride(0), tensor.stride(1)) if tensor.dim() == 3 else (tensor.stride(0), tensor.stride(0))


def _triton_launch(draft_token_ids, target, draft, num_draft_tokens, cu_num_draft_tokens, batch_size, max_drafts,
                   options: VerifyOptions):
    """One launch of the chain kernel; ``cu_num_draft_tokens`` given means the packed layout."""
    from .._kernels.chain_verify import _chain_verify_kernel

    rows_per_request = max_drafts + 1
    vocab_size = target.shape[-1]
    device = target.device
    output = torch.empty((batch_size, rows_per_request), dtype=torch.int32, device=device)
    num_accepted = torch.empty((batch_size,), dtype=torch.int32, device=device)
    outputs = (output, num_accepted)
    if options.logprobs is not None:
        outputs += (torch.empty((batch_size, rows_per_request), dtype=torch.float32, device=device),)
    if batch_size == 0:
        return outputs
    packed = cu_num_draft_tokens is not None
    num_tokens = draft_token_ids.shape[0] if packed else 0
    # Packed: [T+B, V] holds each request's bonus row; [T, V] (bonus ids given) does not (ops/chain_verify_packed.py).
    bonus_rows = not packed or target.shape[0] == num_tokens + batch_size
    if packed and num_tokens == 0:
        # Every n_b is 0, so no id or draft row is read (nor a target row without bonus rows); an empty tensor's
        # null data pointer is no kernel argument on every Triton version.
        draft_token_ids, draft = cu_num_draft_tokens, None
        if not bonus_rows:
            target = target.new_zeros((1, vocab_size))
    # The kernel takes row strides and assumes unit stride along the last dim.
    draft_token_ids, target, draft, num_draft_tokens, cu_num_draft_tokens = (
        unit_last_stride(tensor) for tensor in (draft_token_ids, target, draft, num_draft_tokens, cu_num_draft_tokens))
    options = options.tensors_mapped(unit_last_stride)
    logits, truncate = options.logits, options.truncates
    multiprocessors = _multiprocessor_count(device) if device.type == "cuda" else None
    limits = GPU_LIMITS if multiprocessors is not None else INTERPRETER_LIMITS
    plan = chain_plan(batch_size, rows_per_request, vocab_size, multiprocessors, limits, logits, truncate)
    config = plan.config
    row_blocks = cdiv(batch_size, config.rows)
    guard = device_guard(device)
    with guard:
        scratch = _workspace.buffers(device, triton_workspace_specs(batch_size, rows_per_request, vocab_size,
                                                                    logits, device, truncate,
                                                                    options.logprobs == "raw"))
        errors = _faults.error_counters(device)
        placeholder = target
        _chain_verify_kernel[(plan.waves * row_blocks * config.num_splits,)](
            draft_token_ids, target, placeholder if draft is None else draft,
            placeholder if num_draft_tokens is None else num_draft_tokens,
            placeholder if cu_num_draft_tokens is None else cu_num_draft_tokens,
            *triton_arguments(options, placeholder), output, num_accepted, outputs[-1] if options.logprobs else placeholder,
            *scratch.values(), errors, _faults.give_up_role(), _workspace.launch_stamp(),
            batch_size, max_drafts, num_tokens, vocab_size, config.num_chunks, config.num_splits,
            config.chunks_per_split,
            draft_token_ids.stride(0), *_layout_strides(target), *_layout_strides(draft), output.stride(0),
            HAS_DRAFT=draft is not None, HAS_NUM_DRAFTS=num_draft_tokens is not None, PACKED=packed,
            BONUS_ROWS=bonus_rows, WALK=plan.walk, STAGED=plan.staged, **triton_flags(options),
            SEARCH_BLOCK=config.search_block, LOGPROBS=LOGPROBS_FLAGS[options.logprobs],
            ROWS=config.rows, BLOCK_K1=config.block_k1, BLOCK_V=config.block_v, SPLIT_TILE=config.split_tile,
            CHUNK_TILE=config.chunk_tile, **plan.options,
        )
    return outputs


CUDA_CHUNK_SIZE = 1024  # the sampler's chunk (reference/_sampling.py CHUNK_SIZE)
CUDA_BLOCKS_PER_MULTIPROCESSOR = 2  # csrc/chain_verify.cu aims at two blocks per SM


# The staged plan's records per request (csrc/include/specdec/chain_verify_stages.cuh,
# chain_stage_request_words): 12 headers of 16 words, then per row (K + 1 rows) the
# largest key (1 word), eight radix passes of 256 (high31, low31) bins and the
# search state (3 words), and two split masses (2 words each). A call that does
# not truncate (logits only) uses the first header alone (chain_stage_stride).
CUDA_STAGE_HEADER_WORDS = 12 * 16
CUDA_STAGE_ROW_WORDS = 1 + 8 * (2 * 256 + 3) + 2 * 2
CUDA_STAGE_WORDS = 16


def cuda_stage_words(batch_size, rows_per_request, truncate=True):
    """int64 words of the staged plan's records for ``batch_size`` requests of ``rows_per_request`` rows."""
    if not truncate:
        return batch_size * CUDA_STAGE_WORDS
    return batch_size * (CUDA_STAGE_HEADER_WORDS + rows_per_request * CUDA_STAGE_ROW_WORDS)


def cuda_workspace_specs(batch_size, rows_per_request, vocab_size, logits, device, truncate=True):
    """Scratch the CUDA kernel needs for one call, as ``{name: (numel, dtype)}`` for ``_workspace.buffers``.

    ``workspace`` (int64): three words per 1024-token chunk of every request
    (chunk totals and candidates), then per-slice statistics, int32
    ``[B, splits, K + 1, 2]``, for as many slices as the launcher uses (about
    two blocks per SM on a GPU, up to 8 per batch on the host, so at most
    ``B + target`` slices in all; a smaller workspace only means fewer,
    longer slices); contents need not be initialised. ``arrivals`` (int32
    ``[2 B]``): per request its arrival counter and failure flag (raised by
    a wait that gave up, ``specdec_kernels/_faults.py``). ``stages``
    (int64): the staged plan's records (:func:`cuda_stage_words`) for the
    requests of a batch that splits (fewer than ``target`` of them; larger
    batches have one block per request), one word unless ``logits`` or
    ``truncate`` (only calls with logits or ``top_k``/``top_p``/``min_p``
    split their rows through them; logits alone need 16 words a request).
    ``claims`` (int64 ``[B]``): per request the launch's claim of its words
    (``kernels/stage_records.py``, ``claim``). ``arrivals``, ``stages`` and
    ``claims`` are zero-initialised once and left at zero by every call,
    give-ups included. Every size is non-decreasing in ``B``,
    ``K + 1`` and ``V``, so a reservation for the largest sizes covers every
    smaller call.
    """
    num_chunks = max(1, cdiv(vocab_size, CUDA_CHUNK_SIZE))
    if torch.device(device).type == "cuda":
        target_blocks = CUDA_BLOCKS_PER_MULTIPROCESSOR * _multiprocessor_count(torch.device(device))
    else:
        target_blocks = 8
    # cdiv(target, B) slices per request: B * cdiv(target, B) < B + target.
    slices = min(batch_size * num_chunks, batch_size + target_blocks) if num_chunks > 1 else 0
    stats_words = slices * rows_per_request  # two int32 fields per row: one int64 word
    split_requests = min(batch_size, target_blocks) if num_chunks > 1 and (logits or truncate) else 0
    return {
        "chain_verify_cuda.workspace": (3 * batch_size * num_chunks + stats_words, torch.int64),
        "chain_verify_cuda.arrivals": (2 * batch_size, torch.int32),
        "chain_verify_cuda.stages": (max(1, cuda_stage_words(split_requests, rows_per_request, truncate)),
                                     torch.int64),
        "chain_verify_cuda.claims": (batch_size, torch.int64),
    }


def _cuda_outputs_and_workspace(batch_size, max_drafts, vocab_size, logits, device, truncate):
    """``(output_token_ids, num_accepted, workspace, arrivals, stages, claims)`` of one CUDA call; no workspace
    when ``B == 0``."""
    output = torch.empty((batch_size, max_drafts + 1), dtype=torch.int32, device=device)
    num_accepted = torch.empty((batch_size,), dtype=torch.int32, device=device)
    if batch_size == 0:
        return output, num_accepted, None, None, None, None
    scratch = _workspace.buffers(device, cuda_workspace_specs(batch_size, max_drafts + 1, vocab_size, logits, device,
                                                              truncate))
    return (output, num_accepted, *scratch.values())


def cuda_chain_verify(draft_token_ids, target, draft, num_draft_tokens, *bundle, **named):
    """The schema's arguments; ``*bundle, **named``: ``_verify_options.VerifyOptions``'s fields."""
    batch_size, rows_per_request, _ = target.shape
    return _cuda_launch(torch.ops.specdec_C.chain_verify, (draft_token_ids, target, draft, num_draft_tokens),
                        target, batch_size, rows_per_request - 1, VerifyOptions(*bundle, **named))


def cuda_chain_verify_packed(draft_token_ids, cu_num_draft_tokens, target, draft, max_drafts, *bundle, **named):
    """The packed layout: the extension reads ``cu_num_draft_tokens`` and the packed rows in place."""
    return _cuda_launch(torch.ops.specdec_C.chain_verify_packed,
                        (draft_token_ids, cu_num_draft_tokens, target, draft, max_drafts), target,
                        cu_num_draft_tokens.shape[0] - 1, max_drafts, VerifyOptions(*bundle, **named))


def _cuda_launch(extension_op, layout: tuple, target, batch_size: int, max_drafts: int, options: VerifyOptions):
    """One call of the extension's chain op: its ``layout`` arguments, then the bundle's and the workspace."""
    output, num_accepted, workspace, arrivals, stages, claims = _cuda_outputs_and_workspace(
        batch_size, max_drafts, target.shape[-1], options.logits, target.device, options.truncates)
    if batch_size > 0:
        extension_op(
            *layout, options.temperature, options.logits, options.seed_tensor, options.seed, options.offset_tensor,
            options.offset, workspace, arrivals, output, num_accepted,
            top_k=options.top_k, top_p=options.top_p, min_p=options.min_p, bonus_token_ids=options.bonus_token_ids,
            stages=stages, errors=_faults.error_counters(target.device), fault_role=_faults.give_up_role(),
            claims=claims, stamp=_workspace.launch_stamp(),
        )
    return output, num_accepted
