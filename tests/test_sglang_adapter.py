"""sk.adapters.sglang: SGLang's EAGLE tree layout in, SGLang's outputs out.

The trees are written in SGLang's layout by a builder of their own below
(children pushed onto the head of their parent's list from the last slot to
the first, as SGLang's tree builder does), and the expected outputs come
from plain Python loops: ``sk.tree_verify`` called directly and converted by
hand, and, for greedy requests, SGLang's greedy walk over the links restated
from its kernel (``verify_tree_greedy``).
"""

from __future__ import annotations

import re

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip
from op_recording import recorded_ops
from specdec_kernels.adapters import sglang

BACKENDS = ["reference", "triton", "cuda"]
DRAFT_MODES = ["with_replacement", "without_replacement", None]  # None: draft=None (SGLang's target-only case)


# ----------------------------------------------------------------------------- SGLang's layout, built independently


def eagle_parents(generator, level_sizes):
    """An EAGLE-like tree as a parents list: nodes by level, each parent drawn from the level above.

    Slots are in level order (a parent's slot precedes its children's) and a
    parent's children need not be next to each other, as in SGLang's trees,
    whose slots follow the draft beam's indices.
    """
    parents, level = [-1], [0]
    for size in level_sizes:
        first = len(parents)
        parents += [level[int(torch.randint(len(level), (1,), generator=generator))] for _ in range(size)]
        level = list(range(first, first + size))
    return parents


def sglang_layout(parents_per_request, dtype=torch.int64, retrive_index=None):
    """``(retrive_index, retrive_next_token, retrive_next_sibling)`` of a batch of parents lists."""
    batch_size, tree_size = len(parents_per_request), len(parents_per_request[0])
    next_token = [[-1] * tree_size for _ in range(batch_size)]
    next_sibling = [[-1] * tree_size for _ in range(batch_size)]
    for b, parents in enumerate(parents_per_request):
        for node in range(tree_size - 1, 0, -1):
            parent = parents[node]
            next_sibling[b][node] = next_token[b][parent]
            next_token[b][parent] = node
    if retrive_index is None:
        retrive_index = [[b * tree_size + i for i in range(tree_size)] for b in range(batch_size)]
    return tuple(torch.tensor(t, dtype=dtype) for t in (retrive_index, next_token, next_sibling))


def depths(parents):
    result = [0]
    for node in range(1, len(parents)):
        result.append(result[parents[node]] + 1)
    return result


def by_hand(accepted_nodes, output_token_ids, num_accepted, retrive_index, spec_steps):
    """``tree_verify``'s outputs in SGLang's form, one request and one path node at a time."""
    batch_size, tree_size = accepted_nodes.shape
    predicts = [-1] * (batch_size * tree_size + 1)  # SGLang's predict has a spare row past B * N
    accept_index = [[-1] * (spec_steps + 1) for _ in range(batch_size)]
    for b in range(batch_size):
        for j in range(int(num_accepted[b]) + 1):
            row = int(retrive_index[b, int(accepted_nodes[b, j])])
            accept_index[b][j] = row
            predicts[row] = int(output_token_ids[b, j])
    return torch.tensor(predicts, dtype=torch.int32), torch.tensor(accept_index, dtype=torch.int32), num_accepted


def sglang_greedy_walk(candidates, retrive_index, next_token, next_sibling, target_argmax, spec_steps):
    """SGLang's greedy rule on its own layout: follow the first child in list order equal to the argmax."""
    batch_size, tree_size = candidates.shape
    predicts = {}
    accept_index = [[-1] * (spec_steps + 1) for _ in range(batch_size)]
    accept_token_num = []
    for b in range(batch_size):
        node, accepted = 0, 0
        accept_index[b][0] = int(retrive_index[b, 0])
        while accepted < spec_steps:
            child = int(next_token[b, node])
            while child != -1 and int(candidates[b, child]) != int(target_argmax[b, node]):
                child = int(next_sibling[b, child])
            if child == -1:
                break
            predicts[int(retrive_index[b, node])] = int(candidates[b, child])
            node, accepted = child, accepted + 1
            accept_index[b][accepted] = int(retrive_index[b, node])
        predicts[int(retrive_index[b, node])] = int(target_argmax[b, node])
        accept_token_num.append(accepted)
    return predicts, torch.tensor(accept_index, dtype=torch.int32), torch.tensor(accept_token_num, dtype=torch.int32)


