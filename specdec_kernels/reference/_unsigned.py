"""Unsigned 64- and 128-bit integer arithmetic on int64 tensors.

torch has no unsigned 64-bit arithmetic, so an unsigned 64-bit value is kept
as the int64 with the same bits: addition, subtraction and the low half of a
product wrap modulo ``2**64`` exactly as unsigned arithmetic does; only
comparisons and the high half of a product need care. A 128-bit value is a
pair ``(hi, lo)`` of such words. The kernels use their native ``uint64``
(Triton) or ``unsigned long long`` / ``__umul64hi`` (CUDA) for the same values.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_SIGN = -(2**63)


def from_words(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The 64-bit value ``high * 2**32 + low`` from two 32-bit words (int64 tensors in ``[0, 2**32)``)."""
    return (high << 32) | low


def less(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Unsigned ``a < b``: flipping the sign bit maps unsigned order onto signed order."""
    return (a ^ _SIGN) < (b ^ _SIGN)


def mul_high(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``floor(a * b / 2**64)`` for unsigned 64-bit ``a``, ``b`` (schoolbook on 32-bit halves)."""
    a_lo, a_hi = a & _MASK32, (a >> 32) & _MASK32
    b_lo, b_hi = b & _MASK32, (b >> 32) & _MASK32
    low_low = a_lo * b_lo
    low_high = a_lo * b_hi  # each partial product below 2**64: its bits are exact in int64
    high_low = a_hi * b_lo
    middle = ((low_low >> 32) & _MASK32) + (low_high & _MASK32) + (high_low & _MASK32)
    return a_hi * b_hi + ((low_high >> 32) & _MASK32) + ((high_low >> 32) & _MASK32) + (middle >> 32)


def add128(a_hi, a_lo, b_hi, b_lo):
    """``a + b`` for 128-bit pairs (wraps modulo ``2**128``)."""
    lo = a_lo + b_lo
    return a_hi + b_hi + less(lo, a_lo).to(torch.int64), lo


def less_equal128(a_hi, a_lo, b_hi, b_lo) -> torch.Tensor:
    """Unsigned ``a <= b`` for 128-bit pairs."""
    return less(a_hi, b_hi) | ((a_hi == b_hi) & ~less(b_lo, a_lo))


def scale_down128(r: torch.Tensor, total_hi: torch.Tensor, total_lo: torch.Tensor):
    """``floor(r * total / 2**64)`` as a 128-bit pair, for 64-bit ``r`` and 128-bit ``total``.

    ``r * (hi * 2**64 + lo) / 2**64 = r * hi + r * lo / 2**64``, and ``r * hi``
    is an integer, so the floor only applies to the second term.
    """
    product_lo = r * total_hi
    product_hi = mul_high(r, total_hi)
    return add128(product_hi, product_lo, torch.zeros_like(r), mul_high(r, total_lo))
