"""Launchers of the SGLang adapters' kernels (kernels/eagle_layout.py): one launch each, no host read."""

from __future__ import annotations

import torch

from ._shapes import device_guard, next_power_of_2

NUM_WARPS = 4


def greedy_num_warps(block_nodes: int) -> int:
    """Warps of the greedy walk: one up to 128 slots (a step's tile reductions are then shuffles, no barrier),
    more for wider tiles so that each thread holds at most 4 slots of the five int64 tiles (no spills)."""
    return min(8, max(1, block_nodes // 128))


def rounds(tree_size: int) -> int:
    """Pointer-jumping rounds that reach the end of any chain of ``N`` slots: ``ceil(log2 N)``."""
    return max(tree_size - 1, 0).bit_length()



def triton_eagle_parents(retrive_next_token, retrive_next_sibling, spec_steps, predicts=None):
    """``parents [B, N]`` int32 (nodes deeper than ``spec_steps`` unlinked when it is below ``N - 1``).

    With ``predicts`` given, the same launch sets its rows to -1 (the outputs
    kernel then takes a maximum into them).
    """
    from .._kernels.eagle_layout import _eagle_parents_kernel

    batch_size, tree_size = retrive_next_token.shape
    device = retrive_next_token.device
    parents = torch.empty((batch_size, tree_size), dtype=torch.int32, device=device)
    if batch_size == 0 or tree_size == 0:
        if predicts is not None:
            predicts.fill_(-1)
        return parents
    scratch = torch.empty((batch_size, 3, tree_size), dtype=torch.int32, device=device)
    next_token, next_sibling = (links if links.stride(-1) == 1 else links.contiguous()
                                for links in (retrive_next_token, retrive_next_sibling))
    with device_guard(device):
        _eagle_parents_kernel[(batch_size,)](
            next_token, next_sibling, parents, scratch, parents if predicts is None else predicts,
            tree_size, spec_steps, 0 if predicts is None else predicts.shape[0],
            next_token.stride(0), next_sibling.stride(0), parents.stride(0),
            LIMIT_DEPTH=spec_steps < tree_size - 1, CLEAR_PREDICTS=predicts is not None,
            ROUNDS=rounds(tree_size), BLOCK_N=next_power_of_2(tree_size), num_warps=NUM_WARPS,
        )
    return parents


def triton_eagle_outputs(accepted_nodes, output_token_ids, num_accepted, retrive_index, predicts, accept_index,
                         accept_token_num, in_place):
    """Writes ``accept_index``, ``accept_token_num`` and the path's rows of ``predicts`` (all int32)."""
    from .._kernels.eagle_layout import _eagle_outputs_kernel

    batch_size, tree_size = accepted_nodes.shape
    width = accept_index.shape[1]
    if batch_size == 0:
        return
    retrive = retrive_index if retrive_index.stride(-1) == 1 else retrive_index.contiguous()
    with device_guard(accepted_nodes.device):
        _eagle_outputs_kernel[(batch_size,)](
            accepted_nodes, output_token_ids, num_accepted, retrive, predicts, accept_index, accept_token_num,
            tree_size, width, batch_size * tree_size,
            accepted_nodes.stride(0), output_token_ids.stride(0), retrive.stride(0), accept_index.stride(0),
            IN_PLACE=in_place, BLOCK_W=next_power_of_2(width), num_warps=NUM_WARPS,
        )


def triton_eagle_greedy(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict,
                        predicts, accept_index, accept_token_num):
    """SGLang's ``verify_tree_greedy`` in one launch: writes ``predicts``' path rows, ``accept_index`` and
    ``accept_token_num`` (all int32, in place)."""
    from .._kernels.eagle_layout import _eagle_greedy_kernel

    batch_size, tree_size = candidates.shape
    width = accept_index.shape[1]
    if batch_size == 0 or tree_size == 0:
        return
    block_nodes = next_power_of_2(tree_size)
    inputs = [value if value.stride(-1) == 1 else value.contiguous()
              for value in (candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict)]
    with device_guard(candidates.device):
        _eagle_greedy_kernel[(batch_size,)](
            *inputs, predicts, accept_index, accept_token_num,
            tree_size, width, batch_size * tree_size,
            *(value.stride(0) for value in inputs), accept_index.stride(0),
            BLOCK_N=block_nodes, BLOCK_W=next_power_of_2(width), num_warps=greedy_num_warps(block_nodes),
        )
