"""Counter-based random numbers shared by every backend (PyTorch implementation).

Every random number the package draws is a pure function of
``(seed, offset, request, stream, position, index)`` through Philox4x32-10
(Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011).
The same bit layout is implemented three times and the three produce the same
32-bit words: here (the reference), in ``kernels/rng.py`` (``@triton.jit``)
and in ``csrc/include/specdec/rng.cuh`` (``__device__``).

Bit layout
----------
One Philox call takes a 64-bit key and a 128-bit counter and returns four
32-bit words ``(w0, w1, w2, w3)``::

    key     = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
    counter = (index,
               position | (stream << 24),
               offset & 0xFFFFFFFF,
               ((offset >> 32) & 0xFFFFFFFF) ^ request)

* ``seed`` and ``offset`` are read as 64-bit two's complement integers.
* ``request`` is the row ``b`` of the batch when ``seed`` is one Python int
  shared by the batch, and ``0`` when each request has its own seed (a seed
  tensor). So a request with its own seed draws the same numbers in any batch,
  and requests sharing an int seed draw independent numbers. Offsets below
  ``2**32`` (four billion decoding steps per request) never make two requests
  share a counter.
* ``position`` (< 2**24) is the draft position (chain) or node index (tree).
* ``stream`` (< 256) separates the uses, so no two ever share a counter:
  ``ACCEPT_STREAM`` (0) acceptance tests, ``SAMPLE_STREAM`` (1) the
  residual/bonus sample, ``DRAFT_STREAM`` (2) draft-side sampling.
* ``index`` is the vocabulary index for per-token noise, 0 otherwise.

Philox4x32-10 round, with ``M0 = 0xD2511F53``, ``M1 = 0xCD9E8D57``::

    hi0:lo0 = M0 * c0;  hi1:lo1 = M1 * c2     (64-bit products)
    c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
    k = (k0 + 0x9E3779B9, k1 + 0xBB67AE85)    (between rounds)

From words to numbers
---------------------
``uniform(w)``: ``(2 * (w >> 9) + 1) * 2**-24``, one of ``2**23`` odd
multiples of ``2**-24``. Exactly representable in float32, symmetric about
1/2, never 0 or 1.

``exponential(w0, w1, w2, w3)``: a standard exponential ``E = -log(U)``,
``U ~ Uniform(0, 1)``, built so that float32 rounding neither truncates the
upper tail nor coarsens the lower one. A naive ``-log(uniform)`` fails at both
ends: the smallest uniform (``2**-24``) caps ``E`` at 16.6, and the uniform
next to 1 makes ``E`` at least ``2**-24``, so a token whose residual mass is
below ``~1e-7`` of the total could never win an exponential race. Instead:

1. ``h`` is a uniform on ``(0, 1/2)`` with full float32 resolution at every
   scale. Its binade ``[2**-(z+2), 2**-(z+1))`` is picked with probability
   ``2**-(z+1)`` by counting leading zeros ``z`` in the 72 bits
   ``w0>>8 : w2>>8 : w3>>8`` (``z = 72`` when all are zero, probability
   ``2**-72``); its 23 mantissa bits are ``w1 >> 9``. So ``h`` is assembled
   directly as the float32 with exponent ``-(z+2)`` and that mantissa.
2. ``U = h`` or ``U = 1 - h``, by bit 0 of ``w1``. Since ``h`` is symmetric in
   law with ``1 - h`` around 1/2, ``U`` is uniform on ``(0, 1)``.
3. ``E = -log(h)`` (the upper tail, reaching ``74 ln 2 = 51.3``, where the
   exponential has mass ``2**-74``) or ``E = -log1p(-h)`` (the lower tail,
   reaching down to ``2**-74`` with float32 relative precision).

Both logarithms go through one deterministic float32 routine, ``log1p(x)``
for ``x`` in ``(-1/2, 1)``: an exact range reduction to
``[sqrt(1/2) - 1, sqrt(2) - 1]`` and a degree-9 polynomial evaluated by
Horner's rule with separately rounded multiplies and adds (max error 2 ulp).
Every backend performs the same IEEE operations in the same order (Triton
kernels are compiled with ``enable_fp_fusion=False``; CUDA uses ``__fmul_rn``
and ``__fadd_rn``), so the exponentials agree bit for bit; no backend's
``log`` is used, because libm, libdevice and numpy round differently.

A sample from an unnormalised residual ``r`` is the exponential race
``argmin_v E_v / r_v`` (correctly rounded float32 division; ties to the lower
index): ``E_v / r_v`` is exponential with rate ``r_v``, and the smallest of
independent exponentials is ``v`` with probability ``r_v / sum(r)``. No
normalisation and no prefix sum are needed, so the result does not depend on
any summation order.
"""

from __future__ import annotations

import torch

ACCEPT_STREAM = 0
SAMPLE_STREAM = 1
DRAFT_STREAM = 2

_MASK32 = 0xFFFFFFFF
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85
_PHILOX_ROUNDS = 10

