"""sk.adapters.flashinfer: FlashInfer's chain_speculative_sampling signature and counters over sk.chain_verify.

Expected values come from FlashInfer's own documented and tested cases
(its docstring example, its one-hot-target test, its structural checks),
restated here, and from the counters' exact law derived in this file (the
module docstring of ``adapters/flashinfer.py`` states the rule, read from
FlashInfer's kernel ``ChainSpeculativeSampling``).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from conftest import backend_or_skip
from markov import SIGNIFICANCE, chi_square_pvalue, count_sequences
from op_recording import recorded_ops
from specdec_kernels.adapters import flashinfer
from test_chain_verify_exactness import exactness_pvalue, generate, make_models

PATHS = ["reference", "triton"]


def random_inputs(generator, batch_size, max_drafts, vocab_size, *, drafts_from_draft=True, dtype=torch.float32):
    """FlashInfer's test inputs: normalised random rows (cubed, so they differ), drafts drawn from the draft."""
    draft = torch.rand(batch_size, max_drafts, vocab_size, generator=generator) ** 3
    draft /= draft.sum(-1, keepdim=True)
    target = torch.rand(batch_size, max_drafts + 1, vocab_size, generator=generator) ** 3
    target /= target.sum(-1, keepdim=True)
    if drafts_from_draft:
        ids = torch.multinomial(draft.view(-1, vocab_size), 1, generator=generator).view(batch_size, max_drafts)
    else:
        ids = torch.randint(vocab_size, (batch_size, max_drafts), generator=generator)
    return draft.to(dtype), ids.to(torch.int32), target.to(dtype)


# ----------------------------------------------------------------------------- FlashInfer's own cases


@pytest.mark.parametrize("path", PATHS)
def test_flashinfers_documented_example(path, device):
    """FlashInfer's docstring: draft 2 has target probability 0.6 >= its draft probability 0.3 (accepted
    whatever the draw), draft 1 has target probability 0 (rejected whatever the draw, also when judged
    again), and max(0, p - q) at position 1 is all on token 0. The counters are added to in place."""
    backend_or_skip("chain_verify", path)
    draft_probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]], device=device)
    draft_token_ids = torch.tensor([[2, 1]], dtype=torch.int32, device=device)
    target_probs = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]], device=device)
    accepted = torch.tensor([5], dtype=torch.int32, device=device)
    emitted = torch.tensor([7], dtype=torch.int32, device=device)
    for seed in range(4):
        tokens, accepted_out, emitted_out = flashinfer.chain_speculative_sampling(
            draft_probs, draft_token_ids, target_probs, accepted, emitted, seed=seed, offset=seed, backend=path)
        assert tokens.tolist() == [[2, 0, -1]]
        assert accepted_out is accepted and emitted_out is emitted
    assert accepted.tolist() == [5 + 4] and emitted.tolist() == [7 + 4]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("batch_size, max_drafts", [(1, 1), (7, 3), (3, 7)])
