"""The fixed-point sampler of the reference: its exact law, its bound, its edge cases.

``specdec_kernels/reference/_sampling.py`` defines the sampler every backend
reproduces. Here it is checked against an independent implementation on
Python integers (the same draws, the same tokens), its exact law is computed
by counting the 64-bit draws that select each token and compared with the
float32 weights (the bound stated in ``docs/rng.md``), a chi-square test
checks the law end to end, and the documented outcomes for degenerate rows
are pinned down.
"""

from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import stats

from markov import SIGNIFICANCE
from specdec_kernels import rng
from specdec_kernels.reference import _sampling, chain_verify as reference_chain

CHUNK = _sampling.CHUNK_SIZE
TWO64 = 2**64


def unsigned(word) -> int:
    return int(word) & (TWO64 - 1)


def python_sample(weights: list[int], words_of_chunk) -> int:
    """The sampler's definition on Python integers; ``words_of_chunk(c)`` gives the 4 Philox words."""
    chunks = [weights[start:start + CHUNK] for start in range(0, max(len(weights), 1), CHUNK)]
    candidates, totals = [], []
    for index, chunk in enumerate(chunks):
        w0, w1, _, _ = words_of_chunk(index)
        total = sum(chunk)
        threshold = (((w0 << 32) | w1) * total) >> 64
        prefix, candidate = 0, index * CHUNK + len(chunk)
        for offset, weight in enumerate(chunk):
            prefix += weight
            if prefix > threshold:
                candidate = index * CHUNK + offset
                break
        candidates.append(candidate)
        totals.append(total)
    total = sum(totals)
    if total == 0:
        return -1
    _, _, w2, w3 = words_of_chunk(0)
    threshold = (((w2 << 32) | w3) * total) >> 64
    prefix = 0
    for index, chunk_total in enumerate(totals):
        prefix += chunk_total
        if prefix > threshold:
            return candidates[index]
    raise AssertionError("unreachable: the last prefix is the total, above any threshold")


def draws(seed, offset, batch_size, position):
    keys = rng.RequestKeys(seed, offset, batch_size, "cpu")
    return keys, torch.full((batch_size,), position, dtype=torch.int64)


