"""One measure of the truncation search, over whole rows or shared by the programs of a request (staged plan).

Whole rows (``STAGED`` off): the program measures ``[0, V)`` itself.

Staged (``kernels/chain_verify.py``, small batches): the programs of one
request share every pass of the search through a *stage record* in the
workspace, with the take/publish/wait protocol of the tree kernel's split
plan (``kernels/tree_verify_stages.py``): a program takes slices of whole
sampler chunks from the record's counter until none is left, measures them
(``kernels/truncation_measures.py``), adds its partials into the record as
int64 atomics (an integer max for ``MAX_KEY``), publishes the number of
slices it measured (a release after all its adds), then waits until all
``num_splits`` are published and reads the totals. A slice is taken only by
a running program, so no wait depends on one that has not started; the
interpreter, which runs programs one after another, has a request's first
program take every slice. The totals are integer sums, so they are the
whole-row measure bit for bit, whoever measured which slice.

Record of a stage, ``record_words(ROWS)`` int64 at
``records + stage * record_words(ROWS)``: a 128-byte header line (word 0
slices taken, word 1 slices published, as ``tree_verify_stages``), then the
payload ``[ROWS, CANDIDATES, 2]`` (``first``, ``second`` of each
measure). Stages are numbered by the search (``kernels/truncation.py``);
one a request skips is left at zero. The request's last program to end
zeroes the records of the stages it used (:func:`clear_records`), so no memset
precedes a launch.
"""

import triton
import triton.language as tl

from .tree_verify_stages import STAGE_WORDS, publish, take_slice, wait_for_stage
from .truncation_measures import CANDIDATES, MAX_KEY, measure_slice


@triton.jit
def record_words(ROWS: tl.constexpr):
    """int64 words of one stage record of ``ROWS`` rows (``launchers/chain_verify.py`` sizes the same)."""
    return STAGE_WORDS + ROWS * CANDIDATES * 2


@triton.jit
def measured(row, searching, candidates, floor, row_max, row_inverse_norm, inverse_temperature, vocab_size,
             records, stage, chunks_per_split, num_splits, failed_ptr, give_up,
             KIND: tl.constexpr, STAGED: tl.constexpr, LOGITS: tl.constexpr, ROWS: tl.constexpr,
             BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """The whole-row measure ``KIND`` of the searching rows (``measure_slice``'s arguments): measured here, or,
    ``STAGED``, from stage ``stage`` of the request's ``records``, which every program of the request calls.

    ``BLOCK_V`` is the sampler's chunk (a slice is ``chunks_per_split`` of them) and, whole-row, the max / mass
    tile."""
    if STAGED:
        first = tl.zeros((ROWS, CANDIDATES), tl.int64)
        second = tl.zeros((ROWS, CANDIDATES), tl.int64)
        record = records + stage * record_words(ROWS)
        measured_slices = 0
        taken = take_slice(record)
        while taken < num_splits:
            vocab_lo = taken.to(tl.int32) * chunks_per_split * BLOCK_V  # 32-bit indices, as the whole-row search
            vocab_hi = tl.minimum(vocab_lo + chunks_per_split * BLOCK_V, vocab_size)
            # The max / mass tiles as wide as the candidate tile: ROWS rows at once, in registers.
            slice_first, slice_second = measure_slice(
                row, searching, candidates, floor, vocab_lo, vocab_hi, row_max, row_inverse_norm,
                inverse_temperature, KIND, LOGITS, ROWS, SEARCH_BLOCK * CANDIDATES, SEARCH_BLOCK)
            if KIND == MAX_KEY:
                first = tl.maximum(first, slice_first)
            else:
                first += slice_first
            second += slice_second
            measured_slices += 1
            taken = take_slice(record)
        # One atomic per nonzero word and program (not per slice): most candidates of a step count nothing.
        # Payload [ROWS, CANDIDATES, 2]: first, second.
        first_words = (record + STAGE_WORDS + (tl.arange(0, ROWS)[:, None] * CANDIDATES
                                               + tl.arange(0, CANDIDATES)[None, :]) * 2)
        if KIND == MAX_KEY:
            tl.atomic_max(first_words, first, mask=first != 0, sem="relaxed")
        else:
            tl.atomic_add(first_words, first, mask=first != 0, sem="relaxed")
            tl.atomic_add(first_words + 1, second, mask=second != 0, sem="relaxed")
        publish(record, measured_slices)
        wait_for_stage(record, num_splits, failed_ptr, give_up)
        first = tl.load(first_words, cache_modifier=".cg")
        second = tl.load(first_words + 1, cache_modifier=".cg")
    else:
        first, second = measure_slice(row, searching, candidates, floor, 0, vocab_size, row_max, row_inverse_norm,
                                      inverse_temperature, KIND, LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)
    return first, second


@triton.jit
def clear_records(records, first_stage, end_stage, ROWS: tl.constexpr):
    """Zero the records of stages ``[first_stage, end_stage)`` (the request's last program, after every program
    read them): 1 KB a store step, 2.1 KB a record of 8 rows."""
    words = tl.arange(0, 8 * STAGE_WORDS)
    start_word = first_stage * record_words(ROWS)
    end_word = end_stage * record_words(ROWS)
    for start in range(start_word, end_word, 8 * STAGE_WORDS):
        tl.store(records + start + words, tl.zeros((8 * STAGE_WORDS,), tl.int64), mask=start + words < end_word)