def test_one_hot_target_accepts_every_draft(path, batch_size, max_drafts, device):
    """FlashInfer's onehot_target case: the target puts all its mass on the draft tokens (and on a random
    bonus token), so the output is exactly those tokens and both counters are K."""
    backend_or_skip("chain_verify", path)
    generator = torch.Generator().manual_seed(batch_size * 10 + max_drafts)
    draft, ids, _ = random_inputs(generator, batch_size, max_drafts, 111, drafts_from_draft=False)
    target_ids = torch.randint(111, (batch_size, max_drafts + 1), generator=generator)
    target_ids[:, :max_drafts] = ids
    target = torch.nn.functional.one_hot(target_ids, 111).float()
    for trial in range(3):
        tokens, accepted, emitted = flashinfer.chain_speculative_sampling(
            draft.to(device), ids.to(device), target.to(device), seed=trial, offset=0, backend=path)
        assert torch.equal(tokens.cpu(), target_ids.to(torch.int32))
        assert accepted.tolist() == [max_drafts] * batch_size and emitted.tolist() == [max_drafts] * batch_size


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_structure_of_random_outputs(path, dtype, device):
    """FlashInfer's checks on random rows: the accepted drafts are a prefix, one token follows, then -1;
    emitted + 1 tokens are valid. And the counters agree with the tokens: accepted >= emitted, both within
    [0, K], accepted == K where the whole chain was accepted."""
    backend_or_skip("chain_verify", path)
    generator = torch.Generator().manual_seed(11)
    batch_size, max_drafts, vocab_size = 41, 2, 111
    draft, ids, target = random_inputs(generator, batch_size, max_drafts, vocab_size, dtype=dtype)
    tokens, accepted, emitted = (t.cpu() for t in flashinfer.chain_speculative_sampling(
        draft.to(device), ids.to(device), target.to(device), seed=3, offset=1, backend=path))
    assert tokens.dtype == accepted.dtype == emitted.dtype == torch.int32
    positions = torch.arange(max_drafts + 1)
    prefix = positions[:max_drafts].view(1, -1) < emitted.view(-1, 1)
    assert torch.equal(tokens[:, :max_drafts][prefix], ids[prefix])
    assert bool((tokens[positions.view(1, -1) > emitted.view(-1, 1)] == -1).all())
    assert torch.equal((tokens != -1).sum(1), emitted + 1)
    assert bool(((tokens >= 0) & (tokens < vocab_size))[positions.view(1, -1) <= emitted.view(-1, 1)].all())
    assert bool((accepted >= emitted).all() & (accepted <= max_drafts).all())
    assert bool((accepted[emitted == max_drafts] == max_drafts).all())
    assert 0 < int((emitted < max_drafts).sum()) < batch_size  # both outcomes occur, so the checks bite


@pytest.mark.parametrize("path", PATHS)
def test_drafts_without_target_mass_are_all_rejected(path, device):
    """Every draft has target probability 0: nothing is accepted, counted or emitted from the chain, and the
    first token comes from max(0, p - q) at position 0."""
    backend_or_skip("chain_verify", path)
    generator = torch.Generator().manual_seed(2)
    draft, ids, target = random_inputs(generator, 16, 4, 9)
    target[:, :4].scatter_(-1, ids.long().unsqueeze(-1), 0.0)
    tokens, accepted, emitted = (t.cpu() for t in flashinfer.chain_speculative_sampling(
        draft.to(device), ids.to(device), target.to(device), seed=1, offset=0, backend=path))
    assert accepted.tolist() == [0] * 16 and emitted.tolist() == [0] * 16
    assert bool((tokens[:, 1:] == -1).all())
    residual = (target[:, 0] - draft[:, 0]).clamp_min(0)
    assert bool((residual.gather(1, tokens[:, :1].long()) > 0).all())


# ----------------------------------------------------------------------------- random state


@pytest.mark.parametrize("path", PATHS)
def test_seed_tensors_draw_what_the_ints_draw(path, device):
    """FlashInfer reads entry 0 of a seed or offset tensor (length 1 or B, int64 or uint64): the tokens and
    counters are those of the int seed and offset, for every request."""
    backend_or_skip("chain_verify", path)
    generator = torch.Generator().manual_seed(4)
    draft, ids, target = (t.to(device) for t in random_inputs(generator, 9, 4, 17))
    want = flashinfer.chain_speculative_sampling(draft, ids, target, seed=2**40 + 9, offset=5, backend=path)
    for length in (1, 9):
        seed = torch.full((length,), 2**40 + 9, dtype=torch.int64, device=device)
        seed[1:] = 77  # ignored, as by FlashInfer
        offset = torch.full((length,), 5, dtype=torch.int64, device=device)
        for got_seed, got_offset in ((seed, offset), (seed.view(torch.uint64), offset.view(torch.uint64))):
            got = flashinfer.chain_speculative_sampling(draft, ids, target, seed=got_seed, offset=got_offset,
                                                        backend=path)
            for g, w in zip(got, want):
                assert torch.equal(g, w)


