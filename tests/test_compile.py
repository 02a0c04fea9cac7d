"""The ops under ``torch.compile(fullgraph=True)``: no recompilation per step, whole verification steps.

A Python ``offset`` (or ``seed``) that steps every call must not recompile
every call: the schemas take them as ``SymInt``, so Dynamo compiles once for
the first value and once more, symbolically, when the value changes. A
custom Dynamo backend counts the compilations. The whole-step tests run
Inductor (the linear layers become generated code, the ops stay opaque
calls), on the reference backend, which is what ``"auto"`` resolves to on
a CPU.
"""

import pytest
import torch

import specdec_kernels as sk
from op_inputs import cache_inputs, chain_inputs, tree_inputs

STEPS = 10  # more than Dynamo's recompile limit (8): one compilation per step would fail


def counting_backend(compilations: list):
    """A Dynamo backend that runs the captured graph eagerly and counts compilations."""

    def backend(graph_module, example_inputs):
        compilations.append(graph_module)
        return graph_module.forward

    return backend


def linear_head(in_features, out_features, seed):
    """A linear layer with weights from its own generator (the tests do not depend on the global RNG)."""
    head = torch.nn.Linear(in_features, out_features)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) / in_features**0.5)
        head.bias.copy_(torch.randn(head.bias.shape, generator=generator))
    return head


def chain_step(draft_ids, target, draft, seed, offset):
    return sk.chain_verify(draft_ids, target, draft, seed=seed, offset=offset, backend="reference")


def tree_step(tokens, parents, target, seed, offset):
    return sk.tree_verify(tokens, parents, target, seed=seed, offset=offset, backend="reference")


@pytest.mark.parametrize("stepping", ["offset", "seed"])
@pytest.mark.parametrize("op", ["chain_verify", "tree_verify"])
def test_stepping_an_int_compiles_at_most_twice(op, stepping, device):
    step, inputs = (chain_step, chain_inputs(device)) if op == "chain_verify" else (tree_step, tree_inputs(device))
    compilations = []
    compiled = torch.compile(step, fullgraph=True, backend=counting_backend(compilations))
    for value in range(STEPS):
        seed, offset = (5, value) if stepping == "offset" else (value, 5)
        outputs = compiled(*inputs, seed, offset)
        expected = step(*inputs, seed, offset)
        assert all(torch.equal(output, wanted) for output, wanted in zip(outputs, expected)), value
    assert 1 <= len(compilations) <= 2


def test_seed_none_draws_when_the_compiled_graph_runs(device):
    """The seed is drawn by the op at run time, not baked in at trace time:
    calls of one compiled graph differ, and under ``torch.manual_seed`` they
    repeat the eager calls (nothing else in the graph draws from the CPU
    generator)."""
    draft_ids, target, draft = chain_inputs(device, batch_size=8, max_drafts=0, vocab_size=1000)
    compiled = torch.compile(chain_step, fullgraph=True, backend="aot_eager")
    torch.manual_seed(11)
    compiled_tokens = [compiled(draft_ids, target, draft, None, 0)[0] for _ in range(3)]
    torch.manual_seed(11)
    eager_tokens = [chain_step(draft_ids, target, draft, None, 0)[0] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(compiled_tokens, eager_tokens))
    # Two calls emit the same 8 tokens with probability prod_b sum_v p[b, v]**2 = 5e-21 here.
    assert not torch.equal(compiled_tokens[0], compiled_tokens[1])


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_two_seed_none_calls_in_one_graph_draw_twice(compiler, device):
    """Two identical calls are not merged into one: each draws its own seed."""
    draft_ids, target, draft = chain_inputs(device, batch_size=8, max_drafts=0, vocab_size=1000)

    @torch.compile(fullgraph=True, backend=compiler)
    def twice(draft_ids, target, draft):
        return chain_step(draft_ids, target, draft, None, 0)[0], chain_step(draft_ids, target, draft, None, 0)[0]

    first, second = twice(draft_ids, target, draft)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("offset_kind", ["int", "tensor"])