# log1p(x) ~= x * poly(x) on [sqrt(1/2) - 1, sqrt(2) - 1]; float32 values,
# lowest order first (Chebyshev fit of log1p(x)/x, degree 9).
LOG1P_COEFFS = (
    1.0,
    -0.49999988079071045,
    0.33333325386047363,
    -0.25001585483551025,
    0.2000207155942917,
    -0.16609126329421997,
    0.14180079102516174,
    -0.13240842521190643,
    0.129141703248024,
    -0.07638592272996902,
)
# float32 constants, so every backend uses the same rounded values.
LN2 = 0.6931471824645996  # float32(ln 2)
SQRT2_MINUS_1 = 0.4142135679721832  # float32(sqrt(2) - 1)
SQRT_HALF_MINUS_1 = -0.29289323091506958  # float32(sqrt(1/2) - 1)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on int64 tensors holding unsigned 32-bit values.

    All six inputs broadcast together; returns the four output words, each an
    int64 tensor with values in ``[0, 2**32)``.
    """
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape, k0.shape, k1.shape)
    c0, c2 = c0.expand(shape), c2.expand(shape)
    for round_index in range(_PHILOX_ROUNDS):
        # int64 holds each 64-bit product with wrap-around; masking recovers
        # the unsigned halves (and removes the arithmetic shift's sign fill).
        # In-place ops: this loop dominates the reference's run time.
        product0 = c0 * _PHILOX_M0
        product1 = c2 * _PHILOX_M1
        c0 = (product1 >> 32).bitwise_and_(_MASK32).bitwise_xor_(c1).bitwise_xor_(k0)
        c2 = (product0 >> 32).bitwise_and_(_MASK32).bitwise_xor_(c3).bitwise_xor_(k1)
        c1 = product1.bitwise_and_(_MASK32)
        c3 = product0.bitwise_and_(_MASK32)
        if round_index + 1 < _PHILOX_ROUNDS:
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def _as_int64(value, batch_size: int, device) -> torch.Tensor:
    """A seed or offset as ``[B]`` int64 (Python ints wrap to 64-bit two's complement)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.int64).reshape(-1).expand(batch_size)
    wrapped = int(value) & 0xFFFFFFFFFFFFFFFF
    signed = wrapped - 2**64 if wrapped >= 2**63 else wrapped
    return torch.full((batch_size,), signed, dtype=torch.int64, device=device)


class RequestKeys:
    """Per-request Philox key and upper counter words, shape ``[B]`` each.

    Built once per call from ``seed``/``offset``; the words that vary inside a
    call (``index``, ``position``, ``stream``) are supplied per draw.
    """

    def __init__(self, seed, offset, batch_size: int, device):
        seed64 = _as_int64(seed, batch_size, device)
        offset64 = _as_int64(offset, batch_size, device)
        if isinstance(seed, torch.Tensor):
            request = torch.zeros(batch_size, dtype=torch.int64, device=device)
        else:
            request = torch.arange(batch_size, dtype=torch.int64, device=device)
        self.k0 = seed64 & _MASK32
        self.k1 = (seed64 >> 32) & _MASK32
        self.c2 = offset64 & _MASK32
        self.c3 = ((offset64 >> 32) & _MASK32) ^ request

    def words(self, stream: int, position: torch.Tensor, index: torch.Tensor):
        """Philox words for every ``(b, ...)``.

        ``position`` and ``index`` are int64 tensors broadcastable to a shape
        whose first dimension is the batch.
        """
        shape = torch.broadcast_shapes(position.shape, index.shape)
        extra = (1,) * (len(shape) - 1)
        c1 = position | (stream << 24)
        return philox4x32_10(
            index,
            c1,
            self.c2.view(-1, *extra),
            self.c3.view(-1, *extra),
            self.k0.view(-1, *extra),
            self.k1.view(-1, *extra),
        )


def uniform_from_word(word: torch.Tensor) -> torch.Tensor:
    """float32 uniform in ``(0, 1)`` from one word: ``(2*(w>>9)+1) * 2**-24``."""
    odd = (word >> 9) * 2 + 1
    return odd.to(torch.float32) * (2.0**-24)


def _leading_zeros_24(chunk: torch.Tensor) -> torch.Tensor:
    # chunk < 2**24 converts to float32 exactly; its exponent is floor(log2).
    exponent_bits = chunk.to(torch.float32).view(torch.int32).to(torch.int64) >> 23
    return 150 - exponent_bits


def log1p_reduced(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``log1p(x)``, ``x`` in ``(-1/2, 1)``, into ``k * ln2 + poly(y)``.

    Returns ``(k, poly(y))`` with ``k`` in {-1, 0, 1} (int64). The reductions
    ``y = (x - 1) / 2`` and ``y = 2x + 1`` are exact in float32 for the
    inputs built by :func:`exponential_from_words`.
    """
    high = x > SQRT2_MINUS_1
    low = x < SQRT_HALF_MINUS_1
    y = torch.where(high, (x - 1.0) * 0.5, torch.where(low, x * 2.0 + 1.0, x))
    k = high.to(torch.int64) - low.to(torch.int64)
    acc = torch.full_like(y, LOG1P_COEFFS[-1])
    for coeff in LOG1P_COEFFS[-2::-1]:
        acc = acc * y + coeff
    return k, y * acc


def exponential_from_words(w0, w1, w2, w3) -> torch.Tensor:
    """float32 standard exponential with both tails resolved (module docstring)."""
    a0, a1, a2 = w0 >> 8, w2 >> 8, w3 >> 8
    z = torch.where(
        a0 > 0,
        _leading_zeros_24(a0),
        torch.where(a1 > 0, 24 + _leading_zeros_24(a1), torch.where(a2 > 0, 48 + _leading_zeros_24(a2), 72)),
    )
    mantissa = w1 >> 9
    upper_tail = (w1 & 1) == 0
    h = (((125 - z) << 23) | mantissa).to(torch.int32).view(torch.float32)
    # upper tail: -log(h) = (z + 2) ln2 - log1p(f), h = 2**-(z+2) * (1 + f)
    # lower tail: -log(1 - h) = -log1p(-h)
    fraction = mantissa.to(torch.float32) * (2.0**-23)
    x = torch.where(upper_tail, fraction, -h)
    k, poly = log1p_reduced(x)
    n = torch.where(upper_tail, z + 2, 0) - k
    return n.to(torch.float32) * LN2 - poly


def race_keys(noise: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Exponential-race keys ``E / mass``: the sample is their argmin."""
    return noise / mass
