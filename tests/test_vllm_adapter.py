"""sk.adapters.vllm: vLLM V1's rejection_sample, called as vLLM calls it, over sk.chain_verify_packed.

vLLM's ``RejectionSampler.forward`` calls ``rejection_sample(draft_token_ids,
num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
target_probs, bonus_token_ids, sampling_metadata)`` positionally, with
``target_probs = compute_probs(target_logits, ...)``: the logits themselves
when every request is greedy, else the softmax of the processed logits.
These tests make the same call, with ``sampling_metadata`` a plain object
carrying vLLM's attribute names (``metadata`` below is vLLM's
``create_sampling_metadata``).

The greedy cases, ``test_seeded_requests_repeat`` (vLLM's
``test_deterministic_when_seeded``) and the top-k/top-p cases are vLLM's own
(``tests/v1/sample/test_rejection_sampler.py``), restated. The rest checks
the mapping onto ``chain_verify_packed`` bit for bit on every backend, and
the law by chi-square on the reference, with power against the law that
applying the temperature twice gives.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import specdec_kernels as sk
from conftest import DEVICE
from markov import SIGNIFICANCE, chi_square_pvalue
from specdec_kernels import _backend
from specdec_kernels._extension import cuda_extension_available, extension_ops
from specdec_kernels.adapters import vllm

VOCAB = 100


@pytest.fixture(params=["reference", "triton", "cuda"])
def backend(request, monkeypatch):
    """A backend name; ``"cuda"`` without a GPU runs the kernels' host programs."""
    name = request.param
    if name == "cuda" and DEVICE != "cuda":
        if not (cuda_extension_available() and "chain_verify_packed" in extension_ops()):
            pytest.skip("the CUDA extension is not built")
        monkeypatch.setattr(_backend, "resolve", lambda op_name, backend, device: "cuda")
    return name


def metadata(temperature=None, top_k=None, top_p=None, generators=None):
    """vLLM's ``create_sampling_metadata``: ``temperature=None`` is its all-greedy batch."""
    return SimpleNamespace(all_greedy=temperature is None, all_random=temperature is not None,
                           temperature=temperature, top_k=top_k, top_p=top_p, generators=generators or {})


def greedy_case(spec_tokens, output_tokens):
    """vLLM's ``create_logits_tensor``: positional arguments whose argmax gives ``output_tokens``, all greedy."""
    logits = torch.full((sum(map(len, spec_tokens)), VOCAB), -100.0)
    row = 0
    for tokens, outputs in zip(spec_tokens, output_tokens):
        for position in range(len(tokens)):
            logits[row, outputs[position]] = 100.0
            row += 1
    counts = [len(tokens) for tokens in spec_tokens]
    return [
        torch.tensor([token for tokens in spec_tokens for token in tokens], dtype=torch.int64),
        counts,
        max(counts),
        torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32),
        None,
        logits,  # vLLM's compute_probs returns the logits when all_greedy
        torch.tensor([[outputs[-1]] for outputs in output_tokens]),
        metadata(),
    ]


def on_device(arguments):
    return [value.to(DEVICE) if isinstance(value, torch.Tensor) else value for value in arguments]


VLLM_GREEDY_CASES = {
    "perfect_match": ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),
    "early_mismatch": ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, -1, -1]]),
    "multiple_sequences": ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4, -1]]),
    "single_token": ([[1]], [[1, 2]], [[1, 2]]),
    "empty_sequence": ([[]], [[5]], [[5]]),
    "multiple_mismatches": ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]],
                            [[1, 2, 7, -1], [4, 8, -1, -1]]),
    "perfect_match_with_bonus": ([[1, 2]], [[1, 2, 3]], [[1, 2, 3]]),
    "first_mismatch": ([[1]], [[2, 3]], [[2, -1]]),
    "mixed_matches": ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5, -1], [3, 4, 7]]),
}
FUNCTIONS = [vllm.rejection_sample, vllm.rejection_sample_from_logits]


@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda function: function.__name__)
@pytest.mark.parametrize("name", VLLM_GREEDY_CASES)
def test_vllms_greedy_cases(name, function, backend):
    spec_tokens, output_tokens, expected = VLLM_GREEDY_CASES[name]
    output = function(*on_device(greedy_case(spec_tokens, output_tokens)), backend=backend)
    assert output.dtype == torch.int32
    assert output.cpu().tolist() == expected


