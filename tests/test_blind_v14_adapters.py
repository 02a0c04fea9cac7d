"""Blind acceptance tests for the v1.4 engine adapters (``specdec_kernels.adapters``).

Written from the contract only (``shared/design/API.md``: "Engine adapters (v1.4)" and the sections it
relies on: Common rules, Random numbers, chain_verify, chain_verify_packed, tree_verify), and from the engines'
own public signatures (vLLM ``vllm/v1/sample/rejection_sampler.py``, sgl-kernel
``sgl_kernel/speculative.py`` and its ``test_eagle_utils.py``, FlashInfer ``flashinfer/sampling.py``), without
reading the adapters' implementation or the package's own adapter tests.

Covered: vLLM ``rejection_sample`` / ``rejection_sample_from_logits`` (greedy bit for bit, the sampled law by
chi-square with power against a wrong law, per-request generators), SGLang
``tree_speculative_sampling_target_only`` / ``verify_tree_greedy`` (in-place outputs, thresholds, greedy walk
against a plain-Python restatement of sgl-kernel's walk, the sampled law), FlashInfer
``chain_speculative_sampling`` (the seed rule and the counters). ``rejection_sample_v2`` and ``logprobs`` are
out of scope. Every behavioural test runs on ``backend="reference"`` and ``backend="triton"`` (the interpreter
on CPU); chi-square tests run on the reference only.
"""

from __future__ import annotations

import inspect
import itertools
import types

import numpy as np
import pytest
import torch

from conftest import DEVICE, backend_or_skip
from markov import SIGNIFICANCE, chi_square_pvalue
from specdec_kernels.adapters import flashinfer as fi_adapter
from specdec_kernels.adapters import sglang as sgl_adapter
from specdec_kernels.adapters import vllm as vllm_adapter

BACKENDS = ("reference", "triton")
DEV = torch.device(DEVICE)


def chain_backend(backend):
    return backend_or_skip("chain_verify", backend)


def tree_backend(backend):
    return backend_or_skip("tree_verify", backend)


def histogram(rows):
    """{tuple(row): count} of an int tensor [n, L] (or {(x,): count} of [n])."""
    rows = rows.cpu().long()
    if rows.dim() == 1:
        rows = rows.view(-1, 1)
    unique, counts = torch.unique(rows, dim=0, return_counts=True)
    return {tuple(int(t) for t in r): int(c) for r, c in zip(unique.tolist(), counts.tolist())}


def law_dict(probs):
    return {(i,): float(p) for i, p in enumerate(np.asarray(probs, dtype=np.float64)) if p > 0}


def gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


# ======================================================================================================
# Signatures
# ======================================================================================================
VLLM_NAMES = ["draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs",
              None, "bonus_token_ids", "sampling_metadata"]
SGL_SAMPLING_NAMES = ["predicts", "accept_index", "accept_token_num", "candidates", "retrive_index",
                      "retrive_next_token", "retrive_next_sibling", "uniform_samples",
                      "uniform_samples_for_final_sampling", "target_probs", "draft_probs", "threshold_single",
                      "threshold_acc", "deterministic"]
SGL_GREEDY_NAMES = ["predicts", "accept_index", "accept_token_num", "candidates", "retrive_index",
                    "retrive_next_token", "retrive_next_sibling", "target_predict"]
FI_NAMES = ["draft_probs", "draft_token_ids", "target_probs", "maybe_output_accepted_token_num",
            "maybe_output_emitted_draft_token_num", "deterministic", "generator", "seed", "offset"]


def _positional(fn):
    return [p for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


@pytest.mark.parametrize("fn, names, sixth", [
    (vllm_adapter.rejection_sample, VLLM_NAMES, "target_probs"),
    (vllm_adapter.rejection_sample_from_logits, VLLM_NAMES, "target_logits"),
    (sgl_adapter.tree_speculative_sampling_target_only, SGL_SAMPLING_NAMES, None),
    (sgl_adapter.verify_tree_greedy, SGL_GREEDY_NAMES, None),
    (fi_adapter.chain_speculative_sampling, FI_NAMES, None),
], ids=["vllm.rejection_sample", "vllm.rejection_sample_from_logits", "sglang.tree_sampling",
        "sglang.verify_tree_greedy", "flashinfer.chain"])
def test_signatures_follow_the_engines_and_backend_is_keyword_only_last(fn, names, sixth):
    names = [sixth if n is None else n for n in names]
    params = list(inspect.signature(fn).parameters.values())
    positional = _positional(fn)
    assert [p.name for p in positional[:len(names)]] == names
    backend = inspect.signature(fn).parameters.get("backend")
    assert backend is not None, "every adapter takes backend="
    assert backend.kind is inspect.Parameter.KEYWORD_ONLY
    assert backend.default == "auto"
    assert params[-1].name == "backend", "backend= is the last parameter"
    defaults = {p.name: p.default for p in params}
    if fn is sgl_adapter.tree_speculative_sampling_target_only:
        assert defaults["threshold_single"] == 1.0 and defaults["threshold_acc"] == 1.0
        assert defaults["deterministic"] is True
    if fn is fi_adapter.chain_speculative_sampling:
        for name in FI_NAMES[3:]:
            assert defaults[name] == {"deterministic": True}.get(name, None), name


# ======================================================================================================
# vLLM
# ======================================================================================================
def vllm_pack(drafts, dtype=torch.int32):
    """vLLM's flat layout: draft_token_ids [T], num_draft_tokens list, cu_num_draft_tokens [B] (inclusive, no 0)."""
    num = [len(d) for d in drafts]
    flat = [t for d in drafts for t in d]
    ids = torch.tensor(flat, dtype=dtype, device=DEV)
    cu = torch.tensor(list(itertools.accumulate(num)), dtype=torch.int32, device=DEV)
    return ids, num, cu


def vllm_metadata(temperature, *, generators=None, top_k=None, top_p=None, all_greedy=None, all_random=None):
    """A SamplingMetadata stand-in carrying vLLM's attribute names."""
    if temperature is None:
        t = None
        greedy, random_ = True, False
    else:
        t = torch.tensor(temperature, dtype=torch.float32, device=DEV)
        greedy = bool((t <= 0).all())
        random_ = bool((t > 0).all())
    return types.SimpleNamespace(
        temperature=t,
        all_greedy=greedy if all_greedy is None else all_greedy,
        all_random=random_ if all_random is None else all_random,
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32, device=DEV),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32, device=DEV),
        min_p=None,
        generators={} if generators is None else generators,
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=None,
        presence_penalties=None,
        repetition_penalties=None,
        output_token_ids=[],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=None,
    )


