"""SGLang's EAGLE tree layout in front of ``sk.tree_verify``.

SGLang's tree verifiers (sgl-kernel's ``verify_tree_greedy`` and
``tree_speculative_sampling_target_only``) describe request ``b``'s draft
tree by its ``N`` node slots and two linked lists per node: the slot of its
first child (``retrive_next_token``) and of its next sibling
(``retrive_next_sibling``), ``-1`` ending a list. Slot 0 is the root (the
last verified token). ``retrive_index[b, i]`` is node ``i``'s row in the
flattened batch of ``B * N`` tree tokens (``b * N + i`` as SGLang builds it);
the outputs are indexed by these rows.

SGLang's tree builder already numbers nodes the way ``sk.tree_verify``
needs: a node's slot follows its parent's (slots are the draft beam's
indices, sorted), and each parent's list of children runs in increasing slot
order (children are pushed onto the head of the list from the last slot to
the first). So the node numbering is kept as it is; only ``parents`` is
derived from the links, on the device (``parents_from_links``).

Launches (Triton or CUDA backend, a GPU or the interpreter): three. The
first converts the links to ``parents`` (and, when ``predicts`` is not
given, sets the new ``predicts`` to ``-1`` in the same launch), the second
is ``tree_verify``'s, the third writes ``predicts``, ``accept_index`` and
``accept_token_num`` (``kernels/eagle_layout.py``). With
``backend="reference"`` both conversions are plain torch ops.

SGLang's own buffers, as its callers allocate them
(``python/sglang/srt/speculative/eagle_info.py``,
``EagleVerifyInput.verify``) and sgl-kernel's verifiers write them
(``sgl-kernel/csrc/speculative/speculative_sampling.cuh``,
``TreeSpeculativeSamplingTargetOnly``; ``eagle_utils.cu``,
``VerifyTreeGreedy``): ``predict`` is ``torch.empty`` int32 of shape
``[B * N + 1]`` (the logits' leading shape ``[B * N]`` plus one row), of
which the kernels write only the accepted path's rows; ``accept_index`` is
int32 ``[B, spec_steps + 1]`` filled with ``-1`` by the caller, the kernels
writing the path's entries; ``accept_length`` (newer SGLang:
``num_correct_drafts``) is ``torch.empty`` int32 ``[B]``, written for every
request. The adapter takes tensors of exactly these shapes and dtypes as
``predicts``, ``accept_index`` and ``accept_token_num``, and writes them the
same way (``accept_index`` in full, its ``-1`` padding included, so a
``torch.empty`` one works too).
"""

from __future__ import annotations

import operator

import torch

from .. import _backend, _validation
from ..launchers.eagle_layout import rounds, triton_eagle_outputs, triton_eagle_parents
from ..ops.build_tree import build_tree
from ..ops.tree_verify import tree_verify

OP_NAME = "sglang.eagle_tree_verify"
LINKS = ("retrive_next_token", "retrive_next_sibling")


