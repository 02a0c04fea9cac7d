"""The CUDA tree_verify's split plan (csrc/include/specdec/tree_verify.cuh), run on the host.

The launcher (``launchers/tree_verify.py``, ``cuda_tree_verify``) on CPU
tensors runs the kernel's block program on the emulated block, with the
split of the Triton kernel's interpreter: batches of up to 4 requests over
up to 3 slices, so these tests run the stage records, the slice-taking and
the replay of rejections. Blocks run one after another, a request's in
decreasing rank: the first to run takes every slice, and the writer (rank
0) runs last, so its outputs come from the totals, records and chunk
results another block published. The one-block plan
is forced with ``INTERPRETER_MAX_SPLITS = 1``. Both plans must give the
reference's bits with probabilities and each other's bits with logits, and
leave the stage records at zero. The cases are the Triton split tests'
(tests/test_tree_verify_split.py).
"""

from __future__ import annotations

import pytest
import torch

from conftest import extension_op_marks
from sampling_parameter_cases import PARAMETER_SETS, parameter_values
from specdec_kernels import _faults, _validation, _workspace
from specdec_kernels.launchers import tree_verify as launcher
from test_tree_verify import DRAFT_MODES, assert_same, random_problem
from test_tree_verify_cuda import make_case, run_reference
from test_tree_verify_split import (assert_sizes_do_not_decrease, logits_case, random_split_case, star_case,
                                   unsplit)

needs_op, _, _ = extension_op_marks("tree_verify")
pytestmark = needs_op


def verify(ids, parents, target, draft, *, num_nodes=None, temperature=None, logits=False,
           draft_sampling="with_replacement", seed=0, offset=0, top_k=None, top_p=None, min_p=None,
           bonus_token_ids=None):
    """The CUDA launcher on CPU tensors: the block program on the host, split as the launcher plans."""
    seed_tensor, seed_int, offset_tensor, offset_int = _validation.split_random_state(seed, offset)
    return launcher.cuda_tree_verify(ids, parents, target, draft, num_nodes, temperature, logits, draft_sampling,
                                     seed_tensor, seed_int, offset_tensor, offset_int, top_k, top_p, min_p,
                                     bonus_token_ids)


def reference(ids, parents, target, draft, *, num_nodes=None, temperature=None, logits=False,
              draft_sampling="with_replacement", seed=0, offset=0, **parameters):
    case = dict(tree_token_ids=ids, parents=parents, target=target, draft=draft, num_nodes=num_nodes,
                temperature=temperature, logits=logits, draft_sampling=draft_sampling, **parameters)
    return run_reference(case, seed, offset)


def stage_buffers():
    return [buffer for (name, _, device, _), buffer in _workspace._buffers.items()
            if name == "tree_verify_cuda.stages" and device.type == "cpu"]


def assert_records_clear():
    buffers = stage_buffers()
    assert buffers and all(not buffer.any() for buffer in buffers), "stage records left dirty"


def splits(batch_size, vocab_size):
    return launcher.vocabulary_splits(batch_size, vocab_size, None)[0]


@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
@pytest.mark.parametrize("batch_size, vocab_size", [(2, 2500), (3, 5000)])
@pytest.mark.parametrize("bushy", [True, False])
def test_split_plan_matches_the_reference(draft_mode, batch_size, vocab_size, bushy):
    """Random trees (ragged, invalid ids, zero entries, greedy requests mixed in): the reference's bits."""
    ids, parents, target, draft, arguments = random_split_case(draft_mode, batch_size, vocab_size, bushy)
    assert splits(batch_size, vocab_size) > 1
    assert_same(verify(ids, parents, target, draft, **arguments), reference(ids, parents, target, draft, **arguments))
    assert_records_clear()


@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_split_plan_on_aligned_rows_and_storage_dtypes(draft_mode):
    """Long accepted paths with rejections along the way (make_case of the CUDA tests), bfloat16 inputs."""
    for index, dtype in enumerate((torch.float32, torch.bfloat16)):
        case = make_case(4, 10, 2100, seed=70 + index, draft_mode=draft_mode, dtype=dtype, bushy=True)
        arguments = {name: case[name] for name in ("num_nodes", "temperature", "draft_sampling")}
        assert splits(4, 2100) > 1
        ids, parents, target, draft = (case[name] for name in ("tree_token_ids", "parents", "target", "draft"))
        for seed in range(2):
            assert_same(verify(ids, parents, target, draft, seed=seed, offset=3, **arguments),
                        run_reference(case, seed, 3))
    assert_records_clear()