def vllm_expected(drafts, hot_rows, bonus, max_spec_len):
    """vLLM's outcome when every row's law is a point mass (greedy argmax, or one-hot probabilities): accept
    while the draft equals the row's token, emit the row's token at the first mismatch (a -1 draft never
    matches), else the bonus token; -1 elsewhere."""
    out = [[-1] * (max_spec_len + 1) for _ in drafts]
    row = 0
    for b, d in enumerate(drafts):
        for i, t in enumerate(d):
            hot = hot_rows[row + i]
            out[b][i] = hot
            if t != hot:
                break
        else:
            out[b][len(d)] = bonus[b]
        row += len(d)
    return torch.tensor(out, dtype=torch.int32)


def peaked_probs(hot, V, generator):
    rows = torch.rand(len(hot), V, generator=generator) * 0.5 + 0.05
    rows[torch.arange(len(hot)), torch.tensor(hot)] += 1.0
    return rows / rows.sum(-1, keepdim=True)


def one_hot_probs(hot, V):
    return torch.nn.functional.one_hot(torch.tensor(hot), V).float()


# Hand-made ragged batch: request 1 has no drafts, request 3 is a lone -1 placeholder, request 4 has a -1 inside.
HAND_DRAFTS = [[2, 4, 5], [], [0, 3], [-1], [3, -1, 4]]
HAND_HOT = [2, 4, 1, 0, 3, 5, 3, 0, 4]  # the argmax (or one-hot token) of each of the 9 draft rows, in order
HAND_BONUS = [1, 3, 4, 0, 2]
HAND_EXPECTED = [[2, 4, 1, -1], [3, -1, -1, -1], [0, 3, 4, -1], [5, -1, -1, -1], [3, 0, -1, -1]]
V_HAND = 6


def test_hand_made_expectation_is_the_restated_rule():
    assert vllm_expected(HAND_DRAFTS, HAND_HOT, HAND_BONUS, 3).tolist() == HAND_EXPECTED


def _vllm_call(fn_name, drafts, target, draft_probs, bonus, metadata, max_spec_len, backend, ids_dtype=torch.int32):
    ids, num, cu = vllm_pack(drafts, ids_dtype)
    fn = getattr(vllm_adapter, fn_name)
    bonus_t = torch.tensor(bonus, dtype=torch.int32, device=DEV).view(-1, 1)
    out = fn(ids, num, max_spec_len, cu, None if draft_probs is None else draft_probs.to(DEV), target.to(DEV),
             bonus_t, metadata, backend=backend)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn_name", ["rejection_sample", "rejection_sample_from_logits"])
@pytest.mark.parametrize("temperature", [None, "zeros", "minus_ones"])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_vllm_all_greedy_bit_for_bit(backend, fn_name, temperature, with_draft_probs):
    chain_backend(backend)
    g = torch.Generator().manual_seed(1)
    probs = peaked_probs(HAND_HOT, V_HAND, g)
    target = probs if fn_name == "rejection_sample" else torch.log(probs) * 3.0 + 1.5
    draft_probs = torch.softmax(torch.randn(len(HAND_HOT), V_HAND, generator=g), -1) if with_draft_probs else None
    B = len(HAND_DRAFTS)
    temp = {None: None, "zeros": [0.0] * B, "minus_ones": [-1.0] * B}[temperature]
    meta = vllm_metadata(temp)
    assert meta.all_greedy
    out = _vllm_call(fn_name, HAND_DRAFTS, target, draft_probs, HAND_BONUS, meta, 3, backend)
    assert out.dtype == torch.int32
    assert tuple(out.shape) == (B, 4)
    assert out.cpu().tolist() == HAND_EXPECTED


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn_name", ["rejection_sample", "rejection_sample_from_logits"])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_vllm_output_width_is_max_spec_len_plus_one(backend, fn_name, ids_dtype):
    """max_spec_len wider than the longest chain: the extra columns stay -1."""
    chain_backend(backend)
    g = torch.Generator().manual_seed(2)
    probs = peaked_probs(HAND_HOT, V_HAND, g)
    target = probs if fn_name == "rejection_sample" else torch.log(probs)
    out = _vllm_call(fn_name, HAND_DRAFTS, target, None, HAND_BONUS, vllm_metadata(None), 5, backend, ids_dtype)
    assert out.dtype == torch.int32 and tuple(out.shape) == (len(HAND_DRAFTS), 6)
    assert out.cpu().tolist() == [row + [-1, -1] for row in HAND_EXPECTED]


MIXED_TEMPERATURES = [-1.0, 0.7, 0.0, 1.3, -1.0]  # requests 0, 2, 4 greedy (vLLM's -1 marker and 0), 1, 3 sampled


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn_name", ["rejection_sample", "rejection_sample_from_logits"])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_vllm_mixed_batch_greedy_requests_bit_for_bit(backend, fn_name, with_draft_probs):
    """Greedy requests (temperature -1 or 0) are bit-exact; the sampled ones get one-hot laws, so their outcome
    is certain too: accept a draft iff it is the hot token, else emit the hot token; the bonus after a full run."""
    chain_backend(backend)
    g = torch.Generator().manual_seed(3)
    ids, num, cu = vllm_pack(HAND_DRAFTS)
    row_request = [b for b, d in enumerate(HAND_DRAFTS) for _ in d]
    sampled_row = torch.tensor([MIXED_TEMPERATURES[b] > 0 for b in row_request])
    peaked = peaked_probs(HAND_HOT, V_HAND, g)
    hot = one_hot_probs(HAND_HOT, V_HAND)
    probs = torch.where(sampled_row.view(-1, 1), hot, peaked)
    if fn_name == "rejection_sample":
        target = probs
    else:
        target = torch.where(sampled_row.view(-1, 1), torch.where(hot > 0, 0.0, -1e4), torch.log(peaked) * 2.0)
    draft_probs = None
    if with_draft_probs:
        # Each sampled draft was "drawn" from a one-hot draft row at itself (q(t) = 1); -1 placeholders get any row.
        flat = [t for d in HAND_DRAFTS for t in d]
        draft_probs = one_hot_probs([t if t >= 0 else 0 for t in flat], V_HAND)
    meta = vllm_metadata(MIXED_TEMPERATURES)
    assert not meta.all_greedy and not meta.all_random
    out = _vllm_call(fn_name, HAND_DRAFTS, target, draft_probs, HAND_BONUS, meta, 3, backend)
    assert out.dtype == torch.int32 and tuple(out.shape) == (5, 4)
    assert out.cpu().tolist() == HAND_EXPECTED


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn_name", ["rejection_sample", "rejection_sample_from_logits"])
def test_vllm_random_greedy_batches_match_the_rule(backend, fn_name):
    """Random ragged greedy batches (some requests without drafts, some -1 placeholders), against the rule."""
    chain_backend(backend)
    rng = np.random.default_rng(4)
    V = 5
    for trial in range(3 if backend == "reference" else 1):
        B = 6
        K = 4
        drafts, hot = [], []
        for b in range(B):
            n = int(rng.integers(0, K + 1))
            d = []
            for i in range(n):
                h = int(rng.integers(0, V))
                hot.append(h)
                r = rng.random()
                d.append(h if r < 0.6 else (-1 if r < 0.7 else int(rng.integers(0, V))))
            drafts.append(d)
        if not hot:
            continue
        bonus = [int(x) for x in rng.integers(0, V, B)]
        g = torch.Generator().manual_seed(10 + trial)
        probs = peaked_probs(hot, V, g)
        target = probs if fn_name == "rejection_sample" else torch.log(probs) - 2.0
        temps = [float(rng.choice([-1.0, 0.0])) for _ in range(B)]
        temps[0] = 0.9  # one sampled request keeps the batch mixed; its row is checked for shape only
        meta = vllm_metadata(temps)
        max_len = max(len(d) for d in drafts)
        out = _vllm_call(fn_name, drafts, target, None, bonus, meta, max_len, backend).cpu()
        expected = vllm_expected(drafts, hot, bonus, max_len)
        assert out.dtype == torch.int32 and tuple(out.shape) == (B, max_len + 1)
        assert out[1:].tolist() == expected[1:].tolist(), (drafts, hot, bonus)
        # The sampled request: accepted drafts, one token, then -1.
        row = out[0].tolist()
        valid = [t for t in row if t != -1]
        assert row[:len(valid)] == valid and 1 <= len(valid) <= len(drafts[0]) + 1
        assert all(0 <= t < V for t in valid)


