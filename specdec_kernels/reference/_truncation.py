"""Top-k, top-p and min-p truncation of target rows: the definition every kernel matches.

The rule (docs/api.md): after temperature, keep the ``top_k`` largest
probabilities, then the smallest set of largest probabilities whose mass
reaches ``top_p`` (of what top-k kept), then drop tokens below ``min_p``
times the row's maximum; ties at a threshold are kept; renormalise.

To be identical on every backend for any split of the vocabulary, every
decision is a comparison of exact quantities:

* the **key** of a token is the bit pattern of its float32 probability
  ``p`` (NaN and negatives as ``+0``, above 1 as 1), an int32 that orders
  like ``p``; each threshold is a key value and a token is kept iff its key
  is at least every active threshold (so ties are kept);
* **masses** are sums of the sampler's fixed-point weights ``W``
  (``_sampling.fixed_point``), exact integers; a mass is compared with
  ``top_p`` times another in float64, ``float64(F) >= float64(top_p) *
  float64(S)``, where ``float64(.)`` of an integer is its correctly rounded
  value (both integers are below ``2**71``);
* ``min_p``'s threshold is ``float32(min_p * max_v p_v)``, one float32
  product;
* the kept row is renormalised by ``_sampling.normalise`` (exact integer
  total, one correctly rounded reciprocal).

Thresholds, with ``key`` over the whole row:

* ``tau_k`` = the ``k``-th largest key (counting ties) when ``0 < k < V``;
* ``tau_p`` = the largest key ``tau`` with ``F(tau) >= top_p * S`` where
  ``F(tau)`` is the mass of the tokens with ``key >= max(tau, tau_k)`` and
  ``S = F(tau_k)``, when ``0 < top_p < 1``;
* ``tau_m`` = the key of ``float32(min_p * max p)`` when ``0 < min_p <= 1``.

A parameter is off at its neutral value and outside its range (contract
v1.3: ``top_k`` outside ``(0, V)``, ``top_p`` outside ``(0, 1)``, ``min_p``
outside ``(0, 1]``, NaN included). A request with every
parameter off keeps its rows exactly as given (not renormalised); a request
with any parameter on gets ``normalise(p * kept)`` on every target row.
"""

from __future__ import annotations

import torch

from . import _sampling

_LOW31 = (1 << 31) - 1


def clean(probabilities: torch.Tensor) -> torch.Tensor:
    """``p`` with NaN and negatives (``-0.0`` included) as ``+0.0`` and values above 1 as 1."""
    return torch.where(probabilities > 0, probabilities.clamp_max(1.0), 0.0)


def keys(cleaned: torch.Tensor) -> torch.Tensor:
    """int32 keys: float32 bit patterns of non-negative probabilities order like the probabilities."""
    return cleaned.contiguous().view(torch.int32)


def top_p_on(top_p: torch.Tensor) -> torch.Tensor:
    """Requests whose ``top_p`` truncates: ``0 < top_p < 1`` (1 is off; 0, above 1 and NaN are out of range: off)."""
    return (top_p > 0.0) & (top_p < 1.0)


def min_p_on(min_p: torch.Tensor) -> torch.Tensor:
    """Requests whose ``min_p`` truncates: ``0 < min_p <= 1`` (0 is off; above 1 and NaN are out of range: off)."""
    return (min_p > 0.0) & (min_p <= 1.0)


def active_requests(top_k, top_p, min_p, vocab_size: int, batch_size: int, device) -> torch.Tensor:
    """bool ``[B]``: requests with at least one parameter on."""
    active = torch.zeros(batch_size, dtype=torch.bool, device=device)
    if top_k is not None:
        active |= (top_k > 0) & (top_k < vocab_size)
    if top_p is not None:
        active |= top_p_on(top_p)
    if min_p is not None:
        active |= min_p_on(min_p)
    return active


def exact_float64(high31: torch.Tensor, low31: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float64 of ``high31 * 2**31 + low31`` (both exact in float64, one rounding)."""
    return high31.to(torch.float64) * float(2**31) + low31.to(torch.float64)


def truncate(probabilities: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """Truncated, renormalised rows ``[B, R, V]`` float32 (see the module docstring); ``[B]`` parameters or None.

    Sort-based: the definition, not a fast path.
    """
    batch_size, _, vocab_size = probabilities.shape
    device = probabilities.device
    if top_k is None and top_p is None and min_p is None:
        return probabilities
    active = active_requests(top_k, top_p, min_p, vocab_size, batch_size, device)
    cleaned = clean(probabilities)
    key = keys(cleaned)
    weights = _sampling.fixed_point(cleaned)
    sorted_keys, order = key.sort(dim=-1, descending=True)
    zero = torch.zeros((batch_size, 1, 1), dtype=torch.int32, device=device)

    threshold_k = zero
    if top_k is not None:
        k = top_k.to(torch.int64).view(-1, 1, 1)
        on = (k > 0) & (k < vocab_size)
        kth = sorted_keys.gather(-1, (k - 1).clamp(0, vocab_size - 1).expand(-1, key.shape[1], 1))
        threshold_k = torch.where(on, kth, zero)

    threshold = threshold_k
    if top_p is not None:
        kept_weights = torch.where(key >= threshold_k, weights, 0).gather(-1, order)
        cumulative = exact_float64((kept_weights >> 31).cumsum(-1), (kept_weights & _LOW31).cumsum(-1))
        required = top_p.to(torch.float64).view(-1, 1, 1) * cumulative[..., -1:]
        # cumulative is non-decreasing: the first index reaching the mass gives tau_p (see the docstring).
        first = torch.searchsorted(cumulative, required, right=False).clamp_max(vocab_size - 1)
        threshold_p = sorted_keys.gather(-1, first)
        threshold = torch.maximum(threshold, torch.where(top_p_on(top_p).view(-1, 1, 1), threshold_p, zero))
    if min_p is not None:
        scaled = (min_p.view(-1, 1, 1) * cleaned.amax(dim=-1, keepdim=True)).to(torch.float32)
        threshold_m = keys(clean(scaled))
        threshold = torch.maximum(threshold, torch.where(min_p_on(min_p).view(-1, 1, 1), threshold_m, zero))

    truncated = _sampling.normalise(torch.where(key >= threshold, cleaned, 0.0))
    return torch.where(active.view(-1, 1, 1), truncated, probabilities)
