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
