"""Contract v1.3's value semantics on every op and backend (``/work/shared/design/API.md``, docs/algorithms.md).

Each rule is checked on ``chain_verify``, ``chain_verify_packed`` and
``tree_verify`` alike, on the reference, Triton (under the interpreter
without a GPU) and the CUDA kernels (their block programs on the host when
there is no GPU: the public op with its backend resolved to ``"cuda"``).
Every kernel must equal the reference bit for bit (probabilities), and the
reference must follow the rule itself (stated here independently: greedy
markers give the ``T = 0`` outputs, and so on).
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import DEVICE, backend_or_skip
from specdec_kernels import _backend
from specdec_kernels._extension import cuda_extension_available, extension_ops

OPS = ("chain_verify", "chain_verify_packed", "tree_verify")
TREE_PARENTS = (-1, 0, 0, 1, 1, 2)


@pytest.fixture(params=["reference", "triton", "cuda"])
def backend(request, monkeypatch):
    """A backend name for the public ops; ``"cuda"`` without a GPU runs the kernels' host programs."""
    name = request.param
    if name == "cuda" and DEVICE != "cuda":
        if not (cuda_extension_available() and set(OPS) <= extension_ops()):
            pytest.skip("the CUDA extension is not built")
        monkeypatch.setattr(_backend, "resolve", lambda op_name, backend, device: "cuda")
    return name


def case(op, *, batch_size=6, vocab_size=40, seed=0, agree=0.5):
    """Inputs of ``op`` as keyword arguments of its public function, probabilities on the test device.

    Chains of 3 drafts (packed: the same requests, every ``n_b = 3``); trees
    of ``TREE_PARENTS``. Drafts are drawn from the draft rows, then a share
    ``agree`` of them is replaced by the target's argmax, so greedy requests
    accept some.
    """
    generator = torch.Generator().manual_seed(seed)
    if op == "tree_verify":
        rows, draft_rows = len(TREE_PARENTS), len(TREE_PARENTS)
    else:
        rows, draft_rows = 4, 3
    target = torch.softmax(torch.randn(batch_size, rows, vocab_size, generator=generator) * 2, -1)
    draft = torch.softmax(torch.randn(batch_size, draft_rows, vocab_size, generator=generator) * 2, -1)
    if op == "tree_verify":
        parents = torch.tensor(TREE_PARENTS).expand(batch_size, -1).contiguous()
        ids = torch.multinomial(draft[:, 0], rows, replacement=True, generator=generator)
        argmax = target.argmax(-1).gather(-1, parents.clamp_min(0))  # the argmax of each node's parent row
        inputs = dict(tree_token_ids=ids, parents=parents)
    else:
        ids = torch.multinomial(draft.reshape(-1, vocab_size), 1, generator=generator).view(batch_size, draft_rows)
        argmax = target[:, :draft_rows].argmax(-1)
    agreeing = torch.rand(ids.shape, generator=generator) < agree
    ids = torch.where(agreeing, argmax, ids)
    if op == "tree_verify":
        inputs["tree_token_ids"] = ids
    elif op == "chain_verify":
        inputs = dict(draft_token_ids=ids)
    else:
        inputs = dict(draft_token_ids=ids.reshape(-1),
                      cu_num_draft_tokens=torch.arange(batch_size + 1) * draft_rows,
                      max_num_draft_tokens=draft_rows)
        target, draft = target.reshape(-1, vocab_size), draft.reshape(-1, vocab_size)
    inputs.update(target=target, draft=draft)
    return {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}


def run(op, backend, inputs, **keywords):
    """The op's outputs on the CPU."""
    return tuple(output.cpu() for output in getattr(sk, op)(**inputs, backend=backend, **keywords))


def assert_equal(got, want, what=""):
    for index, (actual, expected) in enumerate(zip(got, want)):
        assert torch.equal(actual, expected), (what, index, actual, expected)


def on_device(values):
    return torch.tensor(values, dtype=torch.float32, device=DEVICE)


# ----------------------------------------------------------------------------- 1. temperature