@pytest.mark.parametrize("path", PATHS)
def test_generator_and_default_seeds(path, device):
    """A generator draws the seed (the same state, the same outputs; it advances); without one the seed comes
    from torch's default generator, so torch.manual_seed repeats a call."""
    backend_or_skip("chain_verify", path)
    generator = torch.Generator().manual_seed(6)
    draft, ids, target = (t.to(device) for t in random_inputs(generator, 8, 3, 13))
    runs = []
    for state in (0, 0, 1):
        runs.append(flashinfer.chain_speculative_sampling(draft, ids, target,
                                                          generator=torch.Generator().manual_seed(state),
                                                          backend=path))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0])
    shared = torch.Generator().manual_seed(0)
    first = flashinfer.chain_speculative_sampling(draft, ids, target, generator=shared, backend=path)
    second = flashinfer.chain_speculative_sampling(draft, ids, target, generator=shared, backend=path)
    assert torch.equal(first[0], runs[0][0]) and not torch.equal(first[0], second[0])
    torch.manual_seed(3)
    default = flashinfer.chain_speculative_sampling(draft, ids, target, backend=path)
    torch.manual_seed(3)
    again = flashinfer.chain_speculative_sampling(draft, ids, target, backend=path)
    assert all(torch.equal(a, b) for a, b in zip(default, again))


@pytest.mark.parametrize("lone", [dict(seed=5), dict(offset=7), dict(seed=torch.tensor([5]))])
def test_a_lone_seed_or_offset_leaves_the_draw_to_the_generator(lone, device):
    """FlashInfer's rule: the draws come from ``generator`` unless both ``seed`` and ``offset`` are given; a lone
    one is not an error and changes nothing."""
    draft, ids, target = (t.to(device) for t in random_inputs(torch.Generator().manual_seed(8), 6, 3, 13))
    lone = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in lone.items()}
    with_lone = flashinfer.chain_speculative_sampling(draft, ids, target, generator=torch.Generator().manual_seed(1),
                                                      backend="reference", **lone)
    without = flashinfer.chain_speculative_sampling(draft, ids, target, generator=torch.Generator().manual_seed(1),
                                                    backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(with_lone, without))


# ----------------------------------------------------------------------------- backends agree


@pytest.mark.parametrize("batch_size, max_drafts, vocab_size, random_state, counters", [
    (1, 1, 7, "int", "none"), (13, 3, 111, "tensor", "accepted"), (5, 7, 1500, "generator", "both"),
    (4, 2, 9, "int", "both"), (4, 2, 9, "tensor", "none"), (4, 2, 9, "generator", "accepted"),
])
def test_triton_equals_reference(batch_size, max_drafts, vocab_size, random_state, counters, device):
    """Tokens and both counters bit for bit: reference (chain_verify's reference and the torch counters)
    against Triton (chain_verify's kernel and the counter kernel), counters given or not."""
    backend_or_skip("chain_verify", "triton")
    generator = torch.Generator().manual_seed(batch_size + max_drafts + vocab_size)
    draft, ids, target = (t.to(device) for t in random_inputs(generator, batch_size, max_drafts, vocab_size))
    results = []
    for path in PATHS:
        state = {"int": dict(seed=-12345, offset=2**33 + 1),
                 "tensor": dict(seed=torch.tensor([8], device=device), offset=torch.tensor([3], device=device)),
                 "generator": dict(generator=torch.Generator().manual_seed(9))}[random_state]
        given = []
        if counters != "none":
            given.append(torch.arange(batch_size, dtype=torch.int32, device=device))
        if counters == "both":
            given.append(torch.arange(batch_size, dtype=torch.int32, device=device) * 2)
        results.append(flashinfer.chain_speculative_sampling(draft, ids, target, *given, **state, backend=path))
    for got, want in zip(results[1], results[0]):
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), want.cpu())


def test_triton_path_is_the_verification_and_one_counter_launch():
    """Beside chain_verify, one launch writes both counters (and two allocations hold them): no other op."""
    backend_or_skip("chain_verify", "triton", "cpu")
    draft, ids, target = random_inputs(torch.Generator().manual_seed(0), 8, 3, 11)
    with recorded_ops(flashinfer, ["triton_flashinfer_counters"]) as seen:
        flashinfer.chain_speculative_sampling(draft, ids, target, seed=1, offset=0, backend="triton")
    assert seen == ["specdec.chain_verify", "aten.empty", "aten.empty", "triton_flashinfer_counters"]


