"""``validate=True`` rejects values the kernels would only give a documented fallback for."""

import pytest
import torch

import specdec_kernels as sk


def chain_inputs(logits=False):
    target = torch.softmax(torch.randn(2, 3, 20), -1)
    draft = torch.softmax(torch.randn(2, 2, 20), -1)
    if logits:
        target = target.log()  # `logits` covers the target only (v1.3)
    return torch.zeros(2, 2, dtype=torch.int64), target, draft


@pytest.mark.parametrize("bad, message", [
    (float("nan"), "probabilities must be finite and >= 0"),
    (float("inf"), "probabilities must be finite and >= 0"),
    (-0.1, "probabilities must be finite and >= 0"),
])
@pytest.mark.parametrize("argument", ["target", "draft"])
def test_chain_rejects_bad_probabilities(bad, message, argument):
    ids, target, draft = chain_inputs()
    {"target": target, "draft": draft}[argument][1, 1, 5] = bad
    with pytest.raises(ValueError, match=f"`{argument}`: {message}; element \\[1, 1, 5\\]"):
        sk.chain_verify(ids, target, draft, validate=True, backend="reference")
    sk.chain_verify(ids, target, draft, backend="reference")  # without validate: a defined outcome


@pytest.mark.parametrize("bad, allowed", [(float("nan"), False), (float("inf"), False), (-float("inf"), True)])
def test_chain_logits_may_hold_minus_inf_only(bad, allowed):
    ids, target, draft = chain_inputs(logits=True)
    target[0, 2, 3] = bad
    call = lambda: sk.chain_verify(ids, target, draft, logits=True, validate=True, backend="reference")  # noqa: E731
    if allowed:
        call()
    else:
        with pytest.raises(ValueError, match="logits must not be NaN or \\+inf"):
            call()


def test_temperatures_must_not_be_infinite():
    """NaN and negative entries are greedy markers (contract v1.3, tests/test_contract_v13.py); +inf is refused."""
    ids, target, draft = chain_inputs(logits=True)
    with pytest.raises(ValueError, match=r"`temperature` must not be \+inf"):
        sk.chain_verify(ids, target, draft, logits=True, temperature=torch.tensor([1.0, float("inf")]),
                        validate=True, backend="reference")


def test_tree_rejects_bad_probabilities():
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32)
    ids = torch.tensor([[0, 1, 2]])
    target = torch.softmax(torch.randn(1, 3, 10), -1)
    target[0, 0, 4] = float("nan")
    with pytest.raises(ValueError, match="`target`: probabilities must be finite"):
        sk.tree_verify(ids, parents, target, validate=True, backend="reference")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_counts_may_be_int64_and_temperature_a_python_float(backend):
    """The contract's other accepted forms give the same tokens as int32 counts and a float32 tensor."""
    from conftest import backend_or_skip

    backend = backend_or_skip("chain_verify", backend)
    generator = torch.Generator().manual_seed(3)
    target = torch.randn(4, 4, 50, generator=generator)
    draft = torch.randn(4, 3, 50, generator=generator)
    ids = torch.randint(0, 50, (4, 3), generator=generator)
    counts = torch.tensor([3, 0, 2, 2**40])  # int64, one far past K (clamped to K either way)
    expected = sk.chain_verify(ids, target, draft, logits=True, num_draft_tokens=counts.clamp_max(3).int(),
                               temperature=torch.full((4,), 0.7), seed=5, backend=backend)
    actual = sk.chain_verify(ids, target, draft, logits=True, num_draft_tokens=counts, temperature=0.7, seed=5,
                             backend=backend)
    assert all(torch.equal(e, a) for e, a in zip(expected, actual))


def test_tree_counts_may_be_int64_and_temperature_a_python_float():
    parents = torch.tensor([[-1, 0, 0, 1]] * 2, dtype=torch.int32)
    ids = torch.tensor([[0, 1, 2, 3]] * 2)
    target = torch.softmax(torch.randn(2, 4, 10, generator=torch.Generator().manual_seed(4)), -1)
    expected = sk.tree_verify(ids, parents, target, num_nodes=torch.tensor([4, 2], dtype=torch.int32),
                              temperature=torch.zeros(2), seed=1, backend="reference")
    actual = sk.tree_verify(ids, parents, target, num_nodes=torch.tensor([4, 2]), temperature=0.0, seed=1,
                            backend="reference")
    assert all(torch.equal(e, a) for e, a in zip(expected, actual))


