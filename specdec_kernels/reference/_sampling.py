"""Sampling primitives shared by the reference verifiers.

Each primitive is the definition the kernels reproduce bit for bit (with
probability inputs): the acceptance test, the fixed-point sampler and the
greedy argmax. ``docs/rng.md`` states the bit layout with a worked example;
``specdec_kernels/rng.py`` is where the random words come from.

The sampler (fixed-point inverse CDF over fixed chunks)
-------------------------------------------------------
Weights ``w_v`` (float32) become integers ``W_v = trunc(clamp(w_v, 0, 1) *
2**SCALE_BITS)``; NaN and negative weights count as 0, weights above 1
(never seen in a distribution) as 1. The vocabulary is cut into chunks of
``CHUNK_SIZE`` tokens, a constant of the package (never a kernel's grid).
Philox at ``(SAMPLE_STREAM, position, index = c)`` gives four words; words
0 and 1 make the 64-bit draw ``r_c`` of chunk ``c`` and words 2 and 3 of
index 0 the 64-bit draw ``R`` that chooses the chunk:

* inside chunk ``c`` (total ``T_c = sum W_v``, below ``2**62``): the
  candidate is the first ``v`` whose inclusive prefix sum exceeds
  ``floor(r_c * T_c / 2**64)``;
* across chunks (total ``T``, a 128-bit integer): the chosen chunk is the
  first whose inclusive prefix of ``T_c`` exceeds ``floor(R * T / 2**64)``;
* the token is the chosen chunk's candidate; ``T == 0`` means "no mass".

Every sum is an integer sum, so the token does not depend on how a kernel
splits the vocabulary, on its reduction order or on the batch; a token with
``W_v == 0`` is never chosen. ``docs/rng.md`` bounds the distance of the
sampled law from the float32 weights by ``V * 2**-52 + n_chunks * 2**-64``
of the row's mass (below ``6e-11`` for ``V <= 2**18``).
"""

from __future__ import annotations

import torch

from .. import rng
from . import _unsigned

CHUNK_SIZE = 1024
SCALE_BITS = 52  # W_v <= 2**52, so a chunk total stays below 2**62 (signed int64 on every backend)
_LOW31 = (1 << 31) - 1


def probabilities(x: torch.Tensor, temperature: torch.Tensor | None, logits: bool) -> torch.Tensor:
    """float32 distributions ``[B, R, V]`` from probabilities or logits.

    Probabilities are used as given (the sampler treats NaN and negatives as
    0). Logits become ``softmax(x / T_b)``, computed as ``z_v / sum(z)`` with
    ``z_v = exp((x_v - m) / T_b)``, ``m`` the row's largest non-NaN logit, and
    ``z_v = 0`` where ``x_v - m`` is ``-inf`` or NaN. That form never
    overflows and gives every temperature a defined outcome: ``T = inf`` is
    uniform over the finite logits, a tiny ``T`` is uniform over the largest
    ones; a row of NaN or ``-inf``, or one holding ``+inf``, has no mass.
    Greedy requests (``T_b`` not ``> 0``: :func:`greedy_requests`) use ``T = 1`` here (they only use
    argmaxes).
    """
    converted = x.to(torch.float32)
    if not logits:
        return converted
    # In place on a tensor of our own (a float32 input is never modified).
    shift = converted.nan_to_num_ if converted is not x else converted.nan_to_num
    shift = shift(nan=-float("inf"), posinf=float("inf"), neginf=-float("inf"))
    shift.sub_(shift.amax(dim=-1, keepdim=True))
    if temperature is not None:
        safe_temperature = torch.where(temperature > 0, temperature, 1.0).to(torch.float32)
        shift.div_(safe_temperature.view(-1, *([1] * (x.dim() - 1))))
    # inf - inf and -inf / inf are NaN: those terms weigh 0 (a row of them has no mass)
    shift.nan_to_num_(nan=-float("inf"), posinf=float("inf"), neginf=-float("inf"))
    return torch.softmax(shift, dim=-1)


def greedy_requests(temperature: torch.Tensor | None, batch_size: int, device) -> torch.Tensor:
    """bool ``[B]``: requests decoded greedily, those whose ``T_b`` is not ``> 0`` (contract v1.3).

    ``0``, a negative marker (vLLM's ``-1``) and NaN are greedy; ``None`` is
    ``T = 1`` for all. Every backend applies this one rule (Triton:
    ``request_temperatures``, CUDA: ``request_temperature``).
    """
    if temperature is None:
        return torch.zeros(batch_size, dtype=torch.bool, device=device)
    return ~(temperature > 0)


