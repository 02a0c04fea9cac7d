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
from ..launchers.eagle_layout import triton_eagle_greedy, triton_eagle_outputs, triton_eagle_parents
from ..ops.build_tree import build_tree
from ..ops.tree_verify import tree_verify
from .eagle_layout import (LINKS, check_outputs, greedy_path, limit_depth, parents_from_links, sglang_outputs,
                           validate_layout)

OP_NAME = "sglang.eagle_tree_verify"


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
    check_outputs(check, predicts, accept_index, accept_token_num, batch_size, tree_size, spec_steps)
    if validate:
        depth = build_tree(parents_from_links(retrive_next_token, retrive_next_sibling), backend=backend).depth
        validate_layout(check, retrive_index, retrive_next_token, retrive_next_sibling, depth, spec_steps)

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
        predicts = sglang_outputs(accepted_nodes, output_token_ids, num_accepted, retrive_index, predicts,
                                   accept_index, accept_token_num)
    return predicts, accept_index, accept_token_num





def tree_speculative_sampling_target_only(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index=None,
    retrive_next_token=None,
    retrive_next_sibling=None,
    uniform_samples=None,
    uniform_samples_for_final_sampling=None,
    target_probs=None,
    draft_probs=None,
    threshold_single=1.0,
    threshold_acc=1.0,
    deterministic=True,
    *,
    retrieve_index=None,
    retrieve_next_token=None,
    retrieve_next_sibling=None,
    backend="auto",
):
    """sgl-kernel's ``tree_speculative_sampling_target_only``, exact, outputs written in place.

    Called as SGLang's ``EagleVerifyInput.verify`` calls sgl-kernel's
    function, by position or by its keywords (the links spelled
    ``retrive_*`` as sgl-kernel's signature has them, or ``retrieve_*`` as
    newer SGLang does). ``target_probs [B, N, V]`` is the law SGLang
    computed (temperature, top-k/top-p and softmax applied), used as given;
    ``draft_probs [B, N, V]`` is SGLang's (all zeros: the candidates are
    deterministic, the target-only rule). The verification is
    :func:`eagle_tree_verify`'s: exact, the path at most
    ``accept_index.shape[1] - 1`` drafts deep, ``predicts``,
    ``accept_index`` and ``accept_token_num`` written as sgl-kernel writes
    them.

    The random numbers are the package's, not SGLang's: ``uniform_samples
    [B, N]`` and ``uniform_samples_for_final_sampling [B]`` are checked for
    shape but not read. Each request gets a fresh 63-bit seed drawn on the
    device from its default generator (``torch.manual_seed`` repeats a call,
    and a captured graph draws anew at each replay, as SGLang's
    ``torch.rand`` coins do).

    ``threshold_single`` and ``threshold_acc`` other than 1 are SGLang's
    relaxed acceptance, which does not keep the target's law: they raise
    ``ValueError``. ``deterministic`` is accepted for the signature (the
    sampling is always deterministic). Returns ``None``, as sgl-kernel does.
    """
    check = _validation.Checker("sglang.tree_speculative_sampling_target_only", _device_of(candidates))
    links = _links(check, retrive_index, retrive_next_token, retrive_next_sibling, retrieve_index,
                   retrieve_next_token, retrieve_next_sibling)
    for name, value in (("uniform_samples", uniform_samples),
                        ("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling),
                        ("target_probs", target_probs), ("draft_probs", draft_probs)):
        if value is None:
            check.fail(f"missing argument `{name}`", TypeError)
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if value != 1.0:
            check.fail(f"`{name}` must be 1.0: other values are SGLang's relaxed acceptance, which does not keep "
                       f"the target's law; got {value!r}")
    if not isinstance(deterministic, bool):
        check.fail(f"`deterministic` must be a bool; got {type(deterministic).__name__}", TypeError)
    batch_size, tree_size = check.tensor("candidates", candidates, (None, None), _validation.TOKEN_DTYPES,
                                         "[B, N]").shape
    spec_steps = _accept_width(check, accept_index, batch_size) - 1
    check.tensor("uniform_samples", uniform_samples, (batch_size, tree_size), _validation.FLOAT_DTYPES, "[B, N]",
                 sizes_from="candidates")
    check.tensor("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling, (batch_size,),
                 _validation.FLOAT_DTYPES, "[B]", sizes_from="candidates")
    eagle_tree_verify(
        candidates, *links, target_probs, draft_probs, spec_steps=spec_steps,
        seed=_validation.device_seeds((batch_size,), candidates.device), predicts=predicts,
        accept_index=accept_index, accept_token_num=accept_token_num, backend=backend)


def verify_tree_greedy(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index=None,
    retrive_next_token=None,
    retrive_next_sibling=None,
    target_predict=None,
    *,
    retrieve_index=None,
    retrieve_next_token=None,
    retrieve_next_sibling=None,
    backend="auto",
):
    """sgl-kernel's ``verify_tree_greedy``: the greedy walk from the target's argmax ids, in place, one launch.

    Called as SGLang calls sgl-kernel's function (the links spelled either
    way, as :func:`tree_speculative_sampling_target_only` takes them).
    ``target_predict [B, N]`` holds the target's argmax after each node,
    read at each node's row of ``retrive_index`` as sgl-kernel reads it.
    From the root the walk accepts the first child, in sibling order, whose
    candidate is the target's token after the last accepted node, at most
    ``accept_index.shape[1] - 1`` times. ``predicts`` gets the target's
    token at each path node's row (rows outside ``[0, B * N)`` are left
    out), ``accept_index`` the path's rows then ``-1`` (every column, so a
    ``torch.empty`` one works), ``accept_token_num`` the accepted drafts.

    A link counts only when it points at a later slot of the request (as in
    every tree SGLang builds): the walk ends within ``N - 1`` steps whatever
    the links hold, and a malformed layout gives the walk over the links
    that count. On the Triton and CUDA backends: one Triton launch, no host
    read; on the reference, torch ops. Returns ``None``, as sgl-kernel does.
    """
    check = _validation.Checker("sglang.verify_tree_greedy", _device_of(candidates))
    links = _links(check, retrive_index, retrive_next_token, retrive_next_sibling, retrieve_index,
                   retrieve_next_token, retrieve_next_sibling)
    if target_predict is None:
        check.fail("missing argument `target_predict`", TypeError)
    batch_size, tree_size = check.tensor("candidates", candidates, (None, None), _validation.TOKEN_DTYPES,
                                         "[B, N]").shape
    if tree_size < 1:
        check.fail(f"`candidates` must have shape [B, N] with N >= 1 (slot 0 is the root); got "
                   f"{list(candidates.shape)}")
    for name, value in zip(("retrive_index", *LINKS, "target_predict"), (*links, target_predict)):
        check.tensor(name, value, (batch_size, tree_size), _validation.TOKEN_DTYPES, "[B, N]",
                     sizes_from="candidates")
    width = _accept_width(check, accept_index, batch_size)
    check_outputs(check, predicts, accept_index, accept_token_num, batch_size, tree_size, width - 1)
    if predicts is None or accept_token_num is None:
        check.fail("`predicts` and `accept_token_num` are written in place: give both", TypeError)
    device = candidates.device
    if _backend.resolve("tree_verify", backend, device) != "reference" and _backend.triton_runs_on(device):
        triton_eagle_greedy(candidates, *links, target_predict, predicts, accept_index, accept_token_num)
        return
    path, tokens, num_accepted = greedy_path(candidates, *links, target_predict, width)
    sglang_outputs(path, tokens, num_accepted, links[0], predicts, accept_index, accept_token_num)


def _device_of(value):
    return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")


def _links(check, *spellings):
    """``(retrive_index, retrive_next_token, retrive_next_sibling)``, each given under one of its two names."""
    old, new = spellings[:3], spellings[3:]
    chosen = []
    for name, first, second in zip(("retrive_index", *LINKS), old, new):
        if (first is None) == (second is None):
            spelled = name.replace("retrive", "retrieve")
            check.fail(f"give `{name}` (sgl-kernel's name) or `{spelled}` (newer SGLang's), once; got "
                       f"{'both' if first is not None else 'neither'}", TypeError)
        chosen.append(second if first is None else first)
    return chosen


def _accept_width(check, accept_index, batch_size):
    """``spec_steps + 1``: the columns of SGLang's ``accept_index [B, spec_steps + 1]``, at least the root's."""
    check.tensor("accept_index", accept_index, (batch_size, None), (torch.int32,), "[B, spec_steps + 1]",
                 sizes_from="candidates")
    if accept_index.shape[1] == 0:
        check.fail(f"`accept_index` must have at least one column (the root's); got shape {list(accept_index.shape)}")
    return accept_index.shape[1]