# ---- the sampled law ------------------------------------------------------------------------------------
LAW_V = 6
LAW_P0 = np.array([0.33, 0.24, 0.18, 0.12, 0.08, 0.05])
LAW_N = 4000


def _law_batch(seed, num_samples, with_draft_probs):
    """num_samples identical requests with two drafts each, drawn by the test from the draft rows."""
    g = torch.Generator().manual_seed(seed)
    p0 = torch.tensor(LAW_P0, dtype=torch.float32)
    p1 = torch.softmax(torch.randn(LAW_V, generator=g), -1)
    q0 = torch.softmax(torch.randn(LAW_V, generator=g), -1)
    q1 = torch.softmax(torch.randn(LAW_V, generator=g), -1)
    if with_draft_probs:
        d0 = torch.multinomial(q0, num_samples, replacement=True, generator=g)
        d1 = torch.multinomial(q1, num_samples, replacement=True, generator=g)
    else:
        d0 = torch.randint(0, LAW_V, (num_samples,), generator=g)
        d1 = torch.randint(0, LAW_V, (num_samples,), generator=g)
    ids = torch.stack([d0, d1], 1).reshape(-1).to(torch.int32)
    target = torch.stack([p0, p1]).repeat(num_samples, 1)
    draft = torch.stack([q0, q1]).repeat(num_samples, 1) if with_draft_probs else None
    num = [2] * num_samples
    cu = torch.arange(1, num_samples + 1, dtype=torch.int32) * 2
    bonus = torch.randint(0, LAW_V, (num_samples, 1), generator=g, dtype=torch.int32)
    return ids, num, cu, target, draft, bonus


@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("top", [False, True], ids=["no_top", "top_k_top_p_in_metadata"])
def test_vllm_rejection_sample_law_is_target_probs_as_given(with_draft_probs, top):
    """The first emitted token follows target_probs as given (temperature 0.5 only marks the requests as sampled;
    top-k/top-p in the metadata were already applied by vLLM and must not be applied again). Power: the same
    counts reject the law with the temperature applied a second time."""
    T = 0.5
    ids, num, cu, target, draft, bonus = _law_batch(100 + with_draft_probs, LAW_N, with_draft_probs)
    meta = vllm_metadata([T] * LAW_N, top_k=[2] * LAW_N if top else None, top_p=[0.5] * LAW_N if top else None)
    assert meta.all_random
    torch.manual_seed(1234)
    out = vllm_adapter.rejection_sample(ids.to(DEV), num, 2, cu.to(DEV), None if draft is None else draft.to(DEV),
                                        target.to(DEV), bonus.to(DEV), meta, backend="reference")
    first = out[:, 0].cpu()
    assert (first >= 0).all()
    counts = histogram(first)
    p_ok = chi_square_pvalue(counts, law_dict(LAW_P0), LAW_N)
    twice = np.exp(np.log(LAW_P0) / T)
    twice /= twice.sum()
    p_twice = chi_square_pvalue(counts, law_dict(twice), LAW_N)
    assert p_ok > SIGNIFICANCE, f"first token does not follow target_probs: p={p_ok}, counts={counts}"
    assert p_twice < SIGNIFICANCE, f"no power against the temperature applied twice: p={p_twice}"


def test_vllm_placeholder_draft_token_is_drawn_from_the_target_itself():
    """A -1 placeholder at the first position of a sampled request: no proposal there, so the first token is
    drawn from target_probs itself, not from the residual max(0, p - q) (power against the residual)."""
    ids, num, cu, target, draft, bonus = _law_batch(105, LAW_N, True)
    ids = ids.view(LAW_N, 2).clone()
    ids[:, 0] = -1
    ids = ids.reshape(-1)
    meta = vllm_metadata([1.0] * LAW_N)
    torch.manual_seed(99)
    out = vllm_adapter.rejection_sample(ids.to(DEV), num, 2, cu.to(DEV), draft.to(DEV), target.to(DEV),
                                        bonus.to(DEV), meta, backend="reference").cpu()
    assert (out[:, 1:] == -1).all(), "the chain stops at the placeholder"
    counts = histogram(out[:, 0])
    assert chi_square_pvalue(counts, law_dict(LAW_P0), LAW_N) > SIGNIFICANCE, counts
    q0 = draft[0].double().numpy()
    residual = np.maximum(LAW_P0 - q0, 0.0)
    residual /= residual.sum()
    assert chi_square_pvalue(counts, law_dict(residual), LAW_N) < SIGNIFICANCE


# Raw logits of the first position (V = 8), sorted-probability gaps chosen so no truncation sits near a threshold.
LOGITS0 = np.array([2.0, 1.45, 0.2, 0.95, -0.6, 0.5, -1.4, -0.1])