@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda function: function.__name__)
@pytest.mark.parametrize("marker", [0.0, -1.0])
def test_greedy_markers_give_the_greedy_tokens(marker, function, backend):
    """A batch that is not all greedy marks its greedy requests by a temperature of -1 (vLLM's
    GREEDY_TEMPERATURE) or 0; vLLM then passes the softmax at T = 1 of their rows."""
    spec_tokens, output_tokens, expected = VLLM_GREEDY_CASES["multiple_mismatches"]
    arguments = greedy_case(spec_tokens, output_tokens)
    if function is vllm.rejection_sample:
        arguments[5] = torch.softmax(arguments[5], -1)
    arguments[7] = metadata(temperature=torch.tensor([marker, marker]).to(DEVICE))
    assert function(*on_device(arguments), backend=backend).cpu().tolist() == expected


def sampled_case(seed, batch_size=4, max_drafts=3, vocab_size=VOCAB, counts=None):
    """vLLM's random-sampling inputs: softmaxed uniform draft rows, uniform target logits, random ids.

    The positional arguments without ``sampling_metadata``, ``target`` raw logits.
    """
    generator = torch.Generator().manual_seed(seed)
    counts = counts or [max_drafts] * batch_size
    num_tokens = sum(counts)
    draft_probs = torch.softmax(torch.rand(num_tokens, vocab_size, generator=generator) * 4, -1)
    return [
        torch.randint(vocab_size, (num_tokens,), generator=generator),
        counts,
        max(counts),
        torch.tensor(counts).cumsum(0),
        draft_probs,
        torch.rand(num_tokens, vocab_size, generator=generator) * 4,
        torch.randint(vocab_size, (len(counts), 1), generator=generator),
    ]


def generators_of(seeds):
    return {index: torch.Generator(device=DEVICE).manual_seed(seed) for index, seed in seeds.items()}


@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda function: function.__name__)
def test_seeded_requests_repeat(function, backend):
    """vLLM's test_deterministic_when_seeded: requests with a generator seeded alike give the same tokens."""
    arguments = on_device(sampled_case(0))
    temperature = torch.ones(4, device=DEVICE)
    seeded = {0: 11, 2: 12}
    runs = [function(*arguments, metadata(temperature, generators=generators_of(seeded)), backend=backend).cpu()
            for _ in range(3)]
    for index in seeded:
        assert all(torch.equal(run[index], runs[0][index]) for run in runs)


def test_a_seeded_request_gives_its_tokens_whatever_its_batch(backend):
    """The request's generator, not its batch index or its neighbours, decides its random numbers."""
    alone = sampled_case(1, batch_size=1)
    crowd = sampled_case(2, batch_size=3, counts=[2, 3, 1])
    # Put the lone request at index 1 of the crowd: its rows replace the crowd's second request's.
    rows = slice(2, 5)
    for place in (0, 4, 5):  # draft_token_ids, draft_probs, target
        crowd[place][rows] = alone[place]
    crowd[6][1] = alone[6][0]
    temperature = torch.tensor([0.8], device=DEVICE)
    single = vllm.rejection_sample_from_logits(*on_device(alone), metadata(temperature, generators=generators_of({0: 5})),
                                               backend=backend)
    batched = vllm.rejection_sample_from_logits(
        *on_device(crowd), metadata(temperature.expand(3).contiguous(), generators=generators_of({1: 5})),
        backend=backend)
    assert torch.equal(batched[1].cpu(), single[0].cpu())


def test_a_request_without_drafts_leaves_its_generator_alone():
    """As vLLM does (its generate_uniform_probs): no draft, no random number drawn from the request's generator."""
    arguments = on_device(sampled_case(4, counts=[2, 0, 3]))
    generators = generators_of({0: 1, 1: 2})
    states = {index: generator.get_state() for index, generator in generators.items()}
    vllm.rejection_sample_from_logits(*arguments, metadata(torch.ones(3, device=DEVICE), generators=generators),
                                      backend="reference")
    assert torch.equal(generators[1].get_state(), states[1])
    assert not torch.equal(generators[0].get_state(), states[0])


