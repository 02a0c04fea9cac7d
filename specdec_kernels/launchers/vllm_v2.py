"""Launchers of the vLLM V2 adapter's kernels (kernels/vllm_v2.py): one launch each, no host read."""

from __future__ import annotations

import torch

from ._shapes import device_guard, next_power_of_2, unit_last_stride

NUM_WARPS = 4
BLOCK_V = 1024  # the draft softmax's tile: two passes over a row of V' tokens



def triton_vllm_v2_prepare(cu_num_logits, draft_sampled, pos, idx_mapping, expanded_idx_mapping,
                           expanded_local_pos, temperature, seed, draft_logits, vocab_size, max_drafts):
    """``(cu_num_draft_tokens [B+1], draft_token_ids [T], draft [T, V'] or None, seed [B], offset [B],
    temperature [B])`` for ``chain_verify_packed``, in one launch over ``B x max(max_drafts, 1)`` programs."""
    from .._kernels.vllm_v2 import _vllm_v2_prepare_kernel

    device = draft_sampled.device
    batch_size = cu_num_logits.shape[0] - 1
    num_logits = draft_sampled.shape[0]
    num_drafts = num_logits - batch_size
    cu_drafts = torch.empty(batch_size + 1, dtype=torch.int64, device=device)
    draft_ids = torch.empty(num_drafts, dtype=torch.int64, device=device)
    draft = None if draft_logits is None else torch.empty((num_drafts, vocab_size), dtype=torch.float32,
                                                           device=device)
    seeds = torch.empty(batch_size, dtype=torch.int64, device=device)
    offsets = torch.empty(batch_size, dtype=torch.int64, device=device)
    temperatures = torch.empty(batch_size, dtype=torch.float32, device=device)
    if batch_size == 0:
        cu_drafts.zero_()
        return cu_drafts, draft_ids, draft, seeds, offsets, temperatures
    inputs = [unit_last_stride(t) for t in (cu_num_logits, draft_sampled, pos, idx_mapping, expanded_idx_mapping,
                                             expanded_local_pos, temperature, seed)]
    logits = draft_ids if draft_logits is None else unit_last_stride(draft_logits)
    with device_guard(device):
        _vllm_v2_prepare_kernel[(batch_size, max(max_drafts, 1))](
            *inputs, logits, cu_drafts, draft_ids, draft_ids if draft is None else draft, seeds, offsets,
            temperatures, num_logits, temperature.shape[0],
            1 if draft_logits is None else draft_logits.shape[1], vocab_size,
            0 if draft_logits is None else logits.stride(0), 0 if draft_logits is None else logits.stride(1),
            0 if draft is None else draft.stride(0),
            HAS_DRAFT=draft_logits is not None, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
        )
    return cu_drafts, draft_ids, draft, seeds, offsets, temperatures


def triton_vllm_v2_outputs(tokens, num_accepted):
    """``(sampled [B, K+1] int64, num_sampled [B] int32)`` from ``chain_verify_packed``'s outputs, one launch."""
    from .._kernels.vllm_v2 import _vllm_v2_outputs_kernel

    batch_size, width = tokens.shape
    sampled = torch.empty((batch_size, width), dtype=torch.int64, device=tokens.device)
    num_sampled = torch.empty(batch_size, dtype=torch.int32, device=tokens.device)
    if batch_size == 0:
        return sampled, num_sampled
    with device_guard(tokens.device):
        _vllm_v2_outputs_kernel[(batch_size,)](
            tokens, num_accepted, sampled, num_sampled, width, tokens.stride(0), sampled.stride(0),
            BLOCK_W=next_power_of_2(width), num_warps=1,
        )
    return sampled, num_sampled
