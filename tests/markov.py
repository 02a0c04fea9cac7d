"""Small Markov-chain "language models" and an exact chi-square test.

The exactness suites drive whole generation loops: a target and a draft are
Markov chains over a tiny vocabulary (the next-token distribution depends on
the previous token), drafts are sampled from the draft model with the test's
own generator, the verifier under test decides, and the joint distribution of
the first few emitted tokens is compared with the exact joint of the target
chain. Everything here is independent of the package.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy import stats

SIGNIFICANCE = 1e-4  # reject exactness when p < 1e-4: with fixed seeds the tests never flake
MIN_EXPECTED = 5.0  # bins are merged until every expected count is at least this


class MarkovModel:
    """Next-token distributions ``P[prev, next]`` (float64), rows summing to 1."""

    def __init__(self, transition: np.ndarray):
        self.transition = np.asarray(transition, dtype=np.float64)
        self.vocab_size = self.transition.shape[0]

    @classmethod
    def random(cls, vocab_size: int, generator: np.random.Generator, zero_tokens=(), sharpness: float = 1.0):
        """Dirichlet rows; tokens in ``zero_tokens`` have probability 0 everywhere."""
        rows = generator.dirichlet(np.full(vocab_size, sharpness), size=vocab_size)
        for token in zero_tokens:
            rows[:, token] = 0.0
        return cls(rows / rows.sum(axis=1, keepdims=True))

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """float32 distributions ``[..., V]`` following each token in ``tokens``."""
        table = torch.as_tensor(self.transition, dtype=torch.float32)
        return table[tokens.long()]

    def logits(self, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        """Logits whose ``softmax(x / temperature)`` is this model's rows."""
        with np.errstate(divide="ignore"):
            log_rows = np.log(self.transition) * temperature
        table = torch.as_tensor(np.maximum(log_rows, -1e30), dtype=torch.float32)
        return table[tokens.long()]

    def exact_joint(self, start_token: int, length: int) -> dict[tuple[int, ...], float]:
        """Exact probability of every sequence of ``length`` tokens after ``start_token``."""
        joint = {}
        for sequence in itertools.product(range(self.vocab_size), repeat=length):
            probability, prev = 1.0, start_token
            for token in sequence:
                probability *= self.transition[prev, token]
                prev = token
            if probability > 0:
                joint[sequence] = probability
        return joint

    def sample(self, prev: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One token per entry of ``prev``, drawn with the test's own generator."""
        rows = torch.as_tensor(self.transition, dtype=torch.float64)[prev.long()]
        return torch.multinomial(rows.reshape(-1, self.vocab_size), 1, generator=generator).view(prev.shape)


def chi_square_pvalue(observed: dict, expected_probability: dict, num_samples: int) -> float:
    """p-value of a chi-square goodness-of-fit test with merged small bins.

    Sequences never expected (probability 0) but observed make the test fail
    outright (p = 0). Bins are sorted by expected count and the smallest are
    pooled until every bin expects at least ``MIN_EXPECTED`` samples.
    """
    if any(key not in expected_probability for key in observed):
        return 0.0
    keys = sorted(expected_probability, key=expected_probability.get)
    bins_observed, bins_expected = [], []
    pooled_observed, pooled_expected = 0.0, 0.0
    for key in keys:
        pooled_observed += observed.get(key, 0)
        pooled_expected += expected_probability[key] * num_samples
        if pooled_expected >= MIN_EXPECTED:
            bins_observed.append(pooled_observed)
            bins_expected.append(pooled_expected)
            pooled_observed, pooled_expected = 0.0, 0.0
    if pooled_expected > 0 and bins_expected:
        bins_observed[-1] += pooled_observed
        bins_expected[-1] += pooled_expected
    if len(bins_expected) < 2:
        return 1.0
    observed_array = np.asarray(bins_observed)
    expected_array = np.asarray(bins_expected)
    expected_array *= observed_array.sum() / expected_array.sum()
    return float(stats.chisquare(observed_array, expected_array).pvalue)


def count_sequences(tokens: torch.Tensor) -> dict[tuple[int, ...], int]:
    """Histogram of the rows of an int tensor ``[num_samples, length]``."""
    unique, counts = torch.unique(tokens, dim=0, return_counts=True)
    return {tuple(int(t) for t in row): int(c) for row, c in zip(unique.tolist(), counts.tolist())}


def append_emitted(tokens: torch.Tensor, produced: torch.Tensor, rows: torch.Tensor, output: torch.Tensor,
                   num_accepted: torch.Tensor) -> torch.Tensor:
    """Append each verified sequence's ``num_accepted + 1`` emitted tokens.

    ``rows`` are the indices of the sequences in the verified batch, in batch
    order; tokens past the width of ``tokens`` are dropped. Returns the last
    emitted token of each row (the next step's context).
    """
    output, num_accepted = output.cpu().long(), num_accepted.cpu().long()
    emitted = num_accepted + 1
    slots = torch.arange(output.shape[1]).view(1, -1)
    positions = produced[rows].view(-1, 1) + slots
    keep = (slots < emitted.view(-1, 1)) & (positions < tokens.shape[1])
    tokens[rows.view(-1, 1).expand_as(positions)[keep], positions[keep]] = output[keep]
    produced[rows] += emitted
    return output[torch.arange(rows.shape[0]), num_accepted]


def joint_pvalue(tokens: torch.Tensor, model: MarkovModel, start_token: int) -> float:
    """Chi-square p-value of the rows of ``tokens`` against the model's exact joint."""
    expected = model.exact_joint(start_token, tokens.shape[1])
    return chi_square_pvalue(count_sequences(tokens), expected, tokens.shape[0])
