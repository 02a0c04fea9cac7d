"""Any workspace state at launch gives a defined outcome (docs/architecture.md, "Damaged words").

The counters, failure flags, claims and stage records of the plans that use
a workspace are filled with a value before a call: -1, 1, 2, 100 and
2**31 - 1 (what a stray write, a shared set or a launch that never ended
could leave). The kernels claim their words for the launch before they use
them (the first program of a launch resets them), so:

* the call writes the reference's outputs and counts no fault (a request
  split over several programs; one of a single program claims nothing, and
  gets the failure outcome with the fault counted); nothing is read or
  written outside the buffers (before claims, -1 and 100 made the
  Triton kernels write out of bounds and left uninitialised tokens, and 1 or
  2 could elect a request's last program early);
* the next call, with another seed, is bit-equal to the reference
  (probabilities) or to the same backend's call on a clean workspace
  (logits), and counts no fault either. (With the same seed, stale chunk
  results left by the call before would look right.)

Triton runs under the interpreter, where programs run one after another in
id order; the CUDA extension's block programs on its host path, blocks in id
order.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _faults, _workspace
from test_faults import (BATCH, CHAIN_PLANS, CLEAN_BUFFERS, chain_case, needs_chain_op, needs_tree_op, resolve,
                         tree_problem)

FILLS = [-1, 1, 2, 100, 2**31 - 1]
# The one-wave split plan (probabilities, no truncation) meets at an arrival counter too.
PLANS = {**CHAIN_PLANS, "split": (False, None, None)}
NO_FAULTS = dict.fromkeys(_faults.KINDS, 0)
CASES = [(plan, value) for plan in PLANS for value in FILLS]
LAYOUTS = ["padded", "packed"]  # chain_verify, chain_verify_packed


def fill_workspace(value):
    """Every counter, flag and record word of the eager CPU workspaces (those CLEAN_BUFFERS names) set to
    ``value``; returns their names."""
    filled = []
    for (name, _, device, stream), buffer in _workspace._buffers.items():
        if name in CLEAN_BUFFERS and device.type == "cpu" and stream == 0:
            buffer.fill_(value)
            filled.append(name)
    return filled


@pytest.fixture(autouse=True)
def zeroed_workspace_after():
    """The fill reaches words the plan under test never uses, and no call puts those back: zero them after."""
    yield
    fill_workspace(0)
    sk.kernel_errors("cpu")  # a failing case may stop before it reads the faults it caused


def chain_call(plan, layout):
    """``(layout arguments, options)`` of the plan's case: padded, or the same rows packed (every request has
    ``DRAFTS`` drafts, so ``[B, K + 1, V]`` rows are already ``[T + B, V]`` in packed order)."""
    logits, top_k, top_p = PLANS[plan]
    ids, target, draft = chain_case(logits)
    options = dict(temperature=torch.full((BATCH,), 0.8), logits=logits, offset=3,
                   top_k=None if top_k is None else torch.tensor(top_k),
                   top_p=None if top_p is None else torch.tensor(top_p))
    if layout == "padded":
        return (ids, target, draft), options
    drafts = ids.shape[1]
    cu_num_draft_tokens = torch.arange(BATCH + 1) * drafts
    return (ids.reshape(-1), cu_num_draft_tokens, target.reshape(-1, target.shape[-1]),
            draft.reshape(-1, draft.shape[-1])), options


def run_chain(backend, plan, seed, layout="padded"):
    arguments, options = chain_call(plan, layout)
    if layout == "padded":
        return sk.chain_verify(*arguments, seed=seed, backend=backend, **options)
    return sk.chain_verify_packed(*arguments, max_num_draft_tokens=arguments[0].shape[0] // BATCH, seed=seed,
                                  backend=backend, **options)


def run_tree(backend, seed):
    ids, parents, target, draft = tree_problem()
    return sk.tree_verify(ids, parents, target, draft, seed=seed, offset=2, backend=backend)


def same(outputs, expected):
    return all(torch.equal(actual, wanted) for actual, wanted in zip(outputs, expected))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("plan", "value"), CASES)
def test_a_damaged_chain_workspace_changes_no_output(plan, value, layout):
    backend = resolve("triton", "chain_verify" if layout == "padded" else "chain_verify_packed")
    logits = PLANS[plan][0]
    expected = run_chain(backend, plan, 77, layout)  # on a clean workspace: it also creates the buffers
    if not logits:
        assert same(expected, run_chain("reference", plan, 77, layout))
    next_expected = run_chain("reference" if not logits else backend, plan, 78, layout)
    assert fill_workspace(value), "the plan used no workspace"
    assert same(run_chain(backend, plan, 77, layout), expected)  # the launch's claims reset the words first
    assert sk.kernel_errors("cpu") == NO_FAULTS
    assert same(run_chain(backend, plan, 78, layout), next_expected)
    assert sk.kernel_errors("cpu") == NO_FAULTS


def test_a_launch_that_never_ended_leaves_nothing_behind():
    """Words mid-count under the claim of another launch (one that was killed, or shares the set): the next
    launch takes the claim over and resets them."""
    backend = resolve("triton", "chain_verify")
    expected = run_chain(backend, "split", seed=77)
    fill_workspace(1)
    for (name, _, device, stream), buffer in _workspace._buffers.items():
        if name == "chain_verify.claims" and device.type == "cpu" and stream == 0:
            buffer.fill_(2 * _workspace.launch_stamp() + 1)  # an earlier launch's, reset and counting
    assert same(run_chain(backend, "split", seed=77), expected)
    assert sk.kernel_errors("cpu") == NO_FAULTS


def unsplit_call(backend, seed):
    """B=3, K=3, V=1000 probabilities: one chunk, so each request is one program, which claims nothing."""
    generator = torch.Generator().manual_seed(13)
    target = torch.softmax(torch.randn(BATCH, 4, 1000, generator=generator) * 2, -1)
    draft = torch.softmax(torch.randn(BATCH, 3, 1000, generator=generator), -1)
    ids = torch.multinomial(draft.view(-1, 1000), 1, generator=generator).view(BATCH, 3)
    if backend == "cuda-host":
        from specdec_kernels.launchers import chain_verify as chain_launcher

        return chain_launcher.cuda_chain_verify(ids, target, draft, None, None, False, None, seed, None, 3)
    return sk.chain_verify(ids, target, draft, seed=seed, offset=3, backend=backend)


@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda-host", marks=needs_chain_op)])
@pytest.mark.parametrize("value", FILLS)
def test_a_damaged_unsplit_request_fails_and_the_next_call_is_clean(backend, value):
    """A request of one program has nobody to count with and claims nothing (large batches would pay the claim's
    round trips for nothing): a damaged arrival count or flag gives it the failure outcome, the fault counted,
    and the call after it is the reference's. (Before, the CUDA block took a damaged count for not its last
    arrival and wrote nothing.)"""
    backend = resolve(backend, "chain_verify")
    expected = unsplit_call("reference", 78)
    assert same(unsplit_call(backend, 77), unsplit_call("reference", 77))  # it also creates the buffers
    assert fill_workspace(value), "the call used no workspace"
    tokens, num_accepted = unsplit_call(backend, 77)
    assert (tokens == -1).all() and (num_accepted == 0).all(), (tokens, num_accepted)
    assert sum(sk.kernel_errors("cpu").values()) > 0
    assert same(unsplit_call(backend, 78), expected)
    assert sk.kernel_errors("cpu") == NO_FAULTS


def test_launch_stamps_are_distinct_and_never_a_small_word():
    stamps = [_workspace.launch_stamp() for _ in range(1000)]
    assert len(set(stamps)) == len(stamps)
    assert all(1 << 40 <= stamp < 1 << 61 for stamp in stamps)  # 2 * stamp + 1 fits an int64, far from -1 or 100


@pytest.mark.parametrize("value", FILLS)
def test_a_damaged_tree_workspace_changes_no_output(value):
    backend = resolve("triton", "tree_verify")
    expected = run_tree("reference", seed=9)
    assert same(run_tree(backend, seed=9), expected)
    next_expected = run_tree("reference", seed=10)
    assert fill_workspace(value), "the plan used no workspace"
    assert same(run_tree(backend, seed=9), expected)
    assert sk.kernel_errors("cpu") == NO_FAULTS
    assert same(run_tree(backend, seed=10), next_expected)
    assert sk.kernel_errors("cpu") == NO_FAULTS


def run_chain_on_the_cuda_host(plan, seed, layout):
    """The CUDA launcher on CPU tensors: the extension's block programs on the host, blocks in id order."""
    from specdec_kernels.launchers import chain_verify as chain_launcher

    arguments, options = chain_call(plan, layout)
    bundle = (options["temperature"], options["logits"], None, seed, None, options["offset"])
    sampling = dict(top_k=options["top_k"], top_p=options["top_p"])
    if layout == "padded":
        return chain_launcher.cuda_chain_verify(*arguments, None, *bundle, **sampling)
    return chain_launcher.cuda_chain_verify_packed(*arguments, arguments[0].shape[0] // BATCH, *bundle, **sampling)


def run_tree_on_the_cuda_host(seed):
    from specdec_kernels.launchers import tree_verify as tree_launcher

    ids, parents, target, draft = tree_problem()
    return tree_launcher.cuda_tree_verify(ids, parents, target, draft, None, None, False, "without_replacement",
                                          None, seed, None, 2)


@needs_chain_op
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("plan", "value"), CASES)
def test_a_damaged_chain_workspace_on_the_cuda_host_path(plan, value, layout):
    expected, next_expected = (run_chain_on_the_cuda_host(plan, seed, layout) for seed in (77, 78))  # clean
    assert fill_workspace(value), "the plan used no workspace"
    assert same(run_chain_on_the_cuda_host(plan, 77, layout), expected)
    assert sk.kernel_errors("cpu") == NO_FAULTS
    assert same(run_chain_on_the_cuda_host(plan, 78, layout), next_expected)
    assert sk.kernel_errors("cpu") == NO_FAULTS


@needs_tree_op
@pytest.mark.parametrize("value", FILLS)
def test_a_damaged_tree_workspace_on_the_cuda_host_path(value):
    expected, next_expected = (run_tree_on_the_cuda_host(seed) for seed in (9, 10))
    assert same(expected, run_tree("reference", seed=9))
    assert fill_workspace(value), "the plan used no workspace"
    assert same(run_tree_on_the_cuda_host(9), expected)
    assert sk.kernel_errors("cpu") == NO_FAULTS
    assert same(run_tree_on_the_cuda_host(10), next_expected)
    assert sk.kernel_errors("cpu") == NO_FAULTS