def vllm_processed_law(logits, T, top_k=None, top_p=None):
    """softmax(logits / T), then vLLM's apply_top_k_top_p: keep the top_k largest, renormalise, keep the smallest
    set of largest probabilities whose mass reaches top_p, renormalise. float64; asserts no threshold is close."""
    x = np.asarray(logits, dtype=np.float64) / T
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.ones_like(probs, dtype=bool)
    if top_k is not None and 0 < top_k < len(probs):
        keep[:] = False
        keep[order[:top_k]] = True
        assert probs[order[top_k - 1]] - probs[order[top_k]] > 1e-3
    law = np.where(keep, probs, 0.0)
    law /= law.sum()
    if top_p is not None and top_p < 1.0:
        sorted_p = law[order]
        before = np.cumsum(sorted_p) - sorted_p
        kept_sorted = before < top_p
        assert np.min(np.abs(before[sorted_p > 0] - top_p)) > 0.02, "test construction: top_p too close to a sum"
        keep2 = np.zeros_like(keep)
        keep2[order[kept_sorted]] = True
        law = np.where(keep2, law, 0.0)
        law /= law.sum()
    return law


@pytest.mark.parametrize("top_k, top_p", [(None, None), (3, None), (None, 0.7), (5, 0.8)],
                         ids=["temperature", "top_k", "top_p", "top_k_top_p"])
def test_vllm_from_logits_law(top_k, top_p):
    """The first emitted token follows softmax(logits / T) truncated as vLLM does; power against the
    temperature applied twice (T^2) and against no temperature."""
    T = 0.7
    n = LAW_N
    g = torch.Generator().manual_seed(200 + (top_k or 0))
    l0 = torch.tensor(LOGITS0, dtype=torch.float32)
    V = len(LOGITS0)
    l1 = torch.randn(V, generator=g) * 1.5
    q0 = torch.softmax(torch.randn(V, generator=g), -1)
    q1 = torch.softmax(torch.randn(V, generator=g), -1)
    d0 = torch.multinomial(q0, n, replacement=True, generator=g)
    d1 = torch.multinomial(q1, n, replacement=True, generator=g)
    ids = torch.stack([d0, d1], 1).reshape(-1).to(torch.int32)
    target = torch.stack([l0, l1]).repeat(n, 1)
    draft = torch.stack([q0, q1]).repeat(n, 1)
    cu = torch.arange(1, n + 1, dtype=torch.int32) * 2
    bonus = torch.randint(0, V, (n, 1), generator=g, dtype=torch.int32)
    meta = vllm_metadata([T] * n, top_k=None if top_k is None else [top_k] * n,
                         top_p=None if top_p is None else [top_p] * n)
    torch.manual_seed(4321)
    out = vllm_adapter.rejection_sample_from_logits(ids.to(DEV), [2] * n, 2, cu.to(DEV), draft.to(DEV),
                                                    target.to(DEV), bonus.to(DEV), meta, backend="reference")
    counts = histogram(out[:, 0].cpu())
    expected = vllm_processed_law(LOGITS0, T, top_k, top_p)
    p_ok = chi_square_pvalue(counts, law_dict(expected), n)
    assert p_ok > SIGNIFICANCE, f"p={p_ok}; counts={counts}; expected={np.round(expected * n, 1)}"
    for wrong_T, what in ((T * T, "temperature applied twice"), (1.0, "temperature not applied")):
        wrong = vllm_processed_law(LOGITS0, wrong_T, top_k, top_p)
        assert np.abs(wrong - expected).max() > 0.03  # the alternative really differs
        p_wrong = chi_square_pvalue(counts, law_dict(wrong), n)
        assert p_wrong < SIGNIFICANCE, f"no power against the {what}: p={p_wrong}"


# ---- per-request generators --------------------------------------------------------------------------------
GEN_DRAFT_COUNTS = [2, 0, 3, 1, 2, 0, 3, 3, 1, 2]
GEN_SEEDED = {0: 100, 1: 101, 2: 102, 5: 105, 6: 106, 7: 107}  # requests 1 and 5 have no drafts


def _gen_case(seed, V=8):
    g = torch.Generator().manual_seed(seed)
    T = sum(GEN_DRAFT_COUNTS)
    drafts = [torch.randint(0, V, (n,), generator=g).tolist() for n in GEN_DRAFT_COUNTS]
    target = torch.softmax(torch.randn(T, V, generator=g), -1)
    draft = torch.softmax(torch.randn(T, V, generator=g), -1)
    bonus = torch.randint(0, V, (len(GEN_DRAFT_COUNTS),), generator=g).tolist()
    return drafts, target, draft, bonus


def _gen_run(fn_name, backend, seeds, global_seed, case, generators_out=None):
    drafts, target, draft, bonus = case
    if fn_name == "rejection_sample_from_logits":
        target = torch.log(target)
    generators = {b: gen(s) for b, s in seeds.items()}
    if generators_out is not None:
        generators_out.update(generators)
    meta = vllm_metadata([1.0] * len(drafts), generators=generators)
    torch.manual_seed(global_seed)
    return _vllm_call(fn_name, drafts, target, draft, bonus, meta, max(GEN_DRAFT_COUNTS), backend).cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn_name", ["rejection_sample", "rejection_sample_from_logits"])
def test_vllm_generators_same_seed_same_tokens(backend, fn_name):
    chain_backend(backend)
    case = _gen_case(5)
    seeded = sorted(GEN_SEEDED)
    a = _gen_run(fn_name, backend, GEN_SEEDED, 1, case)
    b = _gen_run(fn_name, backend, GEN_SEEDED, 2, case)  # another global seed: the seeded requests don't care
    assert torch.equal(a[seeded], b[seeded]), f"\n{a[seeded]}\n{b[seeded]}"
    c = _gen_run(fn_name, backend, GEN_SEEDED, 1, case)  # everything the same: everything equal
    assert torch.equal(a, c)
    # The generators are actually read: other seeds, other tokens somewhere (10 seeded requests of 3 drafts).
    many_counts = [3] * 10
    g = torch.Generator().manual_seed(6)
    drafts = [torch.randint(0, 8, (3,), generator=g).tolist() for _ in many_counts]
    target = torch.softmax(torch.randn(30, 8, generator=g), -1)
    draft = torch.softmax(torch.randn(30, 8, generator=g), -1)
    if fn_name == "rejection_sample_from_logits":
        target = torch.log(target)
    bonus = [0] * 10
    outs = []
    for base in (300, 300, 400):
        meta = vllm_metadata([1.0] * 10, generators={b: gen(base + b) for b in range(10)})
        torch.manual_seed(0)
        outs.append(_vllm_call(fn_name, drafts, target, draft, bonus, meta, 3, backend).cpu())
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2]), "generators with other seeds gave the very same tokens"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn_name", ["rejection_sample", "rejection_sample_from_logits"])
def test_vllm_request_without_drafts_leaves_its_generator_alone(backend, fn_name):
    chain_backend(backend)
    case = _gen_case(7)
    gens = {}
    untouched = {b: gen(s).get_state() for b, s in GEN_SEEDED.items()}
    out = _gen_run(fn_name, backend, GEN_SEEDED, 3, case, generators_out=gens)
    for b in (1, 5):
        assert GEN_DRAFT_COUNTS[b] == 0
        assert torch.equal(gens[b].get_state(), untouched[b]), f"request {b} has no drafts but its generator moved"
        assert out[b].tolist() == [case[3][b]] + [-1] * max(GEN_DRAFT_COUNTS)


