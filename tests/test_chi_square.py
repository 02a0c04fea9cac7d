"""The demo's exactness check (specdec_kernels/_chi_square.py): distributions against scipy, bins, power."""

import pytest
import torch
from scipy import stats

from specdec_kernels import _chi_square


@pytest.mark.parametrize("degrees", [1, 7, 240])
@pytest.mark.parametrize("statistic_scale", [0.3, 1.0, 2.5])
def test_tails_match_scipy(degrees, statistic_scale):
    statistic = statistic_scale * degrees
    assert _chi_square.chi2_sf(statistic, degrees) == pytest.approx(stats.chi2.sf(statistic, degrees), rel=1e-9)
    critical = _chi_square.chi2_critical(degrees, 0.01)
    assert critical == pytest.approx(stats.chi2.isf(0.01, degrees), rel=1e-9)
    for noncentrality in (0.5, 30.0, 5000.0):
        assert _chi_square.noncentral_chi2_sf(critical, degrees, noncentrality) == pytest.approx(
            stats.ncx2.sf(critical, degrees, noncentrality), rel=1e-7, abs=1e-12)


def test_pooled_bins_expect_at_least_five():
    law = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01], [0.25] * 4], dtype=torch.float64)
    row_totals = torch.tensor([40.0, 100.0, 8.0], dtype=torch.float64)
    keep = _chi_square.pooled_bins(row_totals, law)
    # row 0 expects 20, 12, 6, 2: the pool (2) takes the smallest kept cell (6); row 1: 97 and a pool of 3
    # takes the 97 (one bin); row 2 expects 2 per cell: one pooled bin.
    assert keep.tolist() == [[True, True, False, False], [False] * 4, [False] * 4]
    counts = row_totals.view(-1, 1) * law
    result, _ = _chi_square.chi_square_test(counts, law)
    assert result.degrees_of_freedom == 2 and result.statistic == pytest.approx(0.0) and result.p_value == 1.0


def test_rejects_the_wrong_law_and_accepts_the_right_one():
    """10^4 transitions of a 6-token chain: sampled from the law, p is large; from a 10%-distorted law, tiny."""
    generator = torch.Generator().manual_seed(0)
    law = torch.softmax(torch.randn(6, 6, generator=generator, dtype=torch.float64), -1)
    distorted = 0.9 * law + 0.1 * torch.roll(law, 1, dims=1)

    def sample(table):
        tokens, previous = [], torch.zeros(2000, dtype=torch.int64)
        for _ in range(5):
            previous = torch.multinomial(table[previous], 1, generator=generator).squeeze(1)
            tokens.append(previous)
        return _chi_square.transition_counts(torch.zeros(2000, dtype=torch.int64), torch.stack(tokens, 1), 6)

    exact_counts = sample(law)
    result, bins = _chi_square.chi_square_test(exact_counts, law)
    assert result.degrees_of_freedom == 30 and result.p_value > 0.01
    assert _chi_square.power_against(exact_counts, law, distorted, bins, 0.01) > 0.99
    assert _chi_square.power_against(exact_counts, law, law, bins, 0.01) == pytest.approx(0.01)
    assert _chi_square.chi_square_test(sample(distorted), law)[0].p_value < 1e-6