def random_batch(generator, batch_size, level_sizes, vocab_size, *, shuffle_rows=False, greedy_fraction=0.3):
    """Trees, tokens, distributions and temperatures for one batch."""
    parents = [eagle_parents(generator, level_sizes) for _ in range(batch_size)]
    tree_size = len(parents[0])
    retrive_index = None
    if shuffle_rows:  # the adapter must use the rows it is given, not b * N + i
        retrive_index = torch.randperm(batch_size * tree_size, generator=generator).view(batch_size, -1).tolist()
    layout = sglang_layout(parents, retrive_index=retrive_index)
    # Few tokens, so siblings often repeat one and the target often agrees with the draft.
    candidates = torch.randint(0, min(vocab_size, 4), (batch_size, tree_size), generator=generator)
    target = torch.softmax(2 * torch.randn(batch_size, tree_size, vocab_size, generator=generator), -1)
    draft = torch.softmax(torch.randn(batch_size, tree_size, vocab_size, generator=generator), -1)
    greedy = torch.rand(batch_size, generator=generator) < greedy_fraction
    temperature = torch.where(greedy, 0.0, 1.0).to(torch.float32)
    return parents, candidates, layout, target, draft, temperature


# ----------------------------------------------------------------------------- (a) the conversion


@pytest.mark.parametrize("level_sizes", [[], [1], [4, 3, 2], [3, 8, 8, 8], [1, 1, 1, 1, 1, 1], [20, 12]])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_parents_from_links_recovers_the_builders_parents(level_sizes, dtype):
    generator = torch.Generator().manual_seed(len(level_sizes) * 100 + sum(level_sizes))
    parents = [eagle_parents(generator, level_sizes) for _ in range(5)]
    _, next_token, next_sibling = sglang_layout(parents, dtype)
    converted = sglang.parents_from_links(next_token, next_sibling)
    assert converted.dtype == torch.int32
    assert converted.tolist() == parents


def test_parents_from_links_on_a_long_sibling_list():
    # 40 children of the root: the pointer doubling needs all its rounds.
    parents = [[-1] + [0] * 40 + list(range(1, 9))]
    _, next_token, next_sibling = sglang_layout(parents)
    assert sglang.parents_from_links(next_token, next_sibling).tolist() == parents


def test_parents_from_links_gives_unlinked_nodes_no_parent():
    next_token = torch.tensor([[1, -1, -1, 0]])  # slot 2 is linked from nowhere; a link to the root is none
    next_sibling = torch.tensor([[-1, 3, -1, 7]])  # 7 is past the tree
    assert sglang.parents_from_links(next_token, next_sibling).tolist() == [[-1, 0, -1, 0]]


