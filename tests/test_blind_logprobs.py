"""Blind acceptance tests of ``logprobs=`` on the verification ops, written from API.md alone.

The contract (API.md, "Outputs the engines need", v1.3): with ``logprobs="raw" | "processed"``,
``chain_verify``, ``chain_verify_packed`` and ``tree_verify`` return one more output,
``output_logprobs`` float32 with the shape of ``output_token_ids``: the natural log of each emitted
token's probability under the target row it was emitted from -- the raw row (``log_softmax`` of the
logits, or the log of the given probability) or the processed one (after temperature and truncation:
the distribution verification used; greedy requests report the raw value). ``-inf`` where the token is
``-1`` (this rule first); NaN where the token was emitted from a row that was not given (a bonus id in
the packed bonus-free layout). The tokens are those of the same call without ``logprobs``.

Every expectation here is computed independently in float64 from the inputs and the op's own tokens
(which row emitted which token is fixed by the layout rules), never from the package's code.
"""

import math

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip

BACKENDS = ("reference", "triton")
MODES = ("raw", "processed")
VOCABS = (11, 2500)  # tiny, and more than 2048 (Triton splits a row over several programs)
NEG_INF = float("-inf")
NAN = float("nan")
# How far a truncation threshold must be from every probability, so that float32 cannot decide it otherwise.
TOP_P_MARGIN = 2e-5  # absolute, on the cumulative mass
MIN_P_MARGIN = 1e-5  # relative to the row's maximum
TOP_K_MARGIN = 1e-6  # relative gap between the k-th largest and the next smaller probability


class Borderline(Exception):
    """A random input sits too close to a truncation threshold: the test draws another one."""


def every_case(test):
    """Parametrize ``test`` over backend x V x logits or probabilities x mode."""
    for mark in (pytest.mark.parametrize("mode", MODES),
                 pytest.mark.parametrize("logits", [True, False], ids=["logits", "probs"]),
                 pytest.mark.parametrize("V", VOCABS), pytest.mark.parametrize("backend", BACKENDS)):
        test = mark(test)
    return test


# ----------------------------------------------------------------------------------------------------
# Independent float64 model of the rows
# ----------------------------------------------------------------------------------------------------

def is_greedy(t):
    return not (t > 0)  # 0, negative markers and NaN are greedy


def raw_logprob_row(row, logits):
    row = row.double()
    return torch.log_softmax(row, dim=-1) if logits else torch.log(row)


def truncate(p, top_k, top_p, min_p):
    """vLLM-order truncation in float64: top_k (ties kept), then top_p (ties kept), then min_p; renormalised.

    The tests never combine ``top_k`` and ``top_p`` on one request, so whether top_p sees the
    renormalised top-k mass or not does not matter. Raises when an input sits too close to a
    threshold for float32 to decide it the same way (a badly chosen test input, not a package fault).
    """
    V = p.numel()
    keep = torch.ones(V, dtype=torch.bool)
    if 0 < top_k < V:
        kth = torch.sort(p, descending=True).values[top_k - 1]
        keep &= p >= kth
        others = p[p < kth]
        if others.numel() and not (kth - others.max()) > TOP_K_MARGIN * kth:
            raise Borderline("top_k")
    q = torch.where(keep, p, torch.zeros_like(p))
    q = q / q.sum()
    if 0 < top_p < 1:
        s = torch.sort(q, descending=True).values
        c = torch.cumsum(s, 0)
        m = int(torch.nonzero(c >= top_p)[0]) if bool((c >= top_p).any()) else V - 1
        if not (c[m] - top_p > TOP_P_MARGIN or m == V - 1) or not (m == 0 or top_p - c[m - 1] > TOP_P_MARGIN):
            raise Borderline("top_p")
        keep &= q >= s[m]
    if 0 < min_p <= 1:
        threshold = min_p * p.max()
        if not bool(((p - threshold).abs() > MIN_P_MARGIN * p.max()).all()):
            raise Borderline("min_p")
        keep &= p >= threshold
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


