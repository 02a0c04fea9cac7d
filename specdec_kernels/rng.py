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
* ``index`` is the vocabulary chunk for the sampler's draws, 0 otherwise
  (1 for the FlashInfer adapter's second acceptance test, ``docs/rng.md``).

Philox4x32-10 round, with ``M0 = 0xD2511F53``, ``M1 = 0xCD9E8D57``::

    hi0:lo0 = M0 * c0;  hi1:lo1 = M1 * c2     (64-bit products)
    c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
    k = (k0 + 0x9E3779B9, k1 + 0xBB67AE85)    (between rounds)

From words to numbers
---------------------
``uniform(w)``: ``(2 * (w >> 9) + 1) * 2**-24``, one of ``2**23`` odd
multiples of ``2**-24``. Exactly representable in float32, symmetric about
1/2, never 0 or 1.

The sampler (``specdec_kernels/reference/_sampling.py``) reads words 0 and 1
and words 2 and 3 as 64-bit integers, high word first: no float transform
is involved, so nothing about the sample depends on a ``log`` or a division.
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


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on int64 tensors holding unsigned 32-bit values.

    All six inputs broadcast together; returns the four output words, each an
    int64 tensor with values in ``[0, 2**32)``.
    """
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape, k0.shape, k1.shape)
    # Word pairs stacked on a leading dim and the key schedule made up front,
    # so a round is 7 tensor ops instead of 18: the reference's time on small
    # batches is per-op overhead.
    multiplied = torch.stack([c0.expand(shape), c2.expand(shape)])  # (c0, c2)
    xored = torch.stack([c1.expand(shape), c3.expand(shape)])  # (c1, c3)
    key = torch.stack(torch.broadcast_tensors(k0, k1))  # (k0, k1), not expanded to the counters' shape
    multipliers = torch.tensor([_PHILOX_M0, _PHILOX_M1], dtype=torch.int64, device=multiplied.device)
    multipliers = multipliers.view(2, *([1] * len(shape)))
    # The key schedule of all rounds at once: k + round * W (mod 2**32).
    rounds = torch.arange(_PHILOX_ROUNDS, dtype=torch.int64, device=multiplied.device)
    weyl = torch.stack([rounds * _PHILOX_W0, rounds * _PHILOX_W1], dim=1)
    weyl = weyl.view(_PHILOX_ROUNDS, 2, *([1] * (key.dim() - 1)))
    schedule = (key.unsqueeze(0) + weyl).bitwise_and_(_MASK32)
    for round_key in schedule:
        # int64 holds each 64-bit product with wrap-around; masking recovers
        # the unsigned halves (and removes the arithmetic shift's sign fill).
        # (hi0:lo0, hi1:lo1) = (M0 * c0, M1 * c2) -> c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
        products = (multiplied * multipliers).flip(0)
        multiplied = (products >> 32).bitwise_and_(_MASK32).bitwise_xor_(xored).bitwise_xor_(round_key)
        xored = products.bitwise_and_(_MASK32)
    return multiplied[0], xored[0], multiplied[1], xored[1]


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

    def words(self, stream, position: torch.Tensor, index: torch.Tensor):
        """Philox words for every ``(b, ...)``.

        ``position`` and ``index`` (and ``stream``, an int or a tensor) are
        int64 broadcastable to a shape whose first dimension is the batch.
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
