"""sk.adapters.sglang's sgl-kernel drop-ins, called as SGLang calls sgl-kernel.

``tree_speculative_sampling_target_only`` is called with the keywords of
SGLang's ``EagleVerifyInput.verify`` (``draft_probs`` of zeros, the
thresholds at their server defaults of 1, ``deterministic=True``), and
``verify_tree_greedy`` with those of its greedy branch and of sgl-kernel's
``test_verify_tree_greedy`` (ported below with its expected outputs). Newer
SGLang spells the links ``retrieve_*``; sgl-kernel's signature
``retrive_*``: both are called.
"""

from __future__ import annotations

import re

import pytest
import torch

from conftest import backend_or_skip
from markov import SIGNIFICANCE, chi_square_pvalue
from op_recording import recorded_ops
from specdec_kernels import _validation
from specdec_kernels.adapters import sglang
from test_sglang_adapter import malformed_links, random_batch, sgl_kernel_scenario, sglang_greedy_walk

BACKENDS = ["reference", "triton"]


def buffers(batch_size, tree_size, width, device, fill=-1):
    """SGLang's ``predict`` [B*N+1], ``accept_index`` [B, width] and ``accept_length`` [B], int32."""
    return (torch.full((batch_size * tree_size + 1,), fill, dtype=torch.int32, device=device),
            torch.full((batch_size, width), -1, dtype=torch.int32, device=device),
            torch.zeros(batch_size, dtype=torch.int32, device=device))


# ----------------------------------------------------------------------------- verify_tree_greedy


