"""Top-k, top-p and min-p truncation of target rows: the one home of the search, as ``@triton.jit`` helpers.

A twin of ``specdec_kernels/reference/_truncation.py``, whose docstring
holds the rule: a token is kept iff its key (the bit pattern of its float32
probability) is at least every active threshold, and the kept row is
renormalised with an exact integer total. The reference sorts; a kernel
finds each threshold by a radix search over the 31-bit keys instead, with
no sort and no data-dependent memory:

* a threshold is "the largest ``tau`` whose measure ``m(tau)`` reaches a
  goal", where ``m(tau)`` is the count (top-k) or the fixed-point mass
  (top-p) of the kept tokens with ``key >= tau``; ``m`` is non-increasing,
  so ``tau`` is found from the top bit down, ``RADIX_BITS`` at a time: one
  pass over the row measures the ``2**RADIX_BITS`` candidates that extend
  the bits found so far, and the largest that reaches the goal is kept;
* counts and masses are integer sums (masses split at bit 31, as the
  sampler's totals), so the thresholds do not depend on the tile, the
  order of the reductions or the backend; the top-p goal is compared in
  float64 from the exact integers, as in the reference.

Only rows whose request has a parameter on are searched; a program with
none skips every pass. Cost per truncated row: one pass for the maximum
and total, ``31 / RADIX_BITS`` (rounded up) passes per active top-k or
top-p search, one for the kept total: at most 20 reads of the row, which
the verify kernels then read again to test and sample. It is the first
version: a histogram kept in shared memory would need 4 passes.

The interface: the kernels pass a row and its statistics in and get
``(threshold, reciprocal)`` out (:func:`row_truncation`,
:func:`staged_truncation`), then apply them with
:func:`truncated_probability`. Inside, top down:

* the search (:func:`_truncation`, :func:`_largest_key`) asks for one
  *measure* per pass;
* :func:`measured` takes it over the whole row in one program, or, in the
  chain kernel's staged plan, shares it among the programs of a request
  through numbered *stage records*, with the take/publish/wait protocol of
  the tree kernel's split plan (``kernels/stage_records.py``): a
  program takes slices of whole sampler chunks from the record's counter
  until none is left, measures them, adds its partials into the record as
  int64 atomics (an integer max for ``MAX_KEY``), publishes the number of
  slices it measured (a release after all its adds), then waits until all
  ``num_splits`` are published and reads the totals. A slice is taken only
  by a running program, so no wait depends on one that has not started;
  the interpreter, which runs programs one after another, has a request's
  first program take every slice. The totals are integer sums, so they are
  the whole-row measure bit for bit, whoever measured which slice;
* :func:`measure_slice` reads a slice ``[vocab_lo, vocab_hi)`` of each row
  and reduces it. Every measure returns a pair of ``[ROWS, CANDIDATES]``
  int64 tiles ``(first, second)``, the shape a stage record holds:

  * ``MAX_KEY``: the largest key in column 0 of ``first`` (0 for rows not
    measured: keys of probabilities are non-negative);
  * ``MASS``: the split mass ``(>> 31, & (2**31 - 1))`` of the keys at or
    above ``floor``, in column 0;
  * ``COUNTS``: per radix candidate, the number of keys at or above it
    (``first``);
  * ``MASSES``: per radix candidate, the split mass at or above it.

Record of a stage, ``record_words(ROWS)`` int64 at
``records + stage * record_words(ROWS)``: a 128-byte header line (word 0
slices taken, word 1 slices published, as ``tree_verify_stages``), then the
payload ``[ROWS, CANDIDATES, 2]`` (``first``, ``second`` of each measure).
Stages are numbered by the search (``_MAX_KEY_STAGE`` ... ``NUM_STAGES``);
one a request skips is left at zero. The request's last program to end
zeroes the records of the stages it used (:func:`clear_search_records`), so
no memset precedes a launch.
"""

import triton
import triton.language as tl

from .sampling import fixed_point, normaliser_reciprocal, row_probabilities, split_sums
from .stage_records import STAGE_WORDS, publish, take_slice, wait_for_stage

