"""sk.tree_verify: an independent per-request walk, structure and edge cases.

The walk below restates the contract's rule in plain Python, one request at
a time, and draws its random numbers from the RNG module directly; every
backend must agree with it bit for bit on probability inputs. The other
tests pin behaviour that needs no walk: output structure, greedy decoding,
special trees, invalid values and the seed/offset contract.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdec_kernels as sk
from conftest import ALL_BACKENDS, backend_or_skip
from specdec_kernels import rng
from specdec_kernels.reference import _sampling
from specdec_kernels.reference import tree_verify as reference

BACKENDS = list(ALL_BACKENDS)
DRAFT_MODES = ["with_replacement", "without_replacement", None]  # None: draft=None (deterministic candidates)


def run_tree_verify(tree_token_ids, parents, target, draft=None, *, backend, num_nodes=None, temperature=None,
                    logits=False, draft_sampling="without_replacement", seed=0, offset=0, validate=False):
    backend_or_skip("tree_verify", backend)
    return sk.tree_verify(tree_token_ids, parents, target, draft, num_nodes=num_nodes, temperature=temperature,
                          logits=logits, draft_sampling=draft_sampling, seed=seed, offset=offset, backend=backend,
                          validate=validate)


# ----------------------------------------------------------------------------- inputs


def random_parents(generator, batch_size, tree_size, *, bushy=False):
    """Valid random trees: deep ones (a parent among the last 3 nodes, 60% of the time), or
    bushy ones (a parent among the first 3 nodes: many siblings, many rejections in a row)."""
    parents = torch.full((batch_size, tree_size), -1, dtype=torch.int32)
    for i in range(1, tree_size):
        if bushy:
            low, high = 0, min(i, 3)
        else:
            low, high = torch.where(torch.rand(batch_size, generator=generator) < 0.6, max(0, i - 3), 0), i
        parents[:, i] = low + (torch.rand(batch_size, generator=generator) * (high - low)).long()
    return parents


def random_distributions(generator, shape, *, zero_fraction=0.0, sharpness=2.0):
    """Probability rows with about ``zero_fraction`` of the entries exactly zero (never a whole row)."""
    scores = torch.randn(shape, generator=generator) * sharpness
    zeros = torch.rand(shape, generator=generator) < zero_fraction
    zeros[..., 0] &= ~zeros[..., 1:].all(dim=-1)  # keep one entry per row
    return torch.softmax(scores.masked_fill(zeros, float("-inf")), dim=-1)


def random_problem(generator, batch_size, tree_size, vocab_size, *, invalid_fraction=0.0, zero_fraction=0.0,
                   greedy_fraction=0.0, ragged=True, bushy=False):
    """A random batch: ids, parents, target, draft, num_nodes, temperature (None without greedy requests)."""
    parents = random_parents(generator, batch_size, tree_size, bushy=bushy)
    target = random_distributions(generator, (batch_size, tree_size, vocab_size), zero_fraction=zero_fraction)
    draft = random_distributions(generator, (batch_size, tree_size, vocab_size), sharpness=1.0)
    # Children drawn from their parent's draft row, as a drafter would.
    parent_rows = draft[torch.arange(batch_size).view(-1, 1), parents.clamp_min(0).long()]
    tree_token_ids = torch.multinomial(parent_rows.view(-1, vocab_size), 1, generator=generator).view(
        batch_size, tree_size)
    invalid = torch.rand((batch_size, tree_size), generator=generator) < invalid_fraction
    junk = torch.tensor([-1, vocab_size, vocab_size + 7, -5])[
        torch.randint(0, 4, (batch_size, tree_size), generator=generator)]
    tree_token_ids = torch.where(invalid, junk, tree_token_ids)
    num_nodes = None
    if ragged:
        num_nodes = torch.randint(1, tree_size + 1, (batch_size,), generator=generator, dtype=torch.int32)
    temperature = None
    if greedy_fraction > 0:
        greedy = torch.rand(batch_size, generator=generator) < greedy_fraction
        temperature = torch.where(greedy, 0.0, 0.5 + torch.rand(batch_size, generator=generator)).to(torch.float32)
    return tree_token_ids, parents, target, draft, num_nodes, temperature


# ----------------------------------------------------------------------------- the rule, one request at a time


def expected_walk(tree_token_ids, parents, target, draft, num_nodes, temperature, logits, draft_sampling,
                  seed, offset):
    """The contract's decision rule in plain Python, one request at a time."""
    batch_size, tree_size, vocab_size = target.shape
    probs = _sampling.probabilities(target, temperature, logits)
    draft_probs = None if draft is None else draft.to(torch.float32)  # always probabilities (v1.3)
    keys = rng.RequestKeys(seed, offset, batch_size, target.device)
    positions = torch.arange(tree_size, device=target.device).expand(batch_size, -1)
    uniforms = _sampling.acceptance_uniforms(keys, positions).cpu()
    accepted_nodes = torch.full((batch_size, tree_size), -1, dtype=torch.int32)
    output = torch.full((batch_size, tree_size), -1, dtype=torch.int32)
    num_accepted = torch.zeros(batch_size, dtype=torch.int32)
    final_rows, final_nodes, greedy_emitted = [], [], {}
    for b in range(batch_size):
        limit = tree_size if num_nodes is None else min(max(int(num_nodes[b]), 1), tree_size)
        greedy = temperature is not None and float(temperature[b]) == 0.0
        node, path = 0, [0]
        p = probs[b, 0:1].clone()
        q = None if draft_probs is None else draft_probs[b, 0:1].clone()
        while True:
            moved = False
            for child in range(node + 1, limit):
                token = int(tree_token_ids[b, child])
                if int(parents[b, child]) != node or not 0 <= token < vocab_size:
                    continue
                if greedy:
                    if token == int(target[b, node].float().argmax()):
                        node, moved = child, True
                        break
                    continue
                # A candidate not drawn from q (no draft, or q(t) not > 0) is tried against its point mass (v1.3).
                drawn = q is not None and bool(q[0, token] > 0)
                proposal = q if drawn else torch.zeros_like(p)
                if not drawn:
                    proposal[0, token] = 1.0
                if bool(uniforms[b, child] * proposal[0, token] < p[0, token]):  # float32 product
                    node, moved = child, True
                    p = probs[b, child:child + 1].clone()
                    q = None if draft_probs is None else draft_probs[b, child:child + 1].clone()
                    break
                mass = torch.clamp_min(p - proposal, 0.0)
                if not bool((_sampling.fixed_point(mass) > 0).any()):  # no mass at the sampler's resolution
                    mass = p
                p = normalise_twin(mass)
                if drawn and draft_sampling == "without_replacement":
                    q[0, token] = 0.0
                    q = normalise_twin(q)
            if not moved:
                break
            path.append(node)
        accepted_nodes[b, :len(path)] = torch.tensor(path, dtype=torch.int32)
        output[b, :len(path) - 1] = tree_token_ids[b, path[1:]].to(torch.int32)
        num_accepted[b] = len(path) - 1
        final_rows.append(p)
        final_nodes.append(node)
        if greedy:
            greedy_emitted[b] = int(target[b, node].float().argmax())
    sampled = _sampling.sample(keys, torch.tensor(final_nodes), _sampling.fixed_point(torch.cat(final_rows)))
    for b in range(batch_size):
        output[b, int(num_accepted[b])] = greedy_emitted.get(b, int(sampled[b]))
    return accepted_nodes, output, num_accepted


