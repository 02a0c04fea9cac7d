"""Blind acceptance tests for the v1.3 rules of the three verifiers.

Written from the contract (``/work/shared/design/API.md``, the v1.3 parts) and
the public reference (``docs/api.md``) only, without reading the
implementation or the package's own v1.3 tests. Every op runs on the
reference and on Triton (under ``TRITON_INTERPRET=1`` on CPU); with
probability inputs, every Triton call is also checked bit for bit against the
reference under the same seed (the contract: "Same inputs and same
seed/offset give the same outputs on every backend, bit for bit when the
distributions are given as probabilities").

Cases are tiny (B <= 6, V <= 16) so that the interpreter keeps the file fast.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import specdec_kernels as sk
from conftest import DEVICE, backend_or_skip
from markov import SIGNIFICANCE, MarkovModel, append_emitted, joint_pvalue

BACKENDS = ("reference", "triton")
OPS = ("chain", "packed", "tree")
NAN = float("nan")
V = 16


def seeds_for(backend):
    """More seeds on the cheap reference, fewer under the (slow) interpreter."""
    return (11, 12, 13) if backend == "reference" else (11,)


def random_rows(generator, *shape, spread=2.0):
    return torch.softmax(torch.randn(*shape, generator=generator) * spread, -1)


def one_hot(tokens, vocab_size=V):
    return torch.nn.functional.one_hot(tokens.long(), vocab_size).float()


def assert_same(actual, expected, what=""):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == torch.int32, what
        assert torch.equal(a.cpu(), e.cpu()), f"{what}\nactual:   {a.tolist()}\nexpected: {e.tolist()}"


def _is_logits(kwargs):
    return bool(kwargs.get("logits", False))


def run_op(fn, args, kwargs, backend):
    """``fn(*args, **kwargs, backend=backend)``; a Triton call with probabilities must equal the reference."""
    backend_or_skip(fn.__name__, backend)
    out = fn(*args, **kwargs, backend=backend)
    if backend != "reference" and not _is_logits(kwargs):
        ref = fn(*args, **kwargs, backend="reference")
        assert_same(out, ref, f"{fn.__name__}: {backend} differs from the reference bit for bit")
    return out


def to_device(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


# --------------------------------------------------------------------------------------------------------------
# Cases: one object per op, called with a backend and keyword overrides. Chain and packed cases are described in
# the padded layout (target [B, K+1, V], draft [B, K, V]); the packed case packs them on each call ([T+B, V]
# target, or the bonus-free [T, V] target with bonus_free=True).
# --------------------------------------------------------------------------------------------------------------
_KEEP = object()


class ChainCase:
    kind = "chain"

    def __init__(self, ids, target, draft, num_draft_tokens):
        self.ids, self.target, self.draft, self.n = ids, target, draft, num_draft_tokens
        self.B, self.K = ids.shape

    def __call__(self, backend, *, target=_KEEP, draft=_KEEP, **kwargs):
        target = self.target if target is _KEEP else target
        draft = self.draft if draft is _KEEP else draft
        kwargs = {k: to_device(v) for k, v in kwargs.items()}
        args = (to_device(self.ids), to_device(target), to_device(draft))
        return run_op(sk.chain_verify, args, dict(num_draft_tokens=to_device(self.n), **kwargs), backend)

    def greedy_expected(self, target=None):
        """Greedy rule by hand: accept while the draft equals the raw row's argmax, then emit the argmax."""
        target = self.target if target is None else target
        out = torch.full((self.B, self.K + 1), -1, dtype=torch.int32)
        acc = torch.zeros(self.B, dtype=torch.int32)
        for b in range(self.B):
            a = 0
            while a < int(self.n[b]) and int(self.ids[b, a]) == int(target[b, a].argmax()):
                out[b, a] = self.ids[b, a]
                a += 1
            out[b, a] = int(target[b, a].argmax())
            acc[b] = a
        return out, acc


