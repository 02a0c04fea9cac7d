"""Philox4x32-10 and the uniform transform as ``@triton.jit`` helpers.

A line-for-line twin of ``specdec_kernels/rng.py``, whose docstring holds
the bit layout and the reasoning. The sampler reads the words as integers
(``kernels/sampling.py``); the only float transform is the uniform, which is
exact (an integer times a power of two).
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
def request_key(seed_ptr, seed_low, seed_high, offset_ptr, offset_low, offset_high, request, active,
                SEED_PER_REQUEST: tl.constexpr, OFFSET_FROM_TENSOR: tl.constexpr,
                OFFSET_PER_REQUEST: tl.constexpr):
    """Key words and upper counter words of requests: ``(k0, k1, c2, c3)``.

    ``request`` is a tensor of request indices and ``active`` masks those
    inside the batch. ``seed_ptr``/``offset_ptr`` are int64 device tensors
    read when the matching constexpr says so (so a captured CUDA graph sees
    new values); otherwise the launch passes the 64-bit seed and offset as
    two signed 32-bit words each (``split_words`` in the launcher): an
    ``i32`` whatever the value, so a new seed or offset never changes the
    kernel's signature (Triton types an int by its range).
    """
    if SEED_PER_REQUEST:
        seed = tl.load(seed_ptr + request, mask=active, other=0)
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        request_word = (request * 0).to(tl.uint32)
    else:
        k0 = (request.to(tl.int32) * 0 + seed_low).to(tl.uint32, bitcast=True)
        k1 = (request.to(tl.int32) * 0 + seed_high).to(tl.uint32, bitcast=True)
        request_word = request.to(tl.uint32)
    if OFFSET_FROM_TENSOR:
        if OFFSET_PER_REQUEST:
            offset = tl.load(offset_ptr + request, mask=active, other=0)
        else:
            offset = request.to(tl.int64) * 0 + tl.load(offset_ptr)
        c2 = (offset & 0xFFFFFFFF).to(tl.uint32)
        c3 = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32) ^ request_word
    else:
        c2 = (request.to(tl.int32) * 0 + offset_low).to(tl.uint32, bitcast=True)
        c3 = (request.to(tl.int32) * 0 + offset_high).to(tl.uint32, bitcast=True) ^ request_word
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
