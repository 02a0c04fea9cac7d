"""SGLang's EAGLE layout, converted on the device: links to ``parents``, the verified path to SGLang's outputs.

The torch halves of the SGLang adapters (``adapters/sglang.py``; the
Triton twins are ``kernels/eagle_layout.py``), and the host checks of
SGLang's buffers and, under ``validate=True``, of its layout.
"""

from __future__ import annotations

import torch

from ..launchers.eagle_layout import rounds
from ..ops.build_tree import build_tree

LINKS = ("retrive_next_token", "retrive_next_sibling")

def check_outputs(check, predicts, accept_index, accept_token_num, batch_size, tree_size, spec_steps):
    """The caller's output buffers: SGLang's shapes, int32, on the device, unit last stride (kernels write rows)."""
    num_rows = batch_size * tree_size
    if predicts is not None:
        if isinstance(predicts, torch.Tensor) and predicts.dim() == 1 and predicts.shape[0] == num_rows:
            check.tensor("predicts", predicts, (num_rows,), (torch.int32,), "[B * N]")
        else:
            check.tensor("predicts", predicts, (num_rows + 1,), (torch.int32,), "[B * N + 1]")
    check.optional_tensor("accept_index", accept_index, (batch_size, spec_steps + 1), (torch.int32,),
                          "[B, spec_steps + 1]")
    check.optional_tensor("accept_token_num", accept_token_num, (batch_size,), (torch.int32,), "[B]")
    for name, value in (("predicts", predicts), ("accept_index", accept_index),
                        ("accept_token_num", accept_token_num)):
        if value is not None and value.numel() > 0 and value.stride(-1) != 1:
            check.fail(f"`{name}` must have a unit last stride (it is written in place); got strides "
                       f"{list(value.stride())}")


def parents_from_links(retrive_next_token, retrive_next_sibling):
    """``parents [B, N]`` of trees given as first-child / next-sibling lists, on the device.

    A node's parent is the node whose first child heads its list of
    siblings. Each node finds its list's head by pointer doubling over the
    previous-sibling links (``ceil(log2 N)`` gathers, no host read).
    ``parents[b, 0] == -1``; a node no list reaches gets ``-1``.

    A link that is not a slot in ``[1, N)`` is no link (the root is never a
    child or a sibling). In a malformed layout where several nodes link to
    the same slot, the smallest of them counts, so the outcome is defined on
    every device.

    Shape:
        - retrive_next_token, retrive_next_sibling: ``[B, N]`` (int32 or int64)
        - returns: ``[B, N]``, int32

    Examples
    --------
    >>> next_token = torch.tensor([[1, 3, -1, -1]])
    >>> next_sibling = torch.tensor([[-1, 2, -1, -1]])
    >>> parents_from_links(next_token, next_sibling).tolist()
    [[-1, 0, 0, 1]]
    """
    batch_size, tree_size = retrive_next_token.shape
    nodes = torch.arange(tree_size, device=retrive_next_token.device).expand(batch_size, tree_size)
    parent_of_first_child = _smallest_source(retrive_next_token, nodes)
    previous_sibling = _smallest_source(retrive_next_sibling, nodes)
    # head[i] walks back 2**k siblings per round; a list holds at most N - 1
    # nodes, so ceil(log2 N) rounds reach every head.
    head = torch.where(previous_sibling < tree_size, previous_sibling, nodes)
    for _ in range(rounds(tree_size)):
        head = head.gather(1, head)
    parents = parent_of_first_child.gather(1, head)
    return torch.where((parents < tree_size) & (nodes > 0), parents, -1).to(torch.int32)


def _smallest_source(links, nodes):
    """For each slot, the smallest node whose link points at it; ``N`` where none does."""
    batch_size, tree_size = links.shape
    targets = torch.where((links > 0) & (links < tree_size), links.to(torch.int64), tree_size)
    sources = torch.full((batch_size, tree_size + 1), tree_size, dtype=torch.int64, device=links.device)
    # Column N collects the non-links; amin makes repeated links deterministic.
    sources.scatter_reduce_(1, targets, nodes, "amin")
    return sources[:, :tree_size]