RADIX_BITS = tl.constexpr(4)
CANDIDATES = tl.constexpr(16)  # 2**RADIX_BITS
# The measures (see the module docstring).
MAX_KEY = tl.constexpr(0)
MASS = tl.constexpr(1)
COUNTS = tl.constexpr(2)
MASSES = tl.constexpr(3)
_LOW31 = tl.constexpr((1 << 31) - 1)
_KEY_BITS = tl.constexpr(31)  # keys of probabilities in [0, 1] are below 2**30; the search covers 31 bits
_STEPS = tl.constexpr(8)  # ceil(_KEY_BITS / RADIX_BITS)
# Stage numbers of the staged search (fixed, so a skipped search leaves its records unused); stage 0 is the
# chain kernel's softmax normalisers.
_MAX_KEY_STAGE = tl.constexpr(1)
_TOP_K_STAGE = tl.constexpr(2)  # .. 2 + _STEPS - 1
_GOAL_STAGE = tl.constexpr(10)
_TOP_P_STAGE = tl.constexpr(11)  # .. 11 + _STEPS - 1
_KEPT_STAGE = tl.constexpr(19)
NUM_STAGES = tl.constexpr(20)


@triton.jit
def truncation_parameters(top_k_ptr, top_p_ptr, min_p_ptr, requests, active, vocab_size,
                          HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
                          ROWS: tl.constexpr):
    """Per request: ``(top_k, top_p, min_p, k_on, p_on, min_p_on)``, absent parameters off (0, 1, 0)."""
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + requests, mask=active, other=0)
    else:
        top_k = tl.zeros((ROWS,), tl.int32)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + requests, mask=active, other=1.0)
    else:
        top_p = tl.full((ROWS,), 1.0, tl.float32)
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + requests, mask=active, other=0.0)
    else:
        min_p = tl.zeros((ROWS,), tl.float32)
    k_on = active & (top_k > 0) & (top_k < vocab_size)
    # Outside its range (NaN included) a parameter is off, like at its neutral value (contract v1.3).
    p_on = active & (top_p > 0.0) & (top_p < 1.0)
    min_p_on = active & (min_p > 0.0) & (min_p <= 1.0)
    return top_k, top_p, min_p, k_on, p_on, min_p_on


@triton.jit
def any_truncation(parameters):
    """Where a parameter of :func:`truncation_parameters` is on (greedy requests ignore them: the callers mask)."""
    _, _, _, k_on, p_on, min_p_on = parameters
    return k_on | p_on | min_p_on


@triton.jit
def _column_zero(tile):
    """Column 0 of a measure's ``[ROWS, CANDIDATES]`` tile (the ``MAX_KEY`` / ``MASS`` result)."""
    return tl.sum(tl.where(tl.arange(0, CANDIDATES)[None, :] == 0, tile, 0), axis=1)