@pytest.mark.parametrize("op", OPS)
def test_temperature_not_above_zero_is_greedy(op, backend):
    """0, vLLM's -1, any negative and NaN are greedy markers: the outputs of T = 0; T > 0 samples."""
    inputs = case(op)
    markers = on_device([-1.0, float("nan"), -0.25, 0.0, 1.0, -float("inf")])
    zeros_where_greedy = on_device([0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    want = run(op, "reference", inputs, temperature=zeros_where_greedy, seed=3)
    assert_equal(run(op, backend, inputs, temperature=markers, seed=3), want, op)


@pytest.mark.parametrize("op", OPS)
def test_python_nan_temperature_raises(op):
    inputs = case(op)
    with pytest.raises(ValueError, match="`temperature` must not be NaN"):
        getattr(sk, op)(**inputs, temperature=float("nan"), backend="reference")


@pytest.mark.parametrize("op", OPS)
def test_validate_accepts_greedy_markers(op):
    """Under ``validate=True`` negatives and NaN entries are markers, not errors; only +inf is refused."""
    inputs = case(op)
    markers = on_device([-1.0, float("nan"), 0.0, 1.0, 0.5, 2.0])
    getattr(sk, op)(**inputs, temperature=markers, seed=1, validate=True, backend="reference")
    with pytest.raises(ValueError, match=r"`temperature` must not be \+inf"):
        getattr(sk, op)(**inputs, temperature=on_device([float("inf")] + [1.0] * 5), validate=True,
                        backend="reference")


# ----------------------------------------------------------------------------- 2. logits covers the target only


@pytest.mark.parametrize("op", OPS)
def test_logits_cover_the_target_only(op, backend):
    """With ``logits=True`` the draft is still read as probabilities: the outputs with the target as logits
    equal those with its softmax given as probabilities, the same draft rows in both (greedy and sampled
    requests; logits agree with the reference bit for bit on these rows: see the one-hot-like targets)."""
    inputs = case(op, seed=4)
    # A target whose softmax is exact in float32 on every backend: log of powers of two, so that the logits
    # call and the probabilities call see the same target, and any difference is the draft's reading.
    target = inputs["target"]
    exponents = torch.randint(-6, 1, target.shape, generator=torch.Generator().manual_seed(5)).to(target.device)
    powers = torch.pow(2.0, exponents.float())
    probabilities = powers / powers.sum(-1, keepdim=True)
    temperature = on_device([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    want = run(op, "reference", {**inputs, "target": probabilities}, temperature=temperature, seed=7)
    got = run(op, backend, {**inputs, "target": probabilities.log()}, logits=True, temperature=temperature, seed=7)
    assert_equal(got, want, op)


# ----------------------------------------------------------------------------- bonus ids out of range


@pytest.mark.parametrize("op", OPS)
def test_a_bonus_id_outside_the_vocabulary_is_no_bonus(op, backend):
    """An entry outside [0, V) gives that request the outputs of a call without bonus ids (its bonus row,
    or the final node's row, is sampled); an entry inside replaces the token where the request accepted
    everything. Half the requests are greedy and propose the argmax, so they reach the bonus position."""
    inputs = case(op, agree=1.0, seed=11)
    temperature = on_device([0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    vocab_size = inputs["target"].shape[-1]
    bonus = torch.tensor([-1, vocab_size, 5, vocab_size + 3, -7, 2], device=DEVICE)
    valid = (bonus >= 0) & (bonus < vocab_size)
    plain = run(op, "reference", inputs, temperature=temperature, seed=3)
    want = run(op, "reference", inputs, temperature=temperature, seed=3, bonus_token_ids=bonus)
    tokens = 1 if op == "tree_verify" else 0
    accepted = plain[-1]
    for request in range(6):
        if valid[request]:
            continue
        assert torch.equal(want[tokens][request], plain[tokens][request]), request
    reached = [request for request in range(6) if valid[request] and bool(
        want[tokens][request, accepted[request]] == bonus[request])]
    assert reached, "no request with a valid id reached the bonus position: the case tests nothing"
    got = run(op, backend, inputs, temperature=temperature, seed=3, bonus_token_ids=bonus)
    assert_equal(got, want, op)


# ----------------------------------------------------------------------------- 3. deterministic proposals


def chain_proposals(inputs):
    """``(ids [B, K], draft rows [B, K, V])`` of a chain case, padded or packed (every ``n_b = K``)."""
    batch_size, vocab_size = 6, inputs["target"].shape[-1]  # case()'s batch
    return inputs["draft_token_ids"].view(batch_size, -1), inputs["draft"].view(batch_size, -1, vocab_size)


def with_draft_rows(op, inputs, rows):
    """``inputs`` with the chain's draft rows ``[B, K, V]`` replaced (packed: flattened back)."""
    vocab_size = inputs["target"].shape[-1]
    return {**inputs, "draft": rows.reshape(-1, vocab_size) if op == "chain_verify_packed" else rows}


# Each of the Triton chain kernel's plans under the interpreter: (vocabulary, top_k or None). V = 40 is one
# slice a row (probabilities: the wave plan; truncated: the walk); V = 2500 is three slices (truncated: staged).
CHAIN_PLANS = {"wave": (40, None), "walk": (40, 20), "split": (2500, None), "staged": (2500, 1200)}


@pytest.mark.parametrize("op", ("chain_verify", "chain_verify_packed"))
@pytest.mark.parametrize("plan, marker", [("wave", 0.0), ("wave", -0.5), ("wave", float("nan")), ("walk", 0.0),
                                          ("split", 0.0), ("staged", 0.0)])
def test_a_draft_probability_not_above_zero_is_a_deterministic_proposal(op, plan, marker, backend):
    """A proposal whose ``q(t)`` is 0, negative or NaN gives the outputs of a draft row that is the point
    mass on ``t`` at that position (the rest of that row, and the other positions, unchanged): it is
    accepted with probability ``p(t)`` and its rejection samples ``p`` without ``t``."""
    vocab_size, top_k = CHAIN_PLANS[plan]
    inputs = case(op, seed=21, agree=0.0, vocab_size=vocab_size)
    keywords = {} if top_k is None else dict(top_k=torch.full((6,), top_k, device=DEVICE))
    ids, rows = chain_proposals(inputs)
    marked = torch.rand(ids.shape, generator=torch.Generator().manual_seed(22)) < 0.5
    marked = marked.to(ids.device)
    point_mass = torch.nn.functional.one_hot(ids, rows.shape[-1]).float()
    at_token = point_mass.bool() & marked.unsqueeze(-1)
    given = with_draft_rows(op, inputs, torch.where(at_token, marker, rows))
    equivalent = with_draft_rows(op, inputs, torch.where(marked.unsqueeze(-1), point_mass, rows))
    rejected_marked = 0
    for seed in range(4):
        want = run(op, "reference", equivalent, seed=seed, **keywords)
        assert_equal(run(op, backend, given, seed=seed, **keywords), want, (op, seed))
        stop = want[-1].to(ids.device)
        rejected_marked += int((marked.gather(1, stop.clamp_max(ids.shape[1] - 1).view(-1, 1)).view(-1)
                                & (stop < ids.shape[1])).sum())
    assert rejected_marked, "no marked proposal was rejected: the case tests nothing"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("draft_sampling", ("with_replacement", "without_replacement"))
def test_all_zero_draft_rows_verify_as_target_only(op, draft_sampling, backend):
    """SGLang's "target-only" rows: an all-zero draft gives exactly the outputs of ``draft=None``."""
    if op != "tree_verify" and draft_sampling == "without_replacement":
        pytest.skip("draft_sampling is a tree_verify argument")
    inputs = case(op, seed=23)
    keywords = dict(draft_sampling=draft_sampling) if op == "tree_verify" else {}
    for seed in range(3):
        want = run(op, "reference", {**inputs, "draft": None}, seed=seed, **keywords)
        got = run(op, backend, {**inputs, "draft": torch.zeros_like(inputs["draft"])}, seed=seed, **keywords)
        assert_equal(got, want, (op, seed))


# The Triton tree kernel's plans under the interpreter: (batch, vocabulary, top_k or None). Six requests of
# V = 40 are one program's; two of V = 2500 split each request over three programs (replayed rejections).
TREE_PLANS = {"one_program": (6, 40, None), "split": (2, 2500, None), "split_truncated": (2, 2500, 1200)}


@pytest.mark.parametrize("plan", TREE_PLANS)
@pytest.mark.parametrize("draft_sampling", ("with_replacement", "without_replacement"))
def test_tree_candidates_mixing_drawn_and_deterministic_equal_the_reference(plan, draft_sampling, backend):
    """Children whose ``q(t)`` in their parent's row is 0 beside children drawn from it: every kernel
    equals the reference, which keeps ``q`` (it was not drawn from) when such a child is rejected."""
    batch_size, vocab_size, top_k = TREE_PLANS[plan]
    inputs = case("tree_verify", seed=24, agree=0.0, batch_size=batch_size, vocab_size=vocab_size)
    keywords = dict(draft_sampling=draft_sampling)
    if top_k is not None:
        keywords["top_k"] = torch.full((batch_size,), top_k, device=DEVICE)
    ids, parents = inputs["tree_token_ids"], inputs["parents"]
    marked = torch.tensor([False, True, False, False, True, True], device=ids.device).expand_as(ids)
    draft = inputs["draft"].clone()
    rows = torch.arange(ids.shape[0], device=ids.device).view(-1, 1).expand_as(ids)
    draft[rows[marked], parents.clamp_min(0)[marked], ids[marked]] = 0.0
    given = {**inputs, "draft": draft}
    rejected_marked = 0
    for seed in range(4):
        want = run("tree_verify", "reference", given, seed=seed, **keywords)
        assert_equal(run("tree_verify", backend, given, seed=seed, **keywords), want, seed)
        rejected_marked += int(sum(want[0][request, 0] == 0 and want[-1][request] == 0 for request in range(2)))
    assert rejected_marked, "no request rejected node 1 (marked) at the root: the case tests nothing"


def test_a_deterministic_proposal_keeps_the_law():
    """Law (reference): the first emitted token is distributed as target row 0 when the proposal there has
    ``q(t) = 0`` (an n-gram guess beside a draft row), chi-square over 6,000 requests at a fixed seed. The old
    reading (``u * 0 < p``: accept surely) would emit the proposal with probability 1."""
    from markov import SIGNIFICANCE, chi_square_pvalue

    generator = torch.Generator().manual_seed(25)
    batch_size, vocab_size = 6000, 6
    target = torch.softmax(torch.randn(2, vocab_size, generator=generator), -1)
    draft = torch.softmax(torch.randn(1, vocab_size, generator=generator), -1)
    draft[0, 2] = 0.0
    output, _ = sk.chain_verify(torch.full((batch_size, 1), 2), target.expand(batch_size, -1, -1),
                                draft.expand(batch_size, -1, -1), seed=26, backend="reference")
    tokens, counts = output[:, 0].unique(return_counts=True)
    observed = {(int(token),): int(count) for token, count in zip(tokens, counts)}
    expected = {(token,): float(target[0, token]) for token in range(vocab_size)}
    assert chi_square_pvalue(observed, expected, batch_size) > SIGNIFICANCE
