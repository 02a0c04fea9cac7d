"""tree_verify's split plan (Triton): several programs share each request's vocabulary passes.

The interpreter splits batches of up to 4 requests over up to 3 slices
(``launchers/tree_verify.py``), so these tests run the stage records, the
slice-taking and the replay of rejections; the one-program plan is forced
with ``INTERPRETER_MAX_SPLITS = 1``. Both plans must give the reference's
bits with probabilities and each other's bits with logits, and leave the
stage records at zero.
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip
from sampling_parameter_cases import PARAMETER_SETS, parameter_values
from specdec_kernels import _workspace
from specdec_kernels.launchers import tree_verify as launcher
from test_tree_verify import DRAFT_MODES, assert_same, random_problem

pytestmark = pytest.mark.usefixtures("triton_tree_verify")


@pytest.fixture
def triton_tree_verify():
    backend_or_skip("tree_verify", "triton")


def verify(device, ids, parents, target, draft, **arguments):
    on_device = {name: value.to(device) if isinstance(value, torch.Tensor) else value
                 for name, value in arguments.items()}
    return sk.tree_verify(ids.to(device), parents.to(device), target.to(device),
                          None if draft is None else draft.to(device), backend="triton", **on_device)


def unsplit(monkeypatch, call):
    """``call()`` with the one-program plan (a GPU of one SM never splits)."""
    with monkeypatch.context() as patch:
        patch.setattr(launcher, "INTERPRETER_MAX_SPLITS", 1)
        patch.setattr(launcher, "multiprocessor_count", lambda device: 1)
        return call()


def stage_buffers(device):
    return [buffer for (name, _, buffer_device, _), buffer in _workspace._buffers.items()
            if name == "tree_verify.stage_counters" and buffer_device == device]


def star_case(batch_size, children, vocab_size, seed):
    """A root with ``children`` children whose tokens have ``p(t) = 0`` (every one rejected), each child with one
    grandchild: the root's rejections are ``children`` stages in a row."""
    generator = torch.Generator().manual_seed(seed)
    tree_size = 1 + 2 * children
    parents = torch.tensor([-1] + [0] * children + list(range(1, 1 + children)), dtype=torch.int32)
    parents = parents.expand(batch_size, tree_size).contiguous()
    target = torch.softmax(torch.randn(batch_size, tree_size, vocab_size, generator=generator) * 2, dim=-1)
    draft = torch.softmax(torch.randn(batch_size, tree_size, vocab_size, generator=generator), dim=-1)
    ids = torch.randint(0, vocab_size, (batch_size, tree_size), generator=generator)
    target[torch.arange(batch_size).view(-1, 1), 0, ids[:, 1:1 + children]] = 0.0
    return ids, parents, target, draft


def test_the_plan_splits_small_batches_only():
    config = launcher.launch_config(2, 8, 3000, interpreter=True)
    assert (config.num_splits, config.chunks_per_split, config.rows) == (3, 1, 1)
    assert launcher.launch_config(3, 8, 5000, interpreter=True)[-2:] == (2, 3)  # 5 chunks: slices of 3 and 2
    assert launcher.launch_config(5, 8, 5000, interpreter=True).num_splits == 1
    assert launcher.launch_config(2, 8, 1000, interpreter=True).num_splits == 1  # one chunk
    gpu = launcher.launch_config(8, 64, 128256, multiprocessors=132)
    assert (gpu.num_splits, gpu.chunks_per_split, gpu.rows) == (16, 8, 1)
    assert launcher.launch_config(1, 64, 128256, multiprocessors=132)[-2:] == (126, 1)
    assert launcher.launch_config(67, 64, 128256, multiprocessors=132).num_splits == 1
    assert launcher.split_batch_bound(132) == 66 and launcher.split_batch_bound(None) == 4
    assert launcher.launch_config(1, 1025, 128256, multiprocessors=132).num_splits == 1  # records bounded


def random_split_case(draft_mode, batch_size, vocab_size, bushy):
    """``(ids, parents, target, draft, arguments)``: random trees of 12 nodes (ragged, invalid ids, zero
    entries, greedy requests mixed in), per-request seeds."""
    generator = torch.Generator().manual_seed(vocab_size + bushy)
    ids, parents, target, draft, num_nodes, temperature = random_problem(
        generator, batch_size, 12, vocab_size, invalid_fraction=0.05, zero_fraction=0.2, greedy_fraction=0.3,
        bushy=bushy)
    draft = None if draft_mode is None else draft
    arguments = dict(num_nodes=num_nodes, temperature=temperature, draft_sampling=draft_mode or "with_replacement",
                     seed=torch.arange(batch_size) * 977 - 3, offset=5)
    return ids, parents, target, draft, arguments


@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
@pytest.mark.parametrize("batch_size, vocab_size", [(2, 2500), (3, 5000)])
@pytest.mark.parametrize("bushy", [True, False])
def test_split_plan_matches_the_reference(draft_mode, batch_size, vocab_size, bushy, device):
    """Random trees (ragged, invalid ids, zero entries, greedy requests mixed in): the reference's bits."""
    ids, parents, target, draft, arguments = random_split_case(draft_mode, batch_size, vocab_size, bushy)
    assert launcher.launch_config(batch_size, 12, vocab_size, interpreter=True).num_splits > 1
    expected = sk.tree_verify(ids, parents, target, draft, backend="reference", **arguments)
    assert_same(verify(device, ids, parents, target, draft, **arguments), expected)
    assert all(not buffer.any() for buffer in stage_buffers(device))


