"""Every op is a correctly registered torch op: opcheck, torch.compile, CUDA graphs."""

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip
from specdec_kernels import _library


def chain_inputs(device, batch_size=3, max_drafts=3, vocab_size=40):
    generator = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(batch_size, max_drafts + 1, vocab_size, generator=generator), -1)
    draft = torch.softmax(torch.randn(batch_size, max_drafts, vocab_size, generator=generator), -1)
    draft_ids = torch.randint(0, vocab_size, (batch_size, max_drafts), generator=generator)
    return draft_ids.to(device), target.to(device), draft.to(device)


def tree_inputs(device):
    parents = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 1, 2, 0]], dtype=torch.int32)
    tokens = torch.tensor([[7, 1, 2, 3, 4], [7, 5, 6, 7, 8]])
    target = torch.softmax(torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1)), -1)
    return tokens.to(device), parents.to(device), target.to(device)


def cache_inputs(device):
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 5, 4, 64, generator=generator)
    k_cache = torch.randn(6, 4, 2, 64, generator=generator)
    v_cache = torch.randn(6, 4, 2, 64, generator=generator)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, tables, lens))


def opcheck_cases(device):
    draft_ids, target, draft = chain_inputs(device)
    offset = torch.tensor(4, device=device)
    seeds = torch.tensor([1, 2, 3], device=device)
    yield "chain_verify", (draft_ids, target, draft, None, None, False, None, 5, None, 0)
    yield "chain_verify", (draft_ids, target, None, None, None, False, seeds, 0, offset, 0)
    # The same requests packed: request b's drafts and target rows concatenated.
    cu = torch.tensor([0, 3, 6, 9], dtype=torch.int32, device=device)
    yield "chain_verify_packed", (draft_ids.reshape(-1), cu, target.reshape(-1, target.shape[-1]),
                                  draft.reshape(-1, draft.shape[-1]), 3, None, False, None, 5, None, 0)
    yield "chain_verify_packed", (draft_ids.reshape(-1), cu.long(), target.reshape(-1, target.shape[-1]), None, 4,
                                  None, False, seeds, 0, offset, 0)
    tokens, parents, tree_target = tree_inputs(device)
    yield "tree_verify", (tokens, parents, tree_target, None, None, None, False, "without_replacement",
                          None, 3, None, 1)
    yield "build_tree", (parents, None, None)
    q, k_cache, v_cache, tables, lens = cache_inputs(device)
    mask = sk.build_tree(parents).mask
    yield "tree_attention", (q, k_cache, v_cache, tables, lens, mask, None, 0.125)
    accepted = torch.tensor([[0, 1, 3, -1, -1], [0, 4, -1, -1, -1]], dtype=torch.int32, device=device)
    yield "compact_kv", (k_cache.clone(), v_cache.clone(), tables, lens, accepted)


def test_every_op_in_the_contract_is_registered():
    for name in ("chain_verify", "chain_verify_packed", "tree_verify", "build_tree", "tree_attention", "compact_kv"):
        assert hasattr(torch.ops.specdec, name)
        assert name in _library.SCHEMAS


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_opcheck(backend, device):
    for name, args in opcheck_cases(device):
        if backend != "reference":
            try:
                backend_or_skip(name, backend)
            except pytest.skip.Exception:
                continue
        torch.library.opcheck(_library.op(name), (*args, backend))


def test_chain_verify_under_torch_compile_fullgraph(device):
    draft_ids, target, draft = chain_inputs(device)

    @torch.compile(fullgraph=True)  # inductor: the op stays opaque, the "+ 1" is generated code
    def verify(draft_ids, target, draft, offset):
        tokens, accepted = sk.chain_verify(draft_ids, target, draft, seed=9, offset=offset, backend="reference")
        return tokens, accepted + 1

    offset = torch.tensor(3, device=device)
    tokens, emitted = verify(draft_ids, target, draft, offset)
    expected = sk.chain_verify(draft_ids, target, draft, seed=9, offset=offset, backend="reference")
    assert torch.equal(tokens, expected[0]) and torch.equal(emitted, expected[1] + 1)