def pack(ids, target, draft, n, bonus_free=False):
    B = ids.shape[0]
    cu = torch.zeros(B + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(n.long(), 0)
    flat_ids = torch.cat([ids[b, :int(n[b])] for b in range(B)])
    extra = 0 if bonus_free else 1
    flat_target = torch.cat([target[b, :int(n[b]) + extra] for b in range(B)])
    flat_draft = None if draft is None else torch.cat([draft[b, :int(n[b])] for b in range(B)])
    return flat_ids, cu, flat_target, flat_draft


class PackedCase(ChainCase):
    kind = "packed"

    def __call__(self, backend, *, target=_KEEP, draft=_KEEP, bonus_free=False, **kwargs):
        target = self.target if target is _KEEP else target
        draft = self.draft if draft is _KEEP else draft
        ids, cu, flat_target, flat_draft = pack(self.ids, target, draft, self.n, bonus_free)
        kwargs = {k: to_device(v) for k, v in kwargs.items()}
        args = (to_device(ids), to_device(cu), to_device(flat_target), to_device(flat_draft))
        return run_op(sk.chain_verify_packed, args, dict(max_num_draft_tokens=self.K, **kwargs), backend)


class TreeCase:
    kind = "tree"

    def __init__(self, ids, parents, target, draft, num_nodes):
        self.ids, self.parents, self.target, self.draft, self.n = ids, parents, target, draft, num_nodes
        self.B, self.N = ids.shape

    def __call__(self, backend, *, target=_KEEP, draft=_KEEP, **kwargs):
        target = self.target if target is _KEEP else target
        draft = self.draft if draft is _KEEP else draft
        kwargs = {k: to_device(v) for k, v in kwargs.items()}
        args = (to_device(self.ids), to_device(self.parents), to_device(target), to_device(draft))
        return run_op(sk.tree_verify, args, dict(num_nodes=to_device(self.n), **kwargs), backend)

    def greedy_expected(self, target=None):
        """Follow the first child (in index order) whose token is the current raw row's argmax; emit the argmax."""
        target = self.target if target is None else target
        nodes = torch.full((self.B, self.N), -1, dtype=torch.int32)
        out = torch.full((self.B, self.N), -1, dtype=torch.int32)
        acc = torch.zeros(self.B, dtype=torch.int32)
        for b in range(self.B):
            u, depth = 0, 0
            nodes[b, 0] = 0
            while True:
                best = int(target[b, u].argmax())
                child = next((c for c in range(1, int(self.n[b]))
                              if int(self.parents[b, c]) == u and int(self.ids[b, c]) == best), None)
                out[b, depth] = best
                if child is None:
                    break
                depth += 1
                nodes[b, depth] = child
                u = child
            acc[b] = depth
        return nodes, out, acc


def chain_case(kind, seed=0, B=5):
    """Random chain drafts; the first ``m_b`` drafts of request ``b`` are the target's argmax (so greedy requests
    accept some), the others are drawn from the draft rows."""
    g = torch.Generator().manual_seed(seed)
    K = 3
    n = torch.tensor([3, 2, 3, 1, 0, 3][:B], dtype=torch.int64)
    matching = [1, 2, 3, 0, 0, 2][:B]
    target = random_rows(g, B, K + 1, V)
    draft = random_rows(g, B, K, V, spread=1.0)
    ids = torch.multinomial(draft.reshape(-1, V), 1, generator=g).view(B, K)
    for b in range(B):
        for i in range(K):
            best = int(target[b, i].argmax())
            if i < matching[b]:
                ids[b, i] = best
            elif ids[b, i] == best:
                ids[b, i] = (best + 1) % V
    return (ChainCase if kind == "chain" else PackedCase)(ids, target, draft, n)


def tree_case(seed=0, B=5):
    """Random trees of up to 6 nodes; some children carry the argmax of their parent's row (not always the first
    child), so greedy walks go deep and the sibling order matters."""
    g = torch.Generator().manual_seed(seed)
    N = 6
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 1, 3],
                            [-1, 0, 0, 1, 2, 2], [-1, 0, 1, 1, 0, 4], [-1, 0, 0, 1, 1, 2]][:B])
    num_nodes = torch.tensor([6, 6, 5, 6, 4, 6][:B])
    target = random_rows(g, B, N, V)
    draft = random_rows(g, B, N, V, spread=1.0)
    ids = torch.zeros(B, N, dtype=torch.int64)
    ids[:, 0] = 3
    for b in range(B):
        for c in range(1, N):
            ids[b, c] = torch.multinomial(draft[b, parents[b, c]], 1, generator=g)
        for c in range(1, N):  # make one child of every second node the argmax of its parent's row
            p = int(parents[b, c])
            siblings = [s for s in range(1, N) if int(parents[b, s]) == p]
            if c == siblings[-1] and (p + b) % 2 == 0:
                ids[b, c] = int(target[b, p].argmax())
            elif ids[b, c] == int(target[b, p].argmax()) and c != siblings[-1]:
                ids[b, c] = (ids[b, c] + 1) % V
    return TreeCase(ids, parents, target, draft, num_nodes)