@pytest.mark.parametrize("vocab_size", [1, 7, 1024, 1025, 3000])
def test_matches_python_integers(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    batch_size = 6
    weights = torch.rand(batch_size, vocab_size, generator=generator) ** 4
    weights[1] = 0.0  # no mass
    weights[2, : vocab_size // 2] = 0.0
    weights[3] = weights[3] / 1e30  # tiny weights: most become 0 in fixed point
    fixed = _sampling.fixed_point(weights)
    keys, position = draws(11, 5, batch_size, 3)
    tokens = _sampling.sample(keys, position, fixed)
    for b in range(batch_size):
        def words_of_chunk(chunk, b=b):
            words = keys.words(rng.SAMPLE_STREAM, torch.tensor([[3]]), torch.tensor([[chunk]]))
            return tuple(int(word[b if word.shape[0] > 1 else 0, 0]) for word in words)

        expected = python_sample([int(w) for w in fixed[b]], words_of_chunk)
        assert int(tokens[b]) == expected, f"request {b}"


def test_fixed_point_rule():
    values = torch.tensor([0.0, -0.5, float("nan"), float("inf"), 2.0, 1.0, 0.5, 2.0**-52, 2.0**-53, 1e-45])
    expected = [0, 0, 0, 2**52, 2**52, 2**52, 2**51, 1, 0, 0]
    assert _sampling.fixed_point(values).tolist() == expected


def exact_law(weights: list[int]) -> list[Fraction]:
    """The sampler's exact law: for each token, the fraction of the 2**64 x 2**64 draws choosing it.

    A 64-bit draw ``r`` gives ``floor(r * T / 2**64) < Q`` iff ``r < ceil(Q * 2**64 / T)``,
    so the draws choosing the interval ``[Q_prev, Q)`` are counted exactly.
    """
    def share(prefixes, total):
        bounds = [-(-prefix * TWO64 // total) for prefix in prefixes]
        return [Fraction(high - low, TWO64) for low, high in zip([0] + bounds[:-1], bounds)]

    chunks = [weights[start:start + CHUNK] for start in range(0, len(weights), CHUNK)]
    totals = [sum(chunk) for chunk in chunks]
    chunk_share = share(np.cumsum(totals, dtype=object).tolist(), sum(totals))
    law = []
    for chunk, chunk_total, chosen in zip(chunks, totals, chunk_share):
        if chunk_total == 0:
            law.extend([Fraction(0)] * len(chunk))
            continue
        law.extend(chosen * part for part in share(np.cumsum(chunk, dtype=object).tolist(), chunk_total))
    return law


def test_exact_law_is_within_the_documented_bound():
    """TV(sampled law, float32 weights) <= (V * 2**-52 + n_chunks * 2**-64) / total mass (docs/rng.md)."""
    generator = torch.Generator().manual_seed(3)
    vocab_size = 2500
    for scale in (1.0, 1e-6):  # a normalised row and a residual with little mass
        weights = torch.softmax(4 * torch.randn(vocab_size, generator=generator), -1) * scale
        fixed = [int(w) for w in _sampling.fixed_point(weights)]
        law = exact_law(fixed)
        assert sum(law) == 1
        exact_weights = [Fraction(float(w)) for w in weights]
        mass = sum(exact_weights)
        distance = sum(abs(p - w / mass) for p, w in zip(law, exact_weights)) / 2
        num_chunks = -(-vocab_size // CHUNK)
        bound = (Fraction(vocab_size, 2**52) + Fraction(num_chunks, TWO64)) / mass
        assert distance <= bound, (scale, float(distance), float(bound))
        assert all(p == 0 for p, w in zip(law, fixed) if w == 0)  # a weight of 0 is never chosen


def test_law_chi_square_across_chunks():
    generator = torch.Generator().manual_seed(4)
    vocab_size, batch_size = 2100, 60_000
    weights = torch.softmax(torch.randn(vocab_size, generator=generator), -1)
    # A request per sample: per-request seeds are independent streams.
    keys = rng.RequestKeys(torch.arange(batch_size), 9, batch_size, "cpu")
    tokens = _sampling.sample(keys, torch.zeros(batch_size, dtype=torch.int64),
                              _sampling.fixed_point(weights.expand(batch_size, -1)))
    observed = torch.bincount(tokens, minlength=vocab_size).double().numpy()
    expected = weights.double().numpy() * batch_size
    # merge into 100 bins of consecutive tokens (expected counts far above 5)
    observed, expected = observed.reshape(100, -1).sum(1), expected.reshape(100, -1).sum(1)
    expected *= observed.sum() / expected.sum()
    assert stats.chisquare(observed, expected).pvalue > SIGNIFICANCE


def test_per_request_seeds_are_batch_invariant():
    generator = torch.Generator().manual_seed(5)
    weights = _sampling.fixed_point(torch.rand(7, 1500, generator=generator))
    seeds = torch.arange(100, 107)
    keys = rng.RequestKeys(seeds, 4, 7, "cpu")
    together = _sampling.sample(keys, torch.full((7,), 2), weights)
    for b in (0, 3, 6):
        alone = _sampling.sample(rng.RequestKeys(seeds[b:b + 1], 4, 1, "cpu"), torch.full((1,), 2), weights[b:b + 1])
        assert int(alone) == int(together[b])


def chain(target, draft=None, ids=None, temperature=None, logits=False, seed=1):
    batch_size, rows, vocab_size = target.shape
    if ids is None:
        ids = torch.zeros(batch_size, rows - 1, dtype=torch.int64)
    return reference_chain.chain_verify(ids, target, draft, None, temperature, logits, seed, 0)


def test_rows_without_mass_emit_minus_one():
    vocab_size = 40
    target = torch.zeros(4, 1, vocab_size)
    target[0] = float("nan")
    target[1] = -1.0
    target[3, 0, 7] = 0.25  # the only mass
    logits = torch.full((4, 1, vocab_size), -float("inf"))
    logits[1] = float("nan")
    logits[2, 0, 3] = float("inf")
    logits[3, 0, 5] = 2.0
    sampled, _ = chain(target)
    assert sampled[:, 0].tolist() == [-1, -1, -1, 7]
    sampled, _ = chain(logits, logits=True, temperature=torch.ones(4))
    assert sampled[:, 0].tolist() == [-1, -1, -1, 5]
    greedy, _ = chain(target, temperature=torch.zeros(4))
    assert greedy[:, 0].tolist() == [-1, -1, -1, 7]
    greedy, _ = chain(logits, logits=True, temperature=torch.zeros(4))
    assert greedy[:, 0].tolist() == [-1, -1, 3, 5]  # greedy takes a +inf logit as the largest


def test_extreme_temperatures_with_logits():
    """T = inf is uniform over the finite logits; a tiny T is uniform over the largest (no overflow)."""
    batch_size, vocab_size = 4000, 6
    logits = torch.tensor([1.0, 5.0, -float("inf"), 5.0, -3.0, 0.0]).expand(batch_size, 1, vocab_size)
    seeds = torch.arange(batch_size)
    hot, _ = chain(logits, logits=True, temperature=torch.full((batch_size,), float("inf")), seed=seeds)
    counts = torch.bincount(hot[:, 0], minlength=vocab_size)
    assert counts[2] == 0
    assert stats.chisquare(counts[[0, 1, 3, 4, 5]].numpy()).pvalue > SIGNIFICANCE
    cold, _ = chain(logits, logits=True, temperature=torch.full((batch_size,), 1e-30), seed=seeds)
    counts = torch.bincount(cold[:, 0], minlength=vocab_size)
    assert counts.sum() == counts[1] + counts[3]
    assert stats.chisquare(counts[[1, 3]].numpy()).pvalue > SIGNIFICANCE


def test_residual_without_mass_falls_back_to_the_target():
    """p <= q everywhere at the sampler's resolution: the token is drawn from p, never -1."""
    vocab_size = 30
    target = torch.full((8, 2, vocab_size), 1.0 / vocab_size)
    draft = torch.full((8, 1, vocab_size), 1.0 / vocab_size)
    draft[:, 0, 4] += 0.5  # p(4) < q(4): rejections happen, yet max(0, p - q) has no mass
    ids = torch.full((8, 1), 4)
    output, accepted = chain(target, draft, ids, seed=torch.arange(8))
    rejected = accepted == 0
    assert bool(rejected.any())
    assert bool((output[rejected, 0] >= 0).all())


def test_normalise_matches_python_integers_and_ignores_order():
    """``normalise`` is ``float32(W_v * float32(1 / float32(S)))``, ``S`` summed exactly, whatever the row's order.

    Rows: a distribution, a residual with little mass, weights clamped at 1
    whose total passes ``2**64`` (the split sum), entries below ``2**-52`` and
    NaN (weight 0), and a row without mass (all zeros).
    """
    generator = torch.Generator().manual_seed(11)
    vocab_size = 5000
    rows = torch.stack([
        torch.softmax(torch.randn(vocab_size, generator=generator) * 3, -1),
        torch.rand(vocab_size, generator=generator) * 1e-9,
        torch.full((vocab_size,), 7.0),
        torch.where(torch.rand(vocab_size, generator=generator) < 0.5, 1e-17, 0.25),
        torch.where(torch.rand(vocab_size, generator=generator) < 0.5, float("nan"), 1e-3),
        torch.zeros(vocab_size),
    ])
    got = _sampling.normalise(rows)
    for row, values in zip(_sampling.fixed_point(rows).tolist(), got):
        total = sum(row)
        reciprocal = float(np.float32(1.0) / np.float32(float(total))) if total else 0.0
        want = torch.tensor([w * reciprocal for w in row], dtype=torch.float64)
        assert torch.equal(values, want.to(torch.float32))
    permutation = torch.randperm(vocab_size, generator=generator)
    assert torch.equal(_sampling.normalise(rows[:, permutation]), got[:, permutation])