# ----------------------------------------------------------------------------- (b) against tree_verify called directly


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
@pytest.mark.parametrize("level_sizes, spec_steps", [([3, 4, 2], None), ([2, 3, 3, 1], 2), ([5], 3)])
def test_adapter_equals_tree_verify_converted_by_hand(backend, draft_mode, level_sizes, spec_steps, device):
    backend_or_skip("tree_verify", backend)
    generator = torch.Generator().manual_seed(sum(level_sizes) * 7 + len(level_sizes))
    batch_size, vocab_size = 5, 11
    parents, candidates, layout, target, draft, temperature = random_batch(
        generator, batch_size, level_sizes, vocab_size, shuffle_rows=True)
    tree_size = len(parents[0])
    draft = None if draft_mode is None else draft
    sampling = draft_mode or "without_replacement"
    steps = tree_size - 1 if spec_steps is None else spec_steps
    # Nodes deeper than spec_steps are left out of the direct call's tree.
    direct_parents = [[p if d <= steps else -1 for p, d in zip(tree, depths(tree))] for tree in parents]
    candidates, target, temperature = candidates.to(device), target.to(device), temperature.to(device)
    draft = None if draft is None else draft.to(device)
    layout = tuple(t.to(device) for t in layout)

    direct = sk.tree_verify(candidates, torch.tensor(direct_parents, dtype=torch.int32, device=device), target,
                            draft, temperature=temperature, draft_sampling=sampling, seed=123, offset=4,
                            backend=backend)
    expected = by_hand(*(t.cpu() for t in direct), layout[0].cpu(), steps)
    result = sglang.eagle_tree_verify(candidates, *layout, target, draft, spec_steps=spec_steps,
                                      temperature=temperature, draft_sampling=sampling, seed=123, offset=4,
                                      backend=backend)
    for got, want in zip(result, expected):
        assert got.dtype == torch.int32
        assert torch.equal(got.cpu(), want)
    assert int(result[2].max()) <= steps


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampling_parameters_and_bonus_ids_pass_through(backend, device):
    backend_or_skip("tree_verify", backend)
    generator = torch.Generator().manual_seed(5)
    parents, candidates, layout, target, _, temperature = random_batch(generator, 3, [2, 2], 9)
    tree = torch.tensor(parents, dtype=torch.int32)
    options = dict(temperature=temperature, seed=9, top_k=torch.tensor([0, 3, 2]), top_p=0.8, min_p=0.1,
                   bonus_token_ids=torch.tensor([7, 8, 6]), backend=backend)
    direct = sk.tree_verify(candidates.to(device), tree.to(device), target.to(device),
                            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()})
    expected = by_hand(*(t.cpu() for t in direct), layout[0], tree.shape[1] - 1)
    result = sglang.eagle_tree_verify(candidates.to(device), *(t.to(device) for t in layout), target.to(device),
                                      **{k: v.to(device) if isinstance(v, torch.Tensor) else v
                                         for k, v in options.items()})
    for got, want in zip(result, expected):
        assert torch.equal(got.cpu(), want)


# ----------------------------------------------------------------------------- (c) SGLang's semantics


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hand_made_tree_gives_sglangs_outputs(temperature, device):
    """Root 5; slots 1, 2 (tokens 1, 2) its children; slot 3 (token 3) a child of slot 1; slot 4 (token 4)
    a child of slot 2. The target is one-hot: after the root 2, after slot 2 token 4, after slot 4 token 9.

    SGLang's kernels try slot 1 (rejected: the target gives it no mass), then slot 2 (accepted): predicts
    at the root's row is 2. From slot 2 its child slot 4 is accepted: predicts at slot 2's row is 4. Slot 4
    is a leaf, so the target's token 9 is written at its row. accept_index lists the rows of slots 0, 2, 4;
    accept_token_num counts the two accepted drafts. Request 1 is the same tree with rows shifted by N = 5.
    """
    candidates = torch.tensor([[5, 1, 2, 3, 4]] * 2, device=device)
    layout = tuple(t.to(device) for t in sglang_layout([[-1, 0, 0, 1, 2]] * 2))
    assert layout[1][0].tolist() == [1, 3, 4, -1, -1] and layout[2][0].tolist() == [-1, 2, -1, -1, -1]
    target = torch.nn.functional.one_hot(torch.tensor([[2, 0, 4, 0, 9]] * 2), 10).float().to(device)
    predicts, accept_index, accept_token_num = sglang.eagle_tree_verify(
        candidates, *layout, target, spec_steps=3, temperature=temperature, seed=1)
    assert predicts.tolist() == [2, -1, 4, -1, 9, 2, -1, 4, -1, 9, -1]
    assert accept_index.tolist() == [[0, 2, 4, -1], [5, 7, 9, -1]]
    assert accept_token_num.tolist() == [2, 2]

    # With spec_steps = 1 SGLang stops after one acceptance and samples the target after slot 2: token 4.
    predicts, accept_index, accept_token_num = sglang.eagle_tree_verify(
        candidates, *layout, target, spec_steps=1, temperature=temperature, seed=1)
    assert predicts.tolist() == [2, -1, 4, -1, -1, 2, -1, 4, -1, -1, -1]
    assert accept_index.tolist() == [[0, 2], [5, 7]]
    assert accept_token_num.tolist() == [1, 1]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("level_sizes, spec_steps", [([4, 6, 5], 3), ([3, 3, 3, 3], 2), ([1], 5)])