def test_no_host_read():
    """On meta tensors every value read on the host raises: a tensor seed goes through without one."""
    draft, ids, target = random_inputs(torch.Generator().manual_seed(0), 4, 3, 11)
    meta = [t.to("meta") for t in (draft, ids, target)]
    seed, offset = torch.tensor([1], device="meta"), torch.tensor([2], device="meta")
    tokens, accepted, emitted = flashinfer.chain_speculative_sampling(*meta, seed=seed, offset=offset,
                                                                      backend="reference")
    assert tokens.shape == (4, 4) and accepted.shape == emitted.shape == (4,)


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    draft, ids, target = random_inputs(torch.Generator().manual_seed(0), 2, 3, 5)
    call = flashinfer.chain_speculative_sampling
    with pytest.raises(ValueError, match=re.escape("`target_probs` must have shape [B, K+1, V] = [2, 4, 5]")):
        call(draft, ids, target[:, :3])
    with pytest.raises(ValueError, match=re.escape("`draft_token_ids` must have shape [B, K] = [2, 3]")):
        call(draft, ids[:, :2], target)
    with pytest.raises(TypeError, match="`draft_token_ids` must have dtype int32 or int64; got float32"):
        call(draft, ids.float(), target)
    with pytest.raises(TypeError, match="`maybe_output_accepted_token_num` must have dtype int32; got int64"):
        call(draft, ids, target, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=re.escape("`maybe_output_emitted_draft_token_num` must have shape [B] = [2]")):
        call(draft, ids, target, None, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="`seed` and `offset` must both be tensors or both be ints"):
        call(draft, ids, target, seed=torch.tensor([1]), offset=0)
    with pytest.raises(TypeError, match="`seed` must have dtype int64 or uint64; got int32"):
        call(draft, ids, target, seed=torch.tensor([1], dtype=torch.int32), offset=torch.tensor([0]))
    with pytest.raises(ValueError, match=re.escape("`offset` must have shape [1] or [B] = [2]; got [3]")):
        call(draft, ids, target, seed=torch.tensor([1]), offset=torch.tensor([0, 0, 0]))
    with pytest.raises(TypeError, match="`deterministic` must be a bool; got int"):
        call(draft, ids, target, deterministic=1)
    with pytest.raises(TypeError, match="`generator` must be a torch.Generator or None; got int"):
        call(draft, ids, target, generator=5)


# ----------------------------------------------------------------------------- exactness


def _via_the_shim(draft_ids, target, draft, *, num_draft_tokens, temperature, logits, seed, offset, backend):
    """The exactness harness's verifier, through FlashInfer's argument order (draft, ids, target)."""
    assert num_draft_tokens is None and temperature is None and not logits
    tokens, _, emitted = flashinfer.chain_speculative_sampling(draft, draft_ids, target, seed=seed, offset=offset,
                                                               backend=backend)
    return tokens, emitted


def _with_draft_and_target_swapped(draft_ids, target, draft, **options):
    """A shim that passes FlashInfer's arguments in the wrong roles: the harness must catch it."""
    return _via_the_shim(draft_ids, torch.cat([draft, target[:, -1:]], 1), target[:, :-1], **options)


@pytest.mark.parametrize("verify, exact", [(_via_the_shim, True), (_with_draft_and_target_swapped, False)],
                         ids=["shim", "power: draft and target swapped"])
def test_emitted_tokens_follow_the_target(verify, exact, device):
    """Whole generation loops through the shim (tests/test_chain_verify_exactness.py's harness: 100,000
    sequences of Markov-chain drafts, chi-square of the first tokens' joint law against the target chain's,
    p >= 1e-4 with fixed seeds); a mis-wired shim fails the same test."""
    target_model, draft_model = make_models(6, seed=21)
    tokens = generate(target_model, draft_model, max_drafts=3, backend="reference", device=device, ragged=False,
                      verify=verify)
    assert (exactness_pvalue(tokens, target_model) >= SIGNIFICANCE) == exact