@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_split_plan_malformed_trees(draft_mode):
    """Parents outside [0, i), num_nodes outside [1, N], junk at parents[:, 0]: the reference's outcome."""
    case = make_case(4, 9, 2100, seed=16, draft_mode=draft_mode, invalid_fraction=0.2, bushy=True)
    parents = case["parents"].clone()
    parents[:, 0] = torch.tensor([-1, 5, -7, 2**31 - 1], dtype=torch.int32)
    parents[0, 3] = 3
    parents[1, 2] = 7
    parents[2, 5] = -(2**31)
    parents[3, 8] = 100
    case["parents"] = parents
    case["num_nodes"] = torch.tensor([0, 100, 5, -3], dtype=torch.int32)
    arguments = {name: case[name] for name in ("num_nodes", "temperature", "draft_sampling")}
    for offset in range(2):
        assert_same(verify(case["tree_token_ids"], parents, case["target"], case["draft"], seed=0, offset=offset,
                           **arguments), run_reference(case, 0, offset))
    assert_records_clear()


@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
@pytest.mark.parametrize("children", [1, 2, 5])
def test_many_rejections_at_one_node(draft_mode, children, monkeypatch):
    """Every child of the root rejected: ``children`` stages replayed one after another, then the sample
    (a replay applied twice, or not at all, changes the residual and so the sampled tokens)."""
    ids, parents, target, draft = star_case(2, children, 3000, seed=children)
    draft = None if draft_mode is None else draft
    for seed in range(3):
        arguments = dict(draft_sampling=draft_mode or "with_replacement", seed=seed, offset=1)
        split = verify(ids, parents, target, draft, **arguments)
        assert_same(split, reference(ids, parents, target, draft, **arguments))
        assert (split[2] == 0).all()  # every child rejected
        assert_same(unsplit(monkeypatch, lambda: verify(ids, parents, target, draft, **arguments)), split)
        assert_records_clear()


@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_logits_give_the_bits_of_the_one_block_plan(draft_mode, monkeypatch):
    """With logits the kernels only agree with the reference near ties, but the two plans compute the same
    statistics with the same code and the same float32 maps: the same bits."""
    ids, parents, logits, draft_logits, case_arguments = logits_case(draft_mode)
    for seed in range(3):
        arguments = dict(case_arguments, seed=seed)
        split = verify(ids, parents, logits, draft_logits, **arguments)
        assert_same(unsplit(monkeypatch, lambda: verify(ids, parents, logits, draft_logits, **arguments)), split)
    assert_records_clear()


@pytest.mark.parametrize("parameters", sorted(PARAMETER_SETS))
def test_sampling_parameters_in_the_split_plan(parameters):
    """top-k / top-p / min-p thresholds (recomputed by every block) and bonus ids: the reference's bits."""
    generator = torch.Generator().manual_seed(47)
    ids, parents, target, draft, num_nodes, _ = random_problem(generator, 3, 9, 2500, bushy=True)
    for seed in range(2):
        values = parameter_values(PARAMETER_SETS[parameters], 3, 2500, seed=seed)
        arguments = dict(num_nodes=num_nodes, seed=seed, **values)
        assert_same(verify(ids, parents, target, draft, **arguments), reference(ids, parents, target, draft,
                                                                                **arguments))
    assert_records_clear()


def test_a_long_walk_uses_and_clears_many_stages(monkeypatch):
    """A root with 20 rejected children (21 stages with the sample): the records of every stage are used and
    left at zero, a second call with other seeds is not disturbed by the first, and the one-block plan agrees."""
    ids, parents, target, draft = star_case(1, 20, 2100, seed=3)
    for seed in (5, 6):
        arguments = dict(draft_sampling="without_replacement", seed=seed)
        split = verify(ids, parents, target, draft, **arguments)
        assert_same(split, reference(ids, parents, target, draft, **arguments))
        assert_records_clear()
        assert_same(unsplit(monkeypatch, lambda: verify(ids, parents, target, draft, **arguments)), split)


def test_dirty_records_fail_the_request_and_are_cleaned():
    """A record left non-zero by a call damaged from outside makes a wait give up: the request gets the
    failure outcome, the fault is counted, the other request is unaffected and the records end at zero."""
    ids, parents, target, draft = star_case(2, 2, 2100, seed=4)
    workspace_words = launcher.cuda_workspace_specs(2, ids.shape[1], 2100, None)["tree_verify_cuda.workspace"][0]
    stages = torch.zeros(launcher.cuda_workspace_specs(2, ids.shape[1], 2100, None)["tree_verify_cuda.stages"][0],
                         dtype=torch.int64)
    stages[0] = 5  # request 0, stage 0: every slice "taken", none published
    errors = torch.zeros(len(_faults.KINDS), dtype=torch.int32)
    outputs = (torch.empty(2, ids.shape[1], dtype=torch.int32), torch.empty(2, ids.shape[1], dtype=torch.int32),
               torch.empty(2, dtype=torch.int32))
    torch.ops.specdec_C.tree_verify(ids, parents, target, draft, None, None, False, "without_replacement", None,
                                    1, None, 0, torch.zeros(workspace_words, dtype=torch.int64), *outputs,
                                    None, None, None, None, stages, splits(2, 2100), errors=errors)
    accepted, tokens, num_accepted = outputs
    assert accepted[0].tolist() == [0] + [-1] * (ids.shape[1] - 1) and (tokens[0] == -1).all()
    assert num_accepted[0] == 0
    expected = reference(ids, parents, target, draft, draft_sampling="without_replacement", seed=1)
    assert all(torch.equal(actual[1], wanted[1]) for actual, wanted in zip(outputs, expected))
    assert errors.tolist() == [0, 1]  # the first block to wait gave up; the others found the request failed
    assert not stages.any()