def test_greedy_equals_sglangs_greedy_walk(backend, level_sizes, spec_steps, device):
    backend_or_skip("tree_verify", backend)
    generator = torch.Generator().manual_seed(sum(level_sizes) + spec_steps)
    batch_size, vocab_size = 6, 5
    parents, candidates, layout, target, _, _ = random_batch(generator, batch_size, level_sizes, vocab_size,
                                                             shuffle_rows=True)
    expected_predicts, expected_index, expected_num = sglang_greedy_walk(
        candidates, *layout, target.argmax(-1), spec_steps)
    predicts, accept_index, accept_token_num = sglang.eagle_tree_verify(
        candidates.to(device), *(t.to(device) for t in layout), target.to(device), spec_steps=spec_steps,
        temperature=0.0, backend=backend)
    assert torch.equal(accept_index.cpu(), expected_index)
    assert torch.equal(accept_token_num.cpu(), expected_num)
    assert {row: int(predicts[row]) for row in expected_predicts} == expected_predicts
    assert int((predicts != -1).sum()) == len(expected_predicts)  # other rows -1


def test_no_host_read():
    """On meta tensors (shapes without values, which every op's fake implementation takes) any read of a
    value on the host raises, so this runs through only if the adapter never reads one."""
    generator = torch.Generator().manual_seed(3)
    _, candidates, layout, target, _, temperature = random_batch(generator, 4, [3, 3, 3], 7)
    meta = [t.to("meta") for t in (candidates, *layout, target)]
    predicts, accept_index, accept_token_num = sglang.eagle_tree_verify(
        *meta, spec_steps=2, temperature=temperature.to("meta"), seed=8, backend="reference")
    assert predicts.shape == (41,) and accept_index.shape == (4, 3) and accept_token_num.shape == (4,)


def test_traces_into_one_graph(device):
    generator = torch.Generator().manual_seed(3)
    _, candidates, layout, target, _, temperature = random_batch(generator, 4, [3, 3, 3], 7)
    inputs = [t.to(device) for t in (candidates, *layout, target)]

    def step(*inputs, offset):
        return sglang.eagle_tree_verify(*inputs, spec_steps=2, temperature=temperature.to(device), seed=8,
                                        offset=offset, backend="reference")

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for offset in range(3):
        for got, want in zip(compiled(*inputs, offset=offset), step(*inputs, offset=offset)):
            assert torch.equal(got, want)


# ----------------------------------------------------------------------------- errors and malformed layouts


def test_shape_and_type_errors_name_the_argument():
    layout = sglang_layout([[-1, 0, 0]])
    candidates, target = torch.tensor([[1, 2, 3]]), torch.rand(1, 3, 4)
    with pytest.raises(ValueError, match=re.escape("`retrive_next_sibling` must have shape [B, N] = [1, 3]")):
        sglang.eagle_tree_verify(candidates, *layout[:2], layout[2][:, :2], target)
    with pytest.raises(TypeError, match="`retrive_index` must have dtype int32 or int64"):
        sglang.eagle_tree_verify(candidates, layout[0].float(), *layout[1:], target)
    with pytest.raises(ValueError, match="`spec_steps` must be an int >= 0; got -1"):
        sglang.eagle_tree_verify(candidates, *layout, target, spec_steps=-1)
    with pytest.raises(TypeError, match="`spec_steps` must be an int >= 0; got float"):
        sglang.eagle_tree_verify(candidates, *layout, target, spec_steps=2.0)
    with pytest.raises(ValueError, match=re.escape("`target` must have shape [B, N, V] = [1, 3, *]")):
        sglang.eagle_tree_verify(candidates, *layout, torch.rand(1, 4, 4))


