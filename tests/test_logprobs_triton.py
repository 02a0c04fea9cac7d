"""``logprobs=`` of the Triton kernels (contract v1.3), against the contract's values computed by hand.

Every plan of ``kernels/chain_verify.py`` writes the scores through one
writer (``write_outputs``) from one value (``target_logprob``), so each plan
is run: the walk (logits or truncation at a one-slice vocabulary), the
one-wave slices (probabilities), the two waves (logits) and the staged plan
(truncation), which the interpreter reaches at ``V = 2500`` (three slices).
Each case checks the tokens are the call's without ``logprobs``, bit for
bit, and each score against ``test_logprobs.scored`` (float64, by hand;
``rtol = atol = 1e-5``: logits' ``exp`` and sums round differently from the
reference's). A valid bonus id is scored under its bonus row, which the
kernel reads for it alone. The tree kernel's two plans are run the same
way, and a request that failed scores -inf everywhere.
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip
from test_chain_verify import assert_counters_at_zero
from test_logprobs import assert_scores, packed_scores, scored

TEMPERATURES = [0.7, 0.0, 1.3, 1.0, 2.0, 0.0]
TOP_K = [4, 0, 0, 2, 0, 3]


@pytest.fixture(autouse=True)
def _triton_only(device):
    backend_or_skip("chain_verify", "triton")


def chain_inputs(vocab_size, logits, device, seed=1):
    """Six requests of up to three drafts (counts 3, 2, 0, 3, 3, 1; an invalid id), drafts the target partly likes."""
    generator = torch.Generator().manual_seed(seed)
    batch_size, max_drafts = len(TEMPERATURES), 3
    x = torch.randn(batch_size, max_drafts + 1, vocab_size, generator=generator) * 3
    target = x if logits else torch.softmax(x, -1)
    draft = torch.softmax(x[:, :max_drafts] + torch.randn(batch_size, max_drafts, vocab_size, generator=generator),
                          -1)
    ids = torch.multinomial(draft.reshape(-1, vocab_size), 1, generator=generator).view(batch_size, max_drafts)
    ids[4, 1] = -1  # no proposal there
    counts = torch.tensor([3, 2, 0, 3, 3, 1])
    return [tensor.to(device) for tensor in (ids, target, draft, counts)]


def expected_scores(target, tokens, token_rows, kind, logits, top_k):
    return [[scored(target[b, int(token_rows[b, j])].cpu(), int(tokens[b, j]), kind, logits, TEMPERATURES[b],
                    top_k[b]) for j in range(tokens.shape[1])] for b in range(tokens.shape[0])]


@pytest.mark.parametrize("vocab_size", [9, 2500])
@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("kind", ["raw", "processed"])
def test_every_plan_scores_each_token_under_its_row(kind, logits, truncate, vocab_size, device):
    ids, target, draft, counts = chain_inputs(vocab_size, logits, device)
    top_k = TOP_K if truncate else [0] * len(TOP_K)
    keywords = dict(num_draft_tokens=counts, temperature=torch.tensor(TEMPERATURES, device=device), logits=logits,
                    seed=5, backend="triton", **({"top_k": torch.tensor(top_k, device=device)} if truncate else {}))
    tokens, num_accepted = sk.chain_verify(ids, target, draft, **keywords)
    got_tokens, got_accepted, got = sk.chain_verify(ids, target, draft, logprobs=kind, **keywords)
    assert torch.equal(got_tokens, tokens) and torch.equal(got_accepted, num_accepted)
    rows = torch.arange(tokens.shape[1]).expand(tokens.shape)
    assert_scores(got.cpu(), expected_scores(target, tokens.cpu(), rows, kind, logits, top_k))
    assert bool((got_tokens[:, 1:] >= 0).any()), "some request emits a token past position 0"
    assert_counters_at_zero(device)


@pytest.mark.parametrize("vocab_size", [9, 2500])
@pytest.mark.parametrize("logits", [False, True])
def test_a_bonus_id_is_scored_under_its_bonus_row(logits, vocab_size, device):
    """The engine's bonus token (``bonus_token_ids``, padded layout) is scored under row ``n_b``; an id outside
    ``[0, V)`` leaves the bonus row sampled as without ids."""
    ids, target, draft, counts = chain_inputs(vocab_size, logits, device, seed=2)
    # Drafts the target's argmax, so every request accepts all of them (greedy-like sharp rows).
    ids = target[:, :3].argmax(-1)
    ids[4, 1] = -1
    bonus = torch.tensor([3, -1, 2, 5, 1, vocab_size], device=device)
    keywords = dict(num_draft_tokens=counts, temperature=torch.tensor(TEMPERATURES, device=device), logits=logits,
                    seed=7, bonus_token_ids=bonus, backend="triton")
    tokens, num_accepted, got = sk.chain_verify(ids, target * (30 if logits else 1), draft, logprobs="raw",
                                                **keywords)
    sharp = target * (30 if logits else 1)
    rows = torch.arange(tokens.shape[1]).expand(tokens.shape)
    assert_scores(got.cpu(), expected_scores(sharp, tokens.cpu(), rows, "raw", logits, [0] * 6))
    emitted_bonus = [b for b in (0, 2, 3) if int(num_accepted[b]) == int(counts[b])]
    assert emitted_bonus, "some request with a bonus id accepted all its drafts"
    for b in emitted_bonus:
        assert int(tokens[b, int(counts[b])]) == int(bonus[b])


@pytest.mark.parametrize("vocab_size", [9, 2500])
@pytest.mark.parametrize("bonus_rows", [True, False])
def test_packed_scores_and_the_bonus_free_layout(bonus_rows, vocab_size, device):
    """Packed rows scored as the padded call's; in the bonus-free layout a bonus id is emitted from a row that
    was not given: NaN; a bonus id outside [0, V) emits -1 there: -inf."""
    generator = torch.Generator().manual_seed(2)
    counts = [2, 0, 3, 1]
    cu = torch.tensor([0, 2, 2, 5, 6], device=device)
    num_tokens = 6
    target_rows = num_tokens + (len(counts) if bonus_rows else 0)
    logits = torch.randn(target_rows, vocab_size, generator=generator) * 5  # exp((x - max) / T) > 0 in float32
    ids = torch.zeros(num_tokens, dtype=torch.int64)
    for b, count in enumerate(counts):  # drafts the target likes: some requests accept all of theirs
        for j in range(count):
            ids[int(cu[b]) + j] = int(logits[int(cu[b]) + j + (b if bonus_rows else 0)].argmax())
    bonus = torch.tensor([7, 8, -1, 3], device=device)
    temperature = torch.tensor([1.0, 0.5, 0.0, 2.0], device=device)
    keywords = dict(max_num_draft_tokens=3, seed=9, bonus_token_ids=bonus, logits=True, temperature=temperature,
                    backend="triton")
    target, ids = logits.to(device), ids.to(device)
    for kind in ("raw", "processed"):
        tokens, num_accepted, got = sk.chain_verify_packed(ids, cu, target, None, logprobs=kind, **keywords)
        assert torch.equal(tokens, sk.chain_verify_packed(ids, cu, target, None, **keywords)[0])
        expected = packed_scores(logits, tokens.cpu(), counts, cu, bonus_rows, kind, True, temperature.tolist())
        assert_scores(got.cpu(), expected)
        assert int(num_accepted[2]) == 3 and (int(tokens[2, 3]) >= 0) == bonus_rows


def test_raw_logprobs_of_logits_agree_with_the_reference(device):
    """The whole overload against the reference's (the same tokens; the scores within float32 rounding)."""
    ids, target, draft, counts = chain_inputs(2500, True, device, seed=3)
    keywords = dict(num_draft_tokens=counts, temperature=torch.tensor(TEMPERATURES, device=device), logits=True,
                    seed=11, top_p=torch.full((6,), 0.9, device=device), logprobs="raw")
    want = sk.chain_verify(ids, target, draft, backend="reference", **keywords)
    got = sk.chain_verify(ids, target, draft, backend="triton", **keywords)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("kind", ["raw", "processed"])
