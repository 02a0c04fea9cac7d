"""``logprobs=`` on the verification ops (contract v1.3, "Outputs the engines need"), from the contract alone.

Each emitted token is scored in plain Python, one request and one position
at a time, under the target row it was emitted from: ``"raw"`` is that row
as given (``log_softmax`` of logits, the log of a probability),
``"processed"`` the distribution verification used (``softmax(x / T)``, then
top-k, renormalised; greedy requests report the raw value). ``-inf`` where
the token is ``-1``; NaN for a token emitted from a row the call was not
given (a bonus id in the bonus-free packed layout). The tokens are those of
the call without ``logprobs``. The reference and the Triton kernels have
logprobs so far: the CUDA backend raises, naming itself, and ``"auto"``
passes over it.
"""

from __future__ import annotations

import math

import pytest
import torch

import specdec_kernels as sk

VOCAB = 9


def scored(row, token, kind, logits, temperature, top_k):
    """The contract's value of ``token`` under ``row`` (float64, by hand)."""
    if token < 0:
        return -math.inf
    x = [float(value) for value in row]
    if logits:
        peak = max(x)
        raw = [value - peak - math.log(sum(math.exp(v - peak) for v in x)) for value in x]
    else:
        raw = [math.log(value) if value > 0 else -math.inf for value in x]
    if kind == "raw" or not temperature > 0:
        return raw[token]
    if logits:
        peak = max(x)
        weights = [math.exp((value - peak) / temperature) for value in x]
    else:
        weights = list(x)  # probabilities are used as given
    if 0 < top_k < len(weights):
        threshold = sorted(weights, reverse=True)[top_k - 1]
        weights = [w if w >= threshold else 0.0 for w in weights]
    total = sum(weights)
    return math.log(weights[token] / total) if weights[token] > 0 else -math.inf


def assert_scores(got, expected):
    expected = torch.tensor(expected, dtype=torch.float64)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    same_inf = torch.isinf(expected) == torch.isinf(got.double())
    assert bool(same_inf.all()), (got, expected)
    assert bool((torch.isnan(expected) == torch.isnan(got)).all()), (got, expected)
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got.double()[finite], expected[finite], rtol=1e-5, atol=1e-5)


def chain_case(seed, logits):
    generator = torch.Generator().manual_seed(seed)
    batch_size, max_drafts = 5, 3
    x = torch.randn(batch_size, max_drafts + 1, VOCAB, generator=generator) * 2
    target = x if logits else torch.softmax(x, -1)
    draft = torch.softmax(torch.randn(batch_size, max_drafts, VOCAB, generator=generator), -1)
    ids = torch.multinomial(draft.view(-1, VOCAB), 1, generator=generator).view(batch_size, max_drafts)
    ids[4, 1] = -1  # no proposal there
    return ids, target, draft, torch.tensor([3, 2, 0, 3, 3])


@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("kind", ["raw", "processed"])
def test_chain_scores_each_token_under_its_row(kind, logits):
    ids, target, draft, counts = chain_case(1, logits)
    temperature = torch.tensor([0.7, 0.0, 1.3, 1.0, 2.0])
    top_k = torch.tensor([4, 0, 0, 2, 0])
    keywords = dict(num_draft_tokens=counts, temperature=temperature, logits=logits, seed=5, top_k=top_k,
                    backend="reference")
    tokens, num_accepted = sk.chain_verify(ids, target, draft, **keywords)
    got_tokens, got_accepted, got = sk.chain_verify(ids, target, draft, logprobs=kind, **keywords)
    assert torch.equal(got_tokens, tokens) and torch.equal(got_accepted, num_accepted)
    expected = [[scored(target[b, j], int(tokens[b, j]), kind, logits, float(temperature[b]), int(top_k[b]))
                 for j in range(tokens.shape[1])] for b in range(tokens.shape[0])]
    assert_scores(got, expected)


def packed_scores(target, tokens, counts, cu, bonus_rows, kind, logits, temperatures):
    """The contract's scores of a packed call's tokens: each under its request's row, NaN for a bonus id
    emitted where the layout has no bonus row."""
    expected = []
    for b, count in enumerate(counts):
        row_scores = []
        for j in range(tokens.shape[1]):
            token = int(tokens[b, j])
            if token >= 0 and j == count and not bonus_rows:
                row_scores.append(math.nan)  # the bonus id: its row was not given
            else:
                row = int(cu[b]) + min(j, count) + (b if bonus_rows else 0)
                row_scores.append(scored(target[min(row, target.shape[0] - 1)].cpu(), token, kind, logits,
                                         temperatures[b], 0))
        expected.append(row_scores)
    return expected


@pytest.mark.parametrize("bonus_rows", [True, False])
def test_packed_scores_and_the_bonus_free_layout(bonus_rows):
    """Packed rows scored as the padded call's; in the bonus-free layout a bonus id is emitted from a row that
    was not given: NaN; a bonus id outside [0, V) emits -1 there: -inf."""
    generator = torch.Generator().manual_seed(2)
    counts = [2, 0, 3, 1]
    cu = torch.tensor([0, 2, 2, 5, 6])
    num_tokens = 6
    target_rows = num_tokens + (len(counts) if bonus_rows else 0)
    target = torch.softmax(torch.randn(target_rows, VOCAB, generator=generator) * 30, -1)  # near one-hot rows
    # Drafts the target likes, so some requests accept all of theirs.
    ids = torch.zeros(num_tokens, dtype=torch.int64)
    for b, count in enumerate(counts):
        for j in range(count):
            row = int(cu[b]) + j + (b if bonus_rows else 0)
            ids[int(cu[b]) + j] = int(target[row].argmax())
    bonus = torch.tensor([7, 8, -1, 3])
    keywords = dict(max_num_draft_tokens=3, seed=9, bonus_token_ids=bonus, backend="reference")
    tokens, num_accepted, got = sk.chain_verify_packed(ids, cu, target, None, logprobs="raw", **keywords)
    assert torch.equal(tokens, sk.chain_verify_packed(ids, cu, target, None, **keywords)[0])
    assert_scores(got, packed_scores(target, tokens, counts, cu, bonus_rows, "raw", False, [1.0] * len(counts)))
    # Request 2 accepted all its drafts with no valid bonus id: its bonus row is sampled, or without one: -1.
    assert int(num_accepted[2]) == 3 and (int(tokens[2, 3]) >= 0) == bonus_rows