def processed_logprob_row(row, logits, temperature, top_k, top_p, min_p):
    if is_greedy(temperature):
        return raw_logprob_row(row, logits)
    row = row.double()
    # Logits: softmax(x / T). Probabilities: used as given (the temperature only marks greedy requests).
    p = torch.softmax(row / temperature, dim=-1) if logits else row / row.sum()
    return torch.log(truncate(p, top_k, top_p, min_p))


def logprob_rows(target_rows, request_of_row, logits, mode, params):
    """``[R, V]`` float64 log-probabilities of every given row, raw or processed by its request's params."""
    out = []
    for r in range(target_rows.shape[0]):
        b = request_of_row[r]
        if mode == "raw":
            out.append(raw_logprob_row(target_rows[r], logits))
        else:
            out.append(processed_logprob_row(target_rows[r], logits, params["temperature"][b],
                                             params["top_k"][b], params["top_p"][b], params["min_p"][b]))
    return torch.stack(out)


def draw_clear(build, rows_for, seed, mode):
    """``build(seed)`` with the first seed whose processed rows are clear of every truncation threshold
    (checked in both modes, so raw and processed see the same inputs); returns ``(inputs, rows)``."""
    for attempt in range(50):
        try:
            inputs = build(seed + 7919 * attempt)
            processed = rows_for(inputs, "processed")
        except Borderline:
            continue
        return inputs, processed if mode == "processed" else rows_for(inputs, mode)
    raise RuntimeError("no clear input in 50 draws")


def expected_logprobs(tokens, row_of, rows):
    """``tokens [B, W]``; ``row_of(b, j)`` the row index token ``j`` of request ``b`` was emitted from, or None."""
    tokens = tokens.cpu()
    B, W = tokens.shape
    out = torch.empty(B, W, dtype=torch.float64)
    for b in range(B):
        for j in range(W):
            t = int(tokens[b, j])
            if t == -1:
                out[b, j] = NEG_INF
                continue
            r = row_of(b, j)
            out[b, j] = NAN if r is None else rows[r, t]
    return out


def assert_logprobs(actual, expected, tokens):
    assert actual.dtype == torch.float32, actual.dtype
    assert actual.shape == tokens.shape, (actual.shape, tokens.shape)
    actual = actual.cpu().double()
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), f"NaN pattern\n{actual}\n{expected}"
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), f"-inf pattern\n{actual}\n{expected}"
    assert not torch.isposinf(actual).any(), actual
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-5, atol=1e-5)


def assert_tokens_tail(tokens, num_accepted):
    """Tokens ``0..num_accepted`` are valid, the rest ``-1``: the layout every test below relies on."""
    tokens, num_accepted = tokens.cpu(), num_accepted.cpu()
    for b in range(tokens.shape[0]):
        n = int(num_accepted[b])
        assert (tokens[b, n + 1:] == -1).all(), tokens[b]
        assert (tokens[b, :n] >= 0).all(), tokens[b]


def assert_sampled_tokens_possible(tokens, row_of, rows, temperature, valid_rows=None):
    """A sampling request never emits a token of processed probability 0 from a given row."""
    for b in range(tokens.shape[0]):
        if is_greedy(temperature[b]):
            continue
        for j in range(tokens.shape[1]):
            t = int(tokens[b, j])
            r = row_of(b, j)
            if t >= 0 and r is not None:
                assert math.isfinite(float(rows[r, t])), (b, j, t)


def make_rows(R, V, gen, logits, scale=4.0):
    x = (torch.rand(R, V, generator=gen, dtype=torch.float64) * 2 - 1) * scale
    if logits:
        return x.float()
    return torch.softmax(x, dim=-1).float()


def draft_rows_for(target_rows, logits, params, request_of_row):
    """Draft probabilities near the processed target (so chains run several tokens), float32, every entry > 0."""
    out = []
    V = target_rows.shape[1]
    for r in range(target_rows.shape[0]):
        b = request_of_row[r]
        t = params["temperature"][b]
        row = target_rows[r].double()
        p = torch.softmax(row / (t if not is_greedy(t) else 1.0), -1) if logits else row / row.sum()
        if not is_greedy(t):
            p = truncate(p, params["top_k"][b], params["top_p"][b], params["min_p"][b])
        out.append(0.8 * p + 0.2 / V)
    return torch.stack(out).float()


