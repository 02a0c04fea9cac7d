"""Top-k, top-p and min-p truncation of target rows, as ``@triton.jit`` helpers shared by the verify kernels.

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

Each pass is a *measure* (``kernels/truncation_measures.py``): over the
whole row in one program (:func:`row_truncation`), or, in the chain
kernel's staged plan (:func:`staged_truncation`), shared by the programs of
a request slice by slice through numbered stage records
(``kernels/truncation_stages.py``). The search below is the same code for
both, so the thresholds and reciprocals are the same bits.
"""

import triton
import triton.language as tl

from .sampling import normaliser_reciprocal
from .truncation_measures import (CANDIDATES, COUNTS, MASS, MASSES, MAX_KEY, RADIX_BITS, clean_probability,
                                  probability_key, truncated_probability)
from .truncation_stages import clear_records, measured

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
def _column_zero(tile):
    """Column 0 of a measure's ``[ROWS, CANDIDATES]`` tile (the ``MAX_KEY`` / ``MASS`` result)."""
    return tl.sum(tl.where(tl.arange(0, CANDIDATES)[None, :] == 0, tile, 0), axis=1)


@triton.jit
def _largest_key(row, searching, floor, goal_count, goal_mass, row_max, row_inverse_norm, inverse_temperature,
                 vocab_size, records, first_stage, chunks_per_split, num_splits, failed_ptr, give_up,
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
        first, second = measured(row, searching, candidates, floor, row_max, row_inverse_norm, inverse_temperature,
                                 vocab_size, records, first_stage + step, chunks_per_split, num_splits,
                                 failed_ptr, give_up, MASSES if BY_MASS else COUNTS, STAGED, LOGITS,
                                 ROWS, BLOCK_V, SEARCH_BLOCK)
        if BY_MASS:
            reached = first.to(tl.float64) * 2147483648.0 + second.to(tl.float64) >= goal_mass[:, None]
        else:
            reached = first >= goal_count[:, None]
        best = tl.max(tl.where(reached & (digit_ids < (1 << width)), digit_ids, 0), axis=1)
        found = tl.where(searching, found | (best << shift), found)
    return found


@triton.jit
def _truncation(row, truncating, top_k, top_p, min_p, k_on, p_on, min_p_on, row_max, row_inverse_norm,
                inverse_temperature, vocab_size, records, chunks_per_split, num_splits, failed_ptr, give_up,
                STAGED: tl.constexpr, LOGITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
                SEARCH_BLOCK: tl.constexpr):
    """:func:`row_truncation`, its passes whole-row or staged (``kernels/truncation_stages.py``).

    Staged, a search runs where any of the ``ROWS`` rows needs it: the rows
    are one request's, so every program of it runs the same stages.
    """
    no_candidates = tl.zeros((ROWS, CANDIDATES), tl.int32)
    threshold = tl.zeros((ROWS,), tl.int32)
    first, _ = measured(row, truncating, no_candidates, threshold, row_max, row_inverse_norm, inverse_temperature,
                        vocab_size, records, _MAX_KEY_STAGE, chunks_per_split, num_splits, failed_ptr,
                        give_up, MAX_KEY, STAGED, LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)
    max_key = _column_zero(first).to(tl.int32)
    searching_k = truncating & k_on
    if tl.max(searching_k.to(tl.int32), axis=0) > 0:
        threshold = _largest_key(row, searching_k, threshold, top_k, top_p.to(tl.float64), row_max,
                                 row_inverse_norm, inverse_temperature, vocab_size, records, _TOP_K_STAGE,
                                 chunks_per_split, num_splits, failed_ptr, give_up, False, STAGED, LOGITS,
                                 ROWS, BLOCK_V, SEARCH_BLOCK)
    searching_p = truncating & p_on
    if tl.max(searching_p.to(tl.int32), axis=0) > 0:
        high, low = measured(row, searching_p, no_candidates, threshold, row_max, row_inverse_norm,
                             inverse_temperature, vocab_size, records, _GOAL_STAGE, chunks_per_split, num_splits,
                             failed_ptr, give_up, MASS, STAGED, LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)
        goal = top_p.to(tl.float64) * (_column_zero(high).to(tl.float64) * 2147483648.0
                                       + _column_zero(low).to(tl.float64))
        threshold_p = _largest_key(row, searching_p, threshold, top_k, goal, row_max, row_inverse_norm,
                                   inverse_temperature, vocab_size, records, _TOP_P_STAGE, chunks_per_split,
                                   num_splits, failed_ptr, give_up, True, STAGED, LOGITS, ROWS, BLOCK_V,
                                   SEARCH_BLOCK)
        # A goal of 0 is reached by every tau: keep the largest probability and its ties.
        threshold = tl.where(searching_p, tl.maximum(threshold, tl.minimum(threshold_p, max_key)), threshold)
    scaled = min_p * max_key.to(tl.float32, bitcast=True)
    threshold = tl.where(truncating & min_p_on, tl.maximum(threshold, probability_key(clean_probability(scaled))),
                         threshold)
    high, low = measured(row, truncating, no_candidates, threshold, row_max, row_inverse_norm, inverse_temperature,
                         vocab_size, records, _KEPT_STAGE, chunks_per_split, num_splits, failed_ptr,
                         give_up, MASS, STAGED, LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)
    return threshold, tl.where(truncating, normaliser_reciprocal(_column_zero(high), _column_zero(low)), 1.0)


@triton.jit
def row_truncation(row, truncating, top_k, top_p, min_p, k_on, p_on, min_p_on, row_max, row_inverse_norm,
                   inverse_temperature, vocab_size, LOGITS: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """``(threshold, reciprocal)`` of each truncating row, each row read whole by this program; the rest get
    ``(0, 1)``.

    ``row`` and the statistics ``row_max``, ``row_inverse_norm``,
    ``inverse_temperature`` are ``[ROWS, 1]``; the parameters ``[ROWS]``.

    ``threshold`` is the largest active threshold (int32 key); ``reciprocal``
    the float64 reciprocal of the kept row's exact total, as
    ``_sampling.normalise``. With ``LOGITS`` the rows' ``(max, 1 / sum)``
    statistics must be those of the softmax at ``1 / T``.
    """
    return _truncation(row, truncating, top_k, top_p, min_p, k_on, p_on, min_p_on, row_max, row_inverse_norm,
                       inverse_temperature, vocab_size, 0, 0, 0, 0, 0, False, LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)


@triton.jit
def staged_truncation(row, truncating, top_k, top_p, min_p, k_on, p_on, min_p_on, row_max, row_inverse_norm,
                      inverse_temperature, vocab_size, records, chunks_per_split, num_splits, failed_ptr,
                      give_up, LOGITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
                      SEARCH_BLOCK: tl.constexpr):
    """:func:`row_truncation` of ``ROWS`` rows of ONE request, every pass shared by the request's
    ``num_splits`` programs through its stage records ``records`` (``kernels/truncation_stages.py``; slices of
    ``chunks_per_split`` chunks of ``BLOCK_V`` tokens). Every program of the request must call it, with the same
    parameters; the bits are :func:`row_truncation`'s."""
    return _truncation(row, truncating, top_k, top_p, min_p, k_on, p_on, min_p_on, row_max, row_inverse_norm,
                       inverse_temperature, vocab_size, records, chunks_per_split, num_splits, failed_ptr,
                       give_up, True, LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)


@triton.jit
def clear_search_records(records, truncating, k_on, p_on, ROWS: tl.constexpr):
    """Zero the stage records :func:`staged_truncation` used for these parameters (``[ROWS]``, one request's),
    after every program of the request is done with them: at most the whole 20 records (43 KB at 8 rows), on
    the request's critical path, for the searches it ran only (a record of a skipped search is still zero)."""
    truncated = truncating != 0
    if tl.max(truncated.to(tl.int32), axis=0) > 0:
        clear_records(records, _MAX_KEY_STAGE, _TOP_K_STAGE, ROWS)
        if tl.max((truncated & k_on).to(tl.int32), axis=0) > 0:
            clear_records(records, _TOP_K_STAGE, _GOAL_STAGE, ROWS)
        if tl.max((truncated & p_on).to(tl.int32), axis=0) > 0:
            clear_records(records, _GOAL_STAGE, _KEPT_STAGE, ROWS)
        clear_records(records, _KEPT_STAGE, NUM_STAGES, ROWS)
