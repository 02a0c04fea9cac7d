"""Triton kernels of the SGLang adapters: EAGLE links to parents, the accepted path to SGLang's outputs, and
SGLang's greedy walk.

SGLang describes a tree by first-child / next-sibling links
(``specdec_kernels/adapters/sglang.py``). ``_eagle_parents_kernel`` turns
them into ``parents`` for ``tree_verify`` and ``_eagle_outputs_kernel``
writes the verified path where SGLang expects it, so a sampling call is
three launches: these two around the verification. ``_eagle_greedy_kernel``
is the whole of ``verify_tree_greedy`` (argmax ids in, SGLang's outputs
out): one launch.

Each runs one program per request over the request's node slots, which a
program holds in one tile (EAGLE trees have at most a few hundred nodes).
The parents kernel exchanges values between lanes through a per-request
scratch row in global memory, with a barrier between a store and the loads
that read it (a tile-wide gather). Outcomes are the reference's
(``adapters/sglang.py``) bit for bit; every index is bounds-checked, so no
value leads to an out-of-bounds access.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _eagle_parents_kernel(
    next_token_ptr, next_sibling_ptr, parents_ptr, scratch_ptr, predicts_ptr,
    tree_size, spec_steps, num_predicts,
    stride_next_token_b, stride_next_sibling_b, stride_parents_b,
    LIMIT_DEPTH: tl.constexpr, CLEAR_PREDICTS: tl.constexpr, ROUNDS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``parents [B, N]`` from the links; with ``LIMIT_DEPTH`` nodes deeper than ``spec_steps`` get ``-1``.

    ``scratch`` holds three int32 rows of ``N`` per request. With
    ``CLEAR_PREDICTS`` the program also sets ``predicts`` to -1 on its share
    of rows (request ``b``: rows ``b*N .. (b+1)*N``, the last program also
    the rows past ``B*N``), so that the outputs kernel, a later launch, can
    take the largest token per row with an atomic maximum: no fill launch.
    """
    request = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, BLOCK_N)
    in_tree = nodes < tree_size
    first_child_of = scratch_ptr + request * 3 * tree_size  # [N]: smallest node whose first child is the slot
    previous_of = first_child_of + tree_size  # [N]: smallest node whose next sibling is the slot
    exchange = previous_of + tree_size  # [N]: the values one round of pointer jumping reads

    next_token = tl.load(next_token_ptr + request * stride_next_token_b + nodes, mask=in_tree, other=-1)
    next_sibling = tl.load(next_sibling_ptr + request * stride_next_sibling_b + nodes, mask=in_tree, other=-1)
    tl.store(first_child_of + nodes, tree_size + nodes * 0, mask=in_tree)
    tl.store(previous_of + nodes, tree_size + nodes * 0, mask=in_tree)
    tl.debug_barrier()
    # A link that is not a slot in [1, N) is no link; the smallest source wins a contested slot (amin is
    # order-free, so the outcome does not depend on which lane gets there first).
    is_child_link = in_tree & (next_token > 0) & (next_token < tree_size)
    is_sibling_link = in_tree & (next_sibling > 0) & (next_sibling < tree_size)
    tl.atomic_min(first_child_of + tl.where(is_child_link, next_token, 0), nodes, mask=is_child_link)
    tl.atomic_min(previous_of + tl.where(is_sibling_link, next_sibling, 0), nodes, mask=is_sibling_link)
    tl.debug_barrier()
    previous = tl.load(previous_of + nodes, mask=in_tree, other=tree_size)

    # Each node finds the head of its sibling list by pointer doubling (ROUNDS = ceil(log2 N)).
    head = tl.where(previous < tree_size, previous, nodes)
    for _ in tl.static_range(ROUNDS):
        tl.store(exchange + nodes, head, mask=in_tree)
        tl.debug_barrier()
        head = tl.load(exchange + head, mask=in_tree, other=0)
        tl.debug_barrier()
    parent = tl.load(first_child_of + head, mask=in_tree, other=tree_size)
    parents = tl.where((parent < tree_size) & (nodes > 0), parent, -1)

    if LIMIT_DEPTH:
        # build_tree's depth by list ranking: over the parents that precede their child (so the chains are
        # acyclic, at most N - 1 steps), each node jumps to the top of its chain, a node without such a
        # parent pointing at itself. A node is in the tree iff its top is the root; the others get depth -1
        # (tree_verify never visits them), as in build_tree.
        ancestor = tl.where((parents >= 0) & (parents < nodes), parents, nodes)
        distance = tl.where(ancestor != nodes, 1, 0)
        tl.debug_barrier()  # every lane has read first_child_of: it becomes the distance row
        for _ in tl.static_range(ROUNDS):
            tl.store(exchange + nodes, ancestor, mask=in_tree)
            tl.store(first_child_of + nodes, distance, mask=in_tree)
            tl.debug_barrier()
            distance += tl.load(first_child_of + ancestor, mask=in_tree, other=0)
            ancestor = tl.load(exchange + ancestor, mask=in_tree, other=0)
            tl.debug_barrier()
        depth = tl.where(ancestor == 0, distance, -1)
        parents = tl.where(depth > spec_steps, -1, parents)
    tl.store(parents_ptr + request * stride_parents_b + nodes, parents.to(tl.int32), mask=in_tree)

    if CLEAR_PREDICTS:
        rows = request * tree_size + nodes
        tl.store(predicts_ptr + rows, tl.full([BLOCK_N], -1, tl.int32), mask=in_tree & (rows < num_predicts))
        if request == tl.num_programs(0) - 1:
            spare = (request + 1) * tree_size + nodes  # SGLang's predicts has one row past B * N
            tl.store(predicts_ptr + spare, tl.full([BLOCK_N], -1, tl.int32), mask=spare < num_predicts)


