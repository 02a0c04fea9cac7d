"""Faults with a defined outcome (docs/api.md): a bounded wait that gives up fails its request, leaves no state.

The waits of the staged and two-wave chain plans and of the tree split plan
never hang by design; here a test switch (``_faults.forced_give_up``) makes
the program (Triton, under the interpreter) or block (the CUDA extension's
host path) of one role give up its first wait. Then:

* the requests of that program get the failure outcome (tokens ``-1``,
  ``num_accepted`` 0, ``accepted_nodes`` ``[0, -1, ...]``), every other
  request its usual bits;
* ``sk.kernel_errors()`` reports exactly one give-up, of the right kind;
* every counter and stage record of the workspace is back at zero;
* the next call is bit-equal to the reference (probabilities) or to the same
  backend's call before the fault (logits).

The forced role is the first and the last program of a request, since they
play different parts: under the interpreter (programs in id order) the first
takes every slice and the last ends the request; on the host path a tree
request's blocks run in decreasing rank, so its writer (rank 0) ends it.
"""

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip, extension_op_marks
from specdec_kernels import _faults, _workspace
from specdec_kernels.launchers import chain_verify as chain_launcher
from specdec_kernels.launchers import tree_verify as tree_launcher
from test_tree_verify_split import star_case

needs_chain_op, _, _ = extension_op_marks("chain_verify")
needs_tree_op, _, _ = extension_op_marks("tree_verify")

# Every buffer a call must leave at zero (the counters, failure flags and stage records).
CLEAN_BUFFERS = ("chain_verify.tickets", "chain_verify.wave1_arrivals", "chain_verify.arrivals",
                 "chain_verify.failed_row_blocks", "chain_verify.claims", "chain_verify.stage_counters",
                 "tree_verify.stage_counters",
                 "chain_verify_cuda.arrivals", "chain_verify_cuda.stages", "chain_verify_cuda.claims",
                 "tree_verify_cuda.stages")

# The chain plans whose programs wait, on a batch whose rows split three ways (V = 3000, three chunks):
# (logits, top_k, top_p) -> the plan the launchers pick for them (the CUDA kernel stages logits too).
CHAIN_PLANS = {
    "staged": (False, [40, 9, 7], None),
    "staged-logits": (True, None, [0.9, 0.8, 0.95]),
    "two-waves": (True, None, None),
}
BATCH, DRAFTS, VOCAB = 3, 3, 3000


def dirty_buffers():
    return [name for (name, _, device, _), buffer in _workspace._buffers.items()
            if name in CLEAN_BUFFERS and device.type == "cpu" and bool(buffer.any())]


def chain_case(logits):
    generator = torch.Generator().manual_seed(11 + logits)
    target = torch.randn(BATCH, DRAFTS + 1, VOCAB, generator=generator) * 2
    draft = torch.softmax(target[:, :DRAFTS] + torch.randn(BATCH, DRAFTS, VOCAB, generator=generator), -1)
    ids = torch.multinomial(draft.view(-1, VOCAB), 1, generator=generator).view(BATCH, DRAFTS)
    return ids, target if logits else torch.softmax(target, -1), draft


def run_chain(backend, plan):
    logits, top_k, top_p = CHAIN_PLANS[plan]
    ids, target, draft = chain_case(logits)
    temperature = torch.full((BATCH,), 0.8)
    parameters = dict(top_k=None if top_k is None else torch.tensor(top_k),
                      top_p=None if top_p is None else torch.tensor(top_p))
    if backend == "cuda-host":  # the CUDA launcher on CPU tensors: the block program on the host
        return chain_launcher.cuda_chain_verify(ids, target, draft, None, temperature, logits, None, 77, None, 3,
                                                **parameters)
    return sk.chain_verify(ids, target, draft, temperature=temperature, logits=logits, seed=77, offset=3,
                           backend=backend, **parameters)