@pytest.mark.parametrize("fn_name", ["rejection_sample"])
def test_vllm_triton_equals_reference_with_generators(fn_name):
    """Probabilities and the same-seeded generators: the same tokens on every backend, bit for bit."""
    chain_backend("triton")
    case = _gen_case(8)
    seeds = {b: 500 + b for b in range(len(GEN_DRAFT_COUNTS))}
    ref = _gen_run(fn_name, "reference", seeds, 9, case)
    tri = _gen_run(fn_name, "triton", seeds, 9, case)
    assert torch.equal(ref, tri), f"\nreference {ref}\ntriton    {tri}"


# ======================================================================================================
# SGLang
# ======================================================================================================
def sglang_links(parents):
    """SGLang's layout from a parent list (parents[i] < i): children are pushed onto the head of the parent's
    list while walking the slots from the last to the first, so each list runs in increasing slot order."""
    n = len(parents)
    next_token, next_sibling = [-1] * n, [-1] * n
    for i in range(n - 1, 0, -1):
        p = parents[i]
        if next_token[p] != -1:
            next_sibling[i] = next_token[p]
        next_token[p] = i
    return next_token, next_sibling


def sglang_greedy_walk(candidates, retrive_index, next_token, next_sibling, target, num_steps, predicts_size):
    """Plain-Python restatement of sgl-kernel's greedy walk, per request b (all lists of lists, slots local):
    from the root, take the first child in sibling-list order whose candidate equals the target's token after
    the last accepted node; predicts at each accepted node's row gets the target's token there; accept_index
    gets the path's rows (retrive_index); at most num_steps - 1 drafts. Returns full expected outputs, with
    predicts' untouched rows at -1 and accept_index's unused columns at -1."""
    B = len(candidates)
    predicts = [-1] * predicts_size
    accept_index = [[-1] * num_steps for _ in range(B)]
    accept_num = [0] * B
    for b in range(B):
        last_slot = 0
        accept_index[b][0] = retrive_index[b][0]
        accepted = 0
        for _ in range(1, num_steps):
            want = target[b][last_slot]
            child = next_token[b][last_slot]
            while child != -1 and candidates[b][child] != want:
                child = next_sibling[b][child]
            if child == -1:
                break
            predicts[retrive_index[b][last_slot]] = want
            accepted += 1
            accept_index[b][accepted] = retrive_index[b][child]
            last_slot = child
        accept_num[b] = accepted
        predicts[retrive_index[b][last_slot]] = target[b][last_slot]
    return predicts, accept_index, accept_num


def random_sglang_batch(rng, B, N, vocab, match=0.75):
    """Random well-formed trees in SGLang's layout, with a target that often follows a child (so paths run deep).
    Sibling candidates may repeat (the first in sibling order wins)."""
    parents = []
    for _ in range(B):
        p = [-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, N)]
        parents.append(p)
    links = [sglang_links(p) for p in parents]
    next_token = [l[0] for l in links]
    next_sibling = [l[1] for l in links]
    candidates = [[int(x) for x in rng.integers(0, vocab, N)] for _ in range(B)]
    retrive_index = [[b * N + i for i in range(N)] for b in range(B)]
    target = []
    for b in range(B):
        row = []
        for i in range(N):
            kids = [j for j in range(1, N) if parents[b][j] == i]
            if kids and rng.random() < match:
                row.append(candidates[b][int(rng.choice(kids))])
            else:
                row.append(int(rng.integers(0, vocab)))
        target.append(row)
    return candidates, retrive_index, next_token, next_sibling, target


def _t(rows, dtype):
    return torch.tensor(rows, dtype=dtype, device=DEV)


def _sgl_buffers(B, N, num_steps, predicts_size):
    predicts = torch.full((predicts_size,), -1, dtype=torch.int32, device=DEV)
    accept_index = torch.full((B, num_steps), -1, dtype=torch.int32, device=DEV)
    accept_token_num = torch.full((B,), 77, dtype=torch.int32, device=DEV)  # SGLang allocates it with empty
    return predicts, accept_index, accept_token_num


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("call", ["keywords", "positional"])
def test_sglang_verify_tree_greedy_sgl_kernel_case(backend, dtype, call):
    """sgl-kernel's own test_verify_tree_greedy scenario (restated)."""
    tree_backend(backend)
    candidates = _t([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]], dtype)
    retrive_index = _t([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], dtype)
    next_token = _t([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]], dtype)
    next_sibling = _t([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]], dtype)
    target_predict = torch.full((2, 6), 18, dtype=dtype, device=DEV)
    target_predict[0, 0], target_predict[0, 3], target_predict[0, 4] = 3, 4, 5
    target_predict[1, 0], target_predict[1, 4] = 11, 12
    predicts, accept_index, accept_token_num = _sgl_buffers(2, 6, 4, 12)
    if call == "keywords":
        sgl_adapter.verify_tree_greedy(predicts=predicts, accept_index=accept_index,
                                       accept_token_num=accept_token_num, candidates=candidates,
                                       retrive_index=retrive_index, retrive_next_token=next_token,
                                       retrive_next_sibling=next_sibling, target_predict=target_predict,
                                       backend=backend)
    else:
        sgl_adapter.verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                       next_token, next_sibling, target_predict, backend=backend)
    assert predicts.cpu().tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert accept_index.cpu().tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert accept_token_num.cpu().tolist() == [3, 2]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("extra_predict_row", [True, False], ids=["predicts_BN_plus_1", "predicts_BN"])