@pytest.mark.parametrize("edit, pattern", [
    (lambda t: t[1].__setitem__((0, 1), 1), "`retrive_next_token` must hold -1 or a later slot"),
    (lambda t: t[2].__setitem__((0, 0), 3), "`retrive_next_sibling` must be -1 at the root"),
    (lambda t: t[2].__setitem__((0, 2), 3), "request 0 node 3 is linked from 2"),
    (lambda t: t[1].__setitem__((0, 1), -1), "request 0 node 3 is linked from 0"),
    (lambda t: t[0].__setitem__((0, 2), 1), "`retrive_index` must not repeat a row"),
    (lambda t: t[0].__setitem__((0, 2), 4), re.escape("`retrive_index` must lie in [0, B * N) = [0, 4)")),
])
def test_validate_names_what_breaks_the_layout(edit, pattern):
    layout = sglang_layout([[-1, 0, 0, 1]])
    edit(layout)
    with pytest.raises(ValueError, match=pattern):
        sglang.eagle_tree_verify(torch.tensor([[1, 2, 3, 3]]), *layout, torch.rand(1, 4, 4), validate=True)


def test_validate_rejects_a_tree_deeper_than_spec_steps_and_accepts_a_valid_one():
    layout = sglang_layout([[-1, 0, 1, 2]])
    candidates, target = torch.tensor([[1, 2, 3, 3]]), torch.softmax(torch.rand(1, 4, 4), -1)
    sglang.eagle_tree_verify(candidates, *layout, target, spec_steps=3, validate=True)
    with pytest.raises(ValueError, match="deeper than `spec_steps` = 2: request 0 node 3 is at depth 3"):
        sglang.eagle_tree_verify(candidates, *layout, target, spec_steps=2, validate=True)


def test_malformed_layout_has_the_documented_outcome():
    """Without validate: a node reached by a link to an earlier slot is ignored, rows outside [0, B*N) are
    left out of predicts."""
    candidates = torch.tensor([[5, 1, 2]])
    retrive_index = torch.tensor([[0, 99, 2]])
    next_token = torch.tensor([[2, -1, 1]])  # slot 1 is a child of slot 2: not in topological order
    next_sibling = torch.tensor([[-1, -1, -1]])
    target = torch.nn.functional.one_hot(torch.tensor([[2, 3, 1]]), 4).float()
    predicts, accept_index, accept_token_num = sglang.eagle_tree_verify(
        candidates, retrive_index, next_token, next_sibling, target, temperature=0.0)
    # Slot 2 accepted; its child slot 1 (parent 2 > 1) is never tried, so the target's 1 is emitted there.
    assert predicts.tolist() == [2, -1, 1, -1] and accept_index.tolist() == [[0, 2, -1]]
    assert accept_token_num.tolist() == [1]
    retrive_index = torch.tensor([[0, 1, 99]])
    predicts, accept_index, _ = sglang.eagle_tree_verify(
        candidates, retrive_index, next_token, next_sibling, target, temperature=0.0)
    assert predicts.tolist() == [2, -1, -1, -1] and accept_index.tolist() == [[0, 99, -1]]


def test_the_documented_example():
    """The example of the docstring and of docs/layouts.md."""
    candidates = torch.tensor([[5, 1, 2, 3]])
    retrive_index = torch.arange(4).view(1, 4)
    next_token = torch.tensor([[1, 3, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, -1]])
    target = torch.nn.functional.one_hot(torch.tensor([[2, 3, 6, 0]]), 8).float()
    result = sk.adapters.sglang.eagle_tree_verify(candidates, retrive_index, next_token, next_sibling, target,
                                                  spec_steps=2, temperature=0.0)
    assert [t.tolist() for t in result] == [[2, -1, 6, -1, -1], [[0, 2, -1]], [1]]


# ----------------------------------------------------------------------------- the adapter's Triton kernels


def malformed_links(generator, batch_size, tree_size):
    """Links of any value in [-2, N + 2): repeated targets, links back to earlier slots, cycles, out of range."""
    return tuple(torch.randint(-2, tree_size + 2, (batch_size, tree_size), generator=generator) for _ in range(2))


