"""Reference tree verification: the definition every tree kernel matches.

Vectorised over the batch. Node indices are topological (a parent precedes
its children) and siblings are tried in increasing index, so one pass over
the node indices ``1..N-1`` visits every attempt in the order the rule
defines: at step ``i`` each request whose current node is ``parents[b, i]``
tries node ``i``; an acceptance moves it to ``i``, whose children all come
later. The loop runs ``N - 1`` times on ``[B, V]`` tensors.

Why it is exact: one attempt draws ``t`` from the current proposal ``q``
and accepts with probability ``min(1, p(t)/q(t))``, so it emits ``t`` with
probability ``min(p, q)(t)`` and otherwise leaves a remainder distributed as
``normalise(max(0, p - q))``, whatever ``t`` was. The next attempt only has
to be exact for that remainder under the law its own child was drawn from:
``q`` again (i.i.d. children), ``q`` without the rejected tokens (children
drawn without replacement), or the point mass on a fixed candidate
(``draft=None``: the target is sampled without replacement over the
candidates).

Normalising needs a sum over the vocabulary. ``_sampling.normalise`` makes
it an exact integer sum of the fixed-point weights, then one correctly
rounded reciprocal per row and one float64 product per entry, so every
backend gets the same bits whatever its reduction order.
"""

from __future__ import annotations

import torch

from .. import rng
from . import _rows, _sampling
from .build_tree import validate_parents

DRAFT_SAMPLING = ("with_replacement", "without_replacement")