def test_sglang_verify_tree_greedy_random_trees(backend, dtype, extra_predict_row):
    tree_backend(backend)
    rng = np.random.default_rng(20 + (dtype == torch.int32) + 2 * extra_predict_row)
    shapes = [(5, 8, 4), (4, 8, 8), (3, 6, 2), (3, 1, 1), (4, 7, 3)]
    if backend != "reference":
        shapes = shapes[:2] + shapes[3:4]
    for B, N, S in shapes:
        for _ in range(3 if backend == "reference" else 1):
            candidates, retrive_index, nt, ns, target = random_sglang_batch(rng, B, N, vocab=4)
            size = B * N + (1 if extra_predict_row else 0)
            exp_pred, exp_acc, exp_num = sglang_greedy_walk(candidates, retrive_index, nt, ns, target, S, size)
            predicts, accept_index, accept_token_num = _sgl_buffers(B, N, S, size)
            sgl_adapter.verify_tree_greedy(predicts=predicts, accept_index=accept_index,
                                           accept_token_num=accept_token_num, candidates=_t(candidates, dtype),
                                           retrive_index=_t(retrive_index, dtype), retrive_next_token=_t(nt, dtype),
                                           retrive_next_sibling=_t(ns, dtype), target_predict=_t(target, dtype),
                                           backend=backend)
            what = f"B={B} N={N} S={S}\ncandidates={candidates}\nnext={nt}\nsibling={ns}\ntarget={target}"
            assert accept_token_num.cpu().tolist() == exp_num, what
            assert accept_index.cpu().tolist() == exp_acc, what
            assert predicts.cpu().tolist() == exp_pred, what