@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("plan", ["one program", "split"])
def test_tree_scores_each_token_under_its_path_nodes_row(plan, logits, kind, device):
    """Both plans of the tree kernel (the interpreter splits batches of up to 4 requests when ``V`` spans
    chunks), with a draft, top-k and bonus ids: each token under its path node's row."""
    backend_or_skip("tree_verify", "triton")
    batch_size, vocab_size = (6, 9) if plan == "one program" else (4, 2500)
    generator = torch.Generator().manual_seed(3)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]]).expand(batch_size, 7).contiguous()
    x = torch.randn(batch_size, 7, vocab_size, generator=generator) * 2
    target = x if logits else torch.softmax(x, -1)
    draft = torch.softmax(x + torch.randn(batch_size, 7, vocab_size, generator=generator), -1)
    tokens_in = torch.randint(0, 3, (batch_size, 7), generator=generator)
    top_k = [0, 3, 0, 2, 0, 1][:batch_size]
    keywords = dict(temperature=torch.tensor(TEMPERATURES[:batch_size], device=device), logits=logits, seed=4,
                    top_k=torch.tensor(top_k, device=device),
                    bonus_token_ids=torch.tensor([1, 2, -1, 0, 1, 2][:batch_size], device=device), backend="triton")
    inputs = [tensor.to(device) for tensor in (tokens_in, parents, target, draft)]
    path, tokens, num_accepted = sk.tree_verify(*inputs, **keywords)
    *same, got = sk.tree_verify(*inputs, logprobs=kind, **keywords)
    assert all(torch.equal(a, b) for a, b in zip(same, (path, tokens, num_accepted)))
    path, tokens = path.cpu(), tokens.cpu()
    expected = [[scored(target[b, max(int(path[b, j]), 0)], int(tokens[b, j]), kind, logits, TEMPERATURES[b],
                        top_k[b]) for j in range(7)] for b in range(batch_size)]
    assert_scores(got.cpu(), expected)
    assert bool((num_accepted > 0).any())


