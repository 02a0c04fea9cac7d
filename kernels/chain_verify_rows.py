"""Reads of target and draft rows shared by the chain kernel's passes.

``sample_slice`` is the per-element pass of the sampler: loads, subtract,
clamp, scale, convert, one int64 scan per 1024-token chunk, a compare and
a count (``kernels/sampling.py``); no random number per element.
"""

import triton
import triton.language as tl

from .sampling import chunk_draw, chunk_pick, fixed_point, softmax_weight


@triton.jit
def row_pointers(base_ptr, requests, stride_request, position, stride_position):
    """``base + request * stride_request + position * stride_position`` in 64 bits.

    ``K * stride`` passes ``2**31`` for strided inputs; ``aot.py`` checks the
    PTX for any 32-bit use of a stride.
    """
    return base_ptr + requests.to(tl.int64) * stride_request + tl.cast(position, tl.int64) * stride_position


@triton.jit
def sample_slice(
    target_ptr, draft_ptr, chunk_total_ptr, chunk_pick_ptr,
    requests, sampled, subtract, stop, stop_token, stop_max, stop_inverse_norm, stop_dmax, stop_dinverse_norm,
    inverse_temperature, k0, k1, c2, c3, num_chunks, chunk_lo, chunk_hi, vocab_size,
    stride_target_b, stride_target_k, stride_draft_b, stride_draft_k,
    LOGITS: tl.constexpr, HAS_DRAFT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Chunk totals and candidates of chunks ``[chunk_lo, chunk_hi)`` of row ``stop``, stored at ``[request, chunk]``.

    The weights are the residual ``max(0, p - q)`` where ``subtract``, else
    ``p``; with ``LOGITS`` the rows are logits normalised by the stop row's
    ``(max, 1 / sum)``. ``sampled`` masks the requests.
    """
    vocab = tl.arange(0, BLOCK_V)[None, :]
    target_row = row_pointers(target_ptr, requests, stride_target_b, stop, stride_target_k)[:, None]
    draft_row = row_pointers(draft_ptr, requests, stride_draft_b, stop, stride_draft_k)[:, None]
    slot = requests.to(tl.int64) * num_chunks
    subtracting = subtract[:, None]
    for chunk in range(chunk_lo, chunk_hi):
        index = chunk * BLOCK_V + vocab
        mask = sampled[:, None] & (index < vocab_size)
        if LOGITS:
            x = tl.load(target_row + index, mask=mask, other=-float("inf")).to(tl.float32)
            p = softmax_weight(x - stop_max[:, None], inverse_temperature[:, None]) * stop_inverse_norm[:, None]
        else:
            p = tl.load(target_row + index, mask=mask, other=0.0).to(tl.float32)
        if HAS_DRAFT:
            if LOGITS:
                y = tl.load(draft_row + index, mask=mask & subtracting, other=-float("inf")).to(tl.float32)
                q = softmax_weight(y - stop_dmax[:, None], inverse_temperature[:, None]) * stop_dinverse_norm[:, None]
                q = tl.where(subtracting, q, 0.0)
            else:
                q = tl.load(draft_row + index, mask=mask & subtracting, other=0.0).to(tl.float32)
        else:
            q = tl.where(subtracting & (index == stop_token[:, None]), 1.0, 0.0)
        # fixed_point maps the negatives and NaNs of p - q to 0: max(0, p - q) in one step.
        total, offset = chunk_pick(fixed_point(p - q), chunk_draw(k0, k1, c2, c3, stop, chunk))
        tl.store(chunk_total_ptr + slot + chunk, total, mask=sampled)
        tl.store(chunk_pick_ptr + slot + chunk, chunk * BLOCK_V + offset, mask=sampled)
