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
"""

import triton
import triton.language as tl

from .sampling import fixed_point, normaliser_reciprocal, row_probabilities, split_sums

RADIX_BITS = tl.constexpr(4)
_CANDIDATES = tl.constexpr(16)  # 2**RADIX_BITS
_KEY_BITS = tl.constexpr(31)  # keys of probabilities in [0, 1] are below 2**30; the search covers 31 bits
_STEPS = tl.constexpr(8)  # ceil(_KEY_BITS / RADIX_BITS)


@triton.jit
def clean_probability(p):
    """``p`` with NaN and negatives as ``+0.0`` and values above 1 as 1 (the reference's ``clean``)."""
    return tl.where(p > 0.0, tl.minimum(p, 1.0), 0.0)


@triton.jit
def probability_key(cleaned):
    """int32 key of a cleaned probability: its bit pattern, which orders like the value."""
    return cleaned.to(tl.int32, bitcast=True)


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
    p_on = active & (top_p < 1.0)
    min_p_on = active & (min_p > 0.0)
    return top_k, top_p, min_p, k_on, p_on, min_p_on


@triton.jit
def truncated_probability(p, threshold, reciprocal, truncating):
    """The truncated row's entry for probability ``p``: ``float32(W * r)`` if kept, else 0; ``p`` where not truncating.

    ``threshold``, ``reciprocal`` and ``truncating`` broadcast against ``p``
    (from :func:`row_truncation`). The entry is ``_sampling.normalise``'s.
    """
    cleaned = clean_probability(p)
    kept = probability_key(cleaned) >= threshold
    value = (fixed_point(cleaned).to(tl.float64) * reciprocal).to(tl.float32)
    return tl.where(truncating, tl.where(kept, value, 0.0), p)


@triton.jit
def _tile(row, index, mask, row_max, row_inverse_norm, inverse_temperature, LOGITS: tl.constexpr):
    """Keys and fixed-point weights of a tile of each row's probabilities (padding lanes: key -1, weight 0)."""
    cleaned = clean_probability(row_probabilities(row, index, mask, row_max, row_inverse_norm,
                                                  inverse_temperature, LOGITS))
    return tl.where(mask, probability_key(cleaned), -1), fixed_point(cleaned)


@triton.jit
def _mass_at_least(row, searching, floor, row_max, row_inverse_norm, inverse_temperature, vocab_size,
                   LOGITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Split sums of the weights of the tokens with ``key >= floor`` (``[ROWS, 1]`` row pointers)."""
    vocab = tl.arange(0, BLOCK_V)[None, :]
    high = tl.zeros((ROWS,), tl.int64)
    low = tl.zeros((ROWS,), tl.int64)
    for start in range(0, vocab_size, BLOCK_V):
        index = start + vocab
        key, weight = _tile(row, index, searching[:, None] & (index < vocab_size), row_max, row_inverse_norm,
                            inverse_temperature, LOGITS)
        tile_high, tile_low = split_sums(tl.where(key >= floor[:, None], weight, 0))
        high += tile_high
        low += tile_low
    return high, low


@triton.jit
def _largest_key(row, searching, floor, goal_count, goal_mass, row_max, row_inverse_norm, inverse_temperature,
                 vocab_size, BY_MASS: tl.constexpr, LOGITS: tl.constexpr, ROWS: tl.constexpr,
                 SEARCH_BLOCK: tl.constexpr):
    """Per searching row, the largest ``tau`` with ``m(max(tau, floor)) >= goal`` (see the module docstring).

    ``m`` is the count (``goal_count``, int32) or, ``BY_MASS``, the mass
    compared in float64 (``goal_mass``). The goal must hold at ``tau = 0``.
    Rows not searching get 0.
    """
    digit_ids = tl.arange(0, _CANDIDATES)[None, :]
    digits = digit_ids[:, :, None]
    vocab = tl.arange(0, SEARCH_BLOCK)[None, None, :]
    found = tl.zeros((ROWS,), tl.int32)
    for step in range(0, _STEPS):
        shift = tl.maximum(_KEY_BITS - (step + 1) * RADIX_BITS, 0)
        width = _KEY_BITS - step * RADIX_BITS - shift  # the last step takes the bits left
        candidates = found[:, None, None] | (digits << shift)
        in_width = digit_ids < (1 << width)
        bounds = tl.maximum(candidates, floor[:, None, None])
        count = tl.zeros((ROWS, _CANDIDATES), tl.int32)
        high = tl.zeros((ROWS, _CANDIDATES), tl.int64)
        low = tl.zeros((ROWS, _CANDIDATES), tl.int64)
        for start in range(0, vocab_size, SEARCH_BLOCK):
            index = start + vocab
            key, weight = _tile(row[:, :, None], index, searching[:, None, None] & (index < vocab_size),
                                row_max[:, :, None], row_inverse_norm[:, :, None], inverse_temperature[:, :, None],
                                LOGITS)
            reaches = key >= bounds
            if BY_MASS:
                high += tl.sum(tl.where(reaches, weight >> 31, 0), axis=2)
                low += tl.sum(tl.where(reaches, weight & 2147483647, 0), axis=2)
            else:
                count += tl.sum(reaches.to(tl.int32), axis=2)
        if BY_MASS:
            mass = high.to(tl.float64) * 2147483648.0 + low.to(tl.float64)
            reached = mass >= goal_mass[:, None]
        else:
            reached = count >= goal_count[:, None]
        best = tl.max(tl.where(reached & in_width, digit_ids, 0), axis=1)
        found = tl.where(searching, found | (best << shift), found)
    return found


@triton.jit
def row_truncation(row, truncating, top_k, top_p, min_p, k_on, p_on, min_p_on, row_max, row_inverse_norm,
                   inverse_temperature, vocab_size, LOGITS: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """``(threshold, reciprocal)`` of each truncating row; the rest get ``(0, 1)``.

    ``row`` and the statistics ``row_max``, ``row_inverse_norm``,
    ``inverse_temperature`` are ``[ROWS, 1]``; the parameters ``[ROWS]``.

    ``threshold`` is the largest active threshold (int32 key); ``reciprocal``
    the float64 reciprocal of the kept row's exact total, as
    ``_sampling.normalise``. With ``LOGITS`` the rows' ``(max, 1 / sum)``
    statistics must be those of the softmax at ``1 / T``.
    """
    vocab = tl.arange(0, BLOCK_V)[None, :]
    max_key = tl.zeros((ROWS,), tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        index = start + vocab
        key, _ = _tile(row, index, truncating[:, None] & (index < vocab_size), row_max, row_inverse_norm,
                       inverse_temperature, LOGITS)
        max_key = tl.maximum(max_key, tl.max(key, axis=1))
    threshold = tl.zeros((ROWS,), tl.int32)
    searching_k = truncating & k_on
    if tl.max(searching_k.to(tl.int32), axis=0) > 0:
        threshold = _largest_key(row, searching_k, threshold, top_k, top_p.to(tl.float64), row_max,
                                 row_inverse_norm, inverse_temperature, vocab_size, False, LOGITS, ROWS, SEARCH_BLOCK)
    searching_p = truncating & p_on
    if tl.max(searching_p.to(tl.int32), axis=0) > 0:
        high, low = _mass_at_least(row, searching_p, threshold, row_max, row_inverse_norm, inverse_temperature,
                                   vocab_size, LOGITS, ROWS, BLOCK_V)
        goal = top_p.to(tl.float64) * (high.to(tl.float64) * 2147483648.0 + low.to(tl.float64))
        threshold_p = _largest_key(row, searching_p, threshold, top_k, goal, row_max, row_inverse_norm,
                                   inverse_temperature, vocab_size, True, LOGITS, ROWS, SEARCH_BLOCK)
        # A goal of 0 is reached by every tau: keep the largest probability and its ties.
        threshold = tl.where(searching_p, tl.maximum(threshold, tl.minimum(threshold_p, max_key)), threshold)
    scaled = tl.minimum(min_p, 1.0) * max_key.to(tl.float32, bitcast=True)
    threshold = tl.where(truncating & min_p_on, tl.maximum(threshold, probability_key(clean_probability(scaled))),
                         threshold)
    high, low = _mass_at_least(row, truncating, threshold, row_max, row_inverse_norm, inverse_temperature,
                               vocab_size, LOGITS, ROWS, BLOCK_V)
    return threshold, tl.where(truncating, normaliser_reciprocal(high, low), 1.0)