@pytest.mark.parametrize("truncation", ["none", "top_k_top_p"])
def test_the_op_from_logits_calls(truncation, backend):
    """With every request seeded, rejection_sample_from_logits is chain_verify_packed on the bonus-free
    layout with the generators' draws as seeds and the metadata's temperature and truncation, bit for bit;
    the reference gives the same tokens."""
    arguments = on_device(sampled_case(3, counts=[3, 0, 2, 3]))
    keywords = dict(temperature=torch.tensor([1.0, 0.7, 0.0, 1.3], device=DEVICE))
    if truncation != "none":
        keywords.update(top_k=torch.tensor([5, VOCAB, 0, 20], device=DEVICE),
                        top_p=torch.tensor([0.9, 1.0, 0.5, 0.8], device=DEVICE))
    seeds = {0: 100, 2: 102, 3: 103}  # request 1 has no drafts: its generator is not drawn from
    got = vllm.rejection_sample_from_logits(*arguments, metadata(**keywords, generators=generators_of(seeds)),
                                            backend=backend)
    drawn = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    for index, generator in generators_of(seeds).items():
        drawn[index] = torch.randint(2**63 - 1, (1,), dtype=torch.int64, generator=generator, device=DEVICE)[0]
    want = sk.chain_verify_packed(
        arguments[0], torch.nn.functional.pad(arguments[3], (1, 0)), arguments[5], arguments[4],
        max_num_draft_tokens=3, logits=True, seed=drawn, bonus_token_ids=arguments[6].view(-1),
        backend="reference", **keywords)[0]
    assert torch.equal(got.cpu(), want.cpu())


def test_the_op_rejection_sample_calls(backend):
    """rejection_sample reads the sixth argument as the law, given: chain_verify_packed on probabilities, with
    the temperature only marking greedy requests (and the metadata's top-k/top-p, already applied, not read)."""
    arguments = sampled_case(5, counts=[3, 1, 2])
    arguments[5] = torch.softmax(arguments[5], -1)
    arguments = on_device(arguments)
    temperature = torch.tensor([0.5, -1.0, 2.0], device=DEVICE)
    seeds = {0: 7, 1: 8, 2: 9}
    got = vllm.rejection_sample(*arguments, metadata(temperature, top_k=torch.tensor([1, 1, 1], device=DEVICE),
                                                     generators=generators_of(seeds)), backend=backend)
    drawn = torch.cat([torch.randint(2**63 - 1, (1,), dtype=torch.int64, generator=generator, device=DEVICE)
                       for generator in generators_of(seeds).values()])
    want = sk.chain_verify_packed(
        arguments[0], torch.nn.functional.pad(arguments[3], (1, 0)), arguments[5], arguments[4],
        max_num_draft_tokens=3, temperature=torch.tensor([1.0, 0.0, 1.0], device=DEVICE), seed=drawn,
        bonus_token_ids=arguments[6].view(-1), backend="reference")[0]
    assert torch.equal(got.cpu(), want.cpu())


def first_token_counts(function, target, draft, temperature, top_k, batch_size):
    """Counts of each request's first token over ``batch_size`` one-request copies of two positions."""
    generator = torch.Generator().manual_seed(11)
    ids = torch.multinomial(draft, batch_size, replacement=True, generator=generator).t().reshape(-1)
    output = function(
        ids, [2] * batch_size, 2, torch.arange(1, batch_size + 1) * 2, draft.repeat(batch_size, 1),
        target.repeat(batch_size, 1), torch.zeros(batch_size, 1, dtype=torch.int64),
        metadata(torch.full((batch_size,), temperature), top_k=torch.full((batch_size,), top_k)),
        backend="reference")
    tokens, counts = output[:, 0].unique(return_counts=True)
    return {(int(token),): int(count) for token, count in zip(tokens, counts)}


def law(probabilities):
    return {(token,): float(value) for token, value in enumerate(probabilities) if value > 0}