def make_case(kind, seed=0, B=5):
    return tree_case(seed, B) if kind == "tree" else chain_case(kind, seed, B)


# --------------------------------------------------------------------------------------------------------------
# 1. Temperature: entries not > 0 are greedy; None is T = 1; a Python NaN raises.
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", OPS)
def test_temperature_markers_are_greedy(kind, backend):
    """``T_b`` of 0, -1, NaN (and -inf, docs/api.md) makes request ``b`` greedy; a positive entry samples."""
    case = make_case(kind, seed=1)
    temperature = torch.tensor([0.0, -1.0, NAN, -math.inf, 1.0])
    expected = case.greedy_expected()
    for seed in seeds_for(backend):
        # A NaN tensor entry is a greedy marker, not an error, also under validate=True (docs/api.md value rules).
        out = case(backend, temperature=temperature, seed=seed, validate=True)
        for b in range(4):
            assert_same([o[b] for o in out], [e[b] for e in expected], f"greedy request {b}, seed {seed}")
        # The sampling request (b = 4) is untouched by its greedy neighbours: same as with every request at T = 1.
        sampled = case(backend, temperature=None, seed=seed)
        assert_same([o[4] for o in out], [s[4] for s in sampled], "sampling request beside greedy markers")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("marker", [0.0, -1.0])
def test_python_temperature_marker_makes_batch_greedy(kind, backend, marker):
    case = make_case(kind, seed=2)
    assert_same(case(backend, temperature=marker, seed=5), case.greedy_expected(), f"temperature={marker}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", OPS)