@pytest.mark.parametrize("kind", ["raw", "processed"])
def test_tree_scores_each_token_under_its_path_nodes_row(kind):
    generator = torch.Generator().manual_seed(3)
    batch_size = 6
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]]).expand(batch_size, 7).contiguous()
    logits_rows = torch.randn(batch_size, 7, VOCAB, generator=generator) * 2
    tokens_in = torch.randint(0, 3, (batch_size, 7), generator=generator)
    temperature = torch.tensor([1.0, 0.5, 0.0, 1.0, 2.0, 1.0])
    top_k = torch.tensor([0, 3, 0, 2, 0, 1])
    keywords = dict(temperature=temperature, logits=True, seed=4, top_k=top_k, backend="reference")
    path, tokens, num_accepted = sk.tree_verify(tokens_in, parents, logits_rows, **keywords)
    *same, got = sk.tree_verify(tokens_in, parents, logits_rows, logprobs=kind, **keywords)
    assert all(torch.equal(a, b) for a, b in zip(same, (path, tokens, num_accepted)))
    expected = [[scored(logits_rows[b, max(int(path[b, j]), 0)], int(tokens[b, j]), kind, True, float(temperature[b]),
                        int(top_k[b])) for j in range(7)] for b in range(batch_size)]
    assert_scores(got, expected)


def test_kernel_backends_say_they_lack_logprobs():
    """The ops have logprobs on the reference and Triton (tests/test_logprobs_triton.py); the CUDA kernels do not
    yet, and say so."""
    from specdec_kernels import _library

    ids, target, draft, counts = chain_case(4, False)
    for op_name in ("chain_verify", "chain_verify_packed", "tree_verify"):
        with pytest.raises(NotImplementedError, match=rf"{op_name}: `logprobs` is not implemented on the 'cuda' "
                                                      r"backend yet; it runs on 'reference', 'triton'"):
            _library.require(f"{op_name}.logprobs", "cuda")
    with pytest.raises(ValueError, match="`logprobs` must be one of 'raw', 'processed'; got 'log'"):
        sk.chain_verify(ids, target, draft, logprobs="log", seed=1)


def test_auto_chooses_a_backend_that_has_logprobs(monkeypatch):
    """On a GPU where CUDA and Triton both run, ``"auto"`` takes CUDA, but for logprobs the backends that have them."""
    from specdec_kernels import _backend, _library

    monkeypatch.setitem(_backend._WHY_UNAVAILABLE, "cuda", lambda op_name, device: None)
    monkeypatch.setitem(_backend._WHY_UNAVAILABLE, "triton", lambda op_name, device: None)
    gpu = torch.device("cuda", 0)
    assert _library.verification_backend("chain_verify", None, "auto", gpu) == "cuda"
    assert _library.verification_backend("chain_verify", "raw", "auto", gpu) == "triton"
    assert _library.verification_backend("tree_verify", "processed", "auto", gpu) == "triton"
    monkeypatch.setitem(_backend._WHY_UNAVAILABLE, "triton", lambda op_name, device: "no Triton")
    assert _library.verification_backend("tree_verify", "processed", "auto", gpu) == "reference"


def test_logprobs_trace_into_one_graph():
    ids, target, draft, counts = chain_case(5, True)
    call = torch.compile(lambda: sk.chain_verify(ids, target, draft, logits=True, seed=3, logprobs="processed",
                                                 backend="reference"), fullgraph=True)
    compiled = call()
    eager = sk.chain_verify(ids, target, draft, logits=True, seed=3, logprobs="processed", backend="reference")
    assert len(compiled) == 3 and all(torch.equal(a, b) for a, b in zip(compiled, eager))


def test_opcheck_of_the_logprobs_overloads():
    """Schema, fake and AOT dispatch of each `.logprobs` overload (torch.library.opcheck), on the reference."""
    from op_inputs import chain_inputs, tree_inputs
    from specdec_kernels import _library

    draft_ids, target, draft = chain_inputs(torch.device("cpu"))
    cu = torch.tensor([0, 3, 6, 9], dtype=torch.int32)
    tokens, parents, tree_target = tree_inputs(torch.device("cpu"))
    temperature = torch.tensor([1.0, 0.0, 0.5])
    top_k = torch.tensor([2, 0, 40], dtype=torch.int32)
    cases = {
        "chain_verify.logprobs": (draft_ids, target.log(), draft, None, temperature, True, None, 5, None, 0, top_k,
                                  None, None, None, "processed"),
        "chain_verify_packed.logprobs": (draft_ids.reshape(-1), cu, target.reshape(-1, target.shape[-1]),
                                         draft.reshape(-1, draft.shape[-1]), 3, None, False, None, 5, None, 0, None,
                                         None, None, None, "raw"),
        "tree_verify.logprobs": (tokens, parents, tree_target, None, None, None, False, "without_replacement", None,
                                 3, None, 1, None, None, None, None, "raw"),
    }
    assert set(cases) == set(_library.OVERLOAD_SCHEMAS)
    for name, args in cases.items():
        torch.library.opcheck(_library.op(name), args, {"backend": "reference"})