def normalise_twin(mass):
    """``_sampling.normalise`` of one row ``[1, V]`` in Python integers and floats.

    ``float(S)`` of a Python int, numpy's float32 ``/`` and Python's ``*`` are correctly rounded.
    """
    weights = [int(w) for w in _sampling.fixed_point(mass)[0].tolist()]
    total = sum(weights)
    reciprocal = float(np.float32(1.0) / np.float32(float(total))) if total else 0.0
    values = [w * reciprocal for w in weights]
    return torch.tensor([values], dtype=torch.float64).to(torch.float32)


def check_structure(result, tree_token_ids, parents, num_nodes, vocab_size):
    """Invariants every output must satisfy, whatever the inputs."""
    accepted_nodes, output, num_accepted = (t.cpu() for t in result)
    batch_size, tree_size = parents.shape
    assert accepted_nodes.dtype == output.dtype == num_accepted.dtype == torch.int32
    assert accepted_nodes.shape == output.shape == (batch_size, tree_size)
    assert num_accepted.shape == (batch_size,)
    for b in range(batch_size):
        count = int(num_accepted[b])
        limit = tree_size if num_nodes is None else min(max(int(num_nodes[b]), 1), tree_size)
        assert 0 <= count < limit
        path = accepted_nodes[b].tolist()
        assert path[0] == 0 and all(n == -1 for n in path[count + 1:])
        for depth in range(1, count + 1):
            node = path[depth]
            assert path[depth - 1] < node < limit and int(parents[b, node]) == path[depth - 1]
            assert int(output[b, depth - 1]) == int(tree_token_ids[b, node])
            assert 0 <= int(tree_token_ids[b, node]) < vocab_size
        assert 0 <= int(output[b, count]) < vocab_size
        assert all(t == -1 for t in output[b, count + 1:].tolist())


def assert_same(result, expected):
    for got, want in zip(result, expected):
        assert torch.equal(got.cpu(), want.cpu())