def tree_verify(
    tree_token_ids, parents, target, draft, num_nodes, temperature, logits, draft_sampling, seed, offset,
    top_k=None, top_p=None, min_p=None, bonus_token_ids=None,
):
    """See ``specdec_kernels.tree_verify``; shapes and dtypes are already validated.

    ``top_k``/``top_p``/``min_p`` replace every node's target row by its
    truncation (``_rows.target_distributions``) before anything below reads it.

    Decision rule per request ``b``. The current node starts at the root 0
    with residual target ``p`` = target row 0 and proposal ``q`` = draft row 0.
    Node ``i`` is a child of ``n`` iff ``i < num_nodes[b]``, ``n < i`` and
    ``parents[b, i] == n``; children are tried in increasing index:

    * child ``c`` with a valid token ``t`` is accepted iff
      ``u_c * q(t) < p(t)`` (``u_c`` from the acceptance stream at position
      ``c``; ``q`` one-hot on ``t`` when ``draft`` is None or ``q(t)`` is
      not ``> 0``: a deterministic candidate, v1.3); greedy requests
      (``T_b`` not ``> 0``) accept iff ``t`` is the argmax of the raw target row of
      the current node. On acceptance ``c`` becomes the current node and
      ``p``, ``q`` become its rows;
    * a rejection sets ``p = normalise(max(0, p - q))`` (``normalise(p)``
      where that has no mass) and, for ``"without_replacement"`` with a draft,
      ``q = normalise(q with q(t) = 0)`` (left all-zero when nothing is left:
      a later child is then deterministic); ``"with_replacement"`` and a
      deterministic candidate keep ``q``. With ``draft=None``
      ``draft_sampling`` plays no role: ``p`` loses ``t`` and is renormalised;
    * a child whose token is outside ``[0, V)`` is rejected and changes
      nothing (no proposal), exactly like a node that is not there;
    * when the current node has no child left, the emitted token is drawn
      from ``p`` by the fixed-point sampler on the sample stream at position =
      the current node; greedy requests emit the argmax of its raw target row
      (``-1`` for a row without mass or without a greedy choice);
    * with ``bonus_token_ids``, a request none of whose final node's
      children was tried (the path ends at a leaf, as a chain whose drafts
      were all accepted) emits ``bonus_token_ids[b]`` instead; an id outside
      ``[0, V)`` is no bonus: the final node's row is sampled (v1.3).

    Malformed values never index out of bounds: a node whose parent is not in
    ``[0, i)`` is unreachable, ``num_nodes`` is clamped to ``[1, N]`` (the
    root is always there), ``parents[b, 0]`` is never read.

    Returns ``(accepted_nodes [B, N], output_token_ids [B, N], num_accepted [B])``, int32.
    """
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"tree_verify: `draft_sampling` must be one of {DRAFT_SAMPLING}; got {draft_sampling!r}")
    batch_size, tree_size, vocab_size = target.shape
    device = target.device
    rows = torch.arange(batch_size, device=device)
    slots = torch.arange(tree_size, device=device).view(1, -1)

    target_probs = _rows.target_distributions(target, temperature, logits, top_k, top_p, min_p)
    # `logits` covers the target only: the draft is always the probabilities its tokens were drawn from (v1.3).
    draft_probs = None if draft is None else draft.to(torch.float32)
    greedy = _sampling.greedy_requests(temperature, batch_size, device)
    greedy_targets = _sampling.greedy_tokens(target, logits)  # [B, N], on the raw rows
    if num_nodes is None:
        node_limit = torch.full((batch_size,), tree_size, dtype=torch.int64, device=device)
    else:
        node_limit = num_nodes.to(device=device, dtype=torch.int64).clamp(1, tree_size)

    token_ids = tree_token_ids.to(torch.int64)
    parent_ids = parents.to(torch.int64)
    valid = (token_ids >= 0) & (token_ids < vocab_size)
    safe_ids = torch.where(valid, token_ids, 0)

    keys = rng.RequestKeys(seed, offset, batch_size, device)
    uniforms = _sampling.acceptance_uniforms(keys, slots.expand(batch_size, -1))

    remove_drawn = draft_probs is not None and draft_sampling == "without_replacement"
    current = torch.zeros(batch_size, dtype=torch.int64, device=device)
    on_path = torch.zeros((batch_size, tree_size), dtype=torch.bool, device=device)
    on_path[:, 0] = True
    rejected_at_current = torch.zeros(batch_size, dtype=torch.bool, device=device)
    residual_target = target_probs[:, 0]
    proposal = None if draft_probs is None else draft_probs[:, 0]

    for child in range(1, tree_size):
        # current < child always holds, so a parent outside [0, child) never matches.
        tried = (parent_ids[:, child] == current) & (child < node_limit) & valid[:, child]
        token = safe_ids[:, child]
        point_mass = torch.nn.functional.one_hot(token, vocab_size).bool()
        target_at_token = residual_target.gather(-1, token.view(-1, 1)).squeeze(-1)
        proposal_at_token = None if proposal is None else proposal.gather(-1, token.view(-1, 1)).squeeze(-1)
        accepted, from_draft = _rows.acceptance(uniforms[:, child], target_at_token, proposal_at_token, greedy,
                                                token == greedy_targets[rows, current])
        accepted &= tried
        # What a rejection subtracts: q, or the point mass on t for a deterministic candidate (v1.3).
        tried_proposal = point_mass.to(torch.float32) if proposal is None else torch.where(
            from_draft.view(-1, 1), proposal, point_mass.to(torch.float32))

        # Rows that tried nothing keep p and q; the others move to the child's
        # rows or to the residual.
        rejected_target = _sampling.normalise(_sampling.residual(residual_target, tried_proposal))
        residual_target = torch.where(
            tried.view(-1, 1), torch.where(accepted.view(-1, 1), target_probs[:, child], rejected_target),
            residual_target,
        )
        if proposal is not None:
            if remove_drawn:  # a deterministic candidate was not drawn: q stays
                rejected_proposal = torch.where(
                    from_draft.view(-1, 1), _sampling.normalise(proposal.masked_fill(point_mass, 0.0)), proposal)
            else:
                rejected_proposal = proposal
            proposal = torch.where(
                tried.view(-1, 1), torch.where(accepted.view(-1, 1), draft_probs[:, child], rejected_proposal),
                proposal,
            )

        on_path[:, child] = accepted
        rejected_at_current = (rejected_at_current | tried) & ~accepted
        current = torch.where(accepted, child, current)

    # The path's nodes increase with depth: sorting the node indices that are
    # on it (the others keyed past the end) lists them root first.
    num_accepted = on_path.sum(dim=-1) - 1
    path = torch.where(on_path, slots, tree_size).sort(dim=-1).values
    accepted_nodes = torch.where(path < tree_size, path, -1)
    path_tokens = token_ids.gather(-1, path[:, 1:].clamp_max(tree_size - 1))
    output = torch.full((batch_size, tree_size), -1, dtype=torch.int64, device=device)
    output[:, :-1] = torch.where(path[:, 1:] < tree_size, path_tokens, -1)
    sampled = _sampling.sample(keys, current, _sampling.fixed_point(residual_target))
    emitted = torch.where(greedy, greedy_targets[rows, current], sampled)
    if bonus_token_ids is not None:
        takes_bonus = ~rejected_at_current & (bonus_token_ids >= 0) & (bonus_token_ids < vocab_size)
        emitted = torch.where(takes_bonus, bonus_token_ids.to(torch.int64), emitted)
    output[rows, num_accepted] = emitted
    return accepted_nodes.to(torch.int32), output.to(torch.int32), num_accepted.to(torch.int32)


def validate_tree(parents, num_nodes, tree_token_ids, vocab_size: int) -> None:
    """Host-side check of a tree's values (synchronises); ``ValueError`` on the first problem.

    Checks, for every request ``b`` with ``n_b`` nodes (``N`` when
    ``num_nodes`` is None): ``1 <= n_b <= N``; ``parents[b, 0] == -1``;
    ``0 <= parents[b, i] < i`` and ``0 <= tree_token_ids[b, i] < vocab_size``
    for ``1 <= i < n_b``. Entries at or past ``n_b`` are not checked, nor is
    the root's token (it is not verified). The message names the argument
    and the offending request and node. The structure checks are
    ``build_tree.validate_parents``, shared with ``sk.build_tree``.
    """
    used = validate_parents(parents, num_nodes)
    if used is None:
        return
    device = parents.device
    token_ids = tree_token_ids.to(device=device, dtype=torch.int64)
    bad_token = used & ((token_ids < 0) | (token_ids >= vocab_size))
    if bool(bad_token.any()):
        request, node = (int(i) for i in bad_token.nonzero()[0])
        raise ValueError(
            f"`tree_token_ids` must lie in [0, V) = [0, {vocab_size}); request {request} node {node} "
            f"has {int(tree_token_ids[request, node])}"
        )
