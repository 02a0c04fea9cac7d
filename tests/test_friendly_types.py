"""Argument types every op takes alike: int32 or int64 index tensors, temperatures as
numbers or tensors, and shape errors that name both arguments that disagree."""

import numpy as np
import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip
from op_inputs import cache_inputs, chain_inputs, tree_inputs

KERNEL_BACKENDS = ["reference", "triton", "cuda"]


def index_cases(device, dtype):
    """``(op, call)`` pairs whose counts, lengths, parents, block tables and paths have ``dtype``."""
    draft_ids, target, draft = chain_inputs(device)
    counts = torch.tensor([3, 1, 0], dtype=dtype, device=device)
    yield "chain_verify", lambda backend: sk.chain_verify(draft_ids.to(dtype), target, draft, num_draft_tokens=counts,
                                                          seed=3, backend=backend)
    tokens, parents, tree_target = tree_inputs(device)
    parents, num_nodes = parents.to(dtype), torch.tensor([5, 3], dtype=dtype, device=device)
    yield "tree_verify", lambda backend: sk.tree_verify(tokens.to(dtype), parents, tree_target, num_nodes=num_nodes,
                                                        seed=3, backend=backend)
    q, k_cache, v_cache, tables, lens = cache_inputs(device)
    tables, lens = tables.to(dtype), lens.to(dtype)
    yield "build_tree", lambda backend: tuple(sk.build_tree(parents, num_nodes=num_nodes, prefix_lens=lens,
                                                            backend=backend))
    mask = sk.build_tree(parents, num_nodes=num_nodes).mask
    yield "tree_attention", lambda backend: sk.tree_attention(q, k_cache, v_cache, tables, lens, mask,
                                                              num_nodes=num_nodes, backend=backend)
    accepted = torch.tensor([[0, 1, 3, -1, -1], [0, 4, -1, -1, -1]], dtype=dtype, device=device)

    def compact(backend):
        caches = (k_cache.clone(), v_cache.clone())
        sk.compact_kv(*caches, tables, lens, accepted, backend=backend)
        return caches

    yield "compact_kv", compact


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_int32_and_int64_index_tensors_give_the_same_outputs_on_every_op(backend, device):
    checked = []
    for (op, call32), (_, call64) in zip(index_cases(device, torch.int32), index_cases(device, torch.int64)):
        try:
            backend_or_skip(op, backend)
        except pytest.skip.Exception:
            continue
        outputs32, outputs64 = call32(backend), call64(backend)
        outputs32 = outputs32 if isinstance(outputs32, tuple) else (outputs32,)
        outputs64 = outputs64 if isinstance(outputs64, tuple) else (outputs64,)
        assert all(torch.equal(a, b) for a, b in zip(outputs32, outputs64)), op
        checked.append(op)
    if not checked:
        pytest.skip(f"backend {backend!r} runs none of the ops here")


def test_python_numbers_are_not_count_tensors(device):
    draft_ids, target, _ = chain_inputs(device)
    with pytest.raises(TypeError, match=r"chain_verify: `num_draft_tokens` must be a torch.Tensor; got int"):
        sk.chain_verify(draft_ids, target, num_draft_tokens=3)
    tokens, parents, tree_target = tree_inputs(device)
    with pytest.raises(TypeError, match=r"build_tree: `prefix_lens` must be a torch.Tensor; got list"):
        sk.build_tree(parents, prefix_lens=[3, 4])


@pytest.mark.parametrize("temperature", [0.7, 2, np.float32(0.7), np.float64(0.7), np.int64(2)])
def test_a_number_is_one_temperature_for_the_batch(temperature, device):
    draft_ids, target, draft = chain_inputs(device)
    as_tensor = torch.full((3,), float(temperature), device=device)
    chain = lambda t: sk.chain_verify(draft_ids, target.log(), draft, temperature=t, logits=True,  # noqa: E731
                                      seed=1, backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(chain(temperature), chain(as_tensor)))
    tokens, parents, tree_target = tree_inputs(device)
    tree = lambda t: sk.tree_verify(tokens, parents, tree_target.log(), temperature=t, logits=True,  # noqa: E731
                                    seed=1, backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(tree(temperature), tree(as_tensor[:2])))


@pytest.mark.parametrize("temperature", [True, "hot", [1.0, 1.0, 1.0]])
def test_temperatures_that_are_not_numbers_are_refused(temperature, device):
    draft_ids, target, _ = chain_inputs(device)
    with pytest.raises(TypeError, match=r"`temperature` must be a float32 tensor of shape \[B\] or a Python float"):
        sk.chain_verify(draft_ids, target, temperature=temperature)


def test_a_target_without_its_bonus_row_names_both_arguments(device):
    draft_ids, target, _ = chain_inputs(device)  # draft_ids [3, 3], target [3, 4, 40]
    with pytest.raises(ValueError, match=r"`draft_token_ids` must have shape \[B, K\] = \[3, 2\]; got \[3, 3\], "
                                         r"which disagrees with `target` of shape \[B, K\+1, V\] = \[3, 3, 40\]"):
        sk.chain_verify(draft_ids, target[:, :3])


def test_shape_errors_name_the_argument_the_sizes_came_from(device):
    tokens, parents, target = tree_inputs(device)
    with pytest.raises(ValueError, match=r"`parents` must have shape \[B, N\] = \[2, 5\]; got \[2, 4\], "
                                         r"which disagrees with `target` of shape \[B, N, V\] = \[2, 5, 12\]"):
        sk.tree_verify(tokens, parents[:, :4], target)
    q, k_cache, v_cache, tables, lens = cache_inputs(device)
    mask = sk.build_tree(parents).mask
    with pytest.raises(ValueError, match=r"`v_cache` must have shape .* = \[6, 4, 2, 64\]; got \[6, 4, 1, 64\], "
                                         r"which disagrees with `k_cache` of shape"):
        sk.tree_attention(q, k_cache, v_cache[:, :, :1], tables, lens, mask)
    with pytest.raises(ValueError, match=r"`prefix_lens` must have shape \[B\] = \[2\]; got \[1\], "
                                         r"which disagrees with `accepted_nodes` of shape \[B, N\] = \[2, 3\]"):
        sk.compact_kv(k_cache, v_cache, tables, lens[:1], torch.zeros(2, 3, dtype=torch.int32, device=device))