# ----------------------------------------------------------------------------- agreement with the walk


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
@pytest.mark.parametrize(
    "batch_size, tree_size, vocab_size, bushy",
    [(1, 1, 7, False), (7, 9, 7, False), (13, 23, 111, False), (31, 12, 5, True), (11, 16, 32, True),
     (5, 6, 1, True)],
)
def test_matches_independent_walk(backend, draft_mode, batch_size, tree_size, vocab_size, bushy, device):
    generator = torch.Generator().manual_seed(batch_size * 1000 + tree_size * 10 + vocab_size)
    ids, parents, target, draft, num_nodes, temperature = random_problem(
        generator, batch_size, tree_size, vocab_size, invalid_fraction=0.1, zero_fraction=0.3, greedy_fraction=0.3,
        bushy=bushy)
    draft = None if draft_mode is None else draft
    sampling = draft_mode or "without_replacement"
    for offset in range(3):
        args = (ids, parents, target, draft, num_nodes, temperature, False, sampling, 99, offset)
        expected = expected_walk(*args)
        result = run_tree_verify(
            ids.to(device), parents.to(device), target.to(device), None if draft is None else draft.to(device),
            num_nodes=None if num_nodes is None else num_nodes.to(device),
            temperature=None if temperature is None else temperature.to(device),
            draft_sampling=sampling, seed=99, offset=offset, backend=backend)
        check_structure(result, ids, parents, num_nodes, vocab_size)
        assert_same(result, expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_logits_with_temperature_match_walk(backend, draft_mode, device):
    generator = torch.Generator().manual_seed(3)
    ids, parents, _, _, num_nodes, temperature = random_problem(generator, 11, 12, 9, greedy_fraction=0.4)
    target = torch.randn(11, 12, 9, generator=generator) * 3
    target[0, :, 2] = float("-inf")  # a token the target never emits
    draft = None if draft_mode is None else torch.softmax(torch.randn(11, 12, 9, generator=generator), -1)
    sampling = draft_mode or "without_replacement"
    expected = expected_walk(ids, parents, target, draft, num_nodes, temperature, True, sampling, 5, 17)
    result = run_tree_verify(
        ids.to(device), parents.to(device), target.to(device), None if draft is None else draft.to(device),
        num_nodes=num_nodes.to(device), temperature=temperature.to(device), logits=True, draft_sampling=sampling,
        seed=5, offset=17, backend=backend)
    check_structure(result, ids, parents, num_nodes, 9)
    assert_same(result, expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_float32_of_the_same_values(backend, dtype, device):
    generator = torch.Generator().manual_seed(4)
    ids, parents, target, draft, num_nodes, _ = random_problem(generator, 7, 10, 31)
    target, draft = target.to(dtype), draft.to(dtype)
    low = run_tree_verify(ids.to(device), parents.to(device), target.to(device), draft.to(device),
                          num_nodes=num_nodes.to(device), seed=1, backend=backend)
    high = run_tree_verify(ids.to(device), parents.to(device), target.float().to(device), draft.float().to(device),
                           num_nodes=num_nodes.to(device), seed=1, backend=backend)
    assert_same(low, high)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_and_int64_token_ids_agree(backend, device):
    generator = torch.Generator().manual_seed(6)
    ids, parents, target, draft, num_nodes, _ = random_problem(generator, 7, 10, 31, invalid_fraction=0.2)
    results = [
        run_tree_verify(ids.to(dtype).to(device), parents.to(device), target.to(device), draft.to(device),
                        num_nodes=num_nodes.to(device), seed=1, backend=backend)
        for dtype in (torch.int32, torch.int64)
    ]
    assert_same(*results)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_parents_agree_with_int32(backend, device):
    """int64 parents beyond int32's range are outside [0, i) like any other bad parent."""
    generator = torch.Generator().manual_seed(7)
    ids, parents, target, draft, num_nodes, _ = random_problem(generator, 7, 10, 31)
    wide = parents.to(torch.int64)
    wide[0, 4], wide[1, 5], wide[2, 6] = 2**40, -(2**40), 2**32  # 2**32 would wrap to 0 in int32
    narrow = parents.clone()
    narrow[0, 4], narrow[1, 5], narrow[2, 6] = 2**31 - 1, -(2**31), 2**31 - 1
    results = [
        run_tree_verify(ids.to(device), tree_parents.to(device), target.to(device), draft.to(device),
                        num_nodes=num_nodes.to(device), seed=1, backend=backend)
        for tree_parents in (wide, narrow)
    ]
    assert_same(*results)


# ----------------------------------------------------------------------------- special trees and requests


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_shaped_tree_greedy_matches_chain(backend, device):
    """A chain is a tree where every node has one child: greedy decoding must agree."""
    generator = torch.Generator().manual_seed(8)
    batch_size, max_drafts, vocab_size = 7, 5, 7
    target = torch.softmax(torch.randn(batch_size, max_drafts + 1, vocab_size, generator=generator) * 3, dim=-1)
    argmax = target.argmax(dim=-1)
    # Drafts match the argmax up to a per-request position, then random.
    matching = torch.arange(max_drafts).view(1, -1) < torch.arange(batch_size).view(-1, 1) % (max_drafts + 1)
    draft_ids = torch.where(matching, argmax[:, :max_drafts],
                            (argmax[:, :max_drafts] + 1 + torch.randint(0, vocab_size - 1, (1,))) % vocab_size)
    num_drafts = torch.tensor([5, 5, 2, 5, 4, 5, 0], dtype=torch.int32)
    tree_ids = torch.cat([torch.zeros(batch_size, 1, dtype=torch.int64), draft_ids], dim=1)
    parents = (torch.arange(max_drafts + 1, dtype=torch.int32) - 1).expand(batch_size, -1).contiguous()
    temperature = torch.zeros(batch_size)
    accepted_nodes, output, num_accepted = run_tree_verify(
        tree_ids.to(device), parents.to(device), target.to(device), num_nodes=(num_drafts + 1).to(device),
        temperature=temperature.to(device), backend=backend)
    # The chain rule by hand: accept while the draft is the argmax, then emit the argmax.
    for b in range(batch_size):
        count = 0
        while count < int(num_drafts[b]) and int(draft_ids[b, count]) == int(argmax[b, count]):
            count += 1
        assert int(num_accepted[b]) == count
        assert accepted_nodes[b].tolist() == list(range(count + 1)) + [-1] * (max_drafts - count)
        assert output[b].tolist() == draft_ids[b, :count].tolist() + [int(argmax[b, count])] + [-1] * (
            max_drafts - count)
    if hasattr(sk, "chain_verify"):
        chain_output, chain_accepted = sk.chain_verify(
            draft_ids.to(device), target.to(device), num_draft_tokens=num_drafts.to(device),
            temperature=temperature.to(device), backend="reference")
        assert torch.equal(chain_output.cpu(), output.cpu())
        assert torch.equal(chain_accepted.cpu(), num_accepted.cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_requests_mixed_with_sampling_requests(backend, device):
    """Greedy rows follow the argmax; sampling rows are unaffected by the greedy ones."""
    generator = torch.Generator().manual_seed(9)
    ids, parents, target, draft, num_nodes, _ = random_problem(generator, 12, 15, 5, ragged=False)
    # Children that often match the argmax, so greedy paths go deep.
    parent_argmax = target.argmax(dim=-1).gather(1, parents.clamp_min(0).long())
    ids = torch.where(torch.rand(ids.shape, generator=generator) < 0.6, parent_argmax, ids)
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.7, 1.0, 0.0, 2.0, 0.0, 1.0, 1.0, 0.0])
    seed = torch.randint(0, 2**40, (12,), generator=generator)
    result = run_tree_verify(ids.to(device), parents.to(device), target.to(device), draft.to(device),
                             temperature=temperature.to(device), seed=seed.to(device), offset=4, backend=backend)
    check_structure(result, ids, parents, None, 5)
    accepted_nodes, output, num_accepted = (t.cpu() for t in result)
    for b in (temperature == 0).nonzero().view(-1).tolist():
        node, path = 0, [0]
        while True:
            children = [c for c in range(node + 1, 15)
                        if int(parents[b, c]) == node and int(ids[b, c]) == int(target[b, node].argmax())]
            if not children:
                break
            node = children[0]
            path.append(node)
        assert accepted_nodes[b, :len(path)].tolist() == path
        assert int(num_accepted[b]) == len(path) - 1
        assert int(output[b, len(path) - 1]) == int(target[b, node].argmax())
    sampling = temperature > 0
    alone = run_tree_verify(ids[sampling].to(device), parents[sampling].to(device), target[sampling].to(device),
                            draft[sampling].to(device), temperature=temperature[sampling].to(device),
                            seed=seed[sampling].to(device), offset=4, backend=backend)
    assert_same(alone, [t[sampling] for t in (accepted_nodes, output, num_accepted)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft_sampling", ["with_replacement", "without_replacement"])
def test_draft_equal_to_target_accepts_the_first_child_at_every_level(backend, draft_sampling, device):
    """p == q accepts every token with p > 0: the path runs through first children to a leaf,
    and the emitted token is the sample of the leaf's target row."""
    generator = torch.Generator().manual_seed(10)
    batch_size, tree_size, vocab_size = 9, 14, 33
    ids, parents, target, _, num_nodes, _ = random_problem(generator, batch_size, tree_size, vocab_size)
    accepted_nodes, output, num_accepted = (t.cpu() for t in run_tree_verify(
        ids.to(device), parents.to(device), target.to(device), target.to(device), num_nodes=num_nodes.to(device),
        draft_sampling=draft_sampling, seed=21, offset=3, backend=backend))
    leaves = []
    for b in range(batch_size):
        node, path = 0, [0]
        while True:
            children = [c for c in range(node + 1, int(num_nodes[b])) if int(parents[b, c]) == node]
            if not children:
                break
            node = children[0]
            path.append(node)
        leaves.append(node)
        assert accepted_nodes[b, :len(path)].tolist() == path and int(num_accepted[b]) == len(path) - 1
    keys = rng.RequestKeys(21, 3, batch_size, torch.device("cpu"))
    leaves = torch.tensor(leaves)
    emitted = _sampling.sample(keys, leaves, _sampling.fixed_point(target[torch.arange(batch_size), leaves]))
    assert torch.equal(output[torch.arange(batch_size), num_accepted.long()], emitted.to(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
@pytest.mark.parametrize("logits", [False, True])
def test_zero_probability_tokens_are_never_emitted(backend, draft_mode, logits, device):
    generator = torch.Generator().manual_seed(11)
    batch_size, tree_size, vocab_size = 400, 12, 6
    ids, parents, target, draft, num_nodes, _ = random_problem(
        generator, batch_size, tree_size, vocab_size, zero_fraction=0.5)
    # Children the target forbids half the time; the draft favours them.
    draft = torch.where(target == 0, draft + 1.0, draft)
    draft = draft / draft.sum(dim=-1, keepdim=True)
    parent_rows = draft[torch.arange(batch_size).view(-1, 1), parents.clamp_min(0).long()]
    ids = torch.multinomial(parent_rows.view(-1, vocab_size), 1, generator=generator).view(batch_size, tree_size)
    allowed = target > 0
    temperature = torch.full((batch_size,), 0.8) if logits else None
    if logits:
        target = target.log()  # `logits` covers the target only (v1.3)
    draft = None if draft_mode is None else draft
    for offset in range(5):
        accepted_nodes, output, num_accepted = (t.cpu().long() for t in run_tree_verify(
            ids.to(device), parents.to(device), target.to(device), None if draft is None else draft.to(device),
            num_nodes=num_nodes.to(device), temperature=None if temperature is None else temperature.to(device),
            logits=logits, draft_sampling=draft_mode or "without_replacement", seed=offset, offset=offset,
            backend=backend))
        # Token d of the output follows node accepted_nodes[d].
        depth = torch.arange(tree_size).view(1, -1)
        valid = depth <= num_accepted.view(-1, 1)
        rows = allowed[torch.arange(batch_size).view(-1, 1), accepted_nodes.clamp_min(0)]
        assert bool(rows.gather(-1, output.clamp_min(0).unsqueeze(-1)).squeeze(-1)[valid].all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_invalid_ids_are_like_absent_nodes(backend, draft_mode, device):
    """An id outside [0, V) (-1 included) is a rejection that changes nothing: the result is
    that of the same tree with the node detached (and its subtree unreachable)."""
    generator = torch.Generator().manual_seed(12)
    batch_size, tree_size, vocab_size = 64, 12, 5
    ids, parents, target, draft, num_nodes, temperature = random_problem(
        generator, batch_size, tree_size, vocab_size, invalid_fraction=0.25, greedy_fraction=0.2)
    draft = None if draft_mode is None else draft
    invalid = (ids < 0) | (ids >= vocab_size)
    detached_parents = torch.where(invalid, torch.arange(tree_size, dtype=torch.int32).view(1, -1), parents)
    detached_ids = torch.where(invalid, 0, ids)
    results = [
        run_tree_verify(tree_ids.to(device), tree_parents.to(device), target.to(device),
                        None if draft is None else draft.to(device), num_nodes=num_nodes.to(device),
                        temperature=temperature.to(device), draft_sampling=draft_mode or "with_replacement",
                        seed=2, offset=1, backend=backend)
        for tree_ids, tree_parents in ((ids, parents), (detached_ids, detached_parents))
    ]
    assert_same(*results)
    check_structure(results[0], ids, parents, num_nodes, vocab_size)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tree_size", [1, 6])
def test_root_only_emits_a_sample_of_the_root_row(backend, tree_size, device):
    generator = torch.Generator().manual_seed(13)
    batch_size, vocab_size = 5, 111
    ids, parents, target, draft, _, _ = random_problem(generator, batch_size, tree_size, vocab_size)
    temperature = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    accepted_nodes, output, num_accepted = (t.cpu() for t in run_tree_verify(
        ids.to(device), parents.to(device), target.to(device), draft.to(device),
        num_nodes=torch.ones(batch_size, dtype=torch.int32).to(device), temperature=temperature.to(device),
        seed=7, offset=2, backend=backend))
    assert num_accepted.tolist() == [0] * batch_size
    assert accepted_nodes.tolist() == [[0] + [-1] * (tree_size - 1)] * batch_size
    keys = rng.RequestKeys(7, 2, batch_size, torch.device("cpu"))
    sampled = _sampling.sample(keys, torch.zeros(batch_size, dtype=torch.int64), _sampling.fixed_point(target[:, 0]))
    expected = torch.where(temperature == 0, target[:, 0].argmax(dim=-1), sampled)
    assert output[:, 0].tolist() == expected.tolist()
    assert bool((output[:, 1:] == -1).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_vocabulary_of_one(backend, draft_mode, device):
    """With one token every valid child is accepted: the path is first children down to a leaf."""
    batch_size, tree_size = 3, 7
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 2]] * batch_size, dtype=torch.int32)
    ids = torch.zeros(batch_size, tree_size, dtype=torch.int64)
    ids[1, 1] = -1  # request 1: the first child is invalid, so the path goes through node 2
    target = torch.ones(batch_size, tree_size, 1)
    draft = None if draft_mode is None else torch.ones(batch_size, tree_size, 1)
    accepted_nodes, output, num_accepted = (t.cpu() for t in run_tree_verify(
        ids.to(device), parents.to(device), target.to(device), None if draft is None else draft.to(device),
        draft_sampling=draft_mode or "without_replacement", seed=3, backend=backend))
    assert accepted_nodes.tolist() == [[0, 1, 3, 5, -1, -1, -1], [0, 2, 6, -1, -1, -1, -1], [0, 1, 3, 5, -1, -1, -1]]
    assert output.tolist() == [[0, 0, 0, 0, -1, -1, -1], [0, 0, 0, -1, -1, -1, -1], [0, 0, 0, 0, -1, -1, -1]]
    assert num_accepted.tolist() == [3, 2, 3]


# ----------------------------------------------------------------------------- seeds and offsets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset_kind", ["int", "scalar", "per_request"])
def test_per_request_seeds_are_batch_invariant(backend, offset_kind, device):
    generator = torch.Generator().manual_seed(14)
    batch_size, tree_size, vocab_size = 9, 10, 17
    ids, parents, target, draft, num_nodes, temperature = random_problem(
        generator, batch_size, tree_size, vocab_size, greedy_fraction=0.2)
    seed = torch.randint(-(2**62), 2**62, (batch_size,), generator=generator)
    offsets = {"int": 12345, "scalar": torch.tensor(12345), "per_request": torch.arange(batch_size) * 1000}[offset_kind]

    def call(rows):
        offset = offsets[rows] if offset_kind == "per_request" else offsets
        return run_tree_verify(
            ids[rows].to(device), parents[rows].to(device), target[rows].to(device), draft[rows].to(device),
            num_nodes=num_nodes[rows].to(device), temperature=temperature[rows].to(device),
            seed=seed[rows].to(device), offset=offset.to(device) if isinstance(offset, torch.Tensor) else offset,
            backend=backend)

    whole = call(torch.arange(batch_size))
    for b in range(batch_size):
        assert_same(call(torch.tensor([b])), [t[b:b + 1] for t in whole])
    reversed_rows = torch.arange(batch_size - 1, -1, -1)
    assert_same(call(reversed_rows), [t[reversed_rows] for t in whole])


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_seed_and_offset_give_the_same_outputs(backend, device):
    generator = torch.Generator().manual_seed(15)
    batch_size, tree_size, vocab_size = 64, 10, 17
    ids, parents, target, draft, num_nodes, _ = random_problem(generator, batch_size, tree_size, vocab_size)

    def call(seed, offset):
        return run_tree_verify(ids.to(device), parents.to(device), target.to(device), draft.to(device),
                               num_nodes=num_nodes.to(device), seed=seed, offset=offset, backend=backend)

    first = call(2**40 + 3, 7)
    assert_same(call(2**40 + 3, 7), first)
    # An int offset, a 0-dim tensor and a [B] tensor holding the same value are the same offset.
    assert_same(call(2**40 + 3, torch.tensor(7, device=device)), first)
    assert_same(call(2**40 + 3, torch.full((batch_size,), 7, device=device)), first)
    # A Python int wraps to 64-bit two's complement.
    assert_same(call(2**40 + 3 - 2**64, 7 + 2**64), first)
    for other in (call(2**40 + 3, 8), call(2**40 + 4, 7)):
        assert not all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(other, first))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["interpreter-tiles", "gpu-tiles"])
def test_kernels_match_the_reference_on_large_and_strided_inputs(backend, draft_mode, gpu_tiles, device,
                                                                  monkeypatch):
    """Trees wider than a kernel's node tile (N = 150), vocabularies of several sampler chunks
    (V = 2500, not a multiple of 1024), bushy trees (N = 64: about 15 rejections in a row at a node) and a
    target that is a strided slice of a wider tensor: the same bits as the reference. ``gpu-tiles`` gives
    the Triton launcher the GPU's tiles under the interpreter too: one request per program.

    The bushy tree is smaller because the split plan replays a node's rejections on every pass, ``O(k^2)``
    in ``k`` rejections, and the interpreter runs each replay as numpy calls: a bushy N = 150 took 260 s
    there (on a GPU it is a few microseconds)."""
    backend_or_skip("tree_verify", backend)
    if gpu_tiles:
        if backend != "triton" or device.type == "cuda":
            pytest.skip("the interpreter's Triton tiles are the only ones to swap")
        from specdec_kernels.launchers import tree_verify as launcher

        monkeypatch.setattr(launcher, "INTERPRETER_TILE", launcher.TILE)
        assert launcher.launch_config(3, 150, 2500, interpreter=True).rows == launcher.MAX_ROWS == 1
    generator = torch.Generator().manual_seed(150)
    for tree_size, bushy in ((64, True), (150, False)):
        ids, parents, target, draft, num_nodes, temperature = random_problem(
            generator, 3, tree_size, 2500, invalid_fraction=0.05, zero_fraction=0.2, greedy_fraction=0.3,
            bushy=bushy)
        draft = None if draft_mode is None else draft
        wide = torch.zeros(3, tree_size, 2600)
        wide[..., 50:2550] = target
        target = wide[..., 50:2550]  # row stride 2600: not the vocabulary size
        arguments = dict(num_nodes=num_nodes, temperature=temperature, draft_sampling=draft_mode or "with_replacement",
                         seed=torch.tensor([3, 2**40, -5]), offset=torch.tensor([0, 7, 2**33]))
        expected = sk.tree_verify(ids, parents, target, draft, backend="reference", **arguments)
        result = run_tree_verify(
            ids.to(device), parents.to(device), target.to(device), None if draft is None else draft.to(device),
            backend=backend, **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in arguments.items()})
        check_structure(result, ids, parents, num_nodes, 2500)
        assert_same(result, expected)


def rejected_root_case(batch_size, vocab_size, seed=8):
    """ids, parents, target, draft of a root with three children, each rejected: ``p(t) = 0``."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch_size, 4, vocab_size, generator=generator) * 2, dim=-1)
    draft = torch.softmax(torch.randn(batch_size, 4, vocab_size, generator=generator), dim=-1)
    ids = torch.randint(0, vocab_size, (batch_size, 4), generator=generator)
    target[torch.arange(batch_size).view(-1, 1), 0, ids[:, 1:]] = 0.0
    parents = torch.tensor([[-1, 0, 0, 0]] * batch_size, dtype=torch.int32)
    return ids, parents, target, draft


def rows_after_rejections(ids, target, draft, draft_mode, children):
    """The root's ``p`` and ``q`` after rejecting ``children`` in order (``_sampling``'s residual and normalise)."""
    p, q = target[:, 0], None if draft is None else draft[:, 0]
    for child in children:
        drawn = torch.nn.functional.one_hot(ids[:, child], target.shape[-1]).bool()
        p = _sampling.normalise(_sampling.residual(p, drawn.float() if q is None else q))
        if draft_mode == "without_replacement":
            q = _sampling.normalise(q.masked_fill(drawn, 0.0))
    return p, q


@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_triton_scratch_rows_are_the_reference_normaliser(draft_mode, device, monkeypatch):
    """After three rejections at the root, the Triton kernel's scratch rows hold the rows after the
    first two (the third is applied where the rows are read), equal to _sampling's residual and
    normalise bit for bit: outputs alone would rarely show a rounding difference in them. (The
    one-program plan: the split plan writes no rows.)"""
    from specdec_kernels import _workspace
    from specdec_kernels.launchers import tree_verify as launcher

    backend_or_skip("tree_verify", "triton")
    monkeypatch.setattr(launcher, "INTERPRETER_MAX_SPLITS", 1)
    monkeypatch.setattr(launcher, "multiprocessor_count", lambda device: 1)
    batch_size, vocab_size = 3, 2100
    ids, parents, target, draft = rejected_root_case(batch_size, vocab_size)
    draft = None if draft_mode is None else draft
    sampling = draft_mode or "without_replacement"
    on_device = target.to(device)
    result = run_tree_verify(ids.to(device), parents.to(device), on_device,
                             None if draft is None else draft.to(device), draft_sampling=sampling, seed=1, offset=2,
                             backend="triton")
    assert_same(result, sk.tree_verify(ids, parents, target, draft, draft_sampling=sampling, seed=1, offset=2,
                                       backend="reference"))
    p, q = rows_after_rejections(ids, target, draft, draft_mode, (1, 2))
    key = ("tree_verify.scratch", torch.float32, on_device.device, _workspace._stream_key(on_device.device))
    rows = 2 if draft_mode == "without_replacement" else 1
    written = _workspace._buffers[key][:batch_size * rows * vocab_size].view(batch_size, rows, vocab_size).cpu()
    assert torch.equal(written[:, 0], p)
    if draft_mode == "without_replacement":
        assert torch.equal(written[:, 1], q)


# ----------------------------------------------------------------------------- malformed values


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_malformed_trees_do_not_crash(backend, draft_mode, device):
    """Parents outside [0, i) make a node unreachable; num_nodes is clamped to [1, N];
    parents[b, 0] is never read."""
    generator = torch.Generator().manual_seed(16)
    batch_size, tree_size, vocab_size = 8, 9, 6
    ids, parents, target, draft, _, temperature = random_problem(
        generator, batch_size, tree_size, vocab_size, invalid_fraction=0.2, greedy_fraction=0.3)
    draft = None if draft_mode is None else draft
    broken = parents.clone()
    broken[:, 0] = torch.tensor([-1, 0, 5, -7, 2**31 - 1, 1, -1, 3], dtype=torch.int32)
    broken[0, 3] = 3  # self
    broken[1, 2] = 7  # forward
    broken[2, 5] = -1
    broken[3, 4] = -(2**31)
    broken[4, 1] = 2**31 - 1
    broken[5, 8] = 100
    num_nodes = torch.tensor([0, -3, 9, 100, 2**31 - 1, 1, -(2**31), 5], dtype=torch.int32)
    clamped = num_nodes.clamp(1, tree_size)
    unreachable = (broken < 0) | (broken >= torch.arange(tree_size).view(1, -1))
    repaired = torch.where(unreachable, torch.arange(tree_size, dtype=torch.int32).view(1, -1), broken)
    repaired[:, 0] = -1

    def call(tree_parents, counts):
        return run_tree_verify(ids.to(device), tree_parents.to(device), target.to(device),
                               None if draft is None else draft.to(device), num_nodes=counts.to(device),
                               temperature=temperature.to(device), draft_sampling=draft_mode or "with_replacement",
                               seed=0, offset=0, backend=backend)

    result = call(broken, num_nodes)
    check_structure(result, ids, repaired, clamped, vocab_size)
    assert_same(result, call(repaired, clamped))


def test_validate_tree_accepts_a_valid_tree():
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 9]], dtype=torch.int32)
    ids = torch.tensor([[-1, 3, 4, 0], [7, 1, 2, -1]])  # the root's id and padding are not checked
    reference.validate_tree(parents, torch.tensor([4, 3], dtype=torch.int32), ids, 5)
    reference.validate_tree(parents[:1], None, ids[:1], 5)


@pytest.mark.parametrize(
    "parents, num_nodes, ids, pattern",
    [
        ([[-1, 0], [-1, 0]], [2, 0], [[0, 1], [0, 1]], r"`num_nodes`.*request 1 has 0"),
        ([[-1, 0], [-1, 0]], [3, 2], [[0, 1], [0, 1]], r"`num_nodes`.*request 0 has 3"),
        ([[-1, 0], [0, 0]], None, [[0, 1], [0, 1]], r"`parents`.*request 1 node 0"),
        ([[-1, 0, 2], [-1, 0, 0]], None, [[0, 1, 1], [0, 1, 1]], r"`parents`.*request 0 node 2 has parent 2"),
        ([[-1, 0, 0], [-1, 0, -1]], None, [[0, 1, 1], [0, 1, 1]], r"`parents`.*request 1 node 2 has parent -1"),
        ([[-1, 0, 0], [-1, 0, 1]], None, [[0, 1, 1], [0, 1, 5]], r"`tree_token_ids`.*request 1 node 2 has 5"),
        ([[-1, 0, 0], [-1, 0, 1]], None, [[0, -1, 1], [0, 1, 1]], r"`tree_token_ids`.*request 0 node 1 has -1"),
    ],
)
def test_validate_tree_names_the_argument_and_the_node(parents, num_nodes, ids, pattern):
    parents = torch.tensor(parents, dtype=torch.int32)
    num_nodes = None if num_nodes is None else torch.tensor(num_nodes, dtype=torch.int32)
    with pytest.raises(ValueError, match=pattern):
        reference.validate_tree(parents, num_nodes, torch.tensor(ids), 5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_true_raises_on_a_malformed_tree(backend, device):
    parents = torch.tensor([[-1, 0, 0], [-1, 0, 2]], dtype=torch.int32)
    ids = torch.tensor([[0, 1, 2], [0, 1, 2]])
    target = torch.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match=r"`parents`.*request 1 node 2"):
        run_tree_verify(ids.to(device), parents.to(device), target.to(device), validate=True, backend=backend)
    parents[1, 2] = 1
    run_tree_verify(ids.to(device), parents.to(device), target.to(device), validate=True, backend=backend)


def test_unknown_draft_sampling_is_rejected():
    parents = torch.tensor([[-1, 0]], dtype=torch.int32)
    target = torch.full((1, 2, 3), 1 / 3)
    with pytest.raises(ValueError, match="draft_sampling"):
        run_tree_verify(torch.tensor([[0, 1]]), parents, target, target, draft_sampling="replacement",
                        backend="reference")