@triton.jit
def _eagle_outputs_kernel(
    accepted_ptr, tokens_ptr, num_accepted_ptr, retrive_index_ptr,
    predicts_ptr, accept_index_ptr, accept_token_num_ptr,
    tree_size, width, num_rows,
    stride_accepted_b, stride_tokens_b, stride_retrive_b, stride_accept_index_b,
    IN_PLACE: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """``accept_index [B, W]``, ``accept_token_num [B]`` and the path's rows of ``predicts``.

    ``predicts[retrive_index[b, path[j]]] = tokens[b, j]`` for the path's
    nodes whose row lies in ``[0, num_rows)``. Where two nodes share a row
    the larger token wins: an atomic maximum into rows the parents kernel set
    to -1, or, writing into a caller's tensor (``IN_PLACE``: rows off the
    path keep their values, as SGLang's kernels leave them), plain stores of
    each request's winners (rows shared across requests, which only a
    malformed ``retrive_index`` makes, hold one of the tokens).
    """
    request = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK_W)
    in_path_width = (columns < width) & (columns < tree_size)
    path = tl.load(accepted_ptr + request * stride_accepted_b + columns, mask=in_path_width, other=-1)
    tokens = tl.load(tokens_ptr + request * stride_tokens_b + columns, mask=in_path_width, other=-1)
    on_path = (path >= 0) & (path < tree_size)
    rows = tl.load(retrive_index_ptr + request * stride_retrive_b + tl.where(on_path, path, 0), mask=on_path,
                   other=-1).to(tl.int64)
    tl.store(accept_index_ptr + request * stride_accept_index_b + columns, tl.where(on_path, rows, -1).to(tl.int32),
             mask=columns < width)
    tl.store(accept_token_num_ptr + request, tl.load(num_accepted_ptr + request))

    writes = on_path & (rows >= 0) & (rows < num_rows)
    if IN_PLACE:
        # A node loses its row to another of the same request with a larger token (or the same token and
        # an earlier column), so each row is stored once.
        same_row = writes[:, None] & writes[None, :] & (rows[:, None] == rows[None, :])
        beats = (tokens[None, :] > tokens[:, None]) | ((tokens[None, :] == tokens[:, None])
                                                       & (columns[None, :] < columns[:, None]))
        beaten = tl.max((same_row & beats).to(tl.int32), axis=1) > 0
        tl.store(predicts_ptr + tl.where(writes, rows, 0), tokens.to(tl.int32), mask=writes & ~beaten)
    else:
        tl.atomic_max(predicts_ptr + tl.where(writes, rows, 0), tokens.to(tl.int32), mask=writes)