def greedy_tokens(x: torch.Tensor, logits: bool) -> torch.Tensor:
    """Argmax over the last dim of the raw input, NaN ignored, ties to the lowest index.

    Taken on the logits or probabilities as given: the argmax of
    ``softmax(x / T)`` is that of ``x``, and reading ``x`` avoids ties created
    by rounding in the softmax. A row with nothing to choose (every
    probability ``<= 0`` or NaN; every logit ``-inf`` or NaN) gives ``-1``,
    as the sampler does for a row without mass.
    """
    x = x.to(torch.float32)
    x = torch.where(torch.isnan(x), -float("inf"), x)
    best, index = x.max(dim=-1)
    has_choice = best > -float("inf") if logits else best > 0
    return torch.where(has_choice, index, -1)


def accept(uniform: torch.Tensor, target_prob: torch.Tensor, draft_prob: torch.Tensor) -> torch.Tensor:
    """Accept with probability ``min(1, p/q)``: ``u * q < p``.

    A multiply instead of a divide keeps every backend exact (no approximate
    division on GPUs), accepts surely when ``q == 0 < p`` and never when
    ``p == 0`` or either is NaN.
    """
    return uniform * draft_prob < target_prob


def drawn_from_draft(draft_prob: torch.Tensor) -> torch.Tensor:
    """bool: proposals that can have been drawn from the draft, those whose ``q(t)`` is ``> 0`` (contract v1.3).

    Any other ``q(t)`` (``0``, negative, NaN; an engine's all-zero
    "target-only" row) marks a deterministic proposal: it is verified against
    the point mass on ``t``, exactly as with ``draft=None`` there, so it is
    accepted with probability ``p(t)`` and its rejection leaves ``p`` without
    ``t``. Every backend applies this one rule.
    """
    return draft_prob > 0


def acceptance_uniforms(keys: rng.RequestKeys, positions: torch.Tensor) -> torch.Tensor:
    """float32 uniforms of the acceptance stream at ``positions`` (int64, batch first)."""
    words = keys.words(rng.ACCEPT_STREAM, positions, torch.zeros_like(positions))
    return rng.uniform_from_word(words[0])


def fixed_point(weights: torch.Tensor) -> torch.Tensor:
    """int64 ``W_v = trunc(clamp(w_v, 0, 1) * 2**52)``; NaN -> 0.

    Scaling a float32 in ``[0, 1]`` by a power of two is exact, and the
    conversion truncates, the same on every backend.
    """
    w = weights.to(torch.float32).clamp(0.0, 1.0).nan_to_num_(0.0)
    return w.mul_(float(2**SCALE_BITS)).to(torch.int64)