# ----------------------------------------------------------------------------- contract v1.3's value rules


@pytest.mark.parametrize("scale, dtype, refused", [
    (1.002, torch.float32, True), (1.0009, torch.float32, False), (7.0, torch.float32, True),
    (1.003, torch.bfloat16, False), (1.05, torch.bfloat16, True),  # bfloat16 rounds a row to within 4 ulps of 1
])
@pytest.mark.parametrize("argument", ["target", "draft"])
def test_probability_rows_must_sum_to_one(scale, dtype, refused, argument):
    ids, target, draft = chain_inputs()
    rows = {"target": target, "draft": draft}
    rows[argument][1, 1] *= scale
    target, draft = (rows[name].to(dtype) for name in ("target", "draft"))
    call = lambda: sk.chain_verify(ids, target, draft, validate=True, backend="reference")  # noqa: E731
    if refused:
        with pytest.raises(ValueError, match=f"`{argument}`: probability rows must sum to 1 within .*; row \\[1, 1\\]"):
            call()
    else:
        call()


def test_an_all_zero_draft_row_is_allowed():
    """An all-zero draft row marks a deterministic proposal (v1.3), not a malformed distribution."""
    ids, target, draft = chain_inputs()
    draft[0, 1] = 0.0
    sk.chain_verify(ids, target, draft, validate=True, backend="reference")


@pytest.mark.parametrize("op", ["chain_verify", "tree_verify"])
@pytest.mark.parametrize("arguments, message", [
    (dict(top_k=-1), r"`top_k` must be >= 0 \(0 = off\); got -1"),
    (dict(top_p=0.0), r"`top_p` must be in \(0, 1\] \(1 = off\); got 0.0"),
    (dict(top_p=1.5), r"`top_p` must be in \(0, 1\] \(1 = off\); got 1.5"),
    (dict(top_p=float("nan")), r"`top_p` must be in \(0, 1\] \(1 = off\); got nan"),
    (dict(min_p=-0.1), r"`min_p` must be in \[0, 1\] \(0 = off\); got -0.1"),
    (dict(min_p=2.0), r"`min_p` must be in \[0, 1\] \(0 = off\); got 2.0"),
])
def test_python_numbers_out_of_range_raise_at_once(op, arguments, message):
    """Without validate=True: a number out of range is the caller's mistake, for the whole batch."""
    if op == "chain_verify":
        ids, target, draft = chain_inputs()
        call = lambda: sk.chain_verify(ids, target, draft, backend="reference", **arguments)  # noqa: E731
    else:
        parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32)
        target = torch.softmax(torch.randn(1, 3, 10), -1)
        call = lambda: sk.tree_verify(torch.tensor([[0, 1, 2]]), parents, target, backend="reference",  # noqa: E731
                                      **arguments)
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name, values", [
    ("top_k", [-5, 0, 20]), ("top_p", [0.0, 1.5, float("nan")]), ("min_p", [-0.1, 2.0, float("nan")]),
])
def test_tensor_entries_out_of_range_are_off(backend, name, values):
    """Each entry out of range turns the parameter off for its request: the tokens of a call without it."""
    torch.manual_seed(0)
    target = torch.softmax(torch.randn(3, 3, 20) * 2, -1)
    draft = torch.softmax(torch.randn(3, 2, 20) * 2, -1)
    ids = torch.multinomial(draft.view(-1, 20), 1).view(3, 2)
    dtype = torch.int64 if name == "top_k" else torch.float32
    parameter = {name: torch.tensor(values, dtype=dtype)}
    for seed in range(4):
        want = sk.chain_verify(ids, target, draft, seed=seed, backend="reference")
        got = sk.chain_verify(ids, target, draft, seed=seed, backend=backend, **parameter)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