@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
@pytest.mark.parametrize("children", [2, 5])
def test_many_rejections_at_one_node(draft_mode, children, device, monkeypatch):
    """Every child of the root rejected: ``children`` stages replayed one after another, then the sample
    (a replay applied twice, or not at all, changes the residual and so the sampled tokens)."""
    ids, parents, target, draft = star_case(2, children, 3000, seed=children)
    draft = None if draft_mode is None else draft
    sampling = draft_mode or "with_replacement"
    for seed in range(2):
        arguments = dict(draft_sampling=sampling, seed=seed, offset=1)
        expected = sk.tree_verify(ids, parents, target, draft, backend="reference", **arguments)
        split = verify(device, ids, parents, target, draft, **arguments)
        assert_same(split, expected)
        assert (split[2] == 0).all()  # every child rejected
        assert_same(unsplit(monkeypatch, lambda: verify(device, ids, parents, target, draft, **arguments)), split)
    assert all(not buffer.any() for buffer in stage_buffers(device))


def logits_case(draft_mode):
    """``(ids, parents, logits, draft_logits, arguments)``: 2 requests of logits rows over 3 chunks, greedy
    requests mixed in, for comparing the split plan with the one-program plan (add a seed)."""
    generator = torch.Generator().manual_seed(31)
    ids, parents, target, draft, num_nodes, temperature = random_problem(
        generator, 2, 10, 3000, greedy_fraction=0.3, bushy=True)
    logits = torch.log(target + 1e-9) * 3
    draft_logits = None if draft_mode is None else torch.log(draft + 1e-9)
    arguments = dict(num_nodes=num_nodes, temperature=temperature, logits=True,
                     draft_sampling=draft_mode or "with_replacement")
    return ids, parents, logits, draft_logits, arguments


@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_logits_give_the_bits_of_the_one_program_plan(draft_mode, device, monkeypatch):
    """With logits the kernels only agree with the reference near ties, but the two plans compute the same
    statistics with the same code and the same float32 maps: the same bits."""
    ids, parents, logits, draft_logits, case_arguments = logits_case(draft_mode)
    for seed in range(3):
        arguments = dict(case_arguments, seed=seed)
        split = verify(device, ids, parents, logits, draft_logits, **arguments)
        assert_same(unsplit(monkeypatch, lambda: verify(device, ids, parents, logits, draft_logits, **arguments)),
                    split)


@pytest.mark.parametrize("parameters", sorted(PARAMETER_SETS))
def test_sampling_parameters_in_the_split_plan(parameters, device):
    """top-k / top-p / min-p thresholds (Triton: found by one program per node entered and shared through the
    entry stage; CUDA: found by every program) and bonus ids: the reference's bits."""
    generator = torch.Generator().manual_seed(47)
    ids, parents, target, draft, num_nodes, _ = random_problem(generator, 3, 9, 2500, bushy=True)
    for seed in range(2):
        values = parameter_values(PARAMETER_SETS[parameters], 3, 2500, seed=seed)
        arguments = dict(num_nodes=num_nodes, seed=seed, **values)
        expected = sk.tree_verify(ids, parents, target, draft, backend="reference", **arguments)
        assert_same(verify(device, ids, parents, target, draft, **arguments), expected)


def test_a_long_walk_uses_and_clears_many_stages(device):
    """A root with 12 rejected children (13 stages with the sample): the records of every stage are used and
    left at zero, and a second call with other seeds is not disturbed by the first."""
    ids, parents, target, draft = star_case(1, 12, 2100, seed=3)
    for seed in (5, 6):
        arguments = dict(draft_sampling="without_replacement", seed=seed)
        expected = sk.tree_verify(ids, parents, target, draft, backend="reference", **arguments)
        assert_same(verify(device, ids, parents, target, draft, **arguments), expected)
        assert all(not buffer.any() for buffer in stage_buffers(device))


def assert_sizes_do_not_decrease(workspace_specs, multiprocessors):
    """``workspace_specs(B, N, V, multiprocessors)``: a reservation for the largest B, N and V covers every
    smaller call (split batches and their stage records around the split bound included)."""
    sizes = [(batch, nodes, vocab) for batch in (1, 3, 4, 5, 66, 67, 200) for nodes in (1, 64, 1024, 1025, 5000)
             for vocab in (7, 2100, 128256)]
    specs = {size: workspace_specs(*size, multiprocessors) for size in sizes}
    for small in sizes:
        for large in sizes:
            if all(s <= l for s, l in zip(small, large)):
                assert all(specs[small][name][0] <= specs[large][name][0] for name in specs[small])


@pytest.mark.parametrize("multiprocessors", [None, 132])
def test_workspace_sizes_do_not_decrease(multiprocessors):
    """A reservation for the largest B, N and V covers every smaller call."""
    assert_sizes_do_not_decrease(launcher.triton_workspace_specs, multiprocessors)