def test_the_first_token_follows_the_processed_target():
    """Law (reference): whatever the drafts, a request's first token from rejection_sample_from_logits is
    distributed as vLLM's processed target row, softmax(logits / T) truncated to the top k. Chi-square,
    6,000 requests, fixed seed."""
    generator = torch.Generator().manual_seed(7)
    batch_size, vocab_size, temperature, top_k = 6000, 6, 0.7, 4
    logits = torch.randn(2, vocab_size, generator=generator) * 1.5
    draft = torch.softmax(torch.randn(2, vocab_size, generator=generator), -1)
    observed = first_token_counts(vllm.rejection_sample_from_logits, logits, draft, temperature, top_k, batch_size)
    processed = torch.softmax(logits[0].double() / temperature, -1)
    kept = processed.topk(top_k).indices
    expected = torch.zeros(vocab_size, dtype=torch.float64)
    expected[kept] = processed[kept] / processed[kept].sum()
    assert chi_square_pvalue(observed, law(expected), batch_size) > SIGNIFICANCE


def test_rejection_sample_keeps_the_law_it_is_given():
    """Law (reference): rejection_sample's first token follows target_probs as given, at T = 0.5 and top_k
    = 2 in the metadata (vLLM applied them already). Power: the same counts reject softmax(log p / T), the law
    a second temperature would give. Chi-square, 6,000 requests, fixed seed."""
    generator = torch.Generator().manual_seed(8)
    batch_size, vocab_size, temperature = 6000, 5, 0.5
    target_probs = torch.softmax(torch.randn(2, vocab_size, generator=generator), -1)
    draft = torch.softmax(torch.randn(2, vocab_size, generator=generator), -1)
    observed = first_token_counts(vllm.rejection_sample, target_probs, draft, temperature, 2, batch_size)
    given = target_probs[0].double()
    assert chi_square_pvalue(observed, law(given), batch_size) > SIGNIFICANCE
    twice = torch.softmax(given.log() / temperature, -1)
    assert chi_square_pvalue(observed, law(twice), batch_size) < SIGNIFICANCE


def vllm_masked_case(target_logits, sampling_metadata, batch_size, num_draft_tokens):
    """vLLM's ``_test_masked_logits``: drafts drawn from random draft rows; the emitted drafts and recovered
    tokens (bonus excluded) of every position."""
    num_tokens = batch_size * num_draft_tokens
    generator = torch.Generator().manual_seed(12)
    draft_probs = torch.softmax(torch.rand(num_tokens, VOCAB, generator=generator), -1)
    draft_token_ids = torch.multinomial(draft_probs, 1, generator=generator).view(-1)
    cu = torch.arange(1, batch_size + 1) * num_draft_tokens
    output = vllm.rejection_sample_from_logits(
        draft_token_ids, [num_draft_tokens] * batch_size, num_draft_tokens, cu, draft_probs, target_logits,
        torch.zeros(batch_size, 1, dtype=torch.int64), sampling_metadata, backend="reference")
    return output[:, :-1].reshape(-1).tolist()


@pytest.mark.parametrize("top_k", [1, 5, 99])
def test_vllms_top_k(top_k):
    """vLLM's test_top_k: tokens outside each row's top k (logits 0.1 below) are never emitted."""
    batch_size, num_draft_tokens = 100, 3
    generator = torch.Generator().manual_seed(top_k)
    top_k_indices = torch.stack([torch.randperm(VOCAB, generator=generator)[:top_k]
                                 for _ in range(batch_size * num_draft_tokens)])
    target_logits = torch.zeros(batch_size * num_draft_tokens, VOCAB)
    target_logits.scatter_(1, top_k_indices, 0.1)
    tokens = vllm_masked_case(target_logits, metadata(torch.ones(batch_size),
                                                      top_k=torch.full((batch_size,), top_k)),
                              batch_size, num_draft_tokens)
    for row, token in enumerate(tokens):
        assert token == -1 or token in top_k_indices[row].tolist()


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_vllms_top_p(top_p):
    """vLLM's test_top_p: only the smallest set of largest probabilities reaching top_p is ever emitted."""
    batch_size, num_draft_tokens = 100, 3
    target_logits = torch.randn(batch_size * num_draft_tokens, VOCAB, generator=torch.Generator().manual_seed(3))
    sorted_logits, order = target_logits.sort(-1)
    dropped = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
    dropped[:, -1] = False
    tokens = vllm_masked_case(target_logits, metadata(torch.ones(batch_size), top_p=torch.full((batch_size,), top_p)),
                              batch_size, num_draft_tokens)
    for row, token in enumerate(tokens):
        assert token == -1 or token in order[row][~dropped[row]].tolist()