def counter_law(draft, target, second_judgement=True):
    """Exact law of ``(emitted, accepted)`` for one request whose drafts are drawn from ``draft`` rows.

    Position ``i`` of the chain accepts with ``a_i = sum_t q_i(t) r_i(t)``, ``r = min(1, p/q)``. At the first
    rejection the same token is judged again with a fresh uniform: accepted with probability
    ``b_i = sum_t q_i(t) (1 - r_i(t)) r_i(t)`` jointly with the rejection; every later position is judged
    once (``a_i``). ``second_judgement=False`` is the alternative without that second test.
    """
    q, p = draft.double(), target[: draft.shape[0]].double()
    ratio = torch.where(q > 0, torch.minimum(torch.ones_like(p), p / torch.where(q > 0, q, 1.0)), 0.0)
    a = (q * ratio).sum(-1).tolist()
    b = (q * (1 - ratio) * ratio).sum(-1).tolist() if second_judgement else [0.0] * len(a)
    law = {}

    def after(position, emitted, accepted, probability):
        if position == len(a):
            law[(emitted, accepted)] = law.get((emitted, accepted), 0.0) + probability
            return
        after(position + 1, emitted, accepted + 1, probability * a[position])
        after(position + 1, emitted, accepted, probability * (1 - a[position]))

    def chain(position, probability):
        if position == len(a):
            law[(position, position)] = law.get((position, position), 0.0) + probability
            return
        chain(position + 1, probability * a[position])
        rejected = 1 - a[position]
        after(position + 1, position, position + 1, probability * b[position])
        after(position + 1, position, position, probability * (rejected - b[position]))

    chain(0, 1.0)
    return law


def test_counters_follow_flashinfers_law(device):
    """The joint law of (emitted, accepted) over 200,000 requests with the same rows (drafts drawn from the
    draft rows by the test's generator) against counter_law: chi-square, p >= 1e-4, fixed seeds. The same
    samples must reject the law without FlashInfer's second judgement of the rejected position (power). On
    the reference; the counter kernel equals it bit for bit (test_triton_equals_reference)."""
    num_requests = 200_000
    generator = torch.Generator().manual_seed(99)
    draft_rows, _, target_rows = random_inputs(generator, 1, 4, 6)
    draft = draft_rows.expand(num_requests, -1, -1).contiguous()
    target = target_rows.expand(num_requests, -1, -1).contiguous()
    ids = torch.multinomial(draft_rows[0], num_requests, replacement=True, generator=generator).T.contiguous()
    _, accepted, emitted = flashinfer.chain_speculative_sampling(
        draft.to(device), ids.to(torch.int32).to(device), target.to(device), seed=17, offset=0,
        backend="reference")
    observed = count_sequences(torch.stack([emitted.cpu(), accepted.cpu()], 1))
    assert chi_square_pvalue(observed, counter_law(draft_rows[0], target_rows[0]), num_requests) >= SIGNIFICANCE
    wrong = counter_law(draft_rows[0], target_rows[0], second_judgement=False)
    assert chi_square_pvalue(observed, wrong, num_requests) < SIGNIFICANCE
    assert np.isclose(sum(counter_law(draft_rows[0], target_rows[0]).values()), 1.0)


@pytest.mark.parametrize("path", PATHS)
def test_a_token_the_draft_could_not_have_drawn_is_judged_as_chain_verify_judges_it(path, device):
    """The accepted counter judges each position with chain_verify's test: a token whose draft probability is 0
    is tested against the point mass on it, so accepted with probability p(t) (here 0.5), not always. Position 0
    is always rejected (p = 0); position 1's judgement alone moves the counter. 4,000 requests, fixed seed."""
    backend_or_skip("chain_verify", path)
    batch_size = 4000
    target = torch.zeros(batch_size, 3, 4, device=device)
    target[:, 0, 1] = 1.0  # the draft token 0 has no target mass: rejected at position 0
    target[:, 1, 2], target[:, 1, 3] = 0.5, 0.5
    target[:, 2, 0] = 1.0
    draft = torch.zeros(batch_size, 2, 4, device=device)
    draft[:, 0, 0] = 1.0
    draft[:, 1, 3] = 1.0  # the draft token 2 at position 1 has q = 0
    ids = torch.tensor([[0, 2]], device=device).expand(batch_size, 2).contiguous()
    _, accepted, emitted = flashinfer.chain_speculative_sampling(
        draft, ids, target, torch.zeros(batch_size, dtype=torch.int32, device=device),
        torch.zeros(batch_size, dtype=torch.int32, device=device), seed=11, offset=0, backend=path)
    assert int(emitted.sum()) == 0
    assert 0.45 < float(accepted.float().mean()) < 0.55
