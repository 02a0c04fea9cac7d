"""Verification is exact with respect to the truncated target (top_k, top_p, min_p).

The chain and tree harnesses of ``test_chain_verify_exactness.py`` and
``test_tree_verify_exactness.py`` run with truncation on; the emitted tokens
must follow the Markov chain whose rows are the target's rows truncated by
the contract's rule (computed here in float64, independently of the
package), and must *not* follow the untruncated target: the same loop
without the parameters fails the test, so it has the power to see them.
"""

import functools

import numpy as np
import pytest

import specdec_kernels as sk
import test_chain_verify_exactness as chain_harness
import test_tree_verify_exactness as tree_harness
from conftest import ALL_BACKENDS, backend_or_skip
from kernel_law import assert_follows_the_law
from markov import SIGNIFICANCE, MarkovModel, joint_pvalue

TOP_K, TOP_P, MIN_P = 4, 0.8, 0.06
MARGIN = 1e-5  # no row may sit this close to a threshold (float32 rounding is ~1e-7), so float64 agrees


def truncated_model(model: MarkovModel, top_k: int, top_p: float, min_p: float) -> MarkovModel:
    """The contract's truncation of every row, in float64 (ties cannot occur in these random rows)."""
    rows = []
    for row in model.transition:
        order = np.argsort(-row, kind="stable")
        kept = np.zeros_like(row, dtype=bool)
        kept[order[:top_k]] = True
        mass = row * kept
        cumulative = np.cumsum(mass[order]) / mass.sum()
        assert np.all(np.abs(cumulative - top_p) > MARGIN), "a row sits on the top-p threshold"
        kept[order[np.searchsorted(cumulative, top_p) + 1:]] = False
        assert np.all(np.abs(row - min_p * row.max()) > MARGIN * row.max()), "a row sits on the min-p threshold"
        kept &= row >= min_p * row.max()
        rows.append(np.where(kept, row, 0.0) / np.where(kept, row, 0.0).sum())
    return MarkovModel(np.asarray(rows))


def chain_models():
    target, draft = chain_harness.make_models(8, seed=21)
    return target, draft, truncated_model(target, TOP_K, TOP_P, MIN_P)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_chain_follows_the_truncated_target(backend, device):
    backend_or_skip("chain_verify", backend)
    target, draft, truncated = chain_models()
    verify = functools.partial(sk.chain_verify, top_k=TOP_K, top_p=TOP_P, min_p=MIN_P)
    assert_follows_the_law(
        lambda on, sequences: chain_harness.generate(target, draft, max_drafts=3, backend=on, device=device,
                                                     verify=verify, num_sequences=sequences),
        backend, device, lambda tokens: joint_pvalue(tokens, truncated, chain_harness.START_TOKEN),
        chain_harness.NUM_SEQUENCES)


def test_chain_without_truncation_fails_the_truncated_law(device):
    target, draft, truncated = chain_models()
    tokens = chain_harness.generate(target, draft, max_drafts=3, backend="reference", device=device)
    assert joint_pvalue(tokens, truncated, chain_harness.START_TOKEN) < SIGNIFICANCE


def tree_models():
    target, draft = tree_harness.make_models(8, seed=22)
    return target, draft, truncated_model(target, TOP_K, TOP_P, MIN_P)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("mode", ["without_replacement", "top_k"])
def test_tree_follows_the_truncated_target(backend, mode, device):
    backend_or_skip("tree_verify", backend)
    target, draft, truncated = tree_models()
    verify = functools.partial(sk.tree_verify, top_k=TOP_K, top_p=TOP_P, min_p=MIN_P)
    assert_follows_the_law(
        lambda on, sequences: tree_harness.generate(target, draft, branching=tree_harness.SHALLOW, mode=mode,
                                                    backend=on, device=device, verify=verify,
                                                    num_sequences=sequences),
        backend, device, lambda tokens: joint_pvalue(tokens, truncated, tree_harness.START_TOKEN),
        tree_harness.NUM_SEQUENCES)


def test_tree_without_truncation_fails_the_truncated_law(device):
    target, draft, truncated = tree_models()
    tokens = tree_harness.generate(target, draft, branching=tree_harness.SHALLOW, mode="top_k", backend="reference",
                                   device=device, num_sequences=tree_harness.POWER_SEQUENCES)
    assert joint_pvalue(tokens, truncated, tree_harness.START_TOKEN) < SIGNIFICANCE
