"""sk.adapters.vllm.rejection_sample_v2: vLLM model runner V2's rejection_sample, called as vLLM calls it.

vLLM's own V2 cases (its greedy prefix case and "never resamples the
rejected draft", ``tests/v1/worker/gpu``), restated with their inputs built
as its ``_rejection_inputs`` builds them; the mapping onto
``chain_verify_packed`` bit for bit on every backend; a request's tokens
independent of its batch; the law by chi-square, with power against the
temperature applied a second time.
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import DEVICE
from markov import SIGNIFICANCE, chi_square_pvalue
from specdec_kernels.adapters import vllm
from test_vllm_adapter import backend  # noqa: F401  (the fixture: reference, triton, the CUDA host path)

VOCAB = 20
MAX_REQS = 8


def rejection_inputs(cu, temperatures, seeds=None, states=None, first_position=0):
    """vLLM's ``_rejection_inputs``: ``(cu_num_logits, pos, idx_mapping, expanded_idx_mapping,
    expanded_local_pos, temperature [MAX_REQS], seed [MAX_REQS])`` on the test device."""
    num_reqs = len(cu) - 1
    states = list(range(num_reqs)) if states is None else states
    lens = [cu[r + 1] - cu[r] for r in range(num_reqs)]
    temperature = torch.zeros(MAX_REQS)
    seed = torch.zeros(MAX_REQS, dtype=torch.int64)
    for request, state in enumerate(states):
        temperature[state] = temperatures[request]
        seed[state] = (seeds or [0] * num_reqs)[request]
    tensors = (torch.tensor(cu, dtype=torch.int32), torch.arange(cu[-1], dtype=torch.int32) + first_position,
               torch.tensor(states, dtype=torch.int32),
               torch.tensor([states[r] for r, n in enumerate(lens) for _ in range(n)], dtype=torch.int32),
               torch.tensor([i for n in lens for i in range(n)], dtype=torch.int32), temperature, seed)
    return tuple(t.to(DEVICE) for t in tensors)


def call(target_logits, draft_logits, draft_sampled, inputs, num_speculative_steps, **keywords):
    """vLLM's positional call: ``rejection_sample(target_logits, draft_logits, draft_sampled, cu_num_logits, pos,
    idx_mapping, expanded_idx_mapping, expanded_local_pos, temperature, seed, num_speculative_steps)``."""
    cu_num_logits, pos, idx_mapping, expanded_idx, expanded_pos, temperature, seed = inputs
    return vllm.rejection_sample_v2(
        target_logits.to(DEVICE), None if draft_logits is None else draft_logits.to(DEVICE), draft_sampled.to(DEVICE),
        cu_num_logits, pos, idx_mapping, expanded_idx, expanded_pos, temperature, seed, num_speculative_steps,
        **keywords)


def test_vllms_greedy_prefix_case(backend):
    """vLLM's test_rejection_sample_greedy_accepts_matching_prefix: request 0 accepts 3 and recovers 9,
    request 1 accepts its draft and gets the bonus argmax 4, request 2 has no drafts and gets 2."""
    logits = torch.full((6, VOCAB), -10.0)
    for row, token in enumerate([3, 9, 5, 1, 4, 2]):
        logits[row, token] = 0.0
    draft_sampled = torch.tensor([-1, 3, 7, -1, 1, -1], dtype=torch.int32)
    sampled, num_sampled = call(logits, None, draft_sampled, rejection_inputs([0, 3, 5, 6], [0.0, 0.0, 0.0]), 2,
                                backend=backend)
    assert sampled.dtype == torch.int64 and num_sampled.dtype == torch.int32
    assert num_sampled.tolist() == [2, 2, 1]
    assert sampled[0, :2].tolist() == [3, 9] and sampled[1, :2].tolist() == [1, 4] and sampled[2, :1].tolist() == [2]


def test_vllms_rejected_draft_is_never_resampled(backend):
    """vLLM's test_rejection_sample_random_never_resamples_rejected_draft: the target has no mass on the
    one-hot draft 7, so every seed rejects it and recovers another token."""
    logits = torch.zeros(2, VOCAB)
    logits[0, 7] = float("-inf")
    for seed in range(5):
        sampled, num_sampled = call(logits, None, torch.tensor([-1, 7], dtype=torch.int32),
                                    rejection_inputs([0, 2], [1.0], seeds=[seed]), 1, backend=backend)
        assert num_sampled.tolist() == [1] and sampled[0, 0].item() != 7


def random_step(generator, counts, num_steps, states, vocab_size=VOCAB, draft_vocab=None):
    """Logits rows, per-state draft logits [MAX_REQS, K, V'] and draft_sampled for requests with ``counts``
    drafts (drafts drawn from the draft law, a few -1 placeholders)."""
    num_logits = sum(count + 1 for count in counts)
    target = torch.randn(num_logits, vocab_size, generator=generator) * 2
    draft_logits = torch.randn(MAX_REQS, num_steps, draft_vocab or vocab_size, generator=generator)
    draft_sampled = torch.full((num_logits,), -1, dtype=torch.int64)
    row = 0
    for count, state in zip(counts, states):
        for step in range(count):
            law = torch.softmax(draft_logits[state, step], -1)
            draft_sampled[row + step + 1] = int(torch.multinomial(law, 1, generator=generator))
        row += count + 1
    return target, draft_logits, draft_sampled


def by_hand(target, draft_logits, draft_sampled, counts, states, temperature, seed, pos, num_steps):
    """The mapping onto chain_verify_packed (reference), one request and one draft at a time."""
    vocab_size = target.shape[1] if draft_logits is None else min(target.shape[1], draft_logits.shape[2])
    cu, ids, draft_rows, seeds, offsets, temperatures = [0], [], [], [], [], []
    row = 0
    for count, state in zip(counts, states):
        ids += [int(draft_sampled[row + step + 1]) for step in range(count)]
        if draft_logits is not None:
            draft_rows += [torch.softmax(draft_logits[state, step, :vocab_size].float(), -1) for step in range(count)]
        seeds.append(int(seed[state]))
        offsets.append(int(pos[row]))
        temperatures.append(0.0 if float(temperature[state]) == 0 else 1.0)
        cu.append(cu[-1] + count)
        row += count + 1
    tokens, num_accepted = sk.chain_verify_packed(
        torch.tensor(ids, dtype=torch.int64), torch.tensor(cu), target[:, :vocab_size],
        None if draft_logits is None else torch.stack(draft_rows), max_num_draft_tokens=num_steps,
        temperature=torch.tensor(temperatures), logits=True, seed=torch.tensor(seeds), offset=torch.tensor(offsets),
        backend="reference")
    return tokens.to(torch.int64), num_accepted + 1


@pytest.mark.parametrize("one_hot", [False, True])
def test_the_op_it_calls(one_hot, backend):
    """Ragged counts (one request without drafts), states shuffled over R > B, greedy mixed in, -1 drafts:
    chain_verify_packed on the packed layout as it is, per-request seeds seed[state] and offsets pos[first
    row], T = 1 (0 for greedy), draft rows the softmax of the state's draft logits; bit for bit."""
    generator = torch.Generator().manual_seed(21 + one_hot)
    counts, states, num_steps = [3, 0, 2, 3], [5, 1, 7, 2], 3
    target, draft_logits, draft_sampled = random_step(generator, counts, num_steps, states)
    if one_hot:
        draft_logits = None
    draft_sampled[6] = -1  # a padded draft row: no proposal there
    cu = [0] + torch.tensor([count + 1 for count in counts]).cumsum(0).tolist()
    inputs = rejection_inputs(cu, [1.0, 0.7, 0.0, 1.3], seeds=[11, 12, 13, 14], states=states, first_position=40)
    got = call(target, draft_logits, draft_sampled, inputs, num_steps, backend=backend)
    _, pos, _, _, _, temperature, seed = (t.cpu() for t in inputs)
    want = by_hand(target, draft_logits, draft_sampled, counts, states, temperature, seed, pos, num_steps)
    for value, expected in zip(got, want):
        assert torch.equal(value.cpu(), expected)


def test_a_request_gives_its_tokens_whatever_its_batch(backend):
    """The same request (rows, seed, positions) alone at state 0 and as the third of three at state 6 with
    other neighbours: the same tokens."""
    generator = torch.Generator().manual_seed(31)
    target, draft_logits, draft_sampled = random_step(generator, [3], 3, [0])
    alone = call(target, draft_logits, draft_sampled,
                 rejection_inputs([0, 4], [0.9], seeds=[77], first_position=100), 3, backend=backend)
    others, other_draft_logits, other_sampled = random_step(generator, [2, 1], 3, [3, 4])
    batch_draft_logits = other_draft_logits.clone()
    batch_draft_logits[6] = draft_logits[0]
    crowd = call(torch.cat([others, target]), batch_draft_logits, torch.cat([other_sampled, draft_sampled]),
                 rejection_inputs([0, 3, 5, 9], [1.0, 1.0, 0.9], seeds=[5, 6, 77], states=[3, 4, 6],
                                  first_position=95), 3, backend=backend)
    # Positions of the third request's rows: 95 + 5 .. 95 + 8 = 100 .. 103, as alone.
    assert torch.equal(crowd[0][2].cpu(), alone[0][0].cpu()) and int(crowd[1][2]) == int(alone[1][0])


def test_the_law_is_the_softmax_of_the_logits_given():
    """Law (reference): the first token follows softmax(target_logits) of the request's first row, at any
    state temperature (the logits are vLLM's processed ones). Power: the same counts reject softmax(logits / T),
    the law a second temperature would give. Chi-square, 6,000 requests, fixed seed."""
    generator = torch.Generator().manual_seed(41)
    num_requests, vocab_size, temperature = 6000, 5, 0.5
    row_logits = torch.randn(2, vocab_size, generator=generator)
    draft_law = torch.softmax(torch.randn(vocab_size, generator=generator), -1)
    drafts = torch.multinomial(draft_law, num_requests, replacement=True, generator=generator)
    draft_sampled = torch.stack([torch.full((num_requests,), -1), drafts], 1).reshape(-1)
    target = row_logits.repeat(num_requests, 1)
    draft_logits = draft_law.log().view(1, 1, vocab_size).expand(num_requests, 1, vocab_size).contiguous()
    cu = torch.arange(num_requests + 1, dtype=torch.int32) * 2
    states = torch.arange(num_requests, dtype=torch.int32)
    sampled, _ = vllm.rejection_sample_v2(
        target, draft_logits, draft_sampled, cu, torch.arange(2 * num_requests), states, states.repeat_interleave(2),
        torch.tensor([0, 1], dtype=torch.int32).repeat(num_requests), torch.full((num_requests,), temperature),
        torch.arange(num_requests, dtype=torch.int64) * 7919 + 3, 1, backend="reference")
    tokens, counts = sampled[:, 0].unique(return_counts=True)
    observed = {(int(token),): int(count) for token, count in zip(tokens, counts)}
    given = torch.softmax(row_logits[0].double(), -1)
    assert chi_square_pvalue(observed, {(t,): float(p) for t, p in enumerate(given)}, num_requests) > SIGNIFICANCE
    twice = torch.softmax(row_logits[0].double() / temperature, -1)
    assert chi_square_pvalue(observed, {(t,): float(p) for t, p in enumerate(twice)}, num_requests) < SIGNIFICANCE


def test_a_smaller_draft_vocabulary_restricts_the_target_as_vllm_does(backend):
    """Draft logits over V' < V: only the first V' tokens are in play (vLLM takes vocab_size = min(V, V'))."""
    generator = torch.Generator().manual_seed(51)
    target, draft_logits, draft_sampled = random_step(generator, [2, 2], 2, [0, 1], vocab_size=VOCAB,
                                                      draft_vocab=VOCAB - 4)
    inputs = rejection_inputs([0, 3, 6], [1.0, 1.0], seeds=[1, 2])
    sampled, _ = call(target, draft_logits, draft_sampled, inputs, 2, backend=backend)
    narrowed = call(target[:, :VOCAB - 4].contiguous(), draft_logits, draft_sampled, inputs, 2, backend=backend)
    assert torch.equal(sampled.cpu(), narrowed[0].cpu()) and int(sampled.max()) < VOCAB - 4


def test_refusals_and_errors_name_the_argument():
    inputs = rejection_inputs([0, 2], [1.0])
    target, draft_sampled = torch.zeros(2, VOCAB), torch.tensor([-1, 3])
    with pytest.raises(NotImplementedError, match="use_block_verification=True"):
        call(target, None, draft_sampled, inputs, 1, use_block_verification=True)
    with pytest.raises(ValueError, match="`synthetic_conditional_rates`"):
        call(target, None, draft_sampled, inputs, 1, synthetic_conditional_rates=torch.ones(1))
    with pytest.raises(ValueError, match=r"`draft_sampled` must have shape \[L\] = \[2\]; got \[3\]"):
        call(target, None, torch.tensor([-1, 3, 4]), inputs, 1)
    with pytest.raises(TypeError, match="`seed` must have dtype int64"):
        call(target, None, draft_sampled, inputs[:6] + (inputs[6].to(torch.int32),), 1)
    with pytest.raises(ValueError, match=r"`draft_logits` must have shape \[R, num_speculative_steps, V\] = \[8, 1, "):
        call(target, torch.zeros(3, 1, VOCAB), draft_sampled, inputs, 1)
    with pytest.raises(ValueError, match=r"= \[8, 1, \*\]; got \[8, 0, 20\]"):
        call(target, torch.zeros(MAX_REQS, 0, VOCAB), draft_sampled, inputs, 1)  # no step's law: was read anyway
    sampled, num_sampled = call(target, None, draft_sampled, inputs, 1, use_fp64=True)  # accepted, no effect
    assert sampled.shape == (1, 2) and num_sampled.shape == (1,)


def test_triton_path_is_three_launches():
    """On the Triton backend: the preparation, the verification and vLLM's outputs, each one launch (the
    torch path issues about 30 ops)."""
    from conftest import backend_or_skip
    from op_recording import recorded_ops
    from specdec_kernels.adapters import vllm_v2

    backend_or_skip("chain_verify_packed", "triton", "cpu")
    generator = torch.Generator().manual_seed(61)
    target, draft_logits, draft_sampled = random_step(generator, [3, 1], 3, [0, 1])
    inputs = [t.cpu() for t in rejection_inputs([0, 4, 6], [1.0, 1.0], seeds=[1, 2])]
    cu_num_logits, pos, idx_mapping, expanded_idx, expanded_pos, temperature, seed = inputs
    with recorded_ops(vllm_v2, ["triton_vllm_v2_prepare", "triton_vllm_v2_outputs"]) as seen:
        vllm_v2.rejection_sample_v2(target, draft_logits, draft_sampled, cu_num_logits, pos, idx_mapping,
                                    expanded_idx, expanded_pos, temperature, seed, 3, backend="triton")
    launches = [op for op in seen if op not in ("aten.slice", "aten.alias", "aten.empty")]  # views, allocations
    assert launches == ["triton_vllm_v2_prepare", "specdec.chain_verify_packed", "triton_vllm_v2_outputs"]


def test_the_preparation_kernel_equals_its_torch_twin():
    """Ids, counts, seeds, offsets and temperatures bit for bit; the draft softmax within float32 rounding
    (each path rounds its own exp and sum)."""
    from conftest import backend_or_skip
    from specdec_kernels.adapters.vllm_v2 import _torch_prepare
    from specdec_kernels.launchers.vllm_v2 import triton_vllm_v2_prepare

    backend_or_skip("chain_verify_packed", "triton")
    generator = torch.Generator().manual_seed(71)
    counts, states = [4, 0, 2, 1], [3, 0, 6, 5]
    target, draft_logits, draft_sampled = random_step(generator, counts, 4, states, vocab_size=2500)
    cu = [0] + torch.tensor([count + 1 for count in counts]).cumsum(0).tolist()
    cu_num_logits, pos, idx_mapping, expanded_idx, expanded_pos, temperature, seed = rejection_inputs(
        cu, [0.0, 1.0, 0.5, 2.0], seeds=[9, 8, 7, 6], states=states, first_position=7)
    arguments = (cu_num_logits, draft_sampled.to(DEVICE), pos, idx_mapping, expanded_idx, expanded_pos, temperature,
                 seed, draft_logits.to(DEVICE), 2500, 4)
    kernel, twin = triton_vllm_v2_prepare(*arguments), _torch_prepare(*arguments)
    for name, a, b in zip(("cu", "ids", "draft", "seed", "offset", "temperature"), kernel, twin):
        if name == "draft":
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
        else:
            assert torch.equal(a.cpu(), b.cpu().to(a.dtype)), name