@pytest.mark.parametrize("backend", BACKENDS)
def test_sgl_kernels_test_verify_tree_greedy(backend, device):
    """sgl-kernel's test_verify_tree_greedy, its inputs and expected outputs, its keyword call."""
    backend_or_skip("tree_verify", backend)
    candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target = (
        t.to(device) for t in sgl_kernel_scenario())
    target_predict = target.argmax(-1)
    predicts = torch.full((12,), -1, dtype=torch.int32, device=device)
    accept_index = torch.full((2, 4), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.full((2,), 0, dtype=torch.int32, device=device)
    sglang.verify_tree_greedy(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num, candidates=candidates,
        retrieve_index=retrieve_index, retrieve_next_token=retrieve_next_token,
        retrieve_next_sibling=retrieve_next_sibling, target_predict=target_predict, backend=backend)
    assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert accept_token_num.tolist() == [3, 2]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level_sizes, width", [([4, 6, 5], 4), ([3, 3, 3, 3], 3), ([1], 6), ([7], 1)])
def test_greedy_equals_sglangs_greedy_walk(backend, level_sizes, width, device):
    """Random EAGLE trees with rows shuffled, positional call with sgl-kernel's names: the walk restated from
    sgl-kernel's kernel, with target_predict read at each node's row; rows off the path keep their values."""
    backend_or_skip("tree_verify", backend)
    generator = torch.Generator().manual_seed(sum(level_sizes) + width)
    _, candidates, layout, target, _, _ = random_batch(generator, 6, level_sizes, 5, shuffle_rows=True)
    argmax = target.argmax(-1)
    target_predict = torch.empty_like(argmax).view(-1)
    target_predict[layout[0].view(-1)] = argmax.view(-1)  # SGLang's target_predict is indexed by row
    expected_predicts, expected_index, expected_num = sglang_greedy_walk(candidates, *layout, argmax, width - 1)
    predicts, accept_index, accept_token_num = buffers(*candidates.shape, width, device, fill=-7)
    sglang.verify_tree_greedy(predicts, accept_index, accept_token_num, candidates.to(device),
                              *(t.to(device) for t in layout), target_predict.view(argmax.shape).to(device),
                              backend=backend)
    assert torch.equal(accept_index.cpu(), expected_index)
    assert torch.equal(accept_token_num.cpu(), expected_num)
    written = {row: int(predicts[row]) for row in range(predicts.shape[0]) if int(predicts[row]) != -7}
    assert written == expected_predicts


@pytest.mark.parametrize("tree_size, width", [(1, 1), (2, 3), (13, 5), (64, 9), (100, 100)])
def test_triton_greedy_equals_the_reference_on_malformed_layouts(tree_size, width, device):
    """Links of any value (back to earlier slots, cycles, out of range), rows outside [0, B*N) or repeated,
    ids outside the vocabulary: one launch gives the torch walk's outputs, bit for bit, and ends."""
    backend_or_skip("tree_verify", "triton")
    generator = torch.Generator().manual_seed(tree_size * 7 + width)
    batch_size = 5
    next_token, next_sibling = malformed_links(generator, batch_size, tree_size)
    # Mostly well-formed: keep the builder-like forward links, so walks go deep.
    forward = torch.arange(tree_size) + 1
    next_token = torch.where(torch.rand(batch_size, tree_size, generator=generator) < 0.6, forward, next_token)
    rows = torch.randint(-2, batch_size * tree_size + 2, (batch_size, tree_size), generator=generator)
    candidates = torch.randint(-1, 3, (batch_size, tree_size), generator=generator)
    target_predict = torch.randint(-1, 3, (batch_size, tree_size), generator=generator)
    outputs = {}
    for backend in ("reference", "triton"):
        outputs[backend] = buffers(batch_size, tree_size, width, device, fill=-7)
        sglang.verify_tree_greedy(*outputs[backend], *(t.to(device) for t in (
            candidates, rows, next_token, next_sibling, target_predict)), backend=backend)
    for reference, triton in zip(outputs["reference"], outputs["triton"]):
        assert torch.equal(reference.cpu(), triton.cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_writes_target_ids_as_they_are(backend, device):
    """sgl-kernel writes target_predict's value at each path node's row, whatever it is (a negative id too)."""
    backend_or_skip("tree_verify", backend)
    outputs = buffers(1, 3, 3, device, fill=-7)
    sglang.verify_tree_greedy(*outputs, *(torch.tensor(t, device=device) for t in (
        [[9, 5, 6]], [[0, 1, 2]], [[1, 2, -1]], [[-1, -1, -1]], [[5, -5, 7]])), backend=backend)
    assert outputs[0].tolist()[:3] == [5, -5, -7] and outputs[1].tolist() == [[0, 1, -1]]
    assert outputs[2].tolist() == [1]


def test_greedy_is_one_launch_without_allocations():
    backend_or_skip("tree_verify", "triton", "cpu")
    generator = torch.Generator().manual_seed(4)
    _, candidates, layout, target, _, _ = random_batch(generator, 4, [3, 3, 3], 7)
    outputs, target_predict = buffers(4, candidates.shape[1], 3, "cpu"), target.argmax(-1)
    with recorded_ops(sglang, ["triton_eagle_greedy"]) as seen:
        sglang.verify_tree_greedy(*outputs, candidates, *layout, target_predict, backend="triton")
    assert seen == ["triton_eagle_greedy"]


def test_greedy_reads_no_value_on_the_host():
    """On meta tensors any host read of a value raises: the torch walk runs through without one."""
    generator = torch.Generator().manual_seed(5)
    _, candidates, layout, target, _, _ = random_batch(generator, 4, [3, 3, 3], 7)
    meta = [t.to("meta") for t in (*buffers(4, candidates.shape[1], 3, "cpu"), candidates, *layout,
                                   target.argmax(-1))]
    sglang.verify_tree_greedy(*meta, backend="reference")


# ----------------------------------------------------------------------------- tree_speculative_sampling_target_only


def sglang_verify_call(candidates, layout, target_probs, width, device, **keywords):
    """The call of SGLang's EagleVerifyInput.verify: its keywords, coins from torch.rand, draft_probs zeros."""
    batch_size, tree_size = candidates.shape
    predict, accept_index, accept_length = buffers(batch_size, tree_size, width, device)
    retrive_index, retrive_next_token, retrive_next_sibling = (t.to(device) for t in layout)
    sglang.tree_speculative_sampling_target_only(
        predicts=predict, accept_index=accept_index, accept_token_num=accept_length,
        candidates=candidates.to(device), retrive_index=retrive_index, retrive_next_token=retrive_next_token,
        retrive_next_sibling=retrive_next_sibling,
        uniform_samples=torch.rand(candidates.shape, dtype=torch.float32, device=device),
        uniform_samples_for_final_sampling=torch.rand((batch_size,), dtype=torch.float32, device=device),
        target_probs=target_probs.to(device), draft_probs=torch.zeros_like(target_probs, device=device),
        threshold_single=1.0, threshold_acc=1.0, deterministic=True, **keywords)
    return predict, accept_index, accept_length


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglangs_call_is_eagle_tree_verify_with_device_seeds(backend, device):
    """SGLang's call gives eagle_tree_verify's outputs with draft=None and the per-request seeds the device's
    default generator draws; torch.manual_seed repeats it."""
    backend_or_skip("tree_verify", backend)
    generator = torch.Generator().manual_seed(6)
    _, candidates, layout, target, _, _ = random_batch(generator, 5, [3, 4, 2], 6, shuffle_rows=True)
    torch.manual_seed(11)
    got = sglang_verify_call(candidates, layout, target, 3, device, backend=backend)
    torch.manual_seed(11)
    torch.rand(candidates.shape, device=device), torch.rand((5,), device=device)  # SGLang's coins, drawn first
    seeds = _validation.device_seeds((5,), device)
    want = sglang.eagle_tree_verify(candidates.to(device), *(t.to(device) for t in layout), target.to(device),
                                    spec_steps=2, seed=seeds, backend="reference")
    for name, value, expected in zip(("predict", "accept_index", "accept_length"), got, want):
        assert torch.equal(value.cpu(), expected.cpu()), name
    torch.manual_seed(11)
    assert all(torch.equal(a, b) for a, b in zip(sglang_verify_call(candidates, layout, target, 3, device,
                                                                    backend=backend), got))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sgl_kernels_scenario_through_sglangs_call(backend, device):
    """sgl-kernel's tree_speculative_sampling_target_only test scenario (one-hot targets), called as SGLang
    calls it with the newer ``retrieve_*`` names: its expected outputs, whatever the random numbers."""
    backend_or_skip("tree_verify", backend)
    candidates, retrive_index, next_token, next_sibling, target = (t.to(device) for t in sgl_kernel_scenario())
    for seed in range(3):
        torch.manual_seed(seed)
        predicts, accept_index, accept_token_num = buffers(2, 6, 4, device)
        predicts = predicts[:12]  # sgl-kernel's test sizes predicts [B * N]
        sglang.tree_speculative_sampling_target_only(
            predicts, accept_index, accept_token_num, candidates, retrieve_index=retrive_index,
            retrieve_next_token=next_token, retrieve_next_sibling=next_sibling,
            uniform_samples=torch.rand(2, 6, device=device),
            uniform_samples_for_final_sampling=torch.rand(2, device=device), target_probs=target,
            draft_probs=torch.zeros_like(target), backend=backend)
        assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
        assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
        assert accept_token_num.tolist() == [3, 2]


def test_the_first_token_follows_the_target_probs_given():
    """Law (reference): the token after the root (a root with two candidate children) follows SGLang's
    target_probs as given. Power: the same counts reject the law a second temperature (T = 0.6) would give.
    Chi-square, 6,000 requests, fixed seed."""
    generator = torch.Generator().manual_seed(9)
    batch_size, vocab_size, temperature = 6000, 5, 0.6
    root_law = torch.softmax(torch.randn(vocab_size, generator=generator), -1)
    target = torch.softmax(torch.randn(batch_size, 3, vocab_size, generator=generator), -1)
    target[:, 0] = root_law
    candidates = torch.tensor([[4, 0, 1]]).expand(batch_size, 3).contiguous()
    layout = (torch.arange(3 * batch_size).view(batch_size, 3), torch.tensor([[1, -1, -1]]).expand(batch_size, 3),
              torch.tensor([[-1, 2, -1]]).expand(batch_size, 3))
    torch.manual_seed(0)
    predicts, accept_index, _ = sglang_verify_call(candidates, layout, target, 2, "cpu", backend="reference")
    first = predicts[accept_index[:, 0].long()]
    tokens, counts = first.unique(return_counts=True)
    observed = {(int(token),): int(count) for token, count in zip(tokens, counts)}
    given = root_law.double()
    assert chi_square_pvalue(observed, {(t,): float(p) for t, p in enumerate(given)}, batch_size) > SIGNIFICANCE
    twice = torch.softmax(given.log() / temperature, -1)
    assert chi_square_pvalue(observed, {(t,): float(p) for t, p in enumerate(twice)}, batch_size) < SIGNIFICANCE


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    candidates, retrive_index, next_token, next_sibling, target = sgl_kernel_scenario()
    outputs = buffers(2, 6, 4, "cpu")
    coins = dict(uniform_samples=torch.rand(2, 6), uniform_samples_for_final_sampling=torch.rand(2),
                 target_probs=target, draft_probs=torch.zeros_like(target))
    sampling = sglang.tree_speculative_sampling_target_only
    for threshold in ("threshold_single", "threshold_acc"):
        with pytest.raises(ValueError, match=f"`{threshold}` must be 1.0: .*; got 0.5"):
            sampling(*outputs, candidates, retrive_index, next_token, next_sibling, **coins, **{threshold: 0.5})
    with pytest.raises(TypeError, match=re.escape("give `retrive_index` (sgl-kernel's name) or `retrieve_index` "
                                                  "(newer SGLang's), once; got both")):
        sampling(*outputs, candidates, retrive_index, next_token, next_sibling, **coins, retrieve_index=retrive_index)
    with pytest.raises(TypeError, match="got neither"):
        sglang.verify_tree_greedy(*outputs, candidates, retrive_index, next_token, target_predict=target.argmax(-1))
    with pytest.raises(TypeError, match="missing argument `target_probs`"):
        sampling(*outputs, candidates, retrive_index, next_token, next_sibling,
                 **{**coins, "target_probs": None})
    with pytest.raises(ValueError, match=re.escape("`uniform_samples` must have shape [B, N] = [2, 6]")):
        sampling(*outputs, candidates, retrive_index, next_token, next_sibling, **{**coins, "uniform_samples":
                                                                                    torch.rand(2, 5)})
    with pytest.raises(ValueError, match=re.escape("`target_predict` must have shape [B, N] = [2, 6]")):
        sglang.verify_tree_greedy(*outputs, candidates, retrive_index, next_token, next_sibling,
                                  target.argmax(-1)[:, :5])
    with pytest.raises(TypeError, match="`accept_index` must have dtype int32; got int64"):
        sglang.verify_tree_greedy(outputs[0], outputs[1].long(), outputs[2], candidates, retrive_index, next_token,
                                  next_sibling, target.argmax(-1))
    with pytest.raises(ValueError, match=r"`candidates` must have shape \[B, N\] with N >= 1"):
        sglang.verify_tree_greedy(*buffers(2, 0, 4, "cpu"), candidates[:, :0], retrive_index[:, :0],
                                  next_token[:, :0], next_sibling[:, :0], target.argmax(-1)[:, :0])
    with pytest.raises(ValueError, match="`accept_index` must have at least one column"):
        sglang.verify_tree_greedy(outputs[0], outputs[1][:, :0], outputs[2], candidates, retrive_index, next_token,
                                  next_sibling, target.argmax(-1))