def _sgl_sampling_call(backend, candidates, retrive_index, nt, ns, target_probs, S, predicts_size, dtype=torch.int32,
                       threshold_single=1.0, threshold_acc=1.0, uniform=None, uniform_final=None):
    B, N = len(candidates), len(candidates[0])
    predicts, accept_index, accept_token_num = _sgl_buffers(B, N, S, predicts_size)
    if uniform is None:
        uniform = torch.rand(B, N, dtype=torch.float32, device=DEV)
    if uniform_final is None:
        uniform_final = torch.rand(B, dtype=torch.float32, device=DEV)
    sgl_adapter.tree_speculative_sampling_target_only(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
        candidates=_t(candidates, dtype), retrive_index=_t(retrive_index, dtype),
        retrive_next_token=_t(nt, dtype), retrive_next_sibling=_t(ns, dtype),
        uniform_samples=uniform, uniform_samples_for_final_sampling=uniform_final,
        target_probs=target_probs.to(DEV), draft_probs=torch.zeros_like(target_probs, device=DEV),
        threshold_single=threshold_single, threshold_acc=threshold_acc, deterministic=True, backend=backend)
    return predicts.cpu(), accept_index.cpu(), accept_token_num.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sglang_tree_sampling_one_hot_targets_known_outputs(backend, dtype):
    """One-hot target rows make the sampled walk certain: it is the greedy walk; outputs land in place."""
    tree_backend(backend)
    rng = np.random.default_rng(31)
    vocab = 5
    shapes = [(4, 7, 4), (3, 6, 2), (2, 5, 5)] if backend == "reference" else [(4, 7, 4), (2, 5, 2)]
    for B, N, S in shapes:
        candidates, retrive_index, nt, ns, target = random_sglang_batch(rng, B, N, vocab)
        probs = torch.nn.functional.one_hot(torch.tensor(target), vocab).float()
        size = B * N + 1
        exp_pred, exp_acc, exp_num = sglang_greedy_walk(candidates, retrive_index, nt, ns, target, S, size)
        torch.manual_seed(0)
        predicts, accept_index, accept_num = _sgl_sampling_call(backend, candidates, retrive_index, nt, ns, probs,
                                                                S, size, dtype)
        what = f"B={B} N={N} S={S}\ncandidates={candidates}\nnext={nt}\nsibling={ns}\ntarget={target}"
        assert accept_num.tolist() == exp_num, what
        assert accept_index.tolist() == exp_acc, what
        used = [r for row in exp_acc for r in row if r != -1]
        assert predicts[used].tolist() == [exp_pred[r] for r in used], what


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["threshold_single", "threshold_acc"])
@pytest.mark.parametrize("value", [0.5, 0.0, 2.0])
def test_sglang_thresholds_other_than_one_raise(backend, which, value):
    tree_backend(backend)
    rng = np.random.default_rng(32)
    candidates, retrive_index, nt, ns, target = random_sglang_batch(rng, 2, 4, 5)
    probs = torch.softmax(torch.randn(2, 4, 5), -1)
    kwargs = {which: value}
    with pytest.raises(ValueError, match=which):
        _sgl_sampling_call(backend, candidates, retrive_index, nt, ns, probs, 3, 9, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_uniform_samples_are_not_read(backend):
    """Our randomness replaces the engine's uniform samples: under the same torch seed, any uniform samples give
    the same outputs."""
    tree_backend(backend)
    rng = np.random.default_rng(33)
    B, N, V = 6, 6, 5
    candidates, retrive_index, nt, ns, _ = random_sglang_batch(rng, B, N, V)
    probs = torch.softmax(torch.randn(B, N, V, generator=torch.Generator().manual_seed(1)) * 0.7, -1)
    outs = []
    for fill in (0.0, 0.999, 0.5):
        uniform = torch.full((B, N), fill, device=DEV)
        uniform_final = torch.full((B,), fill, device=DEV)
        torch.manual_seed(77)
        outs.append(_sgl_sampling_call(backend, candidates, retrive_index, nt, ns, probs, 4, B * N + 1,
                                       uniform=uniform, uniform_final=uniform_final))
    for other in outs[1:]:
        for a, b in zip(outs[0][1:], other[1:]):
            assert torch.equal(a, b)
        used = [r for row in outs[0][1].tolist() for r in row if r != -1]
        assert torch.equal(outs[0][0][used], other[0][used])


def test_sglang_tree_sampling_triton_equals_reference():
    """Probabilities and the same torch seed: the same outputs on both backends, bit for bit."""
    tree_backend("triton")
    rng = np.random.default_rng(34)
    B, N, V = 6, 7, 6
    candidates, retrive_index, nt, ns, _ = random_sglang_batch(rng, B, N, V)
    probs = torch.softmax(torch.randn(B, N, V, generator=torch.Generator().manual_seed(2)), -1)
    outs = []
    for backend in ("reference", "triton"):
        torch.manual_seed(5)
        outs.append(_sgl_sampling_call(backend, candidates, retrive_index, nt, ns, probs, 4, B * N + 1))
    (p_r, a_r, n_r), (p_t, a_t, n_t) = outs
    assert torch.equal(a_r, a_t) and torch.equal(n_r, n_t)
    used = [r for row in a_r.tolist() for r in row if r != -1]
    assert torch.equal(p_r[used], p_t[used])


# Tree for the law test: root 0 with children 1 (token 1) and 2 (token 3); node 3 (token 0) under 1, node 4
# (token 2) under 2. Slots in SGLang's layout.
LAW_TREE_PARENTS = [-1, 0, 0, 1, 2]
LAW_TREE_TOKENS = [4, 1, 3, 0, 2]


def test_sglang_tree_sampling_law():
    """The emitted sequence (up to 3 tokens, accept_index width 3) follows sampling the target autoregressively
    along the tree: first token ~ target at the root; after accepting a node, the next ~ that node's row.
    Power: the first token rejects the law with the temperature applied again (p0^2)."""
    n = 4000
    V = 5
    N = len(LAW_TREE_PARENTS)
    g = torch.Generator().manual_seed(40)
    rows = torch.softmax(torch.randn(N, V, generator=g) * 0.8, -1)
    rows[0] = torch.tensor([0.1, 0.3, 0.15, 0.25, 0.2])
    nt, ns = sglang_links(LAW_TREE_PARENTS)
    candidates = [LAW_TREE_TOKENS] * n
    retrive_index = [[b * N + i for i in range(N)] for b in range(n)]
    probs = rows.unsqueeze(0).repeat(n, 1, 1)
    torch.manual_seed(2024)
    predicts, accept_index, accept_num = _sgl_sampling_call("reference", candidates, retrive_index, [nt] * n,
                                                            [ns] * n, probs, 3, n * N + 1)
    seq = torch.full((n, 3), -1, dtype=torch.long)
    for j in range(3):
        has = accept_num >= j
        rows_j = accept_index[:, j]
        seq[has, j] = predicts[rows_j[has].long()].long()
    assert (seq[:, 0] >= 0).all()
    # Exact joint.
    p = rows.double().numpy()
    children = {i: [j for j in range(1, N) if LAW_TREE_PARENTS[j] == i] for i in range(N)}
    expected = {}

    def walk(node, prefix, prob, depth):
        for x in range(V):
            px = prob * p[node, x]
            if px == 0:
                continue
            kid = [c for c in children[node] if LAW_TREE_TOKENS[c] == x]
            if kid and depth + 1 < 3:
                walk(kid[0], prefix + (x,), px, depth + 1)
            else:
                expected[prefix + (x,) + (-1,) * (2 - depth)] = px
    walk(0, (), 1.0, 0)
    assert abs(sum(expected.values()) - 1) < 1e-5
    counts = histogram(seq)
    p_ok = chi_square_pvalue(counts, expected, n)
    assert p_ok > SIGNIFICANCE, f"p={p_ok} counts={counts}"
    first = histogram(seq[:, 0])
    assert chi_square_pvalue(first, law_dict(p[0]), n) > SIGNIFICANCE
    squared = p[0] ** 2 / (p[0] ** 2).sum()
    assert chi_square_pvalue(first, law_dict(squared), n) < SIGNIFICANCE


# ======================================================================================================
# FlashInfer
# ======================================================================================================
def _fi_case(seed, B=48, K=3, V=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    ids = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K).to(torch.int32)
    return q.to(DEV), ids.to(DEV), p.to(DEV)


def _fi(case, backend, **kwargs):
    q, ids, p = case
    res = fi_adapter.chain_speculative_sampling(q, ids, p, backend=backend, **kwargs)
    return res


def _tokens(res):
    out = res[0] if isinstance(res, tuple) else res
    assert out.dtype == torch.int32
    return out.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lone", ["int_seed", "int_offset", "tensor_seed", "tensor_offset"])
def test_flashinfer_lone_seed_or_offset_changes_nothing(backend, lone):
    chain_backend(backend)
    case = _fi_case(1)
    B = case[1].shape[0]
    lone_kwargs = {"int_seed": dict(seed=123), "int_offset": dict(offset=7),
                   "tensor_seed": dict(seed=torch.full((B,), 123, dtype=torch.int64, device=DEV)),
                   "tensor_offset": dict(offset=torch.tensor(7, dtype=torch.int64, device=DEV))}[lone]
    g1, g2 = gen(9), gen(9)
    ref = _fi(case, backend, generator=g1)
    out = _fi(case, backend, generator=g2, **lone_kwargs)  # not an error, and the draws still come from generator
    assert torch.equal(_tokens(ref), _tokens(out))
    assert torch.equal(g1.get_state(), g2.get_state()), "the generator was not used the same way"


@pytest.mark.parametrize("backend", BACKENDS)
def test_flashinfer_draws_come_from_the_generator(backend):
    chain_backend(backend)
    case = _fi_case(2)
    a = _tokens(_fi(case, backend, generator=gen(9)))
    b = _tokens(_fi(case, backend, generator=gen(9)))
    c = _tokens(_fi(case, backend, generator=gen(10)))
    assert torch.equal(a, b)
    assert not torch.equal(a, c), "another generator seed gave the very same tokens"
    g = gen(9)
    first = _tokens(_fi(case, backend, generator=g))
    second = _tokens(_fi(case, backend, generator=g))
    assert torch.equal(first, a)
    assert not torch.equal(first, second), "a second call on the same generator reused its numbers"
    # No generator: torch's default generator governs the draws.
    torch.manual_seed(3)
    d = _tokens(_fi(case, backend))
    torch.manual_seed(3)
    e = _tokens(_fi(case, backend))
    assert torch.equal(d, e)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["int", "tensor"])
def test_flashinfer_seed_and_offset_together_replace_the_generator(backend, kind):
    chain_backend(backend)
    case = _fi_case(3)
    B = case[1].shape[0]

    def so(seed, offset):
        if kind == "int":
            return dict(seed=seed, offset=offset)
        return dict(seed=torch.full((B,), seed, dtype=torch.int64, device=DEV),
                    offset=torch.full((B,), offset, dtype=torch.int64, device=DEV))

    g1, g2 = gen(1), gen(2)
    before = g1.get_state()
    a = _tokens(_fi(case, backend, generator=g1, **so(123, 0)))
    b = _tokens(_fi(case, backend, generator=g2, **so(123, 0)))
    c = _tokens(_fi(case, backend, generator=None, **so(123, 0)))
    assert torch.equal(a, b) and torch.equal(a, c), "with seed and offset the generator must not matter"
    assert torch.equal(g1.get_state(), before), "with seed and offset the generator must not be drawn from"
    assert not torch.equal(a, _tokens(_fi(case, backend, **so(123, 1000)))), "offset is not read"
    assert not torch.equal(a, _tokens(_fi(case, backend, **so(124, 0)))), "seed is not read"


