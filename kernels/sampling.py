"""The fixed-point sampler as ``@triton.jit`` helpers, shared by the verify kernels.

A twin of ``specdec_kernels/reference/_sampling.py`` (whose docstring holds
the rule and ``docs/rng.md`` the error bound). A kernel splits a row's
vocabulary into whole chunks of ``CHUNK_SIZE`` tokens across its programs:

* per chunk, :func:`chunk_pick` turns a ``[ROWS, BLOCK]`` tile of int64
  weights (:func:`fixed_point`) into the chunk total ``T_c`` and the
  candidate's offset in the chunk, from the chunk's 64-bit draw
  (:func:`chunk_draw`). Per element: one convert, one int64 scan, one
  compare; no random number;
* once every chunk total is written, one program per row calls
  :func:`chunk_sums` and :func:`choose_chunk`, which choose among the chunk
  totals in vectorised 128-bit arithmetic (``CHUNK_TILE`` chunks per step).

Integer sums are exact, so the token does not depend on the split of the
vocabulary across programs or on any reduction order.

Unsigned 64-bit values are ``tl.uint64`` (``tl.umulhi`` is the high half of
the product, on GPUs and in the interpreter); a 128-bit value is a pair
``(hi, lo)`` of them. ``T_c < 2**62`` fits int64, so chunk totals are stored
as int64.
"""

import triton
import triton.language as tl

from .rng import SAMPLE_STREAM, random_words

CHUNK_SIZE = tl.constexpr(1024)
_LOW31 = tl.constexpr((1 << 31) - 1)


@triton.jit
def fixed_point(weights):
    """int64 ``W = trunc(clamp(w, 0, 1) * 2**52)``, NaN and negatives -> 0 (the reference's rule).

    Scaling a float32 in ``[0, 1]`` by ``2**52`` is exact and the conversion
    truncates (``cvt.rzi``), so the integers equal the reference's.
    """
    clamped = tl.where(weights > 0.0, tl.minimum(weights, 1.0), 0.0)
    return (clamped * 4503599627370496.0).to(tl.int64)


@triton.jit
def softmax_weight(shifted_logit, inverse_temperature):
    """Unnormalised softmax weight ``exp((x - m) / T)`` of ``shifted_logit = x - m``.

    The reference's degenerate rules: a shift of ``-inf`` or NaN (``x`` is
    ``-inf`` or NaN, or ``m`` is ``+inf`` or ``-inf``) weighs 0. A zero
    shift weighs 1 even when ``1/T`` is infinite (tiny ``T``), and ``T = inf``
    gives every finite logit the weight 1. Multiplying by ``1/T`` instead of
    dividing by ``T`` saves a division per element; logits are not bit-equal
    to the reference anyway (``exp`` and the sum round differently).
    """
    shift = tl.where(shifted_logit == 0.0, 0.0, shifted_logit * inverse_temperature)
    return tl.where(shift > -float("inf"), tl.exp(shift), 0.0)


@triton.jit
def row_probabilities(row, index, mask, row_max, row_inverse_norm, inverse_temperature, LOGITS: tl.constexpr):
    """float32 probabilities at ``index`` of input rows: as given, or from logits ``softmax(x / T)``.

    With ``LOGITS`` the row's ``(max, 1 / sum)`` statistics normalise
    ``exp((x - max) / T)``; masked lanes come out 0 (or NaN for a row
    without mass), which weigh 0 in the sampler.
    """
    return given_probability(given_values(row, index, mask, LOGITS), row_max, row_inverse_norm, inverse_temperature,
                             LOGITS)