def test_python_nan_temperature_raises(kind, backend):
    case = make_case(kind, seed=3)
    with pytest.raises(ValueError):
        case(backend, temperature=NAN, seed=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", OPS)
def test_none_temperature_samples_at_one(kind, backend):
    """``None`` means T = 1 for all: with logits it equals T = 1 given as a Python float and as a tensor; with
    probabilities the positive temperature only marks 'not greedy', so any positive values give None's tokens."""
    case = make_case(kind, seed=4)
    logit_target = torch.log(case.target) * 1.5 + 0.25
    for seed in seeds_for(backend)[:2]:
        none = case(backend, target=logit_target, logits=True, temperature=None, seed=seed)
        assert_same(case(backend, target=logit_target, logits=True, temperature=1.0, seed=seed), none,
                    "logits: None vs 1.0")
        assert_same(case(backend, target=logit_target, logits=True, temperature=torch.ones(case.B), seed=seed),
                    none, "logits: None vs ones")
        probs_none = case(backend, temperature=None, seed=seed)
        assert_same(case(backend, temperature=torch.tensor([0.5, 2.0, 1.0, 3.0, 0.1]), seed=seed), probs_none,
                    "probabilities: positive temperatures are used as given")
    # None is not greedy: over a few seeds the sampled tokens differ from the greedy ones somewhere.
    greedy = case.greedy_expected()
    outs = [case("reference", temperature=None, seed=s) for s in range(6)]
    assert any(not torch.equal(o[-2], greedy[-2]) for o in outs), "temperature=None behaved greedily"


# --------------------------------------------------------------------------------------------------------------
# 2. logits=True covers the target only; the draft is always probabilities.
# --------------------------------------------------------------------------------------------------------------
def _low_probability_case(kind, seed):
    """Drafts on the target's least probable token (p << 1/V), with the draft row equal to the target's
    processed row. Read as probabilities, q(t) = p(t) and every draft is accepted; if the draft rows were run
    through softmax, q(t) would be close to 1/V and the drafts would almost surely be rejected."""
    case = make_case(kind, seed=seed, B=4)
    g = torch.Generator().manual_seed(seed + 100)
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0])
    shape = case.target.shape
    logit_target = torch.randn(*shape, generator=g) * 3.0
    processed = torch.softmax(logit_target / temperature.view(-1, 1, 1), -1)
    if kind == "tree":
        draft = processed.clone()
        for b in range(case.B):
            for c in range(1, case.N):
                case.ids[b, c] = int(processed[b, case.parents[b, c]].argmin())
    else:
        draft = processed[:, :-1].clone()
        case.ids = processed[:, :-1].argmin(-1)
    return case, logit_target, processed, draft, temperature


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", OPS)
def test_logits_flag_covers_target_only(kind, backend):
    case, logit_target, processed, draft, temperature = _low_probability_case(kind, seed=7)
    for seed in seeds_for(backend)[:2]:
        out = case(backend, target=logit_target, draft=draft, logits=True, temperature=temperature, seed=seed)
        if kind == "tree":
            # q = p at every node: the first child of every visited node is accepted (without replacement).
            nodes, acc = out[0], out[2]
            for b in range(case.B):
                u, path = 0, [0]
                while True:
                    children = [c for c in range(1, int(case.n[b])) if int(case.parents[b, c]) == u]
                    if not children:
                        break
                    u = children[0]
                    path.append(u)
                assert nodes[b, :len(path)].tolist() == path, f"request {b}: draft read as logits?"
                assert int(acc[b]) == len(path) - 1
        else:
            assert torch.equal(out[1].cpu().long(), case.n), "drafts with q(t) = p(t) were rejected: draft softmaxed?"
        # The same call with the processed target given as probabilities gives the same tokens (the backends'
        # softmax may differ in the last bits; a flipped decision has probability ~1e-7 here).
        probs = case(backend, target=processed, draft=draft, temperature=temperature, seed=seed)
        assert_same(out, probs, "logits=True vs softmax(x / T) as probabilities")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ("chain", "tree"))
def test_logits_greedy_uses_raw_argmax(kind, backend):
    """Greedy with logits: argmax of the raw target logits row; the draft is irrelevant."""
    case = make_case(kind, seed=8)
    logit_target = torch.log(case.target) * 2.0 - 1.0
    out = case(backend, target=logit_target, logits=True, temperature=torch.zeros(case.B), seed=3)
    assert_same(out, case.greedy_expected(logit_target), "greedy with logits")


# --------------------------------------------------------------------------------------------------------------
# 3. A draft token of draft probability 0, negative or NaN is a deterministic proposal.
# --------------------------------------------------------------------------------------------------------------
def _mixed_chain_case(kind, seed=9):
    """Drafts with target probability about one half, so acceptance is a real coin flip."""
    case = make_case(kind, seed=seed, B=4)
    case.n = torch.tensor([3, 3, 2, 3])
    g = torch.Generator().manual_seed(seed + 1)
    case.ids = torch.randint(0, V, (4, 3), generator=g)
    mixed = 0.5 * case.target[:, :3] + 0.5 * one_hot(case.ids)
    case.target = torch.cat([mixed, case.target[:, 3:]], 1)
    return case