def num_chunks(vocab_size: int) -> int:
    return max(1, -(-vocab_size // CHUNK_SIZE))


def sample(keys: rng.RequestKeys, position: torch.Tensor, fixed_weights: torch.Tensor) -> torch.Tensor:
    """Sample ``[B]`` tokens (int64) from int64 weights ``[B, V]`` at ``position [B]``; ``-1`` without mass.

    See the module docstring: one candidate per chunk, then one chunk by its
    total, all in exact integer arithmetic.
    """
    chunks = torch.arange(num_chunks(fixed_weights.shape[-1]), dtype=torch.int64, device=fixed_weights.device)
    words = keys.words(rng.SAMPLE_STREAM, position.view(-1, 1), chunks.view(1, -1))
    return sample_from_words(words, fixed_weights)


def sample_from_words(words, fixed_weights: torch.Tensor) -> torch.Tensor:
    """:func:`sample` given the Philox words ``(w0, w1, w2, w3)``, each ``[B, num_chunks]``, of the sample."""
    batch_size, vocab_size = fixed_weights.shape
    chunk_count = num_chunks(vocab_size)
    padded = torch.nn.functional.pad(fixed_weights, (0, chunk_count * CHUNK_SIZE - vocab_size))
    prefix = padded.view(batch_size, chunk_count, CHUNK_SIZE).cumsum(dim=-1)
    chunk_total = prefix[..., -1]

    chunk_draw = _unsigned.from_words(words[0], words[1])
    threshold = _unsigned.mul_high(chunk_draw, chunk_total)
    # The prefix is non-decreasing: the count of prefixes <= threshold is a binary search.
    chunk_start = torch.arange(0, chunk_count * CHUNK_SIZE, CHUNK_SIZE, device=fixed_weights.device)
    candidate = torch.searchsorted(prefix, threshold.unsqueeze(-1), right=True).squeeze(-1) + chunk_start

    # Inclusive 128-bit prefix of the chunk totals: split each total at bit 31
    # so that both int64 cumsums are exact, then recombine.
    high31 = (chunk_total >> 31).cumsum(dim=-1)
    low31 = (chunk_total & _LOW31).cumsum(dim=-1)
    prefix_hi, prefix_lo = _unsigned.add128(high31 >> 33, high31 << 31, torch.zeros_like(low31), low31)
    total_hi, total_lo = prefix_hi[:, -1:], prefix_lo[:, -1:]
    choice_draw = _unsigned.from_words(words[2][:, :1], words[3][:, :1])
    target_hi, target_lo = _unsigned.scale_down128(choice_draw, total_hi, total_lo)
    chunk = _unsigned.less_equal128(prefix_hi, prefix_lo, target_hi, target_lo).sum(dim=-1, keepdim=True)
    token = candidate.gather(-1, chunk.clamp_max(chunk_count - 1)).squeeze(-1)
    has_mass = ((total_hi != 0) | (total_lo != 0)).squeeze(-1)
    return torch.where(has_mass, token, -1)


def residual(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """Unnormalised residual ``max(0, p - q)``; rows without mass fall back to ``p``.

    "Without mass" is judged at the sampler's resolution: every fixed-point
    weight is 0 (every ``p - q`` below ``2**-52``, or NaN).
    """
    mass = torch.clamp_min(target_row - draft_row, 0.0)
    return torch.where(_has_mass(fixed_point(mass)), mass, target_row)


def residual_weights(target_row: torch.Tensor, draft_row: torch.Tensor, subtract: torch.Tensor) -> torch.Tensor:
    """Fixed-point weights ``[B, V]`` of the row to sample: the residual where ``subtract [B]``, else ``p``.

    The same rule as :func:`residual` (fall back to ``p`` where the residual
    has no mass), converting each row to fixed point once.
    """
    target_weights = fixed_point(target_row)
    weights = fixed_point(torch.clamp_min(target_row - draft_row, 0.0))
    use_residual = subtract.view(-1, 1) & _has_mass(weights)
    return torch.where(use_residual, weights, target_weights)


def normalise(mass: torch.Tensor) -> torch.Tensor:
    """float32 ``W_v / S`` per row, ``W = fixed_point(mass)`` and ``S = sum_v W_v``; all zeros where ``S == 0``.

    The normaliser every backend reproduces bit for bit (a float32 sum would
    depend on its reduction order):

    * ``S`` is an exact integer: each ``W_v < 2**53`` is split at bit 31 into
      two int64 sums, exact in any order, whose float64 values are exact for
      ``V < 2**22``; ``float64(S) = high31 * 2**31 + low31`` is rounded once;
    * ``r = 1 / float32(S)``, one correctly rounded float32 division per row
      (a float64 division costs a GPU a subroutine call);
    * each entry is ``float32(float64(W_v) * float64(r))``: ``W_v`` is exact in
      float64, the product is rounded to float64, then to float32.

    The row's total is within ``2**-22`` of 1, the order of the float32
    rounding of its entries. Entries below ``2**-52`` (and NaN) weigh 0, as in
    the sampler.
    """
    weights = fixed_point(mass)
    high31 = (weights >> 31).sum(dim=-1, keepdim=True)
    low31 = (weights & _LOW31).sum(dim=-1, keepdim=True)
    total = (high31.to(torch.float64) * float(2**31) + low31.to(torch.float64)).to(torch.float32)
    reciprocal = 1.0 / torch.where(total > 0, total, 1.0)
    return (weights.to(torch.float64) * reciprocal.to(torch.float64)).to(torch.float32)


def _has_mass(weights: torch.Tensor) -> torch.Tensor:
    return (weights > 0).any(dim=-1, keepdim=True)
