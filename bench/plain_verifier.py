"""A plain PyTorch chain verifier: the baseline the reference is measured against.

The textbook rejection sampler as engines write it in PyTorch (vLLM's
fallback path has this shape): uniforms from ``torch.rand``, accept while
``u * q(t) < p(t)``, then ``torch.multinomial`` on the residual
``max(0, p - q)`` (or on the bonus row). It is exact in law but draws its own
random numbers, so the benchmark compares its time, not its tokens.
"""

from __future__ import annotations

import torch


def plain_chain_verify(draft_token_ids, target, draft, logits=False):
    """``(output_token_ids [B, K+1], num_accepted [B])`` for ``target [B, K+1, V]``, ``draft [B, K, V]``."""
    batch_size, max_drafts = draft_token_ids.shape
    target = torch.softmax(target.float(), -1) if logits else target.float()
    draft = draft.float()  # probabilities either way (contract v1.3)
    ids = draft_token_ids.long()
    rows = torch.arange(batch_size, device=target.device)
    target_at = target[:, :max_drafts].gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    draft_at = draft.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    accepted = torch.rand(target_at.shape, device=target.device) * draft_at < target_at
    num_accepted = accepted.long().cumprod(-1).sum(-1)
    target_row = target[rows, num_accepted]
    draft_row = torch.nn.functional.pad(draft, (0, 0, 0, 1))[rows, num_accepted]  # zero row: bonus
    residual = torch.clamp_min(target_row - draft_row, 0.0)
    emitted = torch.multinomial(residual, 1).squeeze(-1)
    positions = torch.arange(max_drafts + 1, device=target.device)
    output = torch.where(positions < num_accepted.view(-1, 1), torch.nn.functional.pad(ids, (0, 1)), -1)
    output[rows, num_accepted] = emitted
    return output.int(), num_accepted.int()


SORT_PROVIDERS = ("sort+reference", "sort+triton", "sort+cuda")  # the benchmarks' sort_top_k_top_p providers


def sort_top_k_top_p(probabilities, top_k, top_p):
    """Top-k then top-p truncation of rows ``[..., V]`` as engines write it in PyTorch: one sort per row.

    The baseline the fused truncation is measured against (the renormalised
    rows are then verified by one of the package's untruncated backends).
    """
    ordered, order = probabilities.float().sort(dim=-1, descending=True)
    ranks = torch.arange(ordered.shape[-1], device=ordered.device)
    ordered = torch.where(ranks < top_k, ordered, 0.0)
    mass_before = ordered.cumsum(-1) - ordered
    ordered = torch.where(mass_before < top_p * ordered.sum(-1, keepdim=True), ordered, 0.0)
    truncated = torch.zeros_like(ordered).scatter_(-1, order, ordered)
    return truncated / truncated.sum(-1, keepdim=True)