@triton.jit
def _eagle_greedy_kernel(
    candidates_ptr, retrive_index_ptr, next_token_ptr, next_sibling_ptr, target_predict_ptr,
    predicts_ptr, accept_index_ptr, accept_token_num_ptr,
    tree_size, width, num_rows,
    stride_candidates_b, stride_retrive_b, stride_next_token_b, stride_next_sibling_b, stride_target_b,
    stride_accept_index_b,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """SGLang's greedy tree walk from the target's argmax ids, and its outputs, in one program per request.

    From the root, the walk accepts the first child (in sibling order) whose
    candidate is the target's token after the last accepted node
    (``target_predict`` at that node's row of ``retrive_index``, read as
    SGLang reads it: the flattened ``[B, N]``), at most ``width - 1`` times.
    A link counts only when it points at a later slot, so every step moves
    to a larger slot and the walk ends within ``N - 1`` steps whatever the
    links hold. The request's slots sit in registers, one tile: a step
    reads a slot's values by a tile reduction, not a dependent global load.

    Outputs as sgl-kernel's ``VerifyTreeGreedy`` writes them: each path
    node's row of ``predicts`` gets the target's token there (only rows in
    ``[0, num_rows)``; a row shared by two nodes gets the same token from
    both), ``accept_index[b]`` the path's rows then ``-1`` (every column),
    ``accept_token_num[b]`` the accepted drafts.
    """
    request = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, BLOCK_N)
    in_tree = nodes < tree_size
    candidates = tl.load(candidates_ptr + request * stride_candidates_b + nodes, mask=in_tree, other=-1).to(tl.int64)
    rows = tl.load(retrive_index_ptr + request * stride_retrive_b + nodes, mask=in_tree, other=-1).to(tl.int64)
    next_token = tl.load(next_token_ptr + request * stride_next_token_b + nodes, mask=in_tree, other=-1).to(tl.int64)
    next_sibling = tl.load(next_sibling_ptr + request * stride_next_sibling_b + nodes, mask=in_tree,
                           other=-1).to(tl.int64)
    row_ok = in_tree & (rows >= 0) & (rows < num_rows)
    safe_rows = tl.where(row_ok, rows, 0)
    targets = tl.load(target_predict_ptr + (safe_rows // tree_size) * stride_target_b + safe_rows % tree_size,
                      mask=row_ok, other=-1).to(tl.int64)

    position = tl.where(nodes == 0, 0, -1)  # each node's place on the path; the root is always on it
    num_accepted = tl.zeros([], tl.int32)
    token = tl.sum(tl.where(nodes == 0, targets, 0))
    link = tl.sum(tl.where(nodes == 0, next_token, 0))
    slot = tl.where((link > 0) & (link < tree_size), link, -1)
    while (slot >= 0) & (num_accepted < width - 1):
        at = nodes == slot
        hit = (token >= 0) & (tl.sum(tl.where(at, candidates, 0)) == token)
        num_accepted += hit.to(tl.int32)
        position = tl.where(at & hit, num_accepted, position)
        token = tl.where(hit, tl.sum(tl.where(at, targets, 0)), token)
        link = tl.where(hit, tl.sum(tl.where(at, next_token, 0)), tl.sum(tl.where(at, next_sibling, 0)))
        slot = tl.where((link > slot) & (link < tree_size), link, -1)

    on_path = position >= 0
    writes = on_path & row_ok
    tl.store(predicts_ptr + safe_rows, targets.to(tl.int32), mask=writes)
    columns = tl.arange(0, BLOCK_W)
    accept_row = accept_index_ptr + request * stride_accept_index_b
    tl.store(accept_row + columns, tl.full([BLOCK_W], -1, tl.int32), mask=(columns < width) & (columns > num_accepted))
    tl.store(accept_row + tl.where(on_path, position, 0), rows.to(tl.int32), mask=on_path)
    tl.store(accept_token_num_ptr + request, num_accepted)