@triton.jit
def given_values(row, index, mask, LOGITS: tl.constexpr):
    """float32 values at ``index`` of input rows as given; masked lanes ``-inf`` (logits) or 0: both weigh 0."""
    if LOGITS:
        return tl.load(row + index, mask=mask, other=-float("inf")).to(tl.float32)
    else:
        return tl.load(row + index, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def given_probability(x, row_max, row_inverse_norm, inverse_temperature, LOGITS: tl.constexpr):
    """:func:`row_probabilities` of values already read (:func:`given_values`)."""
    if LOGITS:
        return softmax_weight(x - row_max, inverse_temperature) * row_inverse_norm
    else:
        return x


@triton.jit
def chunk_draw(k0, k1, c2, c3, position, chunk):
    """The 64-bit draw ``r_c`` of ``chunk`` (Philox words 0 and 1 on the sample stream)."""
    w0, w1, _, _ = random_words(k0, k1, c2, c3, SAMPLE_STREAM, position, position * 0 + chunk)
    return (w0.to(tl.uint64) << 32) | w1.to(tl.uint64)


@triton.jit
def choice_draw(k0, k1, c2, c3, position):
    """The 64-bit draw ``R`` that chooses the chunk (Philox words 2 and 3 at index 0)."""
    _, _, w2, w3 = random_words(k0, k1, c2, c3, SAMPLE_STREAM, position, position * 0)
    return (w2.to(tl.uint64) << 32) | w3.to(tl.uint64)


@triton.jit
def chunk_pick(weights, draw):
    """``(T_c, offset)`` of each row of a chunk tile ``weights [ROWS, BLOCK]`` (int64).

    The candidate is the first token whose inclusive prefix sum exceeds
    ``floor(draw * T_c / 2**64)``: its offset is the number of prefixes at or
    below that threshold. Padding lanes must hold 0.
    """
    prefix = tl.cumsum(weights, axis=1)
    total = tl.sum(weights, axis=1)
    threshold = tl.umulhi(draw, total.to(tl.uint64)).to(tl.int64)
    offset = tl.sum((prefix <= threshold[:, None]).to(tl.int32), axis=1)
    return total, offset


@triton.jit
def _to_128(high31, low31):
    """The 128-bit value ``high31 * 2**31 + low31`` of two non-negative int64 sums."""
    shifted = high31.to(tl.uint64) << 31
    lo = shifted + low31.to(tl.uint64)
    return (high31 >> 33).to(tl.uint64) + (lo < shifted).to(tl.uint64), lo


@triton.jit
def _add_128(a_hi, a_lo, b_hi, b_lo):
    lo = a_lo + b_lo
    return a_hi + b_hi + (lo < a_lo).to(tl.uint64), lo


@triton.jit
def chunk_sums(total_ptr, row_offset, rows, num_chunks, ROWS: tl.constexpr, CHUNK_TILE: tl.constexpr):
    """Row totals ``T = sum_c T_c`` as two exact int64 sums ``(sum T_c >> 31, sum T_c & (2**31 - 1))``.

    Splitting each ``T_c < 2**62`` at bit 31 keeps both sums exact for up to
    ``2**32`` chunks, where one int64 sum could overflow on a garbage row
    (weights clamp at 1, so ``T`` reaches ``V * 2**52``). ``total_ptr +
    row_offset`` is each row's first chunk total; ``rows`` masks the rows.
    """
    high31 = tl.zeros((ROWS,), tl.int64)
    low31 = tl.zeros((ROWS,), tl.int64)
    for start in range(0, num_chunks, CHUNK_TILE):
        chunks = start + tl.arange(0, CHUNK_TILE)[None, :]
        totals = tl.load(total_ptr + row_offset[:, None] + chunks, mask=rows[:, None] & (chunks < num_chunks),
                         other=0, cache_modifier=".cg")
        high31 += tl.sum(totals >> 31, axis=1)
        low31 += tl.sum(totals & _LOW31, axis=1)
    return high31, low31


@triton.jit
def choose_chunk(total_ptr, pick_ptr, row_offset, rows, num_chunks, high31, low31, draw,
                 ROWS: tl.constexpr, CHUNK_TILE: tl.constexpr):
    """The token of each row: the candidate of the chunk chosen with probability ``T_c / T``; -1 if ``T == 0``.

    ``t = floor(draw * T / 2**64) = draw * T_hi + umulhi(draw, T_lo)`` in
    128 bits; the chosen chunk is the number of chunks whose inclusive prefix
    is at most ``t`` (vectorised: one ``tl.cumsum`` per tile of chunks, the
    prefix carried across tiles in the same split form as :func:`chunk_sums`).
    ``pick_ptr + row_offset + c`` holds chunk ``c``'s candidate.
    """
    total_hi, total_lo = _to_128(high31, low31)
    target_hi, target_lo = _add_128(tl.umulhi(draw, total_hi), draw * total_hi,
                                    tl.zeros_like(draw), tl.umulhi(draw, total_lo))
    count = tl.zeros((ROWS,), tl.int32)
    carry_high31 = tl.zeros((ROWS,), tl.int64)
    carry_low31 = tl.zeros((ROWS,), tl.int64)
    for start in range(0, num_chunks, CHUNK_TILE):
        chunks = start + tl.arange(0, CHUNK_TILE)[None, :]
        in_range = rows[:, None] & (chunks < num_chunks)
        totals = tl.load(total_ptr + row_offset[:, None] + chunks, mask=in_range, other=0, cache_modifier=".cg")
        prefix_hi, prefix_lo = _to_128(carry_high31[:, None] + tl.cumsum(totals >> 31, axis=1),
                                       carry_low31[:, None] + tl.cumsum(totals & _LOW31, axis=1))
        at_or_below = (prefix_hi < target_hi[:, None]) | ((prefix_hi == target_hi[:, None])
                                                           & (prefix_lo <= target_lo[:, None]))
        count += tl.sum((in_range & at_or_below).to(tl.int32), axis=1)
        carry_high31 += tl.sum(totals >> 31, axis=1)
        carry_low31 += tl.sum(totals & _LOW31, axis=1)
    chosen = tl.minimum(count, num_chunks - 1)
    token = tl.load(pick_ptr + row_offset + chosen, mask=rows, other=-1, cache_modifier=".cg")
    has_mass = (high31 != 0) | (low31 != 0)
    return tl.where(has_mass, token, -1)


@triton.jit
def split_sums(weights):
    """Per row, ``(sum W >> 31, sum W & (2**31 - 1))`` of int64 weights ``W < 2**53``: exact in any order."""
    return tl.sum(weights >> 31, axis=1), tl.sum(weights & _LOW31, axis=1)


@triton.jit
def normaliser_reciprocal(high31, low31):
    """``float64(1 / float32(S))`` for ``S = high31 * 2**31 + low31`` (1 where ``S == 0``), as ``_sampling.normalise``.

    Both halves are exact in float64 and their sum is rounded once; the
    division is float32 and correctly rounded (``div_rn``), once per row.
    """
    total = (high31.to(tl.float64) * 2147483648.0 + low31.to(tl.float64)).to(tl.float32)
    return tl.math.div_rn(tl.zeros_like(total) + 1.0, tl.where(total > 0.0, total, 1.0)).to(tl.float64)