def limit_depth(parents, spec_steps, backend="auto"):
    """``parents`` with the nodes deeper than ``spec_steps`` unlinked (``-1``), on the device.

    Unlinking them makes their parents leaves of the tree ``tree_verify``
    sees (it never visits a node whose parent is -1): the path stops there
    and the target's row is sampled, as in SGLang's kernels, which stop after
    ``spec_steps`` acceptances. The depth is ``build_tree``'s (``-1`` off the
    tree, so those nodes keep their parent); the Triton kernel
    (``kernels/eagle_layout.py``) computes the same in its launch.
    """
    if spec_steps >= parents.shape[1] - 1:
        return parents
    return torch.where(build_tree(parents, backend=backend).depth > spec_steps, -1, parents)


def sglang_outputs(accepted_nodes, output_token_ids, num_accepted, retrive_index, predicts, accept_index,
                    accept_token_num):
    """Torch twin of ``_eagle_outputs_kernel``: writes ``accept_index`` and ``accept_token_num``, returns
    ``predicts`` (the given one, written in place, or a new ``[B * N + 1]`` one)."""
    batch_size, tree_size = retrive_index.shape
    width = accept_index.shape[1]
    # The path has at most spec_steps + 1 nodes (deeper nodes were unlinked).
    path = _columns(accepted_nodes, width)
    tokens = _columns(output_token_ids, width)
    on_path = path >= 0
    rows = retrive_index.to(torch.int64).gather(1, path.clamp_min(0).to(torch.int64))
    accept_index.copy_(torch.where(on_path, rows, -1))
    accept_token_num.copy_(num_accepted)

    num_rows = batch_size * tree_size
    # Row num_rows is SGLang's spare row (left -1); row num_rows + 1 takes every entry not on the path or
    # outside [0, B*N), and is dropped.
    slots = torch.where(on_path & (rows >= 0) & (rows < num_rows), rows, num_rows + 1).flatten()
    # A new predicts is -1 off the path; in place only the path's rows are written, with their tokens as they
    # are (verify_tree_greedy's come from target_predict: any int, as sgl-kernel writes them).
    empty = -1 if predicts is None else torch.iinfo(torch.int32).min
    largest = torch.full((num_rows + 2,), empty, dtype=torch.int32, device=accepted_nodes.device)
    largest.scatter_reduce_(0, slots, tokens.flatten(), "amax")
    if predicts is None:
        return largest[:num_rows + 1]
    # Only the path's rows change; a row written twice gets the same (largest) value both times.
    sink = torch.cat([predicts[:num_rows], predicts.new_empty(2)])
    sink.scatter_(0, slots, largest.gather(0, slots))
    predicts[:num_rows].copy_(sink[:num_rows])
    return predicts


def _columns(values, width):
    """The first ``width`` columns of ``values`` [B, N], padded with -1 when ``width > N``."""
    if width <= values.shape[1]:
        return values[:, :width]
    return torch.nn.functional.pad(values, (0, width - values.shape[1]), value=-1)


