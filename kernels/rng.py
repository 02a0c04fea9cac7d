"""Philox4x32-10 and the float32 transforms as ``@triton.jit`` helpers.

A line-for-line twin of ``specdec_kernels/rng.py``, whose docstring holds
the bit layout and the reasoning. The float transforms are bit-identical to
the reference only when the kernel is compiled with
``enable_fp_fusion=False`` (otherwise multiply-adds may be contracted to
FMAs, which round once instead of twice).
"""

import triton
import triton.language as tl

ACCEPT_STREAM = tl.constexpr(0)
SAMPLE_STREAM = tl.constexpr(1)
DRAFT_STREAM = tl.constexpr(2)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 tensors; returns the four output words."""
    for round_index in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if round_index < 9:
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def request_key(seed_ptr, seed_value, offset_ptr, offset_value, request, active,
                SEED_PER_REQUEST: tl.constexpr, OFFSET_FROM_TENSOR: tl.constexpr,
                OFFSET_PER_REQUEST: tl.constexpr):
    """Key words and upper counter words of requests: ``(k0, k1, c2, c3)``.

    ``request`` is a tensor of request indices and ``active`` masks those
    inside the batch. ``seed_ptr``/``offset_ptr`` are int64 device tensors
    read when the matching constexpr says so (so a captured CUDA graph sees
    new values); otherwise the scalar values passed at launch are used.
    """
    if SEED_PER_REQUEST:
        seed = tl.load(seed_ptr + request, mask=active, other=0)
        request_word = request * 0
    else:
        seed = request.to(tl.int64) * 0 + seed_value
        request_word = request
    if OFFSET_FROM_TENSOR:
        if OFFSET_PER_REQUEST:
            offset = tl.load(offset_ptr + request, mask=active, other=0)
        else:
            offset = request.to(tl.int64) * 0 + tl.load(offset_ptr)
    else:
        offset = request.to(tl.int64) * 0 + offset_value
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c2 = (offset & 0xFFFFFFFF).to(tl.uint32)
    c3 = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32) ^ request_word.to(tl.uint32)
    return k0, k1, c2, c3


@triton.jit
def random_words(k0, k1, c2, c3, stream: tl.constexpr, position, index):
    """Philox words for ``(stream, position, index)`` under one request key."""
    c0 = index.to(tl.uint32)
    c1 = position.to(tl.uint32) | (stream << 24)
    c0, c1 = tl.broadcast(c0, c1)
    return philox4x32_10(c0, c1, c2 + tl.zeros_like(c0), c3 + tl.zeros_like(c0), k0, k1)


@triton.jit
def uniform_from_word(word):
    """float32 uniform in ``(0, 1)``: ``(2*(w>>9)+1) * 2**-24``."""
    odd = (word >> 9) * 2 + 1
    return odd.to(tl.float32) * (2.0**-24)


@triton.jit
def _leading_zeros_24(chunk):
    exponent_bits = chunk.to(tl.float32).to(tl.int32, bitcast=True) >> 23
    return 150 - exponent_bits


@triton.jit
def log1p_reduced(x):
    """``log1p(x) = k * ln2 + poly`` for ``x`` in ``(-1/2, 1)``; returns ``(k, poly)``."""
    high = x > 0.4142135679721832
    low = x < -0.29289323091506958
    y = tl.where(high, (x - 1.0) * 0.5, tl.where(low, x * 2.0 + 1.0, x))
    k = high.to(tl.int32) - low.to(tl.int32)
    acc = tl.zeros_like(y) - 0.07638592272996902
    acc = acc * y + 0.129141703248024
    acc = acc * y - 0.13240842521190643
    acc = acc * y + 0.14180079102516174
    acc = acc * y - 0.16609126329421997
    acc = acc * y + 0.2000207155942917
    acc = acc * y - 0.25001585483551025
    acc = acc * y + 0.33333325386047363
    acc = acc * y - 0.49999988079071045
    acc = acc * y + 1.0
    return k, y * acc


@triton.jit
def exponential_from_words(w0, w1, w2, w3):
    """float32 standard exponential with both tails resolved."""
    a0 = (w0 >> 8).to(tl.int32)
    a1 = (w2 >> 8).to(tl.int32)
    a2 = (w3 >> 8).to(tl.int32)
    z = tl.where(
        a0 > 0,
        _leading_zeros_24(a0),
        tl.where(a1 > 0, 24 + _leading_zeros_24(a1), tl.where(a2 > 0, 48 + _leading_zeros_24(a2), 72)),
    )
    mantissa = (w1 >> 9).to(tl.int32)
    upper_tail = (w1 & 1) == 0
    h = (((125 - z) << 23) | mantissa).to(tl.float32, bitcast=True)
    fraction = mantissa.to(tl.float32) * (2.0**-23)
    x = tl.where(upper_tail, fraction, -h)
    k, poly = log1p_reduced(x)
    n = tl.where(upper_tail, z + 2, 0) - k
    return n.to(tl.float32) * 0.6931471824645996 - poly
