"""The Triton chain kernel's staged plan: truncation (top-k / top-p / min-p) shared by a request's programs.

Small batches split each row over programs (``launchers/chain_verify.py``);
with truncation on, every pass of the threshold search is then a stage
record that the request's programs share (``kernels/chain_verify_stages.py``).
The interpreter caps the slices at 3, so ``V > 2048`` crosses slices, and it
runs programs one after another, so a request's first program takes every
slice while the adds still combine several slices' partials. Checked: bit
equality with the reference for probabilities (each parameter, all of them,
bonus ids, greedy requests, ties, degenerate rows, no draft, packed and
padded), the same tokens as the one-slice walk plan for logits, and the
workspace (records and counters at zero after every call, sizes that never
decrease).
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip
from sampling_parameter_cases import PARAMETER_SETS, parameter_values, quantised
from test_chain_verify import assert_counters_at_zero, random_case
from test_chain_verify_packed import packed_case, padded_equivalent, run_packed
from test_sampling_parameters import on

launcher = pytest.importorskip("specdec_kernels.launchers.chain_verify")


@pytest.fixture(autouse=True)
def _triton_only(device):
    backend_or_skip("chain_verify", "triton")


def assert_staged(batch_size, rows_per_request, vocab_size, device):
    """The launcher takes the staged plan for this call (on a GPU too: these batches are small)."""
    gpu = device.type == "cuda"
    _, staged = launcher.truncation_config(batch_size, rows_per_request, vocab_size,
                                           launcher._multiprocessor_count(device) if gpu else None,
                                           launcher.GPU_LIMITS if gpu else launcher.INTERPRETER_LIMITS)
    assert staged


def assert_workspace_at_zero(device):
    """Counters and every stage record at zero: the next call needs no memset."""
    from specdec_kernels import _workspace

    assert_counters_at_zero(device)
    records = [buffer for (name, _, buffer_device, _), buffer in _workspace._buffers.items()
               if name == "chain_verify.stage_counters" and buffer_device == device]
    assert records and all(not buffer.any() for buffer in records)


def probability_case():
    """Three requests over 5000 tokens (slices of 2, 2 and 1 chunks): ties, degenerate rows, an invalid id."""
    draft_ids, target, draft, _ = random_case(3, 3, 5000, seed=12, sharp=3.0)
    target = quantised({"target": target}, levels=400)["target"]  # ties at every threshold
    target[1, 1, ::2] = float("nan")  # NaN and negatives count as 0
    target[1, 2, 1::2] = -1.0
    target[2, 0] = 0.0  # a row without mass
    draft_ids[2, 1] = -1  # an invalid id: a rejection
    return draft_ids, target, draft, torch.tensor([3, 2, 3], dtype=torch.int32)


def assert_triton_matches(expected, ids, target, draft, device, **kwargs):
    actual = sk.chain_verify(ids.to(device), target.to(device), None if draft is None else draft.to(device),
                             backend="triton", **on(device, kwargs))
    assert torch.equal(actual[0].cpu(), expected[0]) and torch.equal(actual[1].cpu(), expected[1])
    assert_workspace_at_zero(device)


@pytest.mark.parametrize("names", ["top_k", "top_p", "all+bonus"])
def test_probabilities_match_the_reference(names, device):
    """Bit for bit; greedy requests mixed in, then every request sampled without a draft."""
    draft_ids, target, draft, num_drafts = probability_case()
    assert_staged(3, 4, 5000, device)
    parameters = parameter_values(PARAMETER_SETS[names], 3, 5000, seed=len(names))
    for temperature, case_draft in ((torch.tensor([1.0, 0.0, 0.7]), draft), (None, None)):
        kwargs = dict(num_draft_tokens=num_drafts, temperature=temperature, seed=torch.tensor([4, 9, 2**40]),
                      offset=3, **parameters)
        expected = sk.chain_verify(draft_ids, target, case_draft, backend="reference", **kwargs)
        assert_triton_matches(expected, draft_ids, target, case_draft, device, **kwargs)


def test_packed_matches_the_reference_and_the_padded_layout(device):
    case = packed_case([3, 0, 2], 3, 4500, seed=5, device="cpu", greedy=(2,))
    case.update(parameter_values(PARAMETER_SETS["all+bonus"], 3, 4500, seed=8))
    assert_staged(3, 4, 4500, device)
    expected = run_packed(case, "reference", seed=3, offset=1)
    actual = run_packed(on(device, case), "triton", seed=3, offset=1)
    assert torch.equal(actual[0].cpu(), expected[0]) and torch.equal(actual[1].cpu(), expected[1])
    padded = padded_equivalent(case)
    assert_triton_matches(expected, padded.pop("draft_token_ids"), padded.pop("target"), padded.pop("draft"), device,
                          **padded, seed=3, offset=1)


def test_logits_give_the_walk_plans_tokens(monkeypatch, device):
    """Logits: the staged normalisers are combined from slices, the walk's in one pass, so floats may differ
    in the last bit; on these inputs the tokens must not."""
    draft_ids, target, draft, num_drafts = random_case(3, 3, 4200, seed=21, sharp=4.0)
    target = target.log()  # `logits` covers the target only (v1.3)
    target[1, 0, :7] = -float("inf")
    assert_staged(3, 4, 4200, device)
    parameters = dict(top_k=torch.tensor([40, 0, 3]), top_p=torch.tensor([0.8, 0.3, 1.0]),
                      min_p=torch.tensor([0.0, 0.05, 0.2]))
    for case_draft, extra in ((draft, {}), (None, dict(bonus_token_ids=torch.tensor([7, 8, 9])))):
        kwargs = on(device, dict(num_draft_tokens=num_drafts, temperature=torch.tensor([0.8, 1.0, 0.0]),
                                 logits=True, seed=11, offset=2, **parameters, **extra))
        rows = [None if tensor is None else tensor.to(device) for tensor in (draft_ids, target, case_draft)]
        staged = sk.chain_verify(*rows, backend="triton", **kwargs)
        assert_workspace_at_zero(device)
        with monkeypatch.context() as patch:
            patch.setattr(launcher, "STAGED_TRUNCATION", False)
            walked = sk.chain_verify(*rows, backend="triton", **kwargs)
        assert torch.equal(staged[0], walked[0]) and torch.equal(staged[1], walked[1])


def test_the_launchers_mirrors_of_kernel_constants_agree():
    """The launchers size the stage records from copies of the kernels' constants (they cannot import the
    kernels modules at load time: Triton is optional); a kernel change must be mirrored."""
    from specdec_kernels._kernels import tree_verify_stages, truncation
    from specdec_kernels.launchers import tree_verify as tree_launcher

    assert launcher.STAGES_PER_REQUEST == truncation.NUM_STAGES.value
    assert launcher.STAGE_HEADER_WORDS == tree_verify_stages.STAGE_WORDS.value
    assert tree_launcher.STAGE_WORDS == tree_verify_stages.STAGE_WORDS.value
    assert launcher.SEARCH_CANDIDATES == truncation.CANDIDATES.value


@pytest.mark.parametrize("multiprocessors", [None, 132])
def test_stage_records_do_not_decrease(monkeypatch, multiprocessors):
    """A reservation for the largest B, K + 1, V covers every smaller call's stage records."""
    device = torch.device("cpu" if multiprocessors is None else "cuda")
    monkeypatch.setattr(launcher, "_multiprocessor_count", lambda _: multiprocessors)
    sizes = [(batch, rows, vocab) for batch in (1, 3, 263, 264, 300) for rows in (1, 2, 5, 9, 16)
             for vocab in (7, 1024, 1025, 128256)]
    specs = {size: launcher.triton_workspace_specs(*size, True, device) for size in sizes}
    for small in sizes:
        for large in sizes:
            if all(s <= l for s, l in zip(small, large)):
                assert all(specs[small][name][0] <= specs[large][name][0] for name in specs[small])
    for batch, rows, vocab in sizes:
        config, staged = launcher.truncation_config(batch, rows, vocab, multiprocessors, launcher.GPU_LIMITS
                                                    if multiprocessors else launcher.INTERPRETER_LIMITS)
        if staged:
            needed = batch * launcher.STAGES_PER_REQUEST * launcher.stage_record_words(config.block_k1)
            assert needed <= specs[(batch, rows, vocab)]["chain_verify.stage_counters"][0]


def test_gpu_tiles_cross_search_tiles_and_slices(monkeypatch, device):
    """The GPU's tiles (one chunk a slice, a search tile narrower than a chunk; here 8 search tiles a chunk
    instead of 128, for time): the partials of several tiles and slices add up to the reference's thresholds."""
    if device.type == "cuda":
        pytest.skip("the interpreter's tiles are the only ones to swap")
    monkeypatch.setattr(launcher, "INTERPRETER_LIMITS", launcher.GPU_LIMITS._replace(max_splits=3, search_tile=4096))
    draft_ids, target, draft, _ = random_case(1, 1, 2100, seed=14, sharp=3.0)
    config, staged = launcher.truncation_config(1, 2, 2100, None, launcher.INTERPRETER_LIMITS)
    assert staged and config.num_splits == 3 and config.search_block * 8 == config.block_v
    kwargs = dict(top_k=torch.tensor([900]), top_p=torch.tensor([0.7]), min_p=torch.tensor([0.001]), seed=6)
    expected = sk.chain_verify(draft_ids, target, draft, backend="reference", **kwargs)
    assert_triton_matches(expected, draft_ids, target, draft, device, **kwargs)
