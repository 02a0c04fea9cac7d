"""sk.adapters.vllm: vLLM V1's rejection_sample inputs and output over sk.chain_verify_packed.

The greedy cases are vLLM's own (``tests/v1/sample/test_rejection_sampler.py``:
logits of -100 everywhere and 100 at the token each position should give,
the bonus token from vLLM's sampler, ``-1`` placeholders), restated here;
``test_seeded_requests_repeat`` is its ``test_deterministic_when_seeded``.
The rest checks the mapping onto ``chain_verify_packed`` bit for bit on
every backend, and the law by chi-square on the reference.
"""

from __future__ import annotations

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


def greedy_case(spec_tokens, output_tokens):
    """vLLM's ``create_logits_tensor`` and metadata: the inputs whose argmax gives ``output_tokens``."""
    logits = torch.full((sum(map(len, spec_tokens)), VOCAB), -100.0)
    row = 0
    for tokens, outputs in zip(spec_tokens, output_tokens):
        for position in range(len(tokens)):
            logits[row, outputs[position]] = 100.0
            row += 1
    counts = [len(tokens) for tokens in spec_tokens]
    return dict(
        draft_token_ids=torch.tensor([token for tokens in spec_tokens for token in tokens], dtype=torch.int64),
        num_draft_tokens=counts,
        max_spec_len=max(counts),
        cu_num_draft_tokens=torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32),
        draft_probs=None,
        target_logits=logits,
        bonus_token_ids=torch.tensor([[outputs[-1]] for outputs in output_tokens]),
    )


def on_device(inputs):
    return {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}


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


@pytest.mark.parametrize("name", VLLM_GREEDY_CASES)
def test_vllms_greedy_cases(name, backend):
    spec_tokens, output_tokens, expected = VLLM_GREEDY_CASES[name]
    output = vllm.rejection_sample(**on_device(greedy_case(spec_tokens, output_tokens)), backend=backend)
    assert output.dtype == torch.int32
    assert output.cpu().tolist() == expected


@pytest.mark.parametrize("marker", [0.0, -1.0])
def test_greedy_markers_give_the_greedy_tokens(marker, backend):
    """vLLM marks greedy requests by a temperature of 0 (or -1 in older versions) beside sampled ones."""
    spec_tokens, output_tokens, expected = VLLM_GREEDY_CASES["multiple_mismatches"]
    inputs = on_device(greedy_case(spec_tokens, output_tokens))
    temperature = torch.tensor([marker, marker], device=DEVICE)
    output = vllm.rejection_sample(**inputs, temperature=temperature, backend=backend)
    assert output.cpu().tolist() == expected


def sampled_case(seed, batch_size=4, max_drafts=3, vocab_size=VOCAB, counts=None):
    """vLLM's random-sampling inputs: softmaxed uniform draft rows, uniform target logits, random ids."""
    generator = torch.Generator().manual_seed(seed)
    counts = counts or [max_drafts] * batch_size
    num_tokens = sum(counts)
    draft_probs = torch.softmax(torch.rand(num_tokens, vocab_size, generator=generator) * 4, -1)
    return dict(
        draft_token_ids=torch.randint(vocab_size, (num_tokens,), generator=generator),
        num_draft_tokens=counts,
        max_spec_len=max(counts),
        cu_num_draft_tokens=torch.tensor(counts).cumsum(0),
        draft_probs=draft_probs,
        target_logits=torch.rand(num_tokens, vocab_size, generator=generator) * 4,
        bonus_token_ids=torch.randint(vocab_size, (len(counts), 1), generator=generator),
    )


def generators_of(seeds):
    return {index: torch.Generator(device=DEVICE).manual_seed(seed) for index, seed in seeds.items()}


def test_seeded_requests_repeat(backend):
    """vLLM's test_deterministic_when_seeded: requests with a generator seeded alike give the same tokens."""
    inputs = on_device(sampled_case(0))
    temperature = torch.ones(4, device=DEVICE)
    seeded = {0: 11, 2: 12}
    runs = [vllm.rejection_sample(**inputs, temperature=temperature, generators=generators_of(seeded),
                                  backend=backend).cpu() for _ in range(3)]
    for index in seeded:
        assert all(torch.equal(run[index], runs[0][index]) for run in runs)


