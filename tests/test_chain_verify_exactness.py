"""Statistical exactness of chain verification over whole generation loops.

A target and a draft Markov chain generate 100,000 sequences in parallel:
the test samples K drafts from the draft chain with its own generator, the
verifier keeps a prefix and emits one token, and the loop repeats (a new
offset each step) until every sequence has ``LENGTH`` tokens. The joint law
of those tokens must match the target chain's exact joint (chi-square, bins
merged to expected count >= 5, p >= 1e-4, fixed seeds). The same harness must
reject deliberately wrong verifiers, which shows it has the power to catch a
bias of a few percent.
"""

import numpy as np
import pytest
import torch

import specdec_kernels as sk
from conftest import ALL_BACKENDS, backend_or_skip
from kernel_law import assert_follows_the_law
from markov import SIGNIFICANCE, MarkovModel, append_emitted, joint_pvalue
from specdec_kernels.reference import _sampling

NUM_SEQUENCES = 100_000
LENGTH = 3
START_TOKEN = 0


def make_models(vocab_size: int, seed: int, zero_tokens=(4,)):
    generator = np.random.default_rng(seed)
    target = MarkovModel.random(vocab_size, generator, zero_tokens=zero_tokens)
    draft = MarkovModel.random(vocab_size, generator, sharpness=0.7)
    return target, draft


def generate(target_model, draft_model, *, max_drafts, backend, device, draft_mode="sampled", ragged=True,
             temperature=None, seed=1234, test_seed=0, verify=None, num_sequences=NUM_SEQUENCES):
    """Run the speculative loop; returns the first ``LENGTH`` tokens of every sequence.

    ``draft_mode``: ``"sampled"`` (drafts drawn from the draft chain and its
    rows passed as ``draft``) or ``"greedy"`` (drafts are the draft chain's
    argmax, verified with ``draft=None``). ``temperature``: per-sequence
    temperatures, which switch the inputs to logits. ``verify``: the
    verifier to call instead of ``sk.chain_verify``.
    """
    verify = verify or sk.chain_verify
    generator = torch.Generator().manual_seed(test_seed)
    if temperature is not None:
        temperature = temperature[:num_sequences]
    prev = torch.full((num_sequences,), START_TOKEN, dtype=torch.int64)
    tokens = torch.full((num_sequences, LENGTH), -1, dtype=torch.int64)
    produced = torch.zeros(num_sequences, dtype=torch.int64)
    draft_argmax = torch.as_tensor(draft_model.transition).argmax(-1)
    step = 0
    while bool((produced < LENGTH).any()):
        contexts = [prev]
        for _ in range(max_drafts):
            if draft_mode == "sampled":
                contexts.append(draft_model.sample(contexts[-1], generator))
            else:
                contexts.append(draft_argmax[contexts[-1]])
        contexts = torch.stack(contexts, dim=1)
        draft_ids = contexts[:, 1:]
        if temperature is None:
            target = target_model.rows(contexts)
            draft = draft_model.rows(contexts[:, :-1]) if draft_mode == "sampled" else None
        else:
            per_row = torch.where(temperature > 0, temperature, 1.0).view(-1, 1, 1)
            target = target_model.logits(contexts, 1.0) * per_row
            # `logits` covers the target only (v1.3): the draft is the distribution the drafts were drawn from.
            draft = draft_model.rows(contexts[:, :-1]) if draft_mode == "sampled" else None
        num_drafts = None
        if ragged:
            num_drafts = torch.randint(0, max_drafts + 1, (num_sequences,), generator=generator, dtype=torch.int32)
        output, num_accepted = verify(
            draft_ids.to(device), target.to(device), None if draft is None else draft.to(device),
            num_draft_tokens=None if num_drafts is None else num_drafts.to(device),
            temperature=None if temperature is None else temperature.to(device),
            logits=temperature is not None, seed=seed, offset=step, backend=backend,
        )
        prev = append_emitted(tokens, produced, torch.arange(num_sequences), output, num_accepted)
        step += 1
    return tokens


def exactness_pvalue(tokens, target_model):
    return joint_pvalue(tokens, target_model, START_TOKEN)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize(
    "vocab_size, max_drafts, draft_mode",
    [(6, 3, "sampled"), (5, 1, "sampled"), (8, 4, "greedy")],
)
def test_emitted_tokens_follow_the_target(backend, vocab_size, max_drafts, draft_mode, device):
    backend_or_skip("chain_verify", backend)
    target_model, draft_model = make_models(vocab_size, seed=vocab_size)
    assert_follows_the_law(
        lambda on, sequences: generate(target_model, draft_model, max_drafts=max_drafts, backend=on, device=device,
                                       draft_mode=draft_mode, num_sequences=sequences),
        backend, device, lambda tokens: exactness_pvalue(tokens, target_model), NUM_SEQUENCES)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_logits_with_per_request_temperature(backend, device):
    backend_or_skip("chain_verify", backend)
    # Markov rows are softmax(logits * T / T): every temperature gives the
    # same chain, so all sequences share one exact joint.
    target_model, draft_model = make_models(6, seed=11)
    temperature = torch.tensor([0.5, 1.0, 2.0]).repeat(NUM_SEQUENCES // 3 + 1)[:NUM_SEQUENCES]
    assert_follows_the_law(
        lambda on, sequences: generate(target_model, draft_model, max_drafts=3, backend=on, device=device,
                                       temperature=temperature, num_sequences=sequences),
        backend, device, lambda tokens: exactness_pvalue(tokens, target_model), NUM_SEQUENCES)


def test_greedy_requests_follow_the_argmax_path(device):
    target_model, draft_model = make_models(6, seed=5)
    temperature = torch.zeros(NUM_SEQUENCES)
    tokens = generate(target_model, draft_model, max_drafts=3, backend="reference", device=device,
                      temperature=temperature)
    argmax = torch.as_tensor(target_model.transition).argmax(-1)
    expected, prev = [], START_TOKEN
    for _ in range(LENGTH):
        prev = int(argmax[prev])
        expected.append(prev)
    assert bool((tokens == torch.tensor(expected)).all())


def _accept_without_ratio(uniform, target_prob, draft_prob):
    return uniform < target_prob


def _resample_from_target(target_row, draft_row, subtract):
    return _sampling.fixed_point(target_row)


@pytest.mark.parametrize(
    "name, replacement",
    [("accept", _accept_without_ratio), ("residual_weights", _resample_from_target)],
    ids=["accept-with-p-instead-of-min(1,p/q)", "resample-from-p-instead-of-residual"],
)
def test_harness_rejects_wrong_verifiers(name, replacement, monkeypatch, device):
    """The chi-square harness must fail biased verifiers, or it proves nothing."""
    target_model, draft_model = make_models(6, seed=6)
    monkeypatch.setattr(_sampling, name, replacement)
    tokens = generate(target_model, draft_model, max_drafts=3, backend="reference", device=device)
    assert exactness_pvalue(tokens, target_model) < SIGNIFICANCE