def validate_layout(check, retrive_index, retrive_next_token, retrive_next_sibling, depth, spec_steps):
    """``validate=True``: the layout's rules, on the host; ``check.fail`` names the first break."""
    batch_size, tree_size = retrive_next_token.shape
    nodes = torch.arange(tree_size, device=retrive_next_token.device).view(1, -1)
    for name, links in zip(LINKS, (retrive_next_token, retrive_next_sibling)):
        bad = (links != -1) & ((links <= nodes) | (links >= tree_size))
        if bool(bad.any()):
            request, node = (int(i) for i in bad.nonzero()[0])
            check.fail(f"`{name}` must hold -1 or a later slot of the same request (i < link < N = {tree_size}); "
                       f"request {request} node {node} has {int(links[request, node])}")
    if tree_size > 0 and bool((retrive_next_sibling[:, 0] != -1).any()):
        request = int((retrive_next_sibling[:, 0] != -1).nonzero()[0, 0])
        check.fail(f"`retrive_next_sibling` must be -1 at the root (slot 0); request {request} has "
                   f"{int(retrive_next_sibling[request, 0])}")
    incoming = torch.zeros((batch_size, tree_size + 1), dtype=torch.int64, device=nodes.device)
    for links in (retrive_next_token, retrive_next_sibling):
        incoming.scatter_add_(1, torch.where(links >= 0, links.to(torch.int64), tree_size),
                              torch.ones_like(links, dtype=torch.int64))
    bad = (incoming[:, :tree_size] != 1) & (nodes > 0)
    if bool(bad.any()):
        request, node = (int(i) for i in bad.nonzero()[0])
        check.fail(f"every node after the root must be the first child or the next sibling of exactly one node; "
                   f"request {request} node {node} is linked from {int(incoming[request, node])}")
    if bool((depth > spec_steps).any()):
        request, node = (int(i) for i in (depth > spec_steps).nonzero()[0])
        check.fail(f"the tree is deeper than `spec_steps` = {spec_steps}: request {request} node {node} is at "
                   f"depth {int(depth[request, node])}")
    flat = retrive_index.flatten().to(torch.int64)
    num_rows = batch_size * tree_size
    if bool(((flat < 0) | (flat >= num_rows)).any()):
        position = int(((flat < 0) | (flat >= num_rows)).nonzero()[0, 0])
        check.fail(f"`retrive_index` must lie in [0, B * N) = [0, {num_rows}); request {position // tree_size} "
                   f"node {position % tree_size} has {int(flat[position])}")
    if flat.numel() > 1 and bool((flat.sort().values.diff() == 0).any()):
        check.fail("`retrive_index` must not repeat a row (each node has its own row of `predicts`)")


def greedy_path(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict, width):
    """sgl-kernel's greedy walk on the device, without a host read: torch twin of ``_eagle_greedy_kernel``.

    Returns ``(path, tokens, num_accepted)``: ``path [B, width]`` the
    accepted slots, root first, then ``-1``; ``tokens [B, width]`` the
    target's token at each path node's row (``-1`` off the path or for a
    row outside ``[0, B * N)``), as ``sglang_outputs`` takes them.
    """
    batch_size, tree_size = candidates.shape
    device = candidates.device
    num_rows = batch_size * tree_size
    rows = retrive_index.to(torch.int64)
    flat_target = target_predict.to(torch.int64).flatten()

    def target_at(row):
        valid = (row >= 0) & (row < num_rows)
        return torch.where(valid, flat_target[row.clamp(0, max(num_rows - 1, 0))], -1)

    def at(values, slot):
        return values.to(torch.int64).gather(1, slot.clamp_min(0).unsqueeze(1)).squeeze(1)

    path = torch.full((batch_size, width), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch_size, dtype=torch.int64, device=device)
    if tree_size == 0:
        return path, path.clone(), num_accepted.to(torch.int32)
    path[:, 0] = 0
    requests = torch.arange(batch_size, device=device)
    token = target_at(rows[:, 0])
    link = retrive_next_token[:, 0].to(torch.int64)
    slot = torch.where((link > 0) & (link < tree_size), link, -1)
    # Every step moves to a later slot (a link to an earlier one counts as none): N - 1 steps end any walk.
    for _ in range(tree_size - 1):
        live = (slot >= 0) & (num_accepted < width - 1)
        hit = live & (token >= 0) & (at(candidates, slot) == token)
        num_accepted += hit
        path[requests, torch.where(hit, num_accepted, 0)] = torch.where(hit, slot, path[:, 0])
        token = torch.where(hit, target_at(at(rows, slot)), token)
        link = torch.where(hit, at(retrive_next_token, slot), at(retrive_next_sibling, slot))
        slot = torch.where(live & (link > slot) & (link < tree_size), link, -1)
    on_path = path >= 0
    tokens = torch.where(on_path, target_at(rows.gather(1, path.clamp_min(0))), -1)
    return path, tokens.to(torch.int32), num_accepted.to(torch.int32)