def test_the_op_checks_the_stage_records():
    ids, parents, target, draft = star_case(2, 1, 2100, seed=4)
    words = launcher.cuda_workspace_specs(2, ids.shape[1], 2100, None)
    outputs = (torch.empty(2, ids.shape[1], dtype=torch.int32), torch.empty(2, ids.shape[1], dtype=torch.int32),
               torch.empty(2, dtype=torch.int32))
    workspace = torch.zeros(words["tree_verify_cuda.workspace"][0], dtype=torch.int64)

    def call(stages, num_splits):
        torch.ops.specdec_C.tree_verify(ids, parents, target, draft, None, None, False, "without_replacement", None,
                                        1, None, 0, workspace, *outputs, None, None, None, None, stages, num_splits)

    stage_words = words["tree_verify_cuda.stages"][0]
    assert stage_words == 16 * 2 * (ids.shape[1] + 1)
    with pytest.raises(ValueError, match="`num_splits` > 1 needs `stages`"):
        call(None, 2)
    with pytest.raises(ValueError, match=rf"`stages` must be a contiguous \[M\] tensor with M >= .* = {stage_words}"):
        call(torch.zeros(stage_words - 1, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="`num_splits` must be in"):
        call(None, 0)
    call(torch.zeros(stage_words, dtype=torch.int64), 2)  # exactly the specified size


def test_the_op_refuses_a_split_of_a_tree_past_the_replay_capacity():
    """A block replays a node's rejections from shared memory (at most 1,023 of them): the op refuses a split
    plan for trees of more than 1,024 nodes, which the launcher never asks for (it takes one block per request
    there, ``launcher.MAX_SPLIT_TREE_NODES``), instead of writing past the shared-memory array."""
    nodes = launcher.MAX_SPLIT_TREE_NODES + 1
    ids = torch.zeros(1, nodes, dtype=torch.int64)
    parents = torch.arange(-1, nodes - 1, dtype=torch.int32).view(1, nodes)
    target = torch.full((1, nodes, 8), 1 / 8)
    words = launcher.cuda_workspace_specs(1, nodes, 8, None)
    outputs = (torch.empty(1, nodes, dtype=torch.int32), torch.empty(1, nodes, dtype=torch.int32),
               torch.empty(1, dtype=torch.int32))
    stages = torch.zeros(16 * (nodes + 1), dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"`num_splits` > 1 needs N <= {nodes - 1} .*got N = {nodes}"):
        torch.ops.specdec_C.tree_verify(ids, parents, target, None, None, None, False, "without_replacement", None,
                                        1, None, 0, torch.zeros(words["tree_verify_cuda.workspace"][0],
                                                                dtype=torch.int64),
                                        *outputs, None, None, None, None, stages, 2)


def test_opcheck_of_the_split_plan():
    """Schema (the stage records are mutated), Meta kernel and dispatcher registration agree."""
    case = make_case(3, 5, 2100, seed=2)
    specs = launcher.cuda_workspace_specs(3, 5, 2100, None)
    arguments = (case["tree_token_ids"], case["parents"], case["target"], case["draft"], case["num_nodes"],
                 case["temperature"], False, "without_replacement", None, 4, torch.tensor(2), 0,
                 torch.zeros(specs["tree_verify_cuda.workspace"][0], dtype=torch.int64),
                 torch.zeros(3, 5, dtype=torch.int32), torch.zeros(3, 5, dtype=torch.int32),
                 torch.zeros(3, dtype=torch.int32), None, None, None, None,
                 torch.zeros(specs["tree_verify_cuda.stages"][0], dtype=torch.int64), splits(3, 2100))
    torch.library.opcheck(torch.ops.specdec_C.tree_verify.default, arguments)


@pytest.mark.parametrize("multiprocessors", [None, 132])
def test_workspace_sizes_do_not_decrease(multiprocessors):
    """A reservation for the largest B, N and V covers every smaller call."""
    assert_sizes_do_not_decrease(launcher.cuda_workspace_specs, multiprocessors)
