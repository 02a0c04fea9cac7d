"""The CUDA chain kernel's staged truncation plan (csrc/include/specdec/chain_verify_stages.cuh), on the host.

With top_k / top_p / min_p and a batch that splits its rows, the blocks of a
request measure the thresholds of all its rows together, stage by stage,
through records in ``stages``. On the host the blocks run one after another,
so the first block of a request takes every slice of every stage: the
records still combine several slices' partial sums (the split counts below
are forced above 1), and the other blocks read the totals, decide and sample
their own slices. With probabilities the tokens equal the reference bit for
bit; with logits they equal the one-block walk plan's (``staged=False``).
"""

import pytest
import torch

from conftest import extension_op_marks
from specdec_kernels import _faults
from sampling_parameter_cases import PARAMETER_SETS, assert_logits_agree, quantised, with_parameters
from specdec_kernels.launchers import chain_verify as launcher
from test_chain_verify_cuda import agreement, assert_same, degenerate_cases, make_case, random_state, run_op, \
    run_reference
from test_tree_verify_split import assert_sizes_do_not_decrease

needs_op, _, _ = extension_op_marks("chain_verify")

TRUNCATING_SETS = [name for name, names in PARAMETER_SETS.items() if names != ("bonus_token_ids",)]


@needs_op
@pytest.mark.parametrize("parameters", TRUNCATING_SETS)
@pytest.mark.parametrize("with_draft", [True, False])
def test_staged_matches_reference_bitwise(with_draft, parameters):
    """Greedy requests mixed in, ragged counts, invalid ids, V over 5-9 chunks, the launcher's split count and
    forced ones (a last slice shorter than the others), quantised rows (ties at every threshold)."""
    cases = [
        make_case(3, 4, 5000, seed=71, with_draft=with_draft, greedy_fraction=0.3),
        quantised(make_case(2, 3, 9000, seed=72, with_draft=with_draft, invalid_fraction=0.0)),
    ]
    for index, case in enumerate(cases):
        case = with_parameters(case, PARAMETER_SETS[parameters], seed=80 + index)
        seed, offset = random_state("per-request-seed", case["target"].shape[0], "cpu", step=index)
        expected = run_reference(case, seed, offset)
        for num_splits in (0, 4):
            assert_same(run_op(case, seed, offset, num_splits), expected,
                        f"{parameters} case {index} splits={num_splits}")
        # Without records the same call walks the rows with one block per request.
        assert_same(run_op(case, seed, offset, staged=False), expected, f"{parameters} case {index} walk")


@needs_op
def test_staged_degenerate_rows_match_reference():
    """NaN, negative, above-1, tied, all-zero rows and a NaN row, every parameter and bonus ids, three slices."""
    for case in degenerate_cases("cpu", 3000):
        for parameters in ("all", "all+bonus"):
            case = with_parameters(case, PARAMETER_SETS[parameters], seed=6)
            for offset in range(2):
                assert_same(run_op(case, 4, offset, num_splits=3), run_reference(case, 4, offset),
                            f"{parameters} offset {offset}")


@needs_op
@pytest.mark.parametrize("with_draft", [True, False])
def test_staged_logits_equal_the_walk_plan(with_draft):
    """Logits: the thresholds come from the same integer sums, the statistics from the slices merged in slice
    order; on these rows (no near-ties) the tokens equal the one-block walk's, and agree with the reference."""
    rates = []
    for index, parameters in enumerate(("all", "all+bonus", "top_p")):
        case = make_case(4, 3, 4100, seed=100 + index, logits=True, with_draft=with_draft, greedy_fraction=0.25)
        case = with_parameters(case, PARAMETER_SETS[parameters], seed=index)
        staged = run_op(case, 5, index, num_splits=3)
        assert_same(staged, run_op(case, 5, index, staged=False), f"{parameters}: staged vs walk")
        rates.append(agreement(staged, run_reference(case, 5, index)))
    assert_logits_agree(rates, f"staged, draft={with_draft}")


@needs_op
def test_staged_records_are_reused_across_calls():
    """The records are left at zero (run_op checks) and the next call on them gives the same tokens."""
    case = with_parameters(make_case(3, 2, 2500, seed=9, greedy_fraction=0.0), PARAMETER_SETS["all"], seed=2)
    expected = run_reference(case, 1, 0)
    for _ in range(2):
        assert_same(run_op(case, 1, 0, num_splits=3), expected, "repeat")