@pytest.mark.parametrize("tree_size", [1, 2, 13, 64, 100])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_parents_kernel_equals_the_torch_conversion(tree_size, dtype, device):
    """kernels/eagle_layout.py's parents (with and without the depth limit) against parents_from_links and
    limit_depth, bit for bit, on SGLang's layouts and on malformed links."""
    backend_or_skip("tree_verify", "triton")
    from specdec_kernels.launchers.eagle_layout import triton_eagle_parents

    generator = torch.Generator().manual_seed(tree_size * 3 + (dtype == torch.int64))
    sizes = [tree_size - 1] if tree_size <= 2 else [3, tree_size - 4]
    trees = [eagle_parents(generator, [size for size in sizes if size > 0]) for _ in range(5)]
    _, next_token, next_sibling = sglang_layout(trees, dtype)
    layouts = [(next_token, next_sibling), malformed_links(generator, 5, tree_size)]
    for links in layouts:
        links = tuple(t.to(dtype).to(device) for t in links)
        for spec_steps in sorted({0, 1, 2, tree_size - 2, tree_size - 1}):
            if spec_steps < 0:
                continue
            want = sglang.limit_depth(sglang.parents_from_links(*links), spec_steps, backend="reference")
            got = triton_eagle_parents(*links, spec_steps)
            assert got.dtype == torch.int32 and torch.equal(got.cpu(), want.cpu()), spec_steps


@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("level_sizes, spec_steps", [([3, 4, 2], None), ([2, 3, 3, 1], 2), ([5], 3)])
def test_triton_adapter_equals_the_reference_adapter(draft_mode, in_place, level_sizes, spec_steps, device):
    """The whole adapter, Triton kernels around the Triton tree_verify, against the torch path around the
    reference, bit for bit; rows of retrive_index shuffled across the batch."""
    backend_or_skip("tree_verify", "triton")
    generator = torch.Generator().manual_seed(sum(level_sizes) * 11 + in_place)
    parents, candidates, layout, target, draft, temperature = random_batch(
        generator, 7, level_sizes, 11, shuffle_rows=True)
    tree_size = len(parents[0])
    steps = tree_size - 1 if spec_steps is None else spec_steps
    inputs = [t.to(device) for t in (candidates, *layout, target)]
    draft = None if draft_mode is None else draft.to(device)
    results = {}
    for backend in ("reference", "triton"):
        outputs = {}
        if in_place:
            outputs = dict(predicts=torch.full((7 * tree_size + 1,), 777, dtype=torch.int32, device=device),
                           accept_index=torch.full((7, steps + 1), 555, dtype=torch.int32, device=device),
                           accept_token_num=torch.full((7,), 333, dtype=torch.int32, device=device))
        results[backend] = sglang.eagle_tree_verify(
            *inputs, draft, spec_steps=spec_steps, temperature=temperature.to(device),
            draft_sampling=draft_mode or "without_replacement", seed=31, offset=2, backend=backend, **outputs)
    for got, want in zip(results["triton"], results["reference"]):
        assert torch.equal(got.cpu(), want.cpu())
    assert results["triton"][0].shape == (7 * tree_size + 1,)  # SGLang's predict: one row past B * N


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_malformed_rows_have_the_same_outcome_on_both_paths(backend, device):
    """retrive_index with rows out of range and rows repeated: a new predicts holds the largest token of a
    repeated row on every path; in a caller's predicts rows repeated within a request do too."""
    backend_or_skip("tree_verify", backend)
    generator = torch.Generator().manual_seed(17)
    parents, candidates, layout, target, _, temperature = random_batch(generator, 6, [3, 3, 3], 5)
    batch_size, tree_size = candidates.shape
    across = torch.randint(-2, batch_size * tree_size + 2, (batch_size, tree_size), generator=generator)
    within = torch.arange(batch_size).view(-1, 1) * tree_size + torch.randint(0, 3, (batch_size, tree_size),
                                                                             generator=generator)
    for retrive_index, in_place in ((across, False), (within, True)):
        inputs = [t.to(device) for t in (candidates, retrive_index, *layout[1:], target)]
        results = []
        for path_backend in ("reference", backend):
            outputs = {}
            if in_place:
                outputs["predicts"] = torch.full((batch_size * tree_size + 1,), 99, dtype=torch.int32, device=device)
            results.append(sglang.eagle_tree_verify(*inputs, spec_steps=2, temperature=temperature.to(device),
                                                    seed=5, backend=path_backend, **outputs))
        for got, want in zip(*results):
            assert torch.equal(got.cpu(), want.cpu())
        predicts, accept_index, accept_token_num = (t.cpu() for t in results[0])
        path = accept_index[accept_index >= 0]
        assert int((predicts != (99 if in_place else -1)).sum()) <= len(set(path.tolist()))