BAD_POSITIONS = [(0, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ("chain", "packed"))
@pytest.mark.parametrize("bad", [0.0, -0.5, NAN])
def test_nonpositive_draft_probability_is_deterministic_chain(kind, backend, bad):
    case = _mixed_chain_case(kind)
    with_bad, with_one_hot = case.draft.clone(), case.draft.clone()
    for b, i in BAD_POSITIONS:
        t = int(case.ids[b, i])
        with_bad[b, i, t] = bad
        with_one_hot[b, i] = one_hot(torch.tensor(t))
    for seed in seeds_for(backend):
        assert_same(case(backend, draft=with_bad, seed=seed), case(backend, draft=with_one_hot, seed=seed),
                    f"q(t) = {bad} vs a one-hot draft row, seed {seed}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [0.0, -0.5, NAN])
def test_nonpositive_draft_probability_is_deterministic_tree(backend, bad):
    """In a path-shaped tree every node has one child, so a one-hot parent row is the deterministic proposal."""
    g = torch.Generator().manual_seed(21)
    B, N = 4, 5
    parents = torch.tensor([[-1, 0, 1, 2, 3]] * B)
    ids = torch.randint(0, V, (B, N), generator=g)
    target = 0.5 * random_rows(g, B, N, V) + 0.5 * one_hot(torch.cat([ids[:, 1:], ids[:, :1]], 1))
    draft = random_rows(g, B, N, V, spread=1.0)
    case = TreeCase(ids, parents, target, draft, torch.full((B,), N))
    with_bad, with_one_hot = draft.clone(), draft.clone()
    for b, c in [(0, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2), (3, 3), (3, 4)]:
        t, p = int(ids[b, c]), c - 1
        with_bad[b, p, t] = bad
        with_one_hot[b, p] = one_hot(torch.tensor(t))
    for mode in ("without_replacement", "with_replacement"):
        for seed in seeds_for(backend)[:2]:
            assert_same(case(backend, draft=with_bad, draft_sampling=mode, seed=seed),
                        case(backend, draft=with_one_hot, draft_sampling=mode, seed=seed),
                        f"tree q(t) = {bad} vs one-hot row, {mode}, seed {seed}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", OPS)
def test_all_zero_draft_rows_equal_no_draft(kind, backend):
    case = _mixed_chain_case(kind) if kind != "tree" else tree_case(seed=10)
    zeros = torch.zeros_like(case.draft)
    modes = ("without_replacement", "with_replacement") if kind == "tree" else (None,)
    for mode in modes:
        extra = {} if mode is None else {"draft_sampling": mode}
        for seed in seeds_for(backend):
            assert_same(case(backend, draft=zeros, seed=seed, **extra), case(backend, draft=None, seed=seed, **extra),
                        f"all-zero draft rows vs draft=None ({mode}), seed {seed}")


# --------------------------------------------------------------------------------------------------------------
# 4. Value rules.
# --------------------------------------------------------------------------------------------------------------
PYTHON_BAD = [("top_k", -1), ("top_k", -7), ("top_p", 0.0), ("top_p", -0.25), ("top_p", 1.5), ("top_p", NAN),
              ("min_p", -0.1), ("min_p", 1.5), ("min_p", NAN), ("temperature", NAN)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", OPS)
def test_python_out_of_range_values_raise(kind, backend):
    # NaN for top_p / min_p as a Python number: the contract says "outside (0, 1]" / "outside [0, 1]"; NaN is in
    # neither interval, so the natural reading is that it raises too (docs/api.md says so for tensor entries).
    case = make_case(kind, seed=12)
    for name, value in PYTHON_BAD:
        with pytest.raises(ValueError):
            case(backend, seed=1, **{name: value})
    # The boundaries are valid.
    for name, value in [("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("min_p", 1.0), ("top_p", 0.5)]:
        case("reference", seed=1, **{name: value})


TENSOR_OFF = {
    # name: (tensor with out-of-range entries at requests 0, 2, 3, 4; the same with those entries off)
    "top_k": (torch.tensor([-3, 3, V, V + 7, -1]), torch.tensor([0, 3, 0, 0, 0])),
    "top_p": (torch.tensor([0.0, 0.5, NAN, 1.5, -0.25]), torch.tensor([1.0, 0.5, 1.0, 1.0, 1.0])),
    "min_p": (torch.tensor([-0.1, 0.3, NAN, 1.5, math.inf]), torch.tensor([0.0, 0.3, 0.0, 0.0, 0.0])),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("name", list(TENSOR_OFF))
def test_tensor_out_of_range_entries_are_off(kind, backend, name):
    # Case seed 23: checked (while writing the test) to make the off rows differ from a "clamped" reading of
    # the bad entries (top_p <= 0 keeping only the largest, min_p > 1 acting as 1, top_k < 0 acting as 1).
    case = make_case(kind, seed=23)
    bad, off = TENSOR_OFF[name]
    for seed in seeds_for(backend)[:2]:
        assert_same(case(backend, seed=seed, **{name: bad}), case(backend, seed=seed, **{name: off}),
                    f"{name}={bad.tolist()} vs {off.tolist()}, seed {seed}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ("chain", "tree"))
def test_every_parameter_off_keeps_rows(kind, backend):
    """'A request with every parameter off keeps its rows as given' (docs/api.md): off values, given as Python
    numbers or as tensors with out-of-range entries, give the tokens of a call without the parameter."""
    case = make_case(kind, seed=14)
    base = case(backend, seed=4)
    for kwargs in [dict(top_k=0), dict(top_k=V + 3), dict(top_p=1.0), dict(min_p=0.0),
                   dict(top_k=torch.tensor([-1, 0, V, -5, V + 1]), top_p=torch.tensor([NAN, 1.0, 2.0, 0.0, -1.0]),
                        min_p=torch.tensor([NAN, -1.0, 0.0, 3.0, 0.0]))]:
        assert_same(case(backend, seed=4, **kwargs), base, f"{kwargs} vs no parameter")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", OPS)
def test_validate_raises_on_out_of_range_tensor_entries(kind, backend):
    case = make_case(kind, seed=15)
    B = case.B
    good = dict(top_k=torch.tensor([0, 3, V, V + 7, 1]), top_p=torch.tensor([1.0, 0.5, 0.01, 1.0, 0.9]),
                min_p=torch.tensor([0.0, 0.3, 1.0, 0.0, 0.5]))
    # top_k = 0 (the off value) and top_k >= V are in range: the contract's "out of range" for tensors is the
    # Python rule (top_k < 0); its parenthesis "(entries <= 0 or >= V are off)" only says what is off.
    case("reference", seed=1, validate=True, **good)
    for name, value in [("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("top_p", NAN), ("min_p", -0.1),
                        ("min_p", 1.5), ("min_p", NAN)]:
        t = good[name].clone()
        t[1] = value
        with pytest.raises(ValueError):
            case(backend, seed=1, validate=True, **{name: t})
        case("reference", seed=1, **{name: t})  # without validate the same call runs
        assert t.shape == (B,)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", OPS)
def test_validate_raises_on_unnormalised_probability_rows(kind, backend):
    case = make_case(kind, seed=16)
    backend_or_skip("chain_verify", backend)

    def scaled(rows, factor):
        rows = rows.clone()
        rows[0, 0] *= factor  # row 0 of request 0 is read by every op (request 0 has drafts / children)
        return rows

    for factor in (1.01, 0.99, 1.5):
        with pytest.raises(ValueError):
            case(backend, target=scaled(case.target, factor), seed=1, validate=True)
        with pytest.raises(ValueError):
            case(backend, draft=scaled(case.draft, factor), seed=1, validate=True)
        # logits=True covers the target only: a bad draft row still raises.
        with pytest.raises(ValueError):
            case(backend, target=torch.log(case.target), draft=scaled(case.draft, factor), logits=True, seed=1,
                 validate=True)
    # Within 1e-3 of 1 is fine, and logits rows have no sum to check.
    case("reference", target=scaled(case.target, 1 + 4e-4), draft=scaled(case.draft, 1 - 4e-4), seed=1, validate=True)
    case("reference", target=torch.log(case.target) + 3.0, logits=True, seed=1, validate=True)


def _all_accepting_chain(kind):
    """Every draft has target probability 1 at its position, so every request accepts all its drafts; the bonus
    rows are spread, and request 2's bonus row gives its bonus id probability 0."""
    g = torch.Generator().manual_seed(17)
    B, K = 5, 3
    n = torch.tensor([3, 2, 1, 3, 0])
    ids = torch.randint(0, V, (B, K), generator=g)
    target = random_rows(g, B, K + 1, V, spread=0.5)
    for b in range(B):
        target[b, :int(n[b])] = one_hot(ids[b, :int(n[b])])
    target[2, 1, 7] = 0.0
    target[2, 1] /= target[2, 1].sum()
    return (ChainCase if kind == "chain" else PackedCase)(ids, target, None, n)


BONUS = torch.tensor([-1, V, 7, 5, -5])
BONUS_TEMPERATURE = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ("chain", "packed"))
def test_bonus_id_out_of_range_means_no_bonus_chain(kind, backend):
    case = _all_accepting_chain(kind)
    for seed in seeds_for(backend)[:2]:
        out, acc = case(backend, bonus_token_ids=BONUS, temperature=BONUS_TEMPERATURE, seed=seed)
        sampled, sampled_acc = case(backend, bonus_token_ids=None, temperature=BONUS_TEMPERATURE, seed=seed)
        assert acc.tolist() == case.n.tolist() == sampled_acc.tolist()
        for b in (0, 1, 4):  # ids -1, V, -5: the bonus row is sampled (request 4 is greedy: its argmax)
            assert out[b].tolist() == sampled[b].tolist(), f"request {b} with bonus id {int(BONUS[b])}"
        assert int(sampled[4, 0]) == int(case.target[4, 0].argmax())
        for b in (2, 3):  # a valid id replaces the bonus token (request 3 is greedy); request 2's has p = 0
            n_b = int(case.n[b])
            assert out[b, :n_b].tolist() == case.ids[b, :n_b].tolist()
            assert int(out[b, n_b]) == int(BONUS[b]), f"request {b}: valid bonus id not emitted"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bonus_id_out_of_range_in_bonus_free_layout_gives_minus_one(backend):
    case = _all_accepting_chain("packed")
    out, acc = case(backend, bonus_free=True, bonus_token_ids=BONUS, temperature=BONUS_TEMPERATURE, seed=3)
    assert acc.tolist() == case.n.tolist()
    for b in range(case.B):
        n_b = int(case.n[b])
        expected = case.ids[b, :n_b].tolist() + [int(BONUS[b]) if 0 <= int(BONUS[b]) < V else -1]
        expected += [-1] * (case.K - n_b)
        assert out[b].tolist() == expected, f"request {b} with bonus id {int(BONUS[b])}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bonus_id_out_of_range_means_no_bonus_tree(backend):
    """The walk 0 -> 1 -> 3 is forced (one-hot rows) and ends at leaf 3, whose row is the bonus row."""
    g = torch.Generator().manual_seed(18)
    B, N = 5, 5
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * B)
    ids = torch.randint(0, V, (B, N), generator=g)
    ids[:, 2] = (ids[:, 1] + 1) % V
    target = random_rows(g, B, N, V, spread=0.5)
    target[:, 0] = one_hot(ids[:, 1])
    target[:, 1] = one_hot(ids[:, 3])
    target[2, 3, 7] = 0.0
    target[2, 3] /= target[2, 3].sum()
    case = TreeCase(ids, parents, target, None, torch.full((B,), N))
    out = case(backend, bonus_token_ids=BONUS, temperature=BONUS_TEMPERATURE, seed=4)
    sampled = case(backend, temperature=BONUS_TEMPERATURE, seed=4)
    for b in range(B):
        assert out[0][b].tolist() == [0, 1, 3, -1, -1]
        assert out[1][b, :2].tolist() == [int(ids[b, 1]), int(ids[b, 3])]
        if 0 <= int(BONUS[b]) < V:
            assert int(out[1][b, 2]) == int(BONUS[b]), f"request {b}: valid bonus id not emitted"
        else:
            assert out[1][b].tolist() == sampled[1][b].tolist(), f"request {b} with bonus id {int(BONUS[b])}"
    assert int(sampled[1][4, 2]) == int(target[4, 3].argmax())


# --------------------------------------------------------------------------------------------------------------
# 5. Packed bonus-free layout equals the padded chain_verify with the bonus ids.
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_bonus_free_equals_padded(backend):
    g = torch.Generator().manual_seed(19)
    B, K = 5, 3
    n = torch.tensor([3, 0, 2, 1, 3])
    target = random_rows(g, B, K + 1, V)
    draft = random_rows(g, B, K, V, spread=1.0)
    ids = torch.multinomial(draft.reshape(-1, V), 1, generator=g).view(B, K)
    ids[4] = target[4, :K].argmax(-1)  # a greedy request that accepts all: its bonus id is emitted
    bonus = torch.randint(0, V, (B,), generator=g)
    temperature = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.7, 1.0])
    padded = ChainCase(ids, target, draft, n)
    packed = PackedCase(ids, target, draft, n)
    garbage = target.clone()
    garbage[torch.arange(B), n] = random_rows(g, B, V)  # the bonus rows are never read with valid bonus ids
    # An int seed, and (reference only, to keep the interpreter's share small) one int64 seed per request.
    seeds = [11, torch.tensor([5, 9, 2**40 + 3, 7, 1], dtype=torch.int64)] if backend == "reference" else [11]
    for seed in seeds:
        kwargs = dict(bonus_token_ids=bonus, temperature=temperature, top_p=top_p, seed=seed, offset=2)
        expected = padded(backend, target=garbage, **kwargs)
        assert_same(packed(backend, bonus_free=True, **kwargs), expected, f"bonus-free packed vs padded, seed {seed}")
        assert_same(packed(backend, **kwargs), expected, f"[T+B] packed vs padded, seed {seed}")
        assert int(expected[0][4, 3]) == int(bonus[4]) and int(expected[0][1, 0]) == int(bonus[1])


# --------------------------------------------------------------------------------------------------------------
# 6. kernel_errors.
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_errors_zero_after_normal_calls(backend):
    make_case("chain", seed=20)(backend, seed=1)
    make_case("tree", seed=20)(backend, seed=1)
    for reset in (False, True):
        counts = sk.kernel_errors("cpu", reset=reset)
        assert isinstance(counts, dict) and counts
        assert {"chain_verify.wait_gave_up", "tree_verify.wait_gave_up"} <= set(counts)  # docs/api.md names
        for kind, count in counts.items():
            assert isinstance(kind, str) and type(count) is int, (kind, count)
            assert count == 0, (kind, count)
    assert sk.kernel_errors("cpu") == {k: 0 for k in counts}


# --------------------------------------------------------------------------------------------------------------
# 7. Statistical exactness (reference): zero-draft-probability proposals are verified as deterministic ones.
# --------------------------------------------------------------------------------------------------------------
def test_zero_draft_probability_proposals_are_exact():
    """A drafter that samples from Q, where Q gives token 0 no mass, while the engine sometimes injects token 0 as
    a deterministic proposal (n-gram style) with the drafter's row as ``draft``: q(0) is 0, NaN or negative there,
    so position-wise the proposal is fixed and must be verified as with draft=None. The emitted tokens must then
    follow the target's law exactly (v1.3). The 0.1.0 rule (accept whenever p(0) > 0) over-produces token 0."""
    rng = np.random.default_rng(1234)
    vocab, length, samples, K, start = 4, 3, 4000, 2, 1
    target_model = MarkovModel.random(vocab, rng)
    draft_model = MarkovModel.random(vocab, rng, zero_tokens=(0,))
    gen = torch.Generator().manual_seed(99)
    tokens = torch.full((samples, length), -1, dtype=torch.int64)
    produced = torch.zeros(samples, dtype=torch.int64)
    last = torch.full((samples,), start, dtype=torch.int64)
    step = 0
    while bool((produced < length).any()):
        rows = torch.nonzero(produced < length).view(-1)
        ctx = last[rows]
        drafts, draft_rows, prev = [], [], ctx
        for i in range(K):
            q = draft_model.rows(prev)
            drawn = draft_model.sample(prev, gen)
            inject = torch.rand(rows.shape[0], generator=gen) < 0.4
            t = torch.where(inject, torch.zeros_like(drawn), drawn)
            q = q.clone()
            # Q already gives token 0 no mass; where token 0 is the proposal, its entry may also be NaN or
            # negative (the rule's "not a positive number"). Only the proposed token's entry is degenerate: a
            # negative or NaN entry elsewhere would make the residual of a drawn token undefined.
            q[inject, 0] = (0.0, NAN, -0.5)[(i + step) % 3]
            drafts.append(t)
            draft_rows.append(q)
            prev = t
        ids = torch.stack(drafts, 1)
        target = target_model.rows(torch.stack([ctx, ids[:, 0], ids[:, 1]], 1))
        out, acc = sk.chain_verify(ids, target, torch.stack(draft_rows, 1), seed=5000 + step, backend="reference")
        last[rows] = append_emitted(tokens, produced, rows, out, acc)
        step += 1
    pvalue = joint_pvalue(tokens, target_model, start)
    assert pvalue > SIGNIFICANCE, f"joint law of {length} tokens off the target's: p = {pvalue:.3g}"
