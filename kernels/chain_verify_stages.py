"""The staged plan of ``kernels/chain_verify.py``: a request's whole-row passes shared by its programs.

Used when a launch truncates (top-k / top-p / min-p) and its batch is small
enough to split rows over programs (``launchers/chain_verify.py``). A
program holds one request and one fixed slice of its vocabulary; the passes
that need whole rows before anything can be decided are *stages*, shared
through the request's stage records (``kernels/truncation.py``, ``measured``:
take slices from the record's counter, add, publish, wait for all):

0. logits only: per-slice ``(max, sum exp)`` (and argmax) of the target
   rows ``0..n_b`` (draft rows are always probabilities, v1.3), stored at ``[request, position, slice]``; every program combines them
   in slice order (floats: never combined atomically).
1. .. 19. the truncation search of every target row a decision may need
   (``kernels/truncation.py``, stage numbers there), all rows at once.

A record is ``record_words(BLOCK_K1)`` int64 and a request has
``NUM_STAGES`` of them; the request's last program to finish zeroes those
it used.
"""

import triton
import triton.language as tl

from .chain_verify_rows import row_at, scan_statistics
from .stage_records import publish, take_slice, wait_for_stage
from .truncation import NUM_STAGES, clear_records, clear_search_records, record_words, staged_truncation

_NORMALISER_STAGE = tl.constexpr(0)


@triton.jit
def request_records(stages_ptr, request, BLOCK_K1: tl.constexpr):
    """The first stage record of ``request`` (a scalar index)."""
    return stages_ptr + request.to(tl.int64) * (NUM_STAGES * record_words(BLOCK_K1))


@triton.jit
def staged_statistics(
    records, target_rows, stat_max_ptr, stat_arg_ptr, stat_sum_ptr, raw_sum_ptr, requests, active, last_row,
    inverse_temperature, num_chunks, chunks_per_split, num_splits, max_drafts, vocab_size, stride_target_k,
    failed_ptr, give_up, LOGITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_V: tl.constexpr,
    RAW_SUM: tl.constexpr,
):
    """Stage 0: the per-slice statistics of every slice of the request's target rows ``0..last_row``, complete
    when this returns."""
    record = records + _NORMALISER_STAGE * record_words(BLOCK_K1)
    measured_slices = 0
    taken = take_slice(record)
    while taken < num_splits:
        split = taken.to(tl.int32)  # the record's counter is int64; vocabulary indices stay 32-bit
        chunk_lo = split * chunks_per_split
        scan_statistics(
            target_rows, stat_max_ptr, stat_arg_ptr, stat_sum_ptr, raw_sum_ptr, requests, active, active, last_row,
            inverse_temperature, split, num_splits, max_drafts, chunk_lo * BLOCK_V,
            tl.minimum(tl.minimum(chunk_lo + chunks_per_split, num_chunks) * BLOCK_V, vocab_size),
            stride_target_k, LOGITS, ROWS, BLOCK_K1, BLOCK_V, RAW_SUM,
        )
        measured_slices += 1
        taken = take_slice(record)
    publish(record, measured_slices)
    wait_for_stage(record, num_splits, failed_ptr, give_up)


@triton.jit
def staged_thresholds(
    records, target_rows, truncating, last_row, parameters, target_max,
    target_inverse_norm, inverse_temperature, vocab_size, chunks_per_split, num_splits, stride_target_k,
    failed_ptr, give_up, LOGITS: tl.constexpr, BLOCK_K1: tl.constexpr,
    BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
):
    """``(threshold, reciprocal)`` ``[1, BLOCK_K1]`` of the one request's target rows, staged.

    The rows are ``0..last_row``: ``0..n_b`` (acceptance tests and any stop
    row), or ``0..n_b - 1`` with a bonus id (row ``n_b`` is then never sampled): all
    at once, since the stop is unknown until the thresholds are; rows past
    the stop are read for nothing, the price of not deciding row by row.
    Arguments are the request's ``[1]`` values and ``[1, BLOCK_K1]``
    normalisers; every program of the request takes the same stages.
    """
    positions = tl.arange(0, BLOCK_K1)
    searching = (tl.broadcast_to(truncating, (BLOCK_K1,)) != 0) & (positions <= tl.broadcast_to(last_row, (BLOCK_K1,)))
    threshold = tl.zeros((BLOCK_K1,), tl.int32)
    reciprocal = tl.full((BLOCK_K1,), 1.0, tl.float64)
    if tl.max(searching.to(tl.int32), axis=0) > 0:
        rows = row_at(tl.broadcast_to(target_rows, (BLOCK_K1,)), positions, stride_target_k)
        top_k, top_p, min_p, k_on, p_on, min_p_on = parameters  # the request's, one per row
        threshold, reciprocal = staged_truncation(
            rows[:, None], searching,
            (tl.broadcast_to(top_k, (BLOCK_K1,)), tl.broadcast_to(top_p, (BLOCK_K1,)),
             tl.broadcast_to(min_p, (BLOCK_K1,)), tl.broadcast_to(k_on, (BLOCK_K1,)),
             tl.broadcast_to(p_on, (BLOCK_K1,)), tl.broadcast_to(min_p_on, (BLOCK_K1,))),
            (tl.reshape(target_max, (BLOCK_K1, 1)), tl.reshape(target_inverse_norm, (BLOCK_K1, 1)),
             tl.broadcast_to(inverse_temperature, (BLOCK_K1,))[:, None]),
            vocab_size, (records, chunks_per_split, num_splits, failed_ptr, give_up), LOGITS, BLOCK_K1, BLOCK_V,
            SEARCH_BLOCK)
    return tl.reshape(threshold, (1, BLOCK_K1)), tl.reshape(reciprocal, (1, BLOCK_K1))


@triton.jit
def clear_request_records(records, truncating, parameters, LOGITS: tl.constexpr, BLOCK_K1: tl.constexpr):
    """Zero the records the request used (its last program, after every program read them)."""
    if LOGITS:
        clear_records(records, _NORMALISER_STAGE, _NORMALISER_STAGE + 1, BLOCK_K1)
    clear_search_records(records, truncating, parameters, BLOCK_K1)