def test_a_seeded_request_gives_its_tokens_whatever_its_batch(backend):
    """The request's generator, not its batch index or its neighbours, decides its random numbers."""
    alone = sampled_case(1, batch_size=1)
    crowd = sampled_case(2, batch_size=3, counts=[2, 3, 1])
    # Put the lone request at index 1 of the crowd: its rows replace the crowd's second request's.
    rows = slice(2, 5)
    for name in ("draft_token_ids", "draft_probs", "target_logits"):
        crowd[name][rows] = alone[name]
    crowd["bonus_token_ids"][1] = alone["bonus_token_ids"][0]
    temperature = torch.tensor([0.8], device=DEVICE)
    single = vllm.rejection_sample(**on_device(alone), temperature=temperature, generators=generators_of({0: 5}),
                                   backend=backend)
    batched = vllm.rejection_sample(**on_device(crowd), temperature=temperature.expand(3).contiguous(),
                                    generators=generators_of({1: 5}), backend=backend)
    assert torch.equal(batched[1].cpu(), single[0].cpu())


@pytest.mark.parametrize("truncation", ["none", "top_k_top_p"])
def test_the_op_it_calls(truncation, backend):
    """With every request seeded, the adapter is chain_verify_packed on the bonus-free layout with the
    generators' draws as seeds, bit for bit; the reference gives the same tokens."""
    inputs = on_device(sampled_case(3, counts=[3, 0, 2, 3]))
    keywords = dict(temperature=torch.tensor([1.0, 0.7, 0.0, 1.3], device=DEVICE))
    if truncation != "none":
        keywords.update(top_k=torch.tensor([5, VOCAB, 0, 20], device=DEVICE),
                        top_p=torch.tensor([0.9, 1.0, 0.5, 0.8], device=DEVICE))
    seeds = {index: 100 + index for index in range(4)}
    got = vllm.rejection_sample(**inputs, **keywords, generators=generators_of(seeds), backend=backend)
    drawn = torch.cat([torch.randint(2**63 - 1, (1,), dtype=torch.int64, generator=generator, device=DEVICE)
                       for generator in generators_of(seeds).values()])
    want, _ = sk.chain_verify_packed(
        inputs["draft_token_ids"], torch.nn.functional.pad(inputs["cu_num_draft_tokens"], (1, 0)),
        inputs["target_logits"], inputs["draft_probs"], max_num_draft_tokens=3, logits=True, seed=drawn,
        bonus_token_ids=inputs["bonus_token_ids"].view(-1), backend="reference", **keywords)
    assert torch.equal(got.cpu(), want.cpu())


def test_the_first_token_follows_the_processed_target():
    """Law (reference): whatever the drafts, a request's first token is distributed as vLLM's processed
    target row, softmax(logits / T) truncated to the top k. Chi-square, 6,000 requests, fixed seed."""
    generator = torch.Generator().manual_seed(7)
    batch_size, vocab_size, temperature, top_k = 6000, 6, 0.7, 4
    logits = torch.randn(2, vocab_size, generator=generator) * 1.5
    draft = torch.softmax(torch.randn(2, vocab_size, generator=generator), -1)
    ids = torch.multinomial(draft, batch_size, replacement=True, generator=generator).t().reshape(-1)
    output = vllm.rejection_sample(
        ids, [2] * batch_size, 2, torch.arange(1, batch_size + 1) * 2, draft.repeat(batch_size, 1),
        logits.repeat(batch_size, 1), torch.zeros(batch_size, 1, dtype=torch.int64),
        temperature=torch.full((batch_size,), temperature), top_k=torch.full((batch_size,), top_k),
        generators={}, backend="reference")
    processed = torch.softmax(logits[0].double() / temperature, -1)
    kept = processed.topk(top_k).indices
    expected = torch.zeros(vocab_size, dtype=torch.float64)
    expected[kept] = processed[kept] / processed[kept].sum()
    tokens, counts = output[:, 0].unique(return_counts=True)
    observed = {(int(token),): int(count) for token, count in zip(tokens, counts)}
    probabilities = {(token,): float(expected[token]) for token in range(vocab_size) if expected[token] > 0}
    assert chi_square_pvalue(observed, probabilities, batch_size) > SIGNIFICANCE


def test_bad_inputs_name_the_argument():
    inputs = greedy_case(*VLLM_GREEDY_CASES["multiple_sequences"][:2])
    with pytest.raises(ValueError, match=r"`bonus_token_ids` must have shape \[B, 1\] = \[2, 1\]; got \[2\]"):
        vllm.rejection_sample(**{**inputs, "bonus_token_ids": inputs["bonus_token_ids"].view(-1)})
    with pytest.raises(TypeError, match="`num_draft_tokens` must be a list of B = 2 ints"):
        vllm.rejection_sample(**{**inputs, "num_draft_tokens": [2]})
    with pytest.raises(ValueError, match=r"`generators` keys must be batch indices in \[0, B\) = \[0, 2\); got 2"):
        vllm.rejection_sample(**inputs, temperature=torch.ones(2), generators={2: torch.Generator()})
    with pytest.raises(TypeError, match="`cu_num_draft_tokens` must have dtype"):
        vllm.rejection_sample(**{**inputs, "cu_num_draft_tokens": inputs["cu_num_draft_tokens"].float()})