def eagle_tree_verify(
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target,
    draft=None,
    *,
    spec_steps=None,
    temperature=None,
    logits=False,
    draft_sampling="without_replacement",
    seed=None,
    offset=0,
    top_k=None,
    top_p=None,
    min_p=None,
    bonus_token_ids=None,
    predicts=None,
    accept_index=None,
    accept_token_num=None,
    backend="auto",
    validate=False,
):
    """Exact verification of SGLang EAGLE trees, with SGLang's outputs.

    Converts the linked-list layout to ``parents`` (``parents_from_links``),
    runs :func:`specdec_kernels.tree_verify` on it and scatters the accepted
    path into SGLang's ``predicts`` / ``accept_index`` / ``accept_token_num``.
    The decision rule, random numbers and exactness are ``tree_verify``'s:
    with ``draft=None`` (SGLang's "target only" verification, where the
    candidates are deterministic) the target is sampled without replacement
    over each node's children, which has the law SGLang's kernel has at its
    default thresholds (``1.0``; the lossy thresholds below 1 are not
    offered). ``T = 0`` requests are greedy, as ``verify_tree_greedy``.
    Everything runs on the device without a host read (except under
    ``validate=True``): three launches on the Triton and CUDA backends (the
    module docstring says which).

    Parameters
    ----------
    candidates : Tensor, int32 or int64 ``[B, N]``
        Token of each node slot; slot 0 is the root (not verified).
    retrive_index : Tensor, int32 or int64 ``[B, N]``
        Flattened row of each node, in ``[0, B * N)`` (SGLang: ``b * N + i``).
    retrive_next_token : Tensor, int32 or int64 ``[B, N]``
        First child's slot, ``-1`` at a leaf.
    retrive_next_sibling : Tensor, int32 or int64 ``[B, N]``
        Next sibling's slot, ``-1`` for the last child.
    target : Tensor ``[B, N, V]``
        Target distribution after each node (SGLang's ``target_probs``, or
        logits with ``logits=True``).
    draft : Tensor ``[B, N, V]`` or None
        Distribution node ``i``'s children were drawn from, always
        probabilities (``logits`` covers the target only); ``None`` (SGLang's
        case): deterministic candidates.
    spec_steps : int, optional
        Most drafts a request may accept; ``accept_index`` has
        ``spec_steps + 1`` columns (SGLang's ``EagleVerifyInput.spec_steps``).
        Nodes deeper than this are not tried, as in SGLang's kernels: the path
        ends at depth ``spec_steps`` and the target's own row is sampled there.
        Default ``N - 1`` (no limit).
    temperature, logits, draft_sampling, seed, offset, top_k, top_p, min_p, bonus_token_ids, backend
        As in :func:`specdec_kernels.tree_verify`.
    predicts : Tensor, int32 ``[B * N + 1]`` or ``[B * N]``, optional
        SGLang's ``predict`` buffer, written in place: only the accepted
        path's rows change, as with sgl-kernel. Default: a new ``[B * N + 1]``
        tensor, ``-1`` off the path.
    accept_index : Tensor, int32 ``[B, spec_steps + 1]``, optional
        Written in place, every entry. Default: a new tensor.
    accept_token_num : Tensor, int32 ``[B]``, optional
        SGLang's ``accept_length``, written in place. Default: a new tensor.
    validate : bool
        Also check the layout on the host (synchronises) and raise
        ``ValueError`` on a link that is not ``-1`` or a later slot of the
        same request, a root with a sibling, a node that is not linked from
        exactly one node, a node deeper than ``spec_steps``, or
        ``retrive_index`` values outside ``[0, B * N)`` or repeated; then the
        checks of ``tree_verify(validate=True)``. Without it, a malformed
        layout has a defined outcome: ``parents_from_links``'s parents, on
        which ``tree_verify`` ignores a node whose parent does not precede it
        and tries siblings in slot order; rows of ``retrive_index`` outside
        ``[0, B * N)`` are left out of ``predicts``, and where two accepted
        nodes share a row it holds the larger token (in a caller's
        ``predicts`` on the Triton and CUDA backends, rows shared by two
        requests hold one of their tokens).

    Returns
    -------
    predicts : Tensor, int32 ``[B * N + 1]`` (or the given one)
        At the row ``accept_index[b, j]`` of each accepted node, the token
        that follows it: the next accepted node's token, and after the last
        one the token the target chose. So ``predicts[accept_index[b,
        :accept_token_num[b] + 1]]`` are request ``b``'s new tokens.
    accept_index : Tensor, int32 ``[B, spec_steps + 1]``
        ``retrive_index`` of the accepted path's nodes, root first, then
        ``-1``.
    accept_token_num : Tensor, int32 ``[B]``
        Accepted drafts (the root and the target's token not counted).

    Shape:
        - candidates, retrive_index, retrive_next_token, retrive_next_sibling: ``[B, N]``
        - target, draft: ``[B, N, V]``
        - predicts: ``[B * N + 1]``; accept_index: ``[B, spec_steps + 1]``; accept_token_num: ``[B]``

    Examples
    --------
    Root token 5 with children 1 and 2 (slots 1, 2); slot 3 (token 3) is a
    child of slot 1. The greedy target follows the root with 2 and slot 2
    with 6, so slot 2 is accepted and 6 emitted after it:

    >>> import torch, specdec_kernels as sk
    >>> candidates = torch.tensor([[5, 1, 2, 3]])
    >>> retrive_index = torch.arange(4).view(1, 4)
    >>> next_token = torch.tensor([[1, 3, -1, -1]])
    >>> next_sibling = torch.tensor([[-1, 2, -1, -1]])
    >>> target = torch.nn.functional.one_hot(torch.tensor([[2, 3, 6, 0]]), 8).float()
    >>> predicts, accept_index, accept_token_num = sk.adapters.sglang.eagle_tree_verify(
    ...     candidates, retrive_index, next_token, next_sibling, target, spec_steps=2, temperature=0.0)
    >>> predicts.tolist(), accept_index.tolist(), accept_token_num.tolist()
    ([2, -1, 6, -1, -1], [[0, 2, -1]], [1])
    """
    if not isinstance(candidates, torch.Tensor):
        raise TypeError(f"{OP_NAME}: `candidates` must be a torch.Tensor; got {type(candidates).__name__}")
    check = _validation.Checker(OP_NAME, candidates.device)
    check.tensor("candidates", candidates, (None, None), _validation.TOKEN_DTYPES, "[B, N]")
    batch_size, tree_size = candidates.shape
    for name, value in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                        ("retrive_next_sibling", retrive_next_sibling)):
        check.tensor(name, value, (batch_size, tree_size), _validation.TOKEN_DTYPES, "[B, N]")
    # tree_verify checks these too, but would name `candidates` `tree_token_ids`.
    check.tensor("target", target, (batch_size, tree_size, None), _validation.FLOAT_DTYPES, "[B, N, V]")
    check.optional_tensor("draft", draft, target.shape, _validation.FLOAT_DTYPES, "[B, N, V]")
    if spec_steps is None:
        spec_steps = max(tree_size - 1, 0)
    else:
        if isinstance(spec_steps, bool) or not hasattr(spec_steps, "__index__"):
            check.fail(f"`spec_steps` must be an int >= 0; got {type(spec_steps).__name__}", TypeError)
        spec_steps = operator.index(spec_steps)
        if spec_steps < 0:
            check.fail(f"`spec_steps` must be an int >= 0; got {spec_steps}")
    _check_outputs(check, predicts, accept_index, accept_token_num, batch_size, tree_size, spec_steps)
    if validate:
        depth = build_tree(parents_from_links(retrive_next_token, retrive_next_sibling), backend=backend).depth
        _validate_layout(check, retrive_index, retrive_next_token, retrive_next_sibling, depth, spec_steps)

    device = candidates.device
    kernels = _backend.resolve("tree_verify", backend, device) != "reference" and _backend.triton_runs_on(device)
    in_place = predicts is not None
    if kernels and not in_place:
        predicts = torch.empty((batch_size * tree_size + 1,), dtype=torch.int32, device=device)
    if kernels:
        parents = triton_eagle_parents(retrive_next_token, retrive_next_sibling, spec_steps,
                                       None if in_place else predicts)
    else:
        parents = limit_depth(parents_from_links(retrive_next_token, retrive_next_sibling), spec_steps, backend)

    accepted_nodes, output_token_ids, num_accepted = tree_verify(
        candidates, parents, target, draft, temperature=temperature, logits=logits,
        draft_sampling=draft_sampling, seed=seed, offset=offset, top_k=top_k, top_p=top_p, min_p=min_p,
        bonus_token_ids=bonus_token_ids, backend=backend, validate=validate,
    )
    if accept_index is None:
        accept_index = torch.empty((batch_size, spec_steps + 1), dtype=torch.int32, device=device)
    if accept_token_num is None:
        accept_token_num = torch.empty((batch_size,), dtype=torch.int32, device=device)
    if kernels:
        triton_eagle_outputs(accepted_nodes, output_token_ids, num_accepted, retrive_index, predicts, accept_index,
                             accept_token_num, in_place)
    else:
        predicts = _sglang_outputs(accepted_nodes, output_token_ids, num_accepted, retrive_index, predicts,
                                   accept_index, accept_token_num)
    return predicts, accept_index, accept_token_num


def _check_outputs(check, predicts, accept_index, accept_token_num, batch_size, tree_size, spec_steps):
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


def _sglang_outputs(accepted_nodes, output_token_ids, num_accepted, retrive_index, predicts, accept_index,
                    accept_token_num):
    """Torch twin of ``_eagle_outputs_kernel``: writes ``accept_index`` and ``accept_token_num``, returns
    ``predicts`` (the given one, written in place, or a new ``[B * N + 1]`` one)."""
    batch_size, tree_size = accepted_nodes.shape
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
    largest = torch.full((num_rows + 2,), -1, dtype=torch.int32, device=accepted_nodes.device)
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


def _validate_layout(check, retrive_index, retrive_next_token, retrive_next_sibling, depth, spec_steps):
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
