"""Pearson's chi-square test of a Markov chain's transitions, and its power against a known alternative.

The demo's models are bigram models, so the law of every emitted token given
the previous one is known exactly: ``P[x, :]``. Counting the transitions
``x -> y`` of the generated sequences gives a table whose rows, given their
totals ``n_x``, follow ``Multinomial(n_x, P[x, :])`` under exact sampling;
Pearson's statistic summed over the rows is asymptotically chi-square with
``sum_x (cells_x - 1)`` degrees of freedom (Anderson and Goodman 1957).

Cells expecting fewer than ``MIN_EXPECTED`` counts are pooled per row, so the
chi-square approximation holds. The power against an alternative law ``Q``
uses the same bins: the statistic is then approximately non-central
chi-square with non-centrality ``sum_bins (n Q_bin - n P_bin)^2 / (n P_bin)``
(the asymptotic power of Pearson's test, e.g. Cochran 1952). Everything is
float64 and needs only torch (no scipy at run time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_EXPECTED = 5.0


@dataclass
class ChiSquare:
    statistic: float
    degrees_of_freedom: int
    p_value: float


def transition_counts(prompts: torch.Tensor, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[V, V]`` float64 counts of ``x -> y`` in ``prompt, tokens[b, 0], tokens[b, 1], ...``."""
    sequence = torch.cat([prompts.view(-1, 1), tokens], 1).to(torch.int64).cpu()
    pairs = sequence[:, :-1] * vocab_size + sequence[:, 1:]
    return torch.bincount(pairs.reshape(-1), minlength=vocab_size * vocab_size).double().view(vocab_size, vocab_size)


def pooled_bins(row_totals: torch.Tensor, law: torch.Tensor) -> torch.Tensor:
    """Cells kept as their own bin, ``[V, V]`` bool; the others of a row form one pooled bin.

    A row's pooled bin expecting fewer than ``MIN_EXPECTED`` counts absorbs
    the row's smallest kept cell, so every bin of a row with enough counts
    expects at least ``MIN_EXPECTED``.
    """
    expected = row_totals.view(-1, 1) * law
    keep = expected >= MIN_EXPECTED
    pooled = (expected * ~keep).sum(1)
    short = (pooled > 0) & (pooled < MIN_EXPECTED) & keep.any(1)
    smallest = expected.masked_fill(~keep, float("inf")).argmin(1)
    keep[torch.nonzero(short).view(-1), smallest[short]] = False
    return keep


def _pearson(observed: torch.Tensor, expected: torch.Tensor, keep: torch.Tensor) -> float:
    kept = ((observed - expected) ** 2 / expected)[keep].sum()
    pooled_observed, pooled_expected = (observed * ~keep).sum(1), (expected * ~keep).sum(1)
    has_pool = pooled_expected > 0
    return float(kept + ((pooled_observed - pooled_expected)[has_pool] ** 2 / pooled_expected[has_pool]).sum())


def _degrees_of_freedom(row_totals: torch.Tensor, law: torch.Tensor, keep: torch.Tensor) -> int:
    pooled_expected = (row_totals.view(-1, 1) * law * ~keep).sum(1)
    bins = keep.sum() + (pooled_expected > 0).sum()
    return int(bins - (row_totals > 0).sum())


def chi2_sf(statistic: float, degrees_of_freedom: int) -> float:
    """``P(chi2_df > statistic)``."""
    if degrees_of_freedom <= 0:
        return 1.0
    half = torch.tensor(degrees_of_freedom / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(half, torch.tensor(statistic / 2.0, dtype=torch.float64)))


def chi2_critical(degrees_of_freedom: int, significance: float) -> float:
    """The ``x`` with ``P(chi2_df > x) = significance`` (bisection: torch has no chi-square quantile)."""
    low, high = 0.0, degrees_of_freedom + 20.0 * (2.0 * degrees_of_freedom) ** 0.5 + 100.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if chi2_sf(middle, degrees_of_freedom) > significance else (low, middle)
    return high


def noncentral_chi2_sf(threshold: float, degrees_of_freedom: int, noncentrality: float) -> float:
    """``P(chi2_df(noncentrality) > threshold)``: a Poisson(noncentrality / 2) mixture of central tails."""
    if noncentrality <= 0.0:
        return chi2_sf(threshold, degrees_of_freedom)
    mean = noncentrality / 2.0
    terms = torch.arange(int(mean + 40.0 * mean ** 0.5 + 100.0), dtype=torch.float64)
    log_weights = terms * torch.log(torch.tensor(mean, dtype=torch.float64)) - mean - torch.lgamma(terms + 1.0)
    tails = torch.special.gammaincc(degrees_of_freedom / 2.0 + terms,
                                    torch.full_like(terms, threshold / 2.0))
    return float((torch.exp(log_weights) * tails).sum().clamp(0.0, 1.0))


def chi_square_test(counts: torch.Tensor, law: torch.Tensor) -> tuple[ChiSquare, torch.Tensor]:
    """Pearson's test of transition ``counts`` ``[V, V]`` against the exact ``law`` ``[V, V]``; also its bins."""
    law = law.double().cpu()
    row_totals = counts.sum(1)
    keep = pooled_bins(row_totals, law)
    statistic = _pearson(counts, row_totals.view(-1, 1) * law, keep)
    degrees = _degrees_of_freedom(row_totals, law, keep)
    return ChiSquare(statistic, degrees, chi2_sf(statistic, degrees)), keep


def power_against(counts: torch.Tensor, law: torch.Tensor, alternative: torch.Tensor, keep: torch.Tensor,
                  significance: float) -> float:
    """Approximate probability that the test of ``counts``' design rejects when the tokens follow ``alternative``.

    ``keep``: the bins :func:`chi_square_test` used. The row totals are those
    of ``counts`` (the sample actually tested).
    """
    law, alternative = law.double().cpu(), alternative.double().cpu()
    row_totals = counts.sum(1)
    degrees = _degrees_of_freedom(row_totals, law, keep)
    if degrees <= 0:
        return 0.0
    noncentrality = _pearson(row_totals.view(-1, 1) * alternative, row_totals.view(-1, 1) * law, keep)
    return noncentral_chi2_sf(chi2_critical(degrees, significance), degrees, noncentrality)