def test_a_whole_chain_step_compiles(offset_kind, device):
    """Hidden states -> a linear head -> logits -> chain_verify(logits=True), in one graph."""
    batch_size, max_drafts, hidden, vocab_size = 3, 3, 16, 40
    generator = torch.Generator().manual_seed(5)
    head = linear_head(hidden, vocab_size, seed=1).to(device)
    draft_head = linear_head(hidden, vocab_size, seed=2).to(device)
    states = torch.randn(batch_size, max_drafts + 1, hidden, generator=generator).to(device)
    draft_ids, _, _ = chain_inputs(device, batch_size, max_drafts, vocab_size)
    temperature = torch.tensor([1.0, 0.0, 0.7], device=device)

    def step(states, draft_ids, temperature, offset):
        tokens, num_accepted = sk.chain_verify(draft_ids, head(states), draft_head(states[:, :-1]),
                                               temperature=temperature, logits=True, seed=9, offset=offset)
        return tokens, num_accepted + 1

    compiled = torch.compile(step, fullgraph=True)
    with torch.no_grad():
        for value in range(3):
            offset = value if offset_kind == "int" else torch.tensor(value, device=device)
            outputs = compiled(states, draft_ids, temperature, offset)
            expected = step(states, draft_ids, temperature, offset)
            assert all(torch.equal(output, wanted) for output, wanted in zip(outputs, expected)), value


def test_a_whole_tree_step_compiles(device):
    """build_tree -> tree_attention -> a linear head -> logits -> tree_verify -> compact_kv, in one graph;
    compact_kv's in-place moves reach the caller's caches."""
    tokens, parents, _ = tree_inputs(device)
    q, k_cache, v_cache, tables, lens = cache_inputs(device)
    query_heads, head_dim = q.shape[2:]
    head = linear_head(query_heads * head_dim, 12, seed=6).to(device)
    with torch.no_grad():
        # Token 2 dominates every row: request 0 rejects node 1 and accepts
        # node 2, so compact_kv moves node 2's K/V to position 1.
        head.bias[2] = 20.0
    num_nodes_per_request = torch.tensor([5, 4], dtype=torch.int32, device=device)

    def step(q, k_cache, v_cache, tokens, parents, seed):
        info = sk.build_tree(parents, num_nodes=num_nodes_per_request, prefix_lens=lens)
        attended = sk.tree_attention(q, k_cache, v_cache, tables, lens, info.mask, num_nodes=num_nodes_per_request)
        logits = head(attended.flatten(2).float())
        accepted_nodes, output, num_accepted = sk.tree_verify(tokens, parents, logits, num_nodes=num_nodes_per_request,
                                                              logits=True, seed=seed, offset=1)
        sk.compact_kv(k_cache, v_cache, tables, lens, accepted_nodes)
        return attended, accepted_nodes, output, num_accepted + 1, info.positions

    compiled = torch.compile(step, fullgraph=True)
    with torch.no_grad():
        for seed in (3, None):
            caches = (k_cache.clone(), v_cache.clone())
            eager_caches = (k_cache.clone(), v_cache.clone())
            torch.manual_seed(0)
            outputs = compiled(q, *caches, tokens, parents, seed)
            torch.manual_seed(0)
            expected = step(q, *eager_caches, tokens, parents, seed)
            assert all(torch.equal(output, wanted) for output, wanted in zip(outputs, expected)), seed
            assert all(torch.equal(cache, wanted) for cache, wanted in zip(caches, eager_caches)), seed
            assert outputs[1][0, :2].tolist() == [0, 2]
            assert not torch.equal(caches[0], k_cache) and not torch.equal(caches[1], v_cache)


def test_a_packed_chain_step_with_sampling_parameters_compiles(device):
    """chain_verify_packed (vLLM's layout) with top_k/top_p and a stepping int offset, in one graph."""
    draft_ids, target, draft = chain_inputs(device)
    cu = torch.tensor([0, 3, 3, 5], device=device)
    ids, rows, draft_rows = draft_ids.reshape(-1)[:5], target.reshape(-1, 40)[:8], draft.reshape(-1, 40)[:5]
    top_k = torch.tensor([5, 0, 2], device=device)

    def step(ids, cu, rows, draft_rows, offset):
        tokens, accepted = sk.chain_verify_packed(ids, cu, rows, draft_rows, max_num_draft_tokens=4, seed=9,
                                                  offset=offset, top_k=top_k, top_p=0.9, backend="reference")
        return tokens, accepted + 1

    compilations = []
    compiled = torch.compile(step, fullgraph=True, backend=counting_backend(compilations))
    for offset in range(STEPS):
        outputs = compiled(ids, cu, rows, draft_rows, offset)
        expected = step(ids, cu, rows, draft_rows, offset)
        assert outputs[0].shape == (3, 5)
        assert all(torch.equal(output, wanted) for output, wanted in zip(outputs, expected)), offset
    assert len(compilations) <= 2
