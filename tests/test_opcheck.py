"""``torch.library.opcheck`` on every op: schema, fake implementation, dispatch under AOT tracing.

opcheck runs each op eagerly, under FakeTensorMode and through AOT dispatch
with dynamic shapes, and compares the outputs. The ``seed=None`` cases pass
as well: the seed is drawn from torch's default CPU generator, and opcheck
seeds that generator (``torch.manual_seed``) before each run it compares.
Nothing is skipped: ``compact_kv`` mutates its caches in place, which the
schema declares (``Tensor(a!)``) and opcheck checks.
"""

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip
from op_inputs import cache_inputs, chain_inputs, tree_inputs
from specdec_kernels import _library



def opcheck_cases(device):
    """``(case id, op name, schema arguments without the backend)``."""
    draft_ids, target, draft = chain_inputs(device)
    offset = torch.tensor(4, device=device)
    seeds = torch.tensor([1, 2, 3], device=device)
    yield "chain int seed", "chain_verify", (draft_ids, target, draft, None, None, False, None, 5, None, 0)
    yield "chain seed tensors", "chain_verify", (draft_ids, target, None, None, None, False, seeds, 0, offset, 0)
    counts = torch.tensor([3, 1, 0], dtype=torch.int32, device=device)
    temperature = torch.tensor([1.0, 0.0, 0.5], device=device)
    yield "chain logits", "chain_verify", (draft_ids, target.log(), draft, counts, temperature, True, None,
                                           -7, None, 2**40)
    yield "chain seed None", "chain_verify", (draft_ids, target, draft, None, None, False, None, None, None, 0)
    top_k = torch.tensor([2, 0, 40], dtype=torch.int32, device=device)
    top_p = torch.tensor([0.9, 1.0, 0.5], device=device)
    min_p = torch.tensor([0.0, 0.1, 0.2], device=device)
    bonus = torch.tensor([5, 6, 7], device=device)
    yield "chain sampling parameters", "chain_verify", (draft_ids, target, draft, None, None, False, None, 5, None, 0,
                                                        top_k, top_p, min_p, bonus)
    # The same requests packed: request b's drafts and target rows concatenated.
    cu = torch.tensor([0, 3, 6, 9], dtype=torch.int32, device=device)
    packed = (draft_ids.reshape(-1), cu, target.reshape(-1, target.shape[-1]))
    yield "packed int seed", "chain_verify_packed", (*packed, draft.reshape(-1, draft.shape[-1]), 3, None, False,
                                                     None, 5, None, 0)
    yield "packed seed tensors", "chain_verify_packed", (*packed[:1], cu.long(), packed[2], None, 4, None, False,
                                                         seeds, 0, offset, 0)
    yield "packed sampling parameters", "chain_verify_packed", (*packed, None, 3, None, False, None, None, None, 0,
                                                                top_k, top_p, min_p, bonus)
    tokens, parents, tree_target = tree_inputs(device)
    yield "tree int seed", "tree_verify", (tokens, parents, tree_target, None, None, None, False,
                                           "without_replacement", None, 3, None, 1)
    yield "tree with draft", "tree_verify", (tokens, parents.long(), tree_target, tree_target.flip(-1), None, None,
                                             False, "with_replacement", None, 3, offset, 0)
    yield "tree seed None", "tree_verify", (tokens, parents, tree_target, None, None, None, False,
                                            "without_replacement", None, None, None, 1)
    yield "tree sampling parameters", "tree_verify", (tokens, parents, tree_target, None, None, None, False,
                                                      "without_replacement", None, 3, None, 1, top_k[:2], top_p[:2],
                                                      min_p[:2], bonus[:2])
    yield "build_tree", "build_tree", (parents, None, None)
    lens64 = torch.tensor([3, 9], device=device)
    yield "build_tree int64", "build_tree", (parents.long(), lens64 - 1, lens64)
    q, k_cache, v_cache, tables, lens = cache_inputs(device)
    mask = sk.build_tree(parents).mask
    yield "tree_attention", "tree_attention", (q, k_cache, v_cache, tables, lens, mask, None, 0.125)
    yield "tree_attention int64", "tree_attention", (q, k_cache, v_cache, tables.long(), lens.long(), mask,
                                                     lens.long() - 1, 0.125)
    accepted = torch.tensor([[0, 1, 3, -1, -1], [0, 4, -1, -1, -1]], dtype=torch.int32, device=device)
    yield "compact_kv", "compact_kv", (k_cache.clone(), v_cache.clone(), tables, lens, accepted)
    yield "compact_kv int64", "compact_kv", (k_cache.clone(), v_cache.clone(), tables.long(), lens.long(),
                                             accepted.long())


def test_every_op_has_cases():
    assert {name for _, name, _ in opcheck_cases(torch.device("cpu"))} == set(_library.SCHEMAS)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_opcheck(backend, device):
    for case, name, args in opcheck_cases(device):
        if backend != "reference":
            try:
                backend_or_skip(name, backend)
            except pytest.skip.Exception:
                continue
        try:
            torch.library.opcheck(_library.op(name), args, {"backend": backend})
        except Exception as error:
            raise AssertionError(f"opcheck failed for the case {case!r}") from error


def test_seeded_ops_are_tagged_as_consuming_the_global_rng():
    """With ``seed=None`` the ops draw from torch's generator when they run:
    the tag of torch's random ops tells the compiler passes they are impure."""
    for name in ("chain_verify", "chain_verify_packed", "tree_verify"):
        assert torch.Tag.nondeterministic_seeded in _library.op(name).tags
    assert torch.Tag.nondeterministic_seeded not in _library.op("build_tree").tags