@triton.jit
def _largest_key(row, searching, floor, goal_count, goal_mass, statistics, vocab_size, stages, first_stage,
                 BY_MASS: tl.constexpr, STAGED: tl.constexpr, LOGITS: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """Per searching row, the largest ``tau`` with ``m(max(tau, floor)) >= goal`` (see the module docstring).

    ``m`` is the count (``goal_count``, int32) or, ``BY_MASS``, the mass
    compared in float64 (``goal_mass``). The goal must hold at ``tau = 0``.
    Rows not searching get 0. Step ``s`` is stage ``first_stage + s``.
    """
    digit_ids = tl.arange(0, CANDIDATES)[None, :]
    found = tl.zeros((ROWS,), tl.int32)
    for step in range(0, _STEPS):
        shift = tl.maximum(_KEY_BITS - (step + 1) * RADIX_BITS, 0)
        width = _KEY_BITS - step * RADIX_BITS - shift  # the last step takes the bits left
        candidates = tl.maximum(found[:, None] | (digit_ids << shift), floor[:, None])
        first, second = measured(row, searching, candidates, floor, statistics, vocab_size, stages, first_stage + step,
                                 MASSES if BY_MASS else COUNTS, STAGED, LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)
        if BY_MASS:
            reached = first.to(tl.float64) * 2147483648.0 + second.to(tl.float64) >= goal_mass[:, None]
        else:
            reached = first >= goal_count[:, None]
        best = tl.max(tl.where(reached & (digit_ids < (1 << width)), digit_ids, 0), axis=1)
        found = tl.where(searching, found | (best << shift), found)
    return found


@triton.jit
def _truncation(row, truncating, parameters, statistics, vocab_size, stages, STAGED: tl.constexpr,
                LOGITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """:func:`row_truncation`, its passes whole-row or staged (:func:`measured`).

    Staged, a search runs where any of the ``ROWS`` rows needs it: the rows
    are one request's, so every program of it runs the same stages.
    """
    top_k, top_p, min_p, k_on, p_on, min_p_on = parameters
    no_candidates = tl.zeros((ROWS, CANDIDATES), tl.int32)
    threshold = tl.zeros((ROWS,), tl.int32)
    first, _ = measured(row, truncating, no_candidates, threshold, statistics, vocab_size, stages, _MAX_KEY_STAGE,
                        MAX_KEY, STAGED, LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)
    max_key = _column_zero(first).to(tl.int32)
    searching_k = truncating & k_on
    if tl.max(searching_k.to(tl.int32), axis=0) > 0:
        threshold = _largest_key(row, searching_k, threshold, top_k, top_p.to(tl.float64), statistics, vocab_size,
                                 stages, _TOP_K_STAGE, False, STAGED, LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)
    searching_p = truncating & p_on
    if tl.max(searching_p.to(tl.int32), axis=0) > 0:
        high, low = measured(row, searching_p, no_candidates, threshold, statistics, vocab_size, stages, _GOAL_STAGE,
                             MASS, STAGED, LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)
        goal = top_p.to(tl.float64) * (_column_zero(high).to(tl.float64) * 2147483648.0
                                       + _column_zero(low).to(tl.float64))
        threshold_p = _largest_key(row, searching_p, threshold, top_k, goal, statistics, vocab_size, stages,
                                   _TOP_P_STAGE, True, STAGED, LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)
        # A goal of 0 is reached by every tau: keep the largest probability and its ties.
        threshold = tl.where(searching_p, tl.maximum(threshold, tl.minimum(threshold_p, max_key)), threshold)
    scaled = min_p * max_key.to(tl.float32, bitcast=True)
    threshold = tl.where(truncating & min_p_on, tl.maximum(threshold, probability_key(clean_probability(scaled))),
                         threshold)
    high, low = measured(row, truncating, no_candidates, threshold, statistics, vocab_size, stages, _KEPT_STAGE,
                         MASS, STAGED, LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)
    return threshold, tl.where(truncating, normaliser_reciprocal(_column_zero(high), _column_zero(low)), 1.0)


@triton.jit
def row_truncation(row, truncating, parameters, statistics, vocab_size, LOGITS: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """``(threshold, reciprocal)`` of each truncating row, each row read whole by this program; the rest get
    ``(0, 1)``.

    ``row`` and the ``statistics`` ``(max, 1 / sum, 1 / T)`` are ``[ROWS,
    1]``; ``truncating`` and the ``parameters`` (:func:`truncation_parameters`)
    ``[ROWS]``.

    ``threshold`` is the largest active threshold (int32 key); ``reciprocal``
    the float64 reciprocal of the kept row's exact total, as
    ``_sampling.normalise``. With ``LOGITS`` the rows' ``(max, 1 / sum)``
    statistics must be those of the softmax at ``1 / T``.
    """
    return _truncation(row, truncating, parameters, statistics, vocab_size, (0, 0, 0, 0, 0), False, LOGITS, ROWS,
                       BLOCK_V, SEARCH_BLOCK)


@triton.jit
def staged_truncation(row, truncating, parameters, statistics, vocab_size, stages, LOGITS: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """:func:`row_truncation` of ``ROWS`` rows of ONE request, every pass shared by the request's programs
    through its stage records: ``stages`` is ``(records, chunks_per_split, num_splits, failed_ptr, give_up)``
    (:func:`measured`; slices of ``chunks_per_split`` chunks of ``BLOCK_V`` tokens). Every program of the request
    must call it, with the same parameters; the bits are :func:`row_truncation`'s."""
    return _truncation(row, truncating, parameters, statistics, vocab_size, stages, True, LOGITS, ROWS, BLOCK_V,
                       SEARCH_BLOCK)


@triton.jit
def clear_search_records(records, truncating, parameters, ROWS: tl.constexpr):
    """Zero the stage records :func:`staged_truncation` used for these parameters (``[ROWS]``, one request's),
    after every program of the request is done with them: at most the whole 20 records (43 KB at 8 rows), on
    the request's critical path, for the searches it ran only (a record of a skipped search is still zero)."""
    _, _, _, k_on, p_on, _ = parameters
    truncated = truncating != 0
    if tl.max(truncated.to(tl.int32), axis=0) > 0:
        clear_records(records, _MAX_KEY_STAGE, _TOP_K_STAGE, ROWS)
        if tl.max((truncated & k_on).to(tl.int32), axis=0) > 0:
            clear_records(records, _TOP_K_STAGE, _GOAL_STAGE, ROWS)
        if tl.max((truncated & p_on).to(tl.int32), axis=0) > 0:
            clear_records(records, _GOAL_STAGE, _KEPT_STAGE, ROWS)
        clear_records(records, _KEPT_STAGE, NUM_STAGES, ROWS)


@triton.jit
def record_words(ROWS: tl.constexpr):
    """int64 words of one stage record of ``ROWS`` rows (``launchers/chain_verify.py`` sizes the same)."""
    return STAGE_WORDS + ROWS * CANDIDATES * 2


@triton.jit
def measured(row, searching, candidates, floor, statistics, vocab_size, stages, stage,
             KIND: tl.constexpr, STAGED: tl.constexpr, LOGITS: tl.constexpr, ROWS: tl.constexpr,
             BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """The whole-row measure ``KIND`` of the searching rows (``measure_slice``'s arguments): measured here, or,
    ``STAGED``, from stage ``stage`` of the request's records (``stages``: :func:`staged_truncation`), which
    every program of the request calls.

    ``BLOCK_V`` is the sampler's chunk (a slice is ``chunks_per_split`` of them) and, whole-row, the max / mass
    tile."""
    if STAGED:
        records, chunks_per_split, num_splits, failed_ptr, give_up = stages
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
                row, searching, candidates, floor, vocab_lo, vocab_hi, statistics, KIND, LOGITS, ROWS,
                SEARCH_BLOCK * CANDIDATES, SEARCH_BLOCK)
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
        first, second = measure_slice(row, searching, candidates, floor, 0, vocab_size, statistics, KIND, LOGITS, ROWS,
                                      BLOCK_V, SEARCH_BLOCK)
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


@triton.jit
def clean_probability(p):
    """``p`` with NaN and negatives as ``+0.0`` and values above 1 as 1 (the reference's ``clean``)."""
    return tl.where(p > 0.0, tl.minimum(p, 1.0), 0.0)


@triton.jit
def probability_key(cleaned):
    """int32 key of a cleaned probability: its bit pattern, which orders like the value."""
    return cleaned.to(tl.int32, bitcast=True)


@triton.jit
def truncated_probability(p, threshold, reciprocal, truncating):
    """The truncated row's entry for probability ``p``: ``float32(W * r)`` if kept, else 0; ``p`` where not truncating.

    ``threshold``, ``reciprocal`` and ``truncating`` broadcast against ``p``
    (from :func:`row_truncation` / :func:`staged_truncation`). The entry is ``_sampling.normalise``'s.
    """
    cleaned = clean_probability(p)
    kept = probability_key(cleaned) >= threshold
    value = (fixed_point(cleaned).to(tl.float64) * reciprocal).to(tl.float32)
    return tl.where(truncating, tl.where(kept, value, 0.0), p)


@triton.jit
def _tile(row, index, mask, statistics, LOGITS: tl.constexpr):
    """Keys and fixed-point weights of a tile of each row's probabilities (padding lanes: key -1, weight 0)."""
    row_max, row_inverse_norm, inverse_temperature = statistics
    cleaned = clean_probability(row_probabilities(row, index, mask, row_max, row_inverse_norm,
                                                  inverse_temperature, LOGITS))
    return tl.where(mask, probability_key(cleaned), -1), fixed_point(cleaned)


@triton.jit
def _in_column_zero(value, ROWS: tl.constexpr):
    """``[ROWS]`` int values as column 0 of a ``[ROWS, CANDIDATES]`` int64 tile (the rest 0)."""
    columns = tl.arange(0, CANDIDATES)[None, :]
    return tl.where(columns == 0, value.to(tl.int64)[:, None], tl.zeros((ROWS, CANDIDATES), tl.int64))


@triton.jit
def _candidate_measures(row, searching, candidates, vocab_lo, vocab_hi, statistics, BY_MASS: tl.constexpr,
                        LOGITS: tl.constexpr, ROWS: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """Per row and candidate (``[ROWS, CANDIDATES]`` int32 keys), the count or split mass of keys ``>=`` it."""
    row_max, row_inverse_norm, inverse_temperature = statistics
    wide = (row_max[:, :, None], row_inverse_norm[:, :, None], inverse_temperature[:, :, None])  # [ROWS, 1, 1]
    vocab = tl.arange(0, SEARCH_BLOCK)[None, None, :]
    bounds = candidates[:, :, None]
    count = tl.zeros((ROWS, CANDIDATES), tl.int32)
    high = tl.zeros((ROWS, CANDIDATES), tl.int64)
    low = tl.zeros((ROWS, CANDIDATES), tl.int64)
    for start in range(vocab_lo, vocab_hi, SEARCH_BLOCK):
        index = start + vocab
        key, weight = _tile(row[:, :, None], index, searching[:, None, None] & (index < vocab_hi), wide, LOGITS)
        reaches = key >= bounds
        if BY_MASS:
            high += tl.sum(tl.where(reaches, weight >> 31, 0), axis=2)
            low += tl.sum(tl.where(reaches, weight & _LOW31, 0), axis=2)
        else:
            count += tl.sum(reaches.to(tl.int32), axis=2)
    if BY_MASS:
        return high, low
    else:
        return count.to(tl.int64), low


@triton.jit
def measure_slice(row, searching, candidates, floor, vocab_lo, vocab_hi, statistics, KIND: tl.constexpr,
                  LOGITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """``(first, second)`` (see the module docstring) of ``[vocab_lo, vocab_hi)`` of the ``searching`` rows.

    ``row`` and the statistics are ``[ROWS, 1]``; ``candidates`` is ``[ROWS,
    CANDIDATES]`` (``COUNTS`` / ``MASSES``), ``floor`` ``[ROWS]`` (``MASS``).
    """
    vocab = tl.arange(0, BLOCK_V)[None, :]
    if KIND == MAX_KEY:
        found = tl.zeros((ROWS,), tl.int32)
        for start in range(vocab_lo, vocab_hi, BLOCK_V):
            index = start + vocab
            key, _ = _tile(row, index, searching[:, None] & (index < vocab_hi), statistics, LOGITS)
            found = tl.maximum(found, tl.max(key, axis=1))
        return _in_column_zero(found, ROWS), tl.zeros((ROWS, CANDIDATES), tl.int64)
    elif KIND == MASS:
        high = tl.zeros((ROWS,), tl.int64)
        low = tl.zeros((ROWS,), tl.int64)
        for start in range(vocab_lo, vocab_hi, BLOCK_V):
            index = start + vocab
            key, weight = _tile(row, index, searching[:, None] & (index < vocab_hi), statistics, LOGITS)
            tile_high, tile_low = split_sums(tl.where(key >= floor[:, None], weight, 0))
            high += tile_high
            low += tile_low
        return _in_column_zero(high, ROWS), _in_column_zero(low, ROWS)
    else:
        return _candidate_measures(row, searching, candidates, vocab_lo, vocab_hi, statistics, KIND == MASSES, LOGITS,
                                   ROWS, SEARCH_BLOCK)