def test_chain_verify_packed_under_torch_compile_fullgraph(device):
    draft_ids, target, draft = chain_inputs(device)
    cu = torch.tensor([0, 3, 3, 5], device=device)
    ids, rows, draft_rows = draft_ids.reshape(-1)[:5], target.reshape(-1, 40)[:8], draft.reshape(-1, 40)[:5]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def verify(ids, cu, rows, draft_rows, offset):
        tokens, accepted = sk.chain_verify_packed(ids, cu, rows, draft_rows, max_num_draft_tokens=4, seed=9,
                                                  offset=offset, backend="reference")
        return tokens, accepted + 1

    offset = torch.tensor(3, device=device)
    tokens, emitted = verify(ids, cu, rows, draft_rows, offset)
    expected = sk.chain_verify_packed(ids, cu, rows, draft_rows, max_num_draft_tokens=4, seed=9, offset=offset,
                                      backend="reference")
    assert tokens.shape == (3, 5)
    assert torch.equal(tokens, expected[0]) and torch.equal(emitted, expected[1] + 1)


def test_tree_ops_under_torch_compile_fullgraph(device):
    tokens, parents, target = tree_inputs(device)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def verify(tokens, parents, target):
        info = sk.build_tree(parents)
        return sk.tree_verify(tokens, parents, target, seed=2)[0], info.depth

    nodes, depth = verify(tokens, parents, target)
    assert torch.equal(nodes, sk.tree_verify(tokens, parents, target, seed=2)[0])
    assert torch.equal(depth, sk.build_tree(parents).depth)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_chain_verify_in_a_cuda_graph_draws_fresh_numbers_per_offset(backend, device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    backend_or_skip("chain_verify", backend)
    draft_ids, target, draft = chain_inputs(device, batch_size=8, max_drafts=4, vocab_size=32000)
    offset = torch.tensor(0, device=device)
    # Warm up on the capture stream: compiles the kernel and allocates that
    # stream's workspace outside the capture.
    capture_stream = torch.cuda.Stream()
    with torch.cuda.stream(capture_stream):
        sk.chain_verify(draft_ids, target, draft, seed=5, offset=offset, backend=backend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        tokens, accepted = sk.chain_verify(draft_ids, target, draft, seed=5, offset=offset, backend=backend)
    outputs = []
    for step in range(4):
        offset.fill_(step)
        graph.replay()
        expected = sk.chain_verify(draft_ids, target, draft, seed=5, offset=step, backend="reference")
        assert torch.equal(tokens, expected[0]) and torch.equal(accepted, expected[1])
        outputs.append(tokens.clone())
    assert any(not torch.equal(outputs[0], later) for later in outputs[1:])


def test_direct_torch_ops_calls_take_the_public_leading_arguments(device):
    """Schemas carry defaults, and "auto" is resolved inside the op."""
    draft_ids, target, draft = chain_inputs(device)
    direct = torch.ops.specdec.chain_verify(draft_ids, target, draft, seed=7, offset=2)
    public = sk.chain_verify(draft_ids, target, draft, seed=7, offset=2)
    assert torch.equal(direct[0], public[0]) and torch.equal(direct[1], public[1])
    tokens, parents, tree_target = tree_inputs(device)
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.specdec.tree_verify(tokens, parents, tree_target, seed=1),
                                                 sk.tree_verify(tokens, parents, tree_target, seed=1)))
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.specdec.build_tree(parents), sk.build_tree(parents)))
    q, k_cache, v_cache, tables, lens = cache_inputs(device)
    mask = sk.build_tree(parents).mask
    assert torch.equal(torch.ops.specdec.tree_attention(q, k_cache, v_cache, tables, lens, mask),
                       sk.tree_attention(q, k_cache, v_cache, tables, lens, mask))
