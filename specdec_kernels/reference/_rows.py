"""The row core of the reference verifiers: what a target row is worth, and the acceptance test.

Chain and tree verification read target rows and judge proposals the same
way; both come from here, so a new input to the row (a bitmask, say) or to
the test is written once. The kernels mirror the two functions
(``kernels/chain_verify_rows.py``; CUDA's ``block_rows.cuh``).
"""

from __future__ import annotations

import torch

from . import _sampling, _truncation


def target_distributions(target: torch.Tensor, temperature, logits: bool, top_k, top_p, min_p) -> torch.Tensor:
    """float32 ``[B, R, V]``: every target row as the decisions read it.

    ``softmax(x / T_b)`` of logits or the probabilities as given
    (``_sampling.probabilities``), then truncated by ``top_k``/``top_p``/
    ``min_p`` and renormalised (``_truncation.truncate``; rows of requests
    with every parameter off are untouched).
    """
    return _truncation.truncate(_sampling.probabilities(target, temperature, logits), top_k, top_p, min_p)


def acceptance(uniforms: torch.Tensor, target_at_token: torch.Tensor, proposal_at_token: torch.Tensor | None,
               greedy: torch.Tensor | None = None, greedy_hit: torch.Tensor | None = None):
    """``(accepted, from_draft)``: the acceptance test of a proposed token, elementwise.

    ``proposal_at_token`` is ``q(t)``, ``None`` without a draft. A proposal
    whose ``q(t)`` is not ``> 0`` (``_sampling.drawn_from_draft``), and every
    proposal without a draft, is deterministic: tested against the point mass
    on ``t`` (``q(t) = 1``), so accepted with probability ``p(t)``
    (``from_draft`` is ``False`` there). Where ``greedy`` holds, the test is
    ``greedy_hit`` (the token is the raw row's argmax) instead. The caller
    masks out proposals that were not made (invalid ids, absent nodes).
    """
    if proposal_at_token is None:
        from_draft = torch.zeros_like(target_at_token, dtype=torch.bool)
        draft_at_token = torch.ones_like(target_at_token)
    else:
        from_draft = _sampling.drawn_from_draft(proposal_at_token)
        draft_at_token = torch.where(from_draft, proposal_at_token, 1.0)
    accepted = _sampling.accept(uniforms, target_at_token, draft_at_token)
    if greedy is not None:
        accepted = torch.where(greedy, greedy_hit, accepted)
    return accepted, from_draft
