"""Launcher of the FlashInfer adapter's counter kernel (kernels/flashinfer_counters.py): one launch, no host read."""

from __future__ import annotations

from ._shapes import device_guard, next_power_of_2, unit_last_stride
from ._options import split_words

NUM_WARPS = 1  # K <= a few dozen values per request: one warp holds them


def triton_flashinfer_counters(draft_token_ids, target_probs, draft_probs, num_accepted, accepted_count,
                               emitted_count, seed_tensor, seed, offset_tensor, offset, accumulate):
    """Writes (or, with ``accumulate``, adds) both counters of every request; ``seed``/``offset`` as the ops'
    schemas split them (``_validation.split_random_state``)."""
    from .._kernels.flashinfer_counters import _flashinfer_counters_kernel

    batch_size, max_drafts = draft_token_ids.shape
    if batch_size == 0:
        return
    draft_token_ids, target_probs, draft_probs, seed_tensor, offset_tensor = (
        unit_last_stride(t) for t in (draft_token_ids, target_probs, draft_probs, seed_tensor, offset_tensor))
    placeholder = num_accepted
    device = draft_token_ids.device
    guard = device_guard(device)
    with guard:
        _flashinfer_counters_kernel[(batch_size,)](
            draft_token_ids, target_probs, draft_probs, num_accepted, accepted_count, emitted_count,
            placeholder if seed_tensor is None else seed_tensor, *split_words(seed),
            placeholder if offset_tensor is None else offset_tensor, *split_words(offset),
            max_drafts, target_probs.shape[-1],
            draft_token_ids.stride(0), target_probs.stride(0), target_probs.stride(1),
            draft_probs.stride(0), draft_probs.stride(1),
            SEED_PER_REQUEST=seed_tensor is not None, OFFSET_FROM_TENSOR=offset_tensor is not None,
            OFFSET_PER_REQUEST=offset_tensor is not None and offset_tensor.dim() == 1,
            ACCUMULATE=accumulate, BLOCK_K=next_power_of_2(max(max_drafts, 1)), num_warps=NUM_WARPS,
        )