@needs_op
def test_staged_dirty_records_fail_the_request_and_are_cleaned():
    """A stage whose slices look taken by a call damaged from outside: the bounded wait gives up, the request
    gets the failure outcome (tokens -1, num_accepted 0), the fault is counted, the other requests are
    unaffected, and the records are put back to zero."""
    case = with_parameters(make_case(3, 2, 2500, seed=9, greedy_fraction=0.0), PARAMETER_SETS["all"], seed=2)
    batch_size, rows, vocab_size = case["target"].shape
    specs = launcher.cuda_workspace_specs(batch_size, rows, vocab_size, False, "cpu")
    stages = torch.zeros(launcher.cuda_stage_words(batch_size, rows), dtype=torch.int64)
    stages[11 * 16] = 100  # request 0, the kept-mass stage: "slices taken"
    arrivals = torch.zeros(specs["chain_verify_cuda.arrivals"][0], dtype=torch.int32)
    errors = torch.zeros(len(_faults.KINDS), dtype=torch.int32)
    output, num_accepted = torch.zeros(batch_size, rows, dtype=torch.int32), torch.zeros(batch_size, dtype=torch.int32)
    torch.ops.specdec_C.chain_verify(
        case["draft_token_ids"], case["target"], case["draft"], case["num_draft_tokens"], case["temperature"],
        False, None, 1, None, 0, torch.zeros(specs["chain_verify_cuda.workspace"][0], dtype=torch.int64),
        arrivals, output, num_accepted, 3, case["top_k"], case["top_p"], case["min_p"], stages=stages,
        errors=errors)
    assert (output[0] == -1).all() and num_accepted[0] == 0
    expected = run_reference(case, 1, 0)
    assert torch.equal(output[1:], expected[0][1:]) and torch.equal(num_accepted[1:], expected[1][1:])
    assert errors.tolist() == [1, 0]  # the first block to wait gave up; the others found the request failed
    assert not arrivals.any() and not stages.any()


def test_reserve_workspace_includes_the_stage_records(monkeypatch):
    """``sk.reserve_workspace`` reserves the CUDA call's scratch, stage records included (CUDA-graph capture)."""
    import specdec_kernels as sk
    from specdec_kernels import _backend, _workspace

    reserved = {}
    monkeypatch.setattr(_backend, "available",
                        lambda op_name, backend, device: (op_name, backend) == ("chain_verify", "cuda"))
    monkeypatch.setattr(_workspace, "reserve", lambda device, specs, **options: reserved.update(specs))
    sk.reserve_workspace("cpu", batch_size=3, max_draft_tokens=4, vocab_size=5000)
    assert reserved == launcher.cuda_workspace_specs(3, 5, 5000, False, "cpu")
    assert reserved["chain_verify_cuda.stages"][0] == launcher.cuda_stage_words(3, 5)


def test_reserve_workspace_without_truncation_reserves_no_stage_records(monkeypatch):
    """``truncation=False``: the stage records (about 165 KB a request at K = 4) are not reserved, and a call
    without sampling parameters asks for none, so a captured untruncated call is served without them."""
    import specdec_kernels as sk
    from specdec_kernels import _backend, _workspace

    reserved = {}
    monkeypatch.setattr(_backend, "available",
                        lambda op_name, backend, device: op_name == "chain_verify" and backend in ("triton", "cuda"))
    monkeypatch.setattr(_workspace, "reserve", lambda device, specs, **options: reserved.update(specs))
    sk.reserve_workspace("cpu", batch_size=3, max_draft_tokens=4, vocab_size=5000, truncation=False)
    assert reserved["chain_verify_cuda.stages"] == (1, torch.int64)
    assert reserved["chain_verify.stage_counters"] == (1, torch.int64)
    untruncated = {**launcher.cuda_workspace_specs(3, 5, 5000, False, "cpu", truncate=False),
                   **launcher.triton_workspace_specs(3, 5, 5000, False, torch.device("cpu"), truncate=False)}
    assert untruncated == reserved
    truncated = {**launcher.cuda_workspace_specs(3, 5, 5000, False, "cpu"),
                 **launcher.triton_workspace_specs(3, 5, 5000, False, torch.device("cpu"))}
    assert {name: size for name, size in truncated.items() if "stage" not in name} == {
        name: size for name, size in reserved.items() if "stage" not in name}
    assert truncated["chain_verify_cuda.stages"][0] == launcher.cuda_stage_words(3, 5) > 1
    assert truncated["chain_verify.stage_counters"][0] > 1


@pytest.mark.parametrize("multiprocessors", [None, 132])
def test_workspace_sizes_do_not_decrease(multiprocessors, monkeypatch):
    """A reservation for the largest B, K + 1 and V covers every smaller call (around the split bound too)."""
    monkeypatch.setattr(launcher, "_multiprocessor_count", lambda device: multiprocessors)
    device = "cpu" if multiprocessors is None else "cuda"
    assert_sizes_do_not_decrease(
        lambda batch, rows, vocab, _: launcher.cuda_workspace_specs(batch, rows, vocab, True, device), multiprocessors)