def chain_roles(backend, plan, which):
    """The role of request 1's first or last program in the plan, and the requests it fails."""
    logits, top_k, top_p = CHAIN_PLANS[plan]
    if backend == "cuda-host":  # csrc/chain_verify.cu: up to 8 blocks per batch, one request per block, staged
        splits, rows, waves = 3, 1, 1
    else:
        limits = chain_launcher.INTERPRETER_LIMITS
        if top_k is None and top_p is None:
            config = chain_launcher.launch_config(BATCH, DRAFTS + 1, VOCAB, None, limits)
        else:
            config, staged = chain_launcher.truncation_config(BATCH, DRAFTS + 1, VOCAB, None, limits)
            assert staged
        splits, rows, waves = config.num_splits, config.rows, 2 if plan == "two-waves" else 1
    assert splits == 3
    # Two waves (Triton): wave 1 (the first row blocks * splits roles) never waits; fail a wave 2 program.
    wave = -(-BATCH // rows) * splits if waves == 2 else 0
    block = 1 if rows == 1 else 0  # the row block holding request 1
    first = wave + block * splits
    return first + (0 if which == "first" else splits - 1), range(block * rows, min(BATCH, (block + 1) * rows))


def tree_problem():
    """Two requests whose root children are all rejected (``p(t) = 0``): every program waits on each rejection."""
    return star_case(2, 3, VOCAB, seed=4)


def run_tree(backend):
    ids, parents, target, draft = tree_problem()
    if backend == "cuda-host":
        return tree_launcher.cuda_tree_verify(ids, parents, target, draft, None, None, False, "without_replacement",
                                              None, 9, None, 2)
    return sk.tree_verify(ids, parents, target, draft, seed=9, offset=2, backend=backend)


def assert_failed(outputs, failed_requests, tree):
    for output in outputs[-2:-1]:  # output_token_ids
        assert (output[failed_requests] == -1).all()
    assert (outputs[-1][failed_requests] == 0).all()
    if tree:
        accepted = outputs[0][failed_requests]
        assert (accepted[:, 0] == 0).all() and (accepted[:, 1:] == -1).all()


def assert_equal_outside(outputs, expected, failed_requests):
    kept = [b for b in range(expected[0].shape[0]) if b not in failed_requests]
    for actual, wanted in zip(outputs, expected):
        assert torch.equal(actual[kept], wanted[kept])


BACKENDS = [pytest.param("triton"), pytest.param("cuda-host", marks=needs_chain_op)]


def resolve(backend, op):
    return backend if backend == "cuda-host" else backend_or_skip(op, backend, "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("plan", list(CHAIN_PLANS))
@pytest.mark.parametrize("which", ["first", "last"])
def test_chain_give_up_fails_its_requests_only_and_leaves_nothing_behind(backend, plan, which):
    backend = resolve(backend, "chain_verify")
    before = run_chain(backend, plan)
    if not CHAIN_PLANS[plan][0]:
        assert all(torch.equal(a, b) for a, b in zip(before, run_chain("reference", plan)))
    assert sk.kernel_errors("cpu") == dict.fromkeys(_faults.KINDS, 0)
    role, failed_requests = chain_roles(backend, plan, which)
    with _faults.forced_give_up(role):
        outputs = run_chain(backend, plan)
    failed_requests = list(failed_requests)
    assert_failed(outputs, failed_requests, tree=False)
    assert_equal_outside(outputs, before, failed_requests)
    assert sk.kernel_errors("cpu") == {**dict.fromkeys(_faults.KINDS, 0), "chain_verify.wait_gave_up": 1}
    assert dirty_buffers() == []
    after = run_chain(backend, plan)
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert sk.kernel_errors("cpu") == dict.fromkeys(_faults.KINDS, 0)


@pytest.mark.parametrize("backend", [pytest.param("triton"), pytest.param("cuda-host", marks=needs_tree_op)])
@pytest.mark.parametrize("rank", ["first", "last"])
def test_tree_give_up_fails_its_request_only_and_leaves_nothing_behind(backend, rank):
    backend = resolve(backend, "tree_verify")
    splits, _ = tree_launcher.vocabulary_splits(2, VOCAB, None, tree_problem()[0].shape[1])
    assert splits == 3
    expected = run_tree("reference")
    assert all(torch.equal(a, b) for a, b in zip(run_tree(backend), expected))
    role = splits + (0 if rank == "first" else splits - 1)  # request 1's rank 0 or its last rank
    with _faults.forced_give_up(role):
        outputs = run_tree(backend)
    assert_failed(outputs, [1], tree=True)
    assert_equal_outside(outputs, expected, [1])
    assert sk.kernel_errors("cpu") == {**dict.fromkeys(_faults.KINDS, 0), "tree_verify.wait_gave_up": 1}
    assert dirty_buffers() == []
    assert all(torch.equal(a, b) for a, b in zip(run_tree(backend), expected))
    assert sk.kernel_errors("cpu") == dict.fromkeys(_faults.KINDS, 0)


def test_kernel_errors_reads_and_resets_the_device_counters():
    counters = _faults.error_counters(torch.device("cpu"))
    counters[_faults.TREE_WAIT_GAVE_UP] += 2
    assert sk.kernel_errors("cpu", reset=False)["tree_verify.wait_gave_up"] == 2
    assert sk.kernel_errors("cpu")["tree_verify.wait_gave_up"] == 2
    assert sk.kernel_errors("cpu") == dict.fromkeys(_faults.KINDS, 0)


def test_reset_takes_the_counters_by_exchange():
    """Where Triton runs, the reset is one atomic exchange per word (a fault counted meanwhile on another
    stream lands in this reading or the next), not a copy and a subtraction with a window between them."""
    from conftest import DEVICE

    backend_or_skip("chain_verify", "triton")
    counters = _faults.error_counters(torch.device(DEVICE))
    counters.copy_(torch.tensor([3, 5], dtype=torch.int32))
    taken = _faults._taken(counters)
    assert taken.tolist() == [3, 5] and counters.tolist() == [0, 0]


def test_the_kernels_count_into_the_words_of_the_kinds():
    """kernels/faults.py and csrc/include/specdec/faults.cuh index the counters as _faults.KINDS."""
    import re
    from pathlib import Path

    from specdec_kernels._kernels import faults as triton_faults

    assert (triton_faults.CHAIN_WAIT_GAVE_UP.value, triton_faults.TREE_WAIT_GAVE_UP.value) == (
        _faults.CHAIN_WAIT_GAVE_UP, _faults.TREE_WAIT_GAVE_UP)
    header = (Path(__file__).parents[1] / "csrc/include/specdec/faults.cuh").read_text()
    words = {name: int(value) for name, value in re.findall(r"constexpr int (k\w+) = (\d+);", header)}
    assert words == {"kChainWaitGaveUp": _faults.CHAIN_WAIT_GAVE_UP, "kTreeWaitGaveUp": _faults.TREE_WAIT_GAVE_UP,
                     "kFaultKinds": len(_faults.KINDS)}