def test_a_failed_request_scores_minus_infinity(device):
    """A request whose wait gave up gets the failure outcome, tokens -1, so every score is -inf (the chain's
    staged plan and the tree's split plan; ``tests/test_faults.py``'s cases)."""
    from specdec_kernels import _faults
    from test_faults import CHAIN_PLANS, chain_case, chain_roles, tree_problem

    if device.type != "cpu":
        pytest.skip("the forced give-up roles are the interpreter's")
    logits, top_k, _ = CHAIN_PLANS["staged"]
    ids, target, draft = chain_case(logits)
    role, failed = chain_roles("triton", "staged", "first")
    with _faults.forced_give_up(role):
        tokens, num_accepted, scores = sk.chain_verify(ids, target, draft, temperature=torch.full((3,), 0.8),
                                                       top_k=torch.tensor(top_k), seed=77, offset=3, logprobs="raw",
                                                       backend="triton")
    failed = list(failed)
    assert bool((tokens[failed] == -1).all()) and bool(torch.isneginf(scores[failed]).all())
    assert bool((num_accepted[failed] == 0).all()) and bool(torch.isfinite(scores[0, 0]))
    assert sk.kernel_errors("cpu") == {**dict.fromkeys(_faults.KINDS, 0), "chain_verify.wait_gave_up": 1}
    ids, parents, target, draft = tree_problem()
    with _faults.forced_give_up(3):  # request 1's first program of three
        tokens, num_accepted, scores = sk.tree_verify(ids, parents, target, draft, seed=9, offset=2,
                                                      logprobs="processed", backend="triton")[1:]
    assert int(num_accepted[1]) == 0 and bool((tokens[1] == -1).all()) and bool(torch.isneginf(scores[1]).all())
    assert bool(torch.isfinite(scores[0, 0]))
    assert sk.kernel_errors("cpu") == {**dict.fromkeys(_faults.KINDS, 0), "tree_verify.wait_gave_up": 1}