# ----------------------------------------------------------------------------- SGLang's own buffers, in place


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("predicts_rows", ["B*N+1", "B*N"])
def test_outputs_are_written_into_sglangs_buffers(backend, predicts_rows, device):
    """Buffers allocated as SGLang's EagleVerifyInput.verify does (predict empty [B*N + 1], accept_index
    [B, spec_steps + 1], accept_length empty [B], all int32): the same tensors come back, written as
    sgl-kernel writes them (predicts only on the path's rows), with the values of a call without them."""
    backend_or_skip("tree_verify", backend)
    generator = torch.Generator().manual_seed(23)
    parents, candidates, layout, target, draft, temperature = random_batch(generator, 5, [3, 4, 2], 9,
                                                                           shuffle_rows=True)
    batch_size, tree_size = candidates.shape
    inputs = [t.to(device) for t in (candidates, *layout, target)]
    options = dict(spec_steps=2, temperature=temperature.to(device), seed=3, backend=backend)
    fresh = [t.cpu() for t in sglang.eagle_tree_verify(*inputs, **options)]
    num_rows = batch_size * tree_size + (predicts_rows == "B*N+1")
    predicts = torch.full((num_rows,), 12345, dtype=torch.int32, device=device)  # stands for empty()'s garbage
    accept_index = torch.full((batch_size, 3), 777, dtype=torch.int32, device=device)
    accept_token_num = torch.full((batch_size,), 888, dtype=torch.int32, device=device)
    result = sglang.eagle_tree_verify(*inputs, **options, predicts=predicts, accept_index=accept_index,
                                      accept_token_num=accept_token_num)
    assert result[0] is predicts and result[1] is accept_index and result[2] is accept_token_num
    assert torch.equal(accept_index.cpu(), fresh[1]) and torch.equal(accept_token_num.cpu(), fresh[2])
    on_path = torch.zeros(num_rows, dtype=torch.bool)
    on_path[fresh[1][fresh[1] >= 0].long()] = True
    assert torch.equal(predicts.cpu()[on_path], fresh[0][:num_rows][on_path])
    assert bool((predicts.cpu()[~on_path] == 12345).all())
    assert fresh[0].shape == (batch_size * tree_size + 1,) and int(fresh[0][-1]) == -1