def test_flashinfer_triton_equals_reference():
    chain_backend("triton")
    case = _fi_case(4)
    for kwargs in (dict(seed=5, offset=11), dict(generator="g")):
        outs = []
        for backend in ("reference", "triton"):
            kw = dict(kwargs)
            if kw.get("generator") == "g":
                kw["generator"] = gen(12)
            outs.append(_fi(case, backend, **kw))
        assert torch.equal(_tokens(outs[0]), _tokens(outs[1])), kwargs


def _fi_counter_case():
    """Each position is either certainly accepted (p(t) >= q(t)) or certainly rejected (p(t) = 0):
    request 0 accepts all four; 1 rejects position 1; 2 rejects position 0; 3 rejects positions 0 and 2."""
    B, K, V = 4, 4, 6
    g = torch.Generator().manual_seed(50)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    ids = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    reject = {(1, 1), (2, 0), (3, 0), (3, 2)}
    for b in range(B):
        for i in range(K):
            t = int(ids[b, i])
            if (b, i) in reject:
                row = q[b, i].clone()
                row[t] = 0.0
                p[b, i] = row / row.sum()
            else:
                p[b, i] = 0.5 * q[b, i] + 0.5 * torch.nn.functional.one_hot(torch.tensor(t), V).float()
    accepted = [4, 3, 3, 2]   # each position judged as if independently
    emitted = [4, 1, 0, 0]    # accepted draft tokens of the chain
    return (q.to(DEV), ids.to(torch.int32).to(DEV), p.to(DEV)), accepted, emitted


@pytest.mark.parametrize("backend", BACKENDS)
def test_flashinfer_counters_are_added_in_place(backend):
    chain_backend(backend)
    case, accepted, emitted = _fi_counter_case()
    acc = torch.tensor([10, 20, 30, 40], dtype=torch.int32, device=DEV)
    emi = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=DEV)
    res = _fi(case, backend, maybe_output_accepted_token_num=acc, maybe_output_emitted_draft_token_num=emi,
              generator=gen(1))
    assert acc.cpu().tolist() == [a + x for a, x in zip([10, 20, 30, 40], accepted)]
    assert emi.cpu().tolist() == [a + x for a, x in zip([1, 2, 3, 4], emitted)]
    if isinstance(res, tuple):
        assert len(res) == 3
        assert torch.equal(res[1].cpu(), acc.cpu()) and torch.equal(res[2].cpu(), emi.cpu())
    out = _tokens(res)
    K = 4
    assert tuple(out.shape) == (4, K + 1)
    ids = case[1].cpu()
    for b in range(4):
        n = emitted[b]
        assert out[b, :n].tolist() == ids[b, :n].tolist()
        assert 0 <= int(out[b, n]) < 6
        assert out[b, n + 1:].tolist() == [-1] * (K - n)
        if n < K:
            assert int(out[b, n]) != int(ids[b, n]), "a rejected draft token (p = 0) was emitted"
    # A second call adds again.
    _fi(case, backend, maybe_output_accepted_token_num=acc, maybe_output_emitted_draft_token_num=emi,
        generator=gen(2))
    assert acc.cpu().tolist() == [a + 2 * x for a, x in zip([10, 20, 30, 40], accepted)]
    assert emi.cpu().tolist() == [a + 2 * x for a, x in zip([1, 2, 3, 4], emitted)]
    # Without counters: the tuple carries fresh ones (FlashInfer returns them).
    res = _fi(case, backend, generator=gen(3))
    if isinstance(res, tuple):
        assert res[1].cpu().tolist() == accepted and res[2].cpu().tolist() == emitted


def test_flashinfer_counter_expectations():
    """Random drafts drawn from q. Emitted counter: the chain's accepted drafts, E = a0 + a0 a1 + a0 a1 a2 with
    a_i = sum_t min(p_i(t), q_i(t)). Accepted counter ("each position judged as if independently", FlashInfer's
    semantics): the chain's positions before the stop count as judged, and every position from the stop on
    (the rejected one included) is judged again with a fresh uniform, as FlashInfer's kernel does. Its
    expectation is E[pos] + E[sum_{i >= pos} r_i(t_i) | chain] with r = min(1, p/q)."""
    B, K, V = 4000, 3, 6
    g = torch.Generator().manual_seed(60)
    q1 = torch.softmax(torch.randn(K, V, generator=g), -1)
    p1 = torch.softmax(torch.randn(K + 1, V, generator=g), -1)
    q = q1.unsqueeze(0).repeat(B, 1, 1)
    p = p1.unsqueeze(0).repeat(B, 1, 1)
    ids = torch.multinomial(q.view(-1, V), 1, replacement=True, generator=g).view(B, K).to(torch.int32)
    acc = torch.zeros(B, dtype=torch.int32)
    emi = torch.zeros(B, dtype=torch.int32)
    out = _tokens(fi_adapter.chain_speculative_sampling(q.to(DEV), ids.to(DEV), p.to(DEV), acc, emi,
                                                         generator=gen(61), backend="reference"))
    qd, pd = q1.double(), p1[:K].double()
    r = torch.clamp(pd / qd, max=1.0)
    a = (qd * r).sum(-1)                    # P(position i accepted), its draft drawn from q_i
    rejected_then_accepted = (qd * (1 - r) * r).sum(-1)
    exp_emi = float(a[0] + a[0] * a[1] + a[0] * a[1] * a[2])
    exp_acc = 0.0
    for pos in range(K + 1):
        reach = float(torch.prod(a[:pos])) if pos else 1.0
        if pos == K:
            exp_acc += reach * K
        else:
            exp_acc += reach * (pos * (1 - float(a[pos])) + float(rejected_then_accepted[pos])
                                + (1 - float(a[pos])) * float(a[pos + 1:].sum()))
    for counter, expect, what in ((emi, exp_emi, "emitted"), (acc, exp_acc, "accepted")):
        values = counter.double()
        tol = 6 * float(values.std()) / B ** 0.5 + 1e-3
        assert abs(float(values.mean()) - expect) < tol, (what, float(values.mean()), expect, tol)
    assert (acc >= emi).all(), "a chain-accepted position is also counted by the accepted counter"
    assert torch.equal((out != -1).sum(1).to(torch.int32) - 1, emi)
