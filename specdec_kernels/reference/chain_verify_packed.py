"""Reference packed chain verification: the packed rows gathered into the padded layout, then the chain reference.

The oracle copies the rows into padded ``[B, K(+1), V]`` tensors because that
is the most readable statement of the contract ("the same tokens as
``chain_verify`` on the padded equivalent"); the kernels read the packed rows
in place and never make that copy.
"""

from __future__ import annotations

import torch

from . import chain_verify as chain_reference


def packed_requests(cu_num_draft_tokens: torch.Tensor, num_tokens: int, max_drafts: int):
    """``(first_draft_row, num_drafts)`` int64 ``[B]`` of each request: the outcome of every ``cu`` on every backend.

    ``start_b = clamp(cu[b], 0, T)``, ``end_b = clamp(cu[b+1], start_b, T)``
    and ``n_b = min(end_b - start_b, K)``. For a well-formed ``cu`` (starts at
    0, non-decreasing, ends at ``T``, every ``n_b <= K``) this is ``cu[b]`` and
    ``cu[b+1] - cu[b]``; any other ``cu`` (a decreasing step, values below 0 or
    past ``T``, a request longer than ``K``) is read with its counts clamped
    into ``[0, K]`` and its rows clamped into range, so no access is out of
    bounds: request ``b`` reads ids and draft rows ``start_b .. start_b + n_b
    - 1 < T`` and target rows ``start_b + b .. start_b + b + n_b <= T + b``.
    """
    cu = cu_num_draft_tokens.to(torch.int64)
    start = cu[:-1].clamp(0, num_tokens)
    end = torch.maximum(cu[1:].clamp(max=num_tokens), start)
    return start, (end - start).clamp(max=max_drafts)


def padded_target_rows(target, start, num_drafts, max_drafts, bonus_rows):
    """The padded equivalent's target ``[B, K+1, V]``: request ``b``'s rows at ``[b, 0..n_b]``.

    With bonus rows, positions past ``n_b`` repeat the bonus row; in the
    bonus-free layout (``bonus_rows`` False) position ``n_b`` and later are
    never read (the bonus id is emitted there) and repeat an in-range row.
    """
    batch_size = start.shape[0]
    num_tokens = target.shape[0] - (batch_size if bonus_rows else 0)
    vocab_size = target.shape[-1]
    requests = torch.arange(batch_size, device=target.device).view(-1, 1)
    positions = torch.arange(max_drafts + 1, device=target.device).view(1, -1)
    first_row, count = start.view(-1, 1), num_drafts.view(-1, 1)
    if bonus_rows:
        rows = first_row + requests + torch.minimum(positions, count)
    else:
        rows = (first_row + torch.minimum(positions, count - 1)).clamp(0, max(num_tokens - 1, 0))
    if target.shape[0] == 0:
        return target.new_zeros((batch_size, max_drafts + 1, vocab_size))
    return target.index_select(0, rows.flatten()).view(batch_size, max_drafts + 1, vocab_size)


def chain_verify_packed(draft_token_ids, cu_num_draft_tokens, target, draft, max_drafts, temperature, logits, seed,
                        offset, top_k=None, top_p=None, min_p=None, bonus_token_ids=None):
    """See ``specdec_kernels.chain_verify_packed``; arguments are already validated.

    Builds the padded equivalent (:func:`packed_requests` says which rows) and
    runs :func:`chain_reference.chain_verify` on it, so every decision and
    random number is that of request ``b`` position ``i`` in a padded call.
    Padding positions (``i > n_b`` for the target, ``i >= n_b`` for ids and
    draft) repeat an in-range row or hold ``-1``; the chain reference never
    reads them. In the bonus-free layout (``target [T, V]``, bonus ids given)
    position ``n_b`` is padding too: the bonus id is emitted there, ``-1``
    for an id outside ``[0, V)``.
    """
    num_tokens = draft_token_ids.shape[0]
    batch_size = cu_num_draft_tokens.shape[0] - 1
    vocab_size = target.shape[-1]
    device = target.device
    start, num_drafts = packed_requests(cu_num_draft_tokens, num_tokens, max_drafts)
    positions = torch.arange(max_drafts + 1, device=device).view(1, -1)
    first_row = start.view(-1, 1)
    count = num_drafts.view(-1, 1)

    bonus_rows = target.shape[0] == num_tokens + batch_size  # else [T, V] with bonus ids: no bonus rows
    padded_target = padded_target_rows(target, start, num_drafts, max_drafts, bonus_rows)

    draft_positions = positions[:, :max_drafts]
    in_chain = draft_positions < count
    if num_tokens == 0:  # every n_b is 0: nothing is read from ids or draft
        padded_ids = torch.full((batch_size, max_drafts), -1, dtype=torch.int64, device=device)
        padded_draft = None if draft is None else draft.new_zeros((batch_size, max_drafts, vocab_size))
    else:
        draft_rows = (first_row + draft_positions).clamp(max=num_tokens - 1)
        padded_ids = torch.where(in_chain, draft_token_ids.to(torch.int64)[draft_rows], -1)
        padded_draft = None if draft is None else draft.index_select(0, draft_rows.flatten()).view(
            batch_size, max_drafts, vocab_size)
    if bonus_rows:
        return chain_reference.chain_verify(padded_ids, padded_target, padded_draft, num_drafts.to(torch.int32),
                                            temperature, logits, seed, offset, top_k, top_p, min_p, bonus_token_ids)
    # No bonus row to sample: a request that accepts all its drafts with an out-of-range bonus id emits -1 there.
    valid_bonus = (bonus_token_ids >= 0) & (bonus_token_ids < vocab_size)
    output, num_accepted = chain_reference.chain_verify(
        padded_ids, padded_target, padded_draft, num_drafts.to(torch.int32), temperature, logits, seed, offset,
        top_k, top_p, min_p, torch.where(valid_bonus, bonus_token_ids, 0))
    no_token = (~valid_bonus & (num_accepted == num_drafts)).view(-1, 1) & (positions == count)
    return output.masked_fill(no_token, -1), num_accepted
