"""What one pass of the truncation search measures over a slice ``[vocab_lo, vocab_hi)`` of rows.

``kernels/truncation.py`` drives the search (which measure, which goal,
which digit); this module only reads a slice of each row and reduces it.
Every measure is an integer reduction (a max, a count or a fixed-point mass
split at bit 31), so the measures of disjoint slices combine exactly in any
order: the whole-row search takes the slice ``[0, V)`` in one program, the
staged one (``kernels/truncation_stages.py``) adds the slices of many
programs atomically, and both get the same bits.

Every measure returns a pair of ``[ROWS, CANDIDATES]`` int64 tiles
``(first, second)``, the shape a stage record holds:

* ``MAX_KEY``: the largest key in column 0 of ``first`` (0 for rows not
  measured: keys of probabilities are non-negative);
* ``MASS``: the split mass ``(>> 31, & (2**31 - 1))`` of the keys at or
  above ``floor``, in column 0;
* ``COUNTS``: per radix candidate, the number of keys at or above it
  (``first``);
* ``MASSES``: per radix candidate, the split mass at or above it.
"""

import triton
import triton.language as tl

from .sampling import fixed_point, row_probabilities, split_sums

RADIX_BITS = tl.constexpr(4)
CANDIDATES = tl.constexpr(16)  # 2**RADIX_BITS
MAX_KEY = tl.constexpr(0)
MASS = tl.constexpr(1)
COUNTS = tl.constexpr(2)
MASSES = tl.constexpr(3)
_LOW31 = tl.constexpr((1 << 31) - 1)


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
    (from ``kernels/truncation.py``). The entry is ``_sampling.normalise``'s.
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
def _in_column_zero(value, ROWS: tl.constexpr):
    """``[ROWS]`` int values as column 0 of a ``[ROWS, CANDIDATES]`` int64 tile (the rest 0)."""
    columns = tl.arange(0, CANDIDATES)[None, :]
    return tl.where(columns == 0, value.to(tl.int64)[:, None], tl.zeros((ROWS, CANDIDATES), tl.int64))


@triton.jit
def _candidate_measures(row, searching, candidates, vocab_lo, vocab_hi, row_max, row_inverse_norm,
                        inverse_temperature, BY_MASS: tl.constexpr, LOGITS: tl.constexpr, ROWS: tl.constexpr,
                        SEARCH_BLOCK: tl.constexpr):
    """Per row and candidate (``[ROWS, CANDIDATES]`` int32 keys), the count or split mass of keys ``>=`` it."""
    vocab = tl.arange(0, SEARCH_BLOCK)[None, None, :]
    bounds = candidates[:, :, None]
    count = tl.zeros((ROWS, CANDIDATES), tl.int32)
    high = tl.zeros((ROWS, CANDIDATES), tl.int64)
    low = tl.zeros((ROWS, CANDIDATES), tl.int64)
    for start in range(vocab_lo, vocab_hi, SEARCH_BLOCK):
        index = start + vocab
        key, weight = _tile(row[:, :, None], index, searching[:, None, None] & (index < vocab_hi),
                            row_max[:, :, None], row_inverse_norm[:, :, None], inverse_temperature[:, :, None],
                            LOGITS)
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
def measure_slice(row, searching, candidates, floor, vocab_lo, vocab_hi, row_max, row_inverse_norm,
                  inverse_temperature, KIND: tl.constexpr, LOGITS: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """``(first, second)`` (see the module docstring) of ``[vocab_lo, vocab_hi)`` of the ``searching`` rows.

    ``row`` and the statistics are ``[ROWS, 1]``; ``candidates`` is ``[ROWS,
    CANDIDATES]`` (``COUNTS`` / ``MASSES``), ``floor`` ``[ROWS]`` (``MASS``).
    """
    vocab = tl.arange(0, BLOCK_V)[None, :]
    if KIND == MAX_KEY:
        found = tl.zeros((ROWS,), tl.int32)
        for start in range(vocab_lo, vocab_hi, BLOCK_V):
            index = start + vocab
            key, _ = _tile(row, index, searching[:, None] & (index < vocab_hi), row_max, row_inverse_norm,
                           inverse_temperature, LOGITS)
            found = tl.maximum(found, tl.max(key, axis=1))
        return _in_column_zero(found, ROWS), tl.zeros((ROWS, CANDIDATES), tl.int64)
    elif KIND == MASS:
        high = tl.zeros((ROWS,), tl.int64)
        low = tl.zeros((ROWS,), tl.int64)
        for start in range(vocab_lo, vocab_hi, BLOCK_V):
            index = start + vocab
            key, weight = _tile(row, index, searching[:, None] & (index < vocab_hi), row_max, row_inverse_norm,
                                inverse_temperature, LOGITS)
            tile_high, tile_low = split_sums(tl.where(key >= floor[:, None], weight, 0))
            high += tile_high
            low += tile_low
        return _in_column_zero(high, ROWS), _in_column_zero(low, ROWS)
    else:
        return _candidate_measures(row, searching, candidates, vocab_lo, vocab_hi, row_max, row_inverse_norm,
                                   inverse_temperature, KIND == MASSES, LOGITS, ROWS, SEARCH_BLOCK)