def params_for(B, V, temperature):
    """Per-request truncation: top_k with min_p, top_p alone, or off; never top_k with top_p."""
    big = V > 100
    top_k = [(40 if big else 3), 0, (25 if big else 2), 0, (7 if big else 4), 0][:B]
    top_p = [1.0, 0.8, 1.0, 1.0, 1.0, 0.9][:B]
    min_p = [0.1, 0.0, 0.0, 0.05, 0.0, 0.0][:B]
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}


def sampling_kwargs(params, device):
    return {
        "temperature": torch.tensor(params["temperature"], dtype=torch.float32, device=device),
        "top_k": torch.tensor(params["top_k"], dtype=torch.int32, device=device),
        "top_p": torch.tensor(params["top_p"], dtype=torch.float32, device=device),
        "min_p": torch.tensor(params["min_p"], dtype=torch.float32, device=device),
    }


def run_pair(fn, *args, mode, **kwargs):
    """The op with and without logprobs; the tokens must agree bit for bit. Returns the logprobs call's outputs."""
    plain = fn(*args, **kwargs)
    with_lp = fn(*args, logprobs=mode, **kwargs)
    assert len(with_lp) == len(plain) + 1
    for a, b in zip(plain, with_lp[:-1]):
        assert torch.equal(a, b), f"outputs differ with logprobs={mode!r}\n{a}\n{b}"
    return with_lp


# ----------------------------------------------------------------------------------------------------
# chain_verify, padded layout
# ----------------------------------------------------------------------------------------------------

CHAIN_TEMPS = [0.7, 1.0, 0.0, 1.5, -1.0]  # requests 2 and 4 are greedy (0 and vLLM's -1 marker)
CHAIN_N = [3, 2, 3, 0, 1]


def chain_inputs(V, logits, seed, device):
    B, K = len(CHAIN_TEMPS), 3
    gen = torch.Generator().manual_seed(seed)
    target = make_rows(B * (K + 1), V, gen, logits).view(B, K + 1, V)
    request_of_row = [b for b in range(B) for _ in range(K + 1)]
    params = params_for(B, V, CHAIN_TEMPS)
    draft = draft_rows_for(target[:, :K].reshape(B * K, V), logits, params,
                           [b for b in range(B) for _ in range(K)]).view(B, K, V)
    drafts = torch.full((B, K), -1, dtype=torch.int64)
    for b in range(B):
        for i in range(CHAIN_N[b]):
            if is_greedy(CHAIN_TEMPS[b]):  # the target's argmax: every draft accepted, then the bonus row
                drafts[b, i] = int(torch.argmax(target[b, i]))
            else:
                drafts[b, i] = int(torch.multinomial(draft[b, i].double(), 1, generator=gen))
    return target, draft, drafts, request_of_row, params


