"""A whole tree step on the GPU: build_tree -> tree_verify -> compact_kv, without a host sync, in a CUDA graph.

For every kernel backend that runs all three ops on this machine (GPU only):

* eager, under ``torch.cuda.set_sync_debug_mode("error")``: any host
  synchronisation inside the step raises;
* captured once in a CUDA graph (workspaces reserved first), then replayed
  with the offset tensor advanced in place: each replay equals the eager
  step at that offset (tokens, accepted paths, the compacted caches).
"""

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip
from test_tree_verify import random_problem

BATCH, NODES, VOCAB = 4, 16, 3000
BLOCK_SIZE, HEADS, HEAD_DIM, MAX_BLOCKS = 16, 2, 64, 8

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="a tree step in a CUDA graph needs a GPU")


def make_step_inputs(device):
    generator = torch.Generator().manual_seed(17)
    ids, parents, target, draft, num_nodes, temperature = random_problem(
        generator, BATCH, NODES, VOCAB, greedy_fraction=0.25, bushy=True)
    prefix_lens = torch.randint(0, BLOCK_SIZE * 4, (BATCH,), generator=generator, dtype=torch.int32)
    block_tables = torch.randperm(BATCH * MAX_BLOCKS, generator=generator).view(BATCH, MAX_BLOCKS).to(torch.int32)
    cache_shape = (BATCH * MAX_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, generator=generator).to(torch.bfloat16)
    v_cache = torch.randn(cache_shape, generator=generator).to(torch.bfloat16)
    tensors = dict(ids=ids, parents=parents, target=target, draft=draft, num_nodes=num_nodes,
                   temperature=temperature, prefix_lens=prefix_lens, block_tables=block_tables,
                   k_cache=k_cache, v_cache=v_cache, offset=torch.tensor(0, dtype=torch.int64))
    return {name: value.to(device) for name, value in tensors.items()}


def tree_step(inputs, backend):
    """One verification step; returns (mask, positions, accepted_nodes, output, num_accepted)."""
    mask, _, positions = sk.build_tree(inputs["parents"], num_nodes=inputs["num_nodes"],
                                       prefix_lens=inputs["prefix_lens"], backend=backend)
    accepted_nodes, output, num_accepted = sk.tree_verify(
        inputs["ids"], inputs["parents"], inputs["target"], inputs["draft"], num_nodes=inputs["num_nodes"],
        temperature=inputs["temperature"], seed=123, offset=inputs["offset"], backend=backend)
    sk.compact_kv(inputs["k_cache"], inputs["v_cache"], inputs["block_tables"], inputs["prefix_lens"],
                  accepted_nodes, backend=backend)
    return mask, positions, accepted_nodes, output, num_accepted


@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_tree_step_has_no_host_sync_and_replays_in_a_graph(backend):
    for op in ("build_tree", "tree_verify", "compact_kv"):
        backend_or_skip(op, backend)
    device = torch.device("cuda")
    inputs = make_step_inputs(device)
    caches = {name: inputs[name].clone() for name in ("k_cache", "v_cache")}

    eager = []
    for step in range(3):
        inputs["offset"].fill_(step)
        for name in caches:
            inputs[name].copy_(caches[name])
        torch.cuda.set_sync_debug_mode("error")
        try:
            outputs = tree_step(inputs, backend)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        eager.append([t.clone() for t in outputs] + [inputs["k_cache"].clone(), inputs["v_cache"].clone()])

    sk.reserve_workspace(device, batch_size=BATCH, max_draft_tokens=NODES, vocab_size=VOCAB, trees=True)
    graph = torch.cuda.CUDAGraph()
    inputs["offset"].fill_(0)
    with torch.cuda.graph(graph):
        captured = tree_step(inputs, backend)
    for step in range(3):
        inputs["offset"].fill_(step)
        for name in caches:
            inputs[name].copy_(caches[name])
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in captured] + [inputs["k_cache"], inputs["v_cache"]]
        for want, got in zip(eager[step], replayed):
            assert torch.equal(want, got), f"replay at offset {step} differs from the eager step"