def test_bad_inputs_name_the_argument():
    arguments = greedy_case(*VLLM_GREEDY_CASES["multiple_sequences"][:2])

    def replaced(place, value):
        return arguments[:place] + [value] + arguments[place + 1:]

    with pytest.raises(ValueError, match=r"`bonus_token_ids` must have shape \[B, 1\] = \[2, 1\]; got \[2\]"):
        vllm.rejection_sample(*replaced(6, arguments[6].view(-1)))
    with pytest.raises(TypeError, match="`num_draft_tokens` must be a list of B = 2 ints"):
        vllm.rejection_sample(*replaced(1, [2]))
    with pytest.raises(ValueError, match=r"`sampling_metadata.generators` keys must be batch indices in "
                                         r"\[0, B\) = \[0, 2\); got 2"):
        vllm.rejection_sample(*replaced(7, metadata(torch.ones(2), generators={2: torch.Generator()})))
    with pytest.raises(TypeError, match="`cu_num_draft_tokens` must have dtype"):
        vllm.rejection_sample_from_logits(*replaced(3, arguments[3].float()))
    with pytest.raises(TypeError, match="`target_probs` must be a torch.Tensor"):
        vllm.rejection_sample(*replaced(5, arguments[5].tolist()))


@pytest.mark.parametrize("kind", ["raw", "processed"])
def test_from_logits_returns_the_ops_logprobs(kind):
    """logprobs= (reference): chain_verify_packed's logprobs of the same call (the generators' seeds, the
    metadata's temperature and top-k), bit for bit; NaN where vLLM's bonus token was emitted (its row is not in
    target_logits), -inf at the placeholders."""
    arguments = sampled_case(8, counts=[3, 0, 2, 3])
    seeds = {0: 1, 1: 2, 2: 3, 3: 4}
    keywords = dict(temperature=torch.tensor([1.0, 0.7, 0.0, 1.3]), top_k=torch.tensor([5, VOCAB, 0, 20]))
    tokens, logprobs = vllm.rejection_sample_from_logits(
        *arguments, metadata(**keywords, generators=generators_of(seeds)), logprobs=kind, backend="reference")
    drawn = torch.cat([torch.randint(2**63 - 1, (1,), dtype=torch.int64, generator=generator)
                       for generator in generators_of(seeds).values()])
    drawn[1] = 0  # request 1 has no drafts: its generator is not drawn from, and it draws nothing
    want_tokens, _, want = sk.chain_verify_packed(
        arguments[0], torch.nn.functional.pad(arguments[3], (1, 0)), arguments[5], arguments[4],
        max_num_draft_tokens=3, logits=True, seed=drawn, bonus_token_ids=arguments[6].view(-1), logprobs=kind,
        backend="reference", **keywords)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(logprobs.isnan(), want.isnan()) and torch.equal(logprobs.nan_to_num(), want.nan_to_num())
    counts = torch.tensor(arguments[1])
    bonus = (tokens >= 0) & (torch.arange(tokens.shape[1]).view(1, -1) == counts.view(-1, 1))
    assert bool(torch.isnan(logprobs[bonus]).all()) and bool(torch.isneginf(logprobs[tokens == -1]).all())
    assert bool(torch.isfinite(logprobs[(tokens >= 0) & ~bonus]).all())
    # The Triton kernel: the same tokens, the same scores within float32 rounding (tests/test_logprobs_triton.py).
    triton_tokens, triton_logprobs = vllm.rejection_sample_from_logits(
        *arguments, metadata(**keywords, generators=generators_of(seeds)), logprobs=kind, backend="triton")
    assert torch.equal(triton_tokens, tokens)
    torch.testing.assert_close(triton_logprobs, logprobs, rtol=1e-5, atol=1e-5, equal_nan=True)