def test_output_buffers_are_checked():
    layout = sglang_layout([[-1, 0, 0]])
    candidates, target = torch.tensor([[1, 2, 3]]), torch.rand(1, 3, 4)
    with pytest.raises(ValueError, match=re.escape("`predicts` must have shape [B * N + 1] = [4]; got [5]")):
        sglang.eagle_tree_verify(candidates, *layout, target, predicts=torch.empty(5, dtype=torch.int32))
    with pytest.raises(TypeError, match="`predicts` must have dtype int32; got int64"):
        sglang.eagle_tree_verify(candidates, *layout, target, predicts=torch.empty(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=re.escape("`accept_index` must have shape [B, spec_steps + 1] = [1, 2]")):
        sglang.eagle_tree_verify(candidates, *layout, target, spec_steps=1,
                                 accept_index=torch.empty(1, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match=re.escape("`accept_token_num` must have shape [B] = [1]")):
        sglang.eagle_tree_verify(candidates, *layout, target, accept_token_num=torch.empty(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="`accept_index` must have a unit last stride"):
        sglang.eagle_tree_verify(candidates, *layout, target, spec_steps=1,
                                 accept_index=torch.empty(1, 4, dtype=torch.int32)[:, ::2])


# ----------------------------------------------------------------------------- sgl-kernel's own test scenario


def sgl_kernel_scenario():
    """The two-request tree of sgl-kernel's tree_speculative_sampling_target_only test, in our words.

    Request 0: slots 0 -> 1 -> 2 and 0 -> 3 -> 4 -> 5 (slot 3 is slot 1's next sibling); request 1: 0 -> 4
    -> 5 and 4's sibling 1, 1 -> 2 -> 3. Candidates 0..5 and 7..12. The target is one-hot after the nodes the
    test peaks (request 0: token 3 after slot 0, 4 after slot 3, 5 after slot 4; request 1: 11 after slot 0,
    12 after slot 4) and token 18 after every other node; V = 20.
    """
    candidates = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    retrive_index = torch.arange(12).view(2, 6)
    next_token = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
    next_sibling = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
    peaks = torch.full((2, 6), 18)
    peaks[0, 0], peaks[0, 3], peaks[0, 4], peaks[1, 0], peaks[1, 4] = 3, 4, 5, 11, 12
    target = torch.nn.functional.one_hot(peaks, 20).float()
    return candidates, retrive_index, next_token, next_sibling, target


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sgl_kernels_own_scenario(backend, temperature, device):
    """sgl-kernel's expected outputs at its default thresholds (1, 1): request 0 accepts slots 3, 4, 5 (all
    three steps), request 1 slots 4 and 5, then 18 is sampled after the last accepted node. SGLang's test
    sizes predicts [B * N] and prefills it with -1."""
    backend_or_skip("tree_verify", backend)
    inputs = [t.to(device) for t in sgl_kernel_scenario()]
    predicts = torch.full((12,), -1, dtype=torch.int32, device=device)
    accept_index = torch.full((2, 4), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.zeros(2, dtype=torch.int32, device=device)
    for seed in range(3):  # a one-hot target leaves nothing to chance
        sglang.eagle_tree_verify(*inputs, spec_steps=3, temperature=temperature, seed=seed, backend=backend,
                                 predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num)
        assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
        assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
        assert accept_token_num.tolist() == [3, 2]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_candidate_without_target_probability_is_never_accepted(backend, device):
    """sgl-kernel's test_zero_probability_candidate_is_never_accepted: one child whose token has target
    probability 0 is rejected whatever the random numbers, and the target's token is emitted instead."""
    backend_or_skip("tree_verify", backend)
    target = torch.tensor([[[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]]], device=device)
    candidates, retrive_index = torch.tensor([[0, 1]], device=device), torch.arange(2, device=device).view(1, 2)
    next_token, next_sibling = torch.tensor([[1, -1]], device=device), torch.tensor([[-1, -1]], device=device)
    # Buffers as that test makes them: predicts [B * N] of -1, accept_index [1, 2] of -1, a zero count.
    predicts = torch.full((2,), -1, dtype=torch.int32, device=device)
    accept_index = torch.full((1, 2), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.zeros(1, dtype=torch.int32, device=device)
    for seed in range(20):
        sglang.eagle_tree_verify(candidates, retrive_index, next_token, next_sibling, target, spec_steps=1,
                                 temperature=1.0, seed=seed, backend=backend, predicts=predicts,
                                 accept_index=accept_index, accept_token_num=accept_token_num)
        assert accept_token_num.tolist() == [0] and predicts.tolist() == [2, -1]
        assert accept_index.tolist() == [[0, -1]]


# ----------------------------------------------------------------------------- what a call costs


def test_triton_path_is_three_launches_and_allocations():
    """With the Triton kernels the adapter issues tree_verify, its own two launches and allocations, nothing
    else (before them it issued about 50 small torch ops around tree_verify)."""
    backend_or_skip("tree_verify", "triton", "cpu")
    generator = torch.Generator().manual_seed(3)
    _, candidates, layout, target, _, temperature = random_batch(generator, 4, [3, 3, 3], 7)
    with recorded_ops(sglang, ["triton_eagle_parents", "triton_eagle_outputs"]) as seen:
        sglang.eagle_tree_verify(candidates, *layout, target, spec_steps=2, temperature=temperature, seed=8,
                                 backend="triton")
    assert [op for op in seen if op != "aten.empty"] == ["triton_eagle_parents", "specdec.tree_verify",
                                                           "triton_eagle_outputs"]
    assert seen.count("aten.empty") == 3  # predicts, accept_index, accept_token_num