@every_case
def test_chain_verify_logprobs(backend, V, logits, mode, device):
    backend_or_skip("chain_verify", backend)
    (target, draft, drafts, request_of_row, params), rows = draw_clear(
        lambda s: chain_inputs(V, logits, s, device),
        lambda inp, m: logprob_rows(inp[0].view(-1, V), inp[3], logits, m, inp[4]), 100 + V, mode)
    B, K1 = target.shape[:2]
    for seed in (1, 2) if V < 2048 else (1,):  # the wide rows cost the interpreter seconds a call
        tokens, num_accepted, lp = run_pair(
            sk.chain_verify, drafts.to(device), target.to(device), draft.to(device),
            num_draft_tokens=torch.tensor(CHAIN_N, dtype=torch.int32, device=device), logits=logits,
            seed=seed, offset=7, backend=backend, mode=mode, **sampling_kwargs(params, device))
        assert_tokens_tail(tokens, num_accepted)
        # Greedy requests with argmax drafts accept everything.
        for b in (2, 4):
            assert int(num_accepted[b]) == CHAIN_N[b]

        def row_of(b, j):
            return b * K1 + j

        expected = expected_logprobs(tokens, row_of, rows)
        assert_logprobs(lp, expected, tokens)
        assert torch.isneginf(expected).any()  # the -1 tail is covered
        if mode == "processed":
            assert_sampled_tokens_possible(tokens, row_of, rows, CHAIN_TEMPS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_verify_greedy_reports_raw_under_processed(backend, device):
    """A greedy request's processed logprob is the raw row's value, truncation and temperature notwithstanding."""
    backend_or_skip("chain_verify", backend)
    V, K = 13, 2
    gen = torch.Generator().manual_seed(5)
    x = make_rows(3 * (K + 1), V, gen, True, scale=3.0).view(3, K + 1, V)
    drafts = torch.stack([x[b, :K].argmax(-1) for b in range(3)])
    drafts[1, 1] = (drafts[1, 1] + 1) % V  # a mismatch: request 1 stops there and emits that row's argmax
    for temperature in (0.0, torch.tensor([0.0, -1.0, float("nan")], device=device)):
        tokens, num_accepted, lp = run_pair(
            sk.chain_verify, drafts.to(device), x.to(device), logits=True, temperature=temperature,
            top_k=torch.tensor([2, 1, 3], dtype=torch.int32, device=device),
            min_p=torch.tensor([0.3, 0.0, 0.5], dtype=torch.float32, device=device),
            seed=3, backend=backend, mode="processed")
        assert num_accepted.tolist() == [2, 1, 2]
        raw = torch.log_softmax(x.double(), -1).view(3 * (K + 1), V)
        expected = expected_logprobs(tokens, lambda b, j: b * (K + 1) + j, raw)
        assert_logprobs(lp, expected, tokens)
        # The emitted tokens are the argmaxes, whose raw logprob is below 0 (the processed one would be ~0).
        assert (lp.cpu()[torch.isfinite(lp.cpu())] < -1e-3).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_verify_without_draft_and_float_temperature(backend, mode, device):
    """Deterministic proposals (draft=None), one Python-float temperature, probabilities with ties under top_k."""
    backend_or_skip("chain_verify", backend)
    V, K, B = 8, 3, 4
    base = torch.tensor([0.25, 0.15, 0.15, 0.15, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    target = torch.stack([base[torch.randperm(V, generator=gen)] for _ in range(B * (K + 1))]).float()
    target = target.view(B, K + 1, V)
    # Propose the row's most likely token, so chains run a while (acceptance probability 0.25).
    drafts = target[:, :K].argmax(-1)
    # top_k=2 keeps the 0.25 token and all three tied 0.15 tokens (mass 0.7); top_k=4 keeps the same four.
    params = {"temperature": [1.3] * B, "top_k": [2, 0, 4, 1], "top_p": [1.0] * B, "min_p": [0.0, 0.5, 0.0, 0.0]}
    rows = logprob_rows(target.view(-1, V), [b for b in range(B) for _ in range(K + 1)], False, mode, params)
    if mode == "processed":
        assert abs(float(rows[0].exp().max()) - 0.25 / 0.7) < 1e-6  # ties kept in the model itself
    kwargs = sampling_kwargs(params, device)
    kwargs["temperature"] = 1.3
    for seed in range(6):
        tokens, num_accepted, lp = run_pair(
            sk.chain_verify, drafts.to(device), target.to(device), None, logits=False, seed=seed,
            backend=backend, mode=mode, **kwargs)
        assert_tokens_tail(tokens, num_accepted)

        def row_of(b, j):
            return b * (K + 1) + j

        expected = expected_logprobs(tokens, row_of, rows)
        assert_logprobs(lp, expected, tokens)
        if mode == "processed":
            assert_sampled_tokens_possible(tokens, row_of, rows, params["temperature"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_verify_bonus_ids_padded(backend, device):
    """With bonus rows given, a valid bonus id is scored under the bonus row; an invalid one means the row is sampled."""
    backend_or_skip("chain_verify", backend)
    V, K, B = 2500, 2, 3
    gen = torch.Generator().manual_seed(21)
    target = make_rows(B * (K + 1), V, gen, False).view(B, K + 1, V)
    temps = [0.9, 0.0, 1.2]
    drafts = torch.stack([target[b, :K].argmax(-1) for b in range(B)])
    for b in (0, 2):  # sampling requests: drafts drawn from draft == target, so always accepted
        for i in range(K):
            drafts[b, i] = int(torch.multinomial(target[b, i].double(), 1, generator=gen))
    bonus = torch.tensor([int(target[0, K].argmax()), 17, -1], dtype=torch.int64)  # request 2: no bonus
    for mode in MODES:
        rows = logprob_rows(target.view(-1, V), [b for b in range(B) for _ in range(K + 1)], False, mode,
                            {"temperature": temps, "top_k": [0] * B, "top_p": [1.0] * B, "min_p": [0.0] * B})
        tokens, num_accepted, lp = run_pair(
            sk.chain_verify, drafts.to(device), target.to(device), target[:, :K].contiguous().to(device),
            temperature=torch.tensor(temps, device=device), bonus_token_ids=bonus.to(device), seed=4,
            backend=backend, mode=mode)
        assert num_accepted.tolist() == [K, K, K]
        assert tokens[0, K] == bonus[0] and tokens[1, K] == bonus[1]
        expected = expected_logprobs(tokens, lambda b, j: b * (K + 1) + j, rows)
        assert torch.isfinite(expected).all()
        assert_logprobs(lp, expected, tokens)


# ----------------------------------------------------------------------------------------------------
# chain_verify_packed, both layouts
# ----------------------------------------------------------------------------------------------------

PACKED_TEMPS = [0.8, 0.0, 1.4, -1.0, 0.6, 0.0]
PACKED_N = [2, 3, 0, 1, 3, 0]


def packed_inputs(V, logits, seed, bonus_free):
    B, K = len(PACKED_N), 3
    cu = [0]
    for n in PACKED_N:
        cu.append(cu[-1] + n)
    T = cu[-1]
    gen = torch.Generator().manual_seed(seed)
    R = T if bonus_free else T + B
    target = make_rows(R, V, gen, logits)
    # Row -> (request, position): position j of request b is row cu[b] + j (+ b with bonus rows).
    start = [cu[b] + (0 if bonus_free else b) for b in range(B)]
    request_of_row = [None] * R
    for b in range(B):
        for j in range(PACKED_N[b] + (0 if bonus_free else 1)):
            request_of_row[start[b] + j] = b
    assert None not in request_of_row
    draft_request = [b for b in range(B) for _ in range(PACKED_N[b])]
    draft_target = torch.stack([target[start[b] + j] for b in range(B) for j in range(PACKED_N[b])])
    params = params_for(B, V, PACKED_TEMPS)
    draft = draft_rows_for(draft_target, logits, params, draft_request)
    drafts = torch.empty(T, dtype=torch.int64)
    for b in range(B):
        for j in range(PACKED_N[b]):
            if is_greedy(PACKED_TEMPS[b]):
                drafts[cu[b] + j] = int(torch.argmax(target[start[b] + j]))
            else:
                drafts[cu[b] + j] = int(torch.multinomial(draft[cu[b] + j].double(), 1, generator=gen))
    return target, draft, drafts, cu, start, request_of_row, params, K


def packed_case(V, logits, mode, bonus_free, base_seed):
    """Packed inputs away from every truncation threshold, and their rows' expected log-probabilities."""
    return draw_clear(lambda s: packed_inputs(V, logits, s, bonus_free),
                      lambda inp, m: logprob_rows(inp[0], inp[5], logits, m, inp[6]), base_seed + V, mode)


@every_case
def test_chain_verify_packed_with_bonus_rows(backend, V, logits, mode, device):
    backend_or_skip("chain_verify_packed", backend)
    (target, draft, drafts, cu, start, request_of_row, params, K), rows = packed_case(V, logits, mode, False, 300)
    seed = 5
    tokens, num_accepted, lp = run_pair(
        sk.chain_verify_packed, drafts.to(device), torch.tensor(cu, dtype=torch.int32, device=device),
        target.to(device), draft.to(device), max_num_draft_tokens=K, logits=logits, seed=seed,
        backend=backend, mode=mode, **sampling_kwargs(params, device))
    assert tokens.shape == (len(PACKED_N), K + 1)
    assert_tokens_tail(tokens, num_accepted)
    for b in (1, 3, 5):
        assert int(num_accepted[b]) == PACKED_N[b]

    def row_of(b, j):
        return start[b] + j

    expected = expected_logprobs(tokens, row_of, rows)
    assert not torch.isnan(expected).any()
    assert_logprobs(lp, expected, tokens)
    if mode == "processed":
        assert_sampled_tokens_possible(tokens, row_of, rows, PACKED_TEMPS)


@every_case
def test_chain_verify_packed_bonus_free(backend, V, logits, mode, device):
    """Target ``[T, V]`` with bonus ids: a valid bonus id has no row (NaN); an invalid one gives -1 (-inf)."""
    backend_or_skip("chain_verify_packed", backend)
    (target, draft, drafts, cu, start, request_of_row, params, K), rows = packed_case(V, logits, mode, True, 500)
    B = len(PACKED_N)
    # Greedy requests 1, 3, 5 accept everything: 1 and 5 (n=0) have valid bonus ids, 3 has none.
    bonus = torch.tensor([4, 2, 9, -1, 6, 3], dtype=torch.int64)
    seed = 7
    tokens, num_accepted, lp = run_pair(
        sk.chain_verify_packed, drafts.to(device), torch.tensor(cu, dtype=torch.int32, device=device),
        target.to(device), draft.to(device), max_num_draft_tokens=K, logits=logits, seed=seed,
        bonus_token_ids=bonus.to(device), backend=backend, mode=mode, **sampling_kwargs(params, device))
    assert tokens.shape == (B, K + 1)
    for b in (1, 3, 5):
        assert int(num_accepted[b]) == PACKED_N[b]
    assert int(tokens[1, 3]) == 2 and int(tokens[5, 0]) == 3  # the bonus ids, emitted from no given row
    assert int(tokens[3, 1]) == -1  # no bonus id, no bonus row: -1 at the bonus position
    # Request 2 (n=0, sampling, valid bonus id) emits its bonus id at once.
    assert int(num_accepted[2]) == 0 and int(tokens[2, 0]) == 9
    for b in range(B):
        n = int(num_accepted[b])
        assert (tokens[b, n + 1:] == -1).all()
        assert (tokens[b, :n] >= 0).all()

    def row_of(b, j):
        return start[b] + j if j < PACKED_N[b] else None

    expected = expected_logprobs(tokens, row_of, rows)
    assert math.isnan(expected[1, 3]) and math.isnan(expected[5, 0]) and math.isnan(expected[2, 0])
    assert expected[3, 1] == NEG_INF and expected[5, 1] == NEG_INF
    assert_logprobs(lp, expected, tokens)
    if mode == "processed":
        assert_sampled_tokens_possible(tokens, row_of, rows, PACKED_TEMPS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_verify_packed_bonus_free_sampling_full_accept(backend, device):
    """A sampling request that accepts every draft in the bonus-free layout emits its bonus id with NaN."""
    backend_or_skip("chain_verify_packed", backend)
    V = 2500
    gen = torch.Generator().manual_seed(31)
    n = [2, 1]
    target = make_rows(3, V, gen, False)
    drafts = torch.tensor([int(torch.multinomial(target[i].double(), 1, generator=gen)) for i in range(3)])
    bonus = torch.tensor([123, -1])
    for mode in MODES:
        tokens, num_accepted, lp = run_pair(
            sk.chain_verify_packed, drafts.to(device), torch.tensor([0, 2, 3], dtype=torch.int32, device=device),
            target.to(device), target.to(device), max_num_draft_tokens=2, temperature=1.0,
            bonus_token_ids=bonus.to(device), seed=9, backend=backend, mode=mode)
        assert num_accepted.tolist() == n  # draft == target: accepted with probability 1
        assert tokens[0].tolist() == [int(drafts[0]), int(drafts[1]), 123]
        assert tokens[1].tolist() == [int(drafts[2]), -1, -1]
        raw = torch.log(target.double())
        expected = torch.tensor([[raw[0, drafts[0]], raw[1, drafts[1]], NAN],
                                 [raw[2, drafts[2]], NEG_INF, NEG_INF]], dtype=torch.float64)
        assert_logprobs(lp, expected, tokens)


# ----------------------------------------------------------------------------------------------------
# tree_verify
# ----------------------------------------------------------------------------------------------------

TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3]  # children of 0: 1, 2; of 1: 3, 4; of 2: 5; of 3: 6
TREE_TEMPS = [0.8, float("nan"), 1.3, 0.0]  # requests 1 (NaN marker) and 3 are greedy
TREE_NUM_NODES = [7, 7, 4, 7]


def tree_inputs(V, logits, seed):
    B, N = len(TREE_TEMPS), len(TREE_PARENTS)
    gen = torch.Generator().manual_seed(seed)
    target = make_rows(B * N, V, gen, logits).view(B, N, V)
    tokens = torch.empty(B, N, dtype=torch.int64)
    for b in range(B):
        tokens[b, 0] = int(torch.randint(0, V, (1,), generator=gen))
        for parent in range(N):
            children = [i for i in range(1, N) if TREE_PARENTS[i] == parent]
            if not children:
                continue
            # The parent row's most likely tokens (a top-k tree); the first child is the argmax, so a
            # greedy request follows the first children to a leaf.
            order = torch.argsort(target[b, parent], descending=True)
            for rank, child in enumerate(children):
                tokens[b, child] = int(order[rank])
    params = params_for(B, V, TREE_TEMPS)
    draft = draft_rows_for(target.view(B * N, V), logits, params, [b for b in range(B) for _ in range(N)]).view(B, N, V)
    return target, tokens, draft, params


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("logits", [True, False], ids=["logits-nodraft", "probs-draft"])
@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_verify_logprobs(backend, V, logits, mode, device):
    backend_or_skip("tree_verify", backend)
    (target, tree_tokens, draft, params), rows = draw_clear(
        lambda s: tree_inputs(V, logits, s),
        lambda inp, m: logprob_rows(inp[0].view(-1, V), [b for b in range(inp[1].shape[0]) for _ in range(
            inp[1].shape[1])], logits, m, inp[3]), 700 + V, mode)
    B, N = tree_tokens.shape
    parents = torch.tensor([TREE_PARENTS] * B, dtype=torch.int32)
    for seed in (11, 12) if V < 2048 else (11,):
        accepted_nodes, tokens, num_accepted, lp = run_pair(
            sk.tree_verify, tree_tokens.to(device), parents.to(device), target.to(device),
            None if logits else draft.to(device),
            num_nodes=torch.tensor(TREE_NUM_NODES, dtype=torch.int32, device=device), logits=logits,
            seed=seed, backend=backend, mode=mode, **sampling_kwargs(params, device))
        assert tokens.shape == (B, N) and accepted_nodes.shape == (B, N)
        assert_tokens_tail(tokens, num_accepted)
        # Greedy requests follow the argmax children to the leaf 6: path 0, 1, 3, 6.
        for b in (1, 3):
            assert accepted_nodes[b, :4].tolist() == [0, 1, 3, 6], accepted_nodes[b]
            assert int(num_accepted[b]) == 3
        nodes = accepted_nodes.cpu()
        for b in range(B):
            n = int(num_accepted[b])
            assert int(nodes[b, 0]) == 0 and (nodes[b, n + 1:] == -1).all()
            assert all(0 <= int(nodes[b, j]) < TREE_NUM_NODES[b] for j in range(n + 1))

        def row_of(b, j):
            return b * N + int(nodes[b, j])  # token j follows the path node j (the root is node 0)

        expected = expected_logprobs(tokens, row_of, rows)
        assert_logprobs(lp, expected, tokens)
        assert torch.isneginf(expected).any()
        if mode == "processed":
            assert_sampled_tokens_possible(tokens, row_of, rows, TREE_TEMPS)
