"""Triton kernel of the FlashInfer adapter: the two counters of ``chain_speculative_sampling``, one launch.

FlashInfer counts, per request, the draft tokens accepted when every
position is judged on its own (``accepted``) and the accepted prefix of the
chain (``emitted``, which is ``chain_verify``'s ``num_accepted``). Judging
a position needs its acceptance uniform, so this kernel redraws, from the
same key and counters ``chain_verify`` used (``docs/rng.md``), the uniforms
of the positions after the prefix, and one fresh uniform for the position
that was rejected (FlashInfer's kernel judges it again with a new draw). It
reads ``K`` probabilities from each of ``target`` and ``draft`` per request
and adds both counts to the caller's tensors in place (or stores them).
The rule and the reasoning are in ``specdec_kernels/adapters/flashinfer.py``;
the torch twin there is the definition this kernel matches bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chain_verify_rows import acceptance_of_uniform, proposal_probability
from .rng import ACCEPT_STREAM, random_words, request_key, uniform_from_word


@triton.jit
def _flashinfer_counters_kernel(
    ids_ptr, target_ptr, draft_ptr, num_accepted_ptr, accepted_count_ptr, emitted_count_ptr,
    seed_ptr, seed_low, seed_high, offset_ptr, offset_low, offset_high,
    max_drafts, vocab_size,
    stride_ids_b, stride_target_b, stride_target_k, stride_draft_b, stride_draft_k,
    SEED_PER_REQUEST: tl.constexpr, OFFSET_FROM_TENSOR: tl.constexpr, OFFSET_PER_REQUEST: tl.constexpr,
    ACCUMULATE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    positions = tl.arange(0, BLOCK_K)
    in_chain = positions < max_drafts
    requests = request + positions * 0
    k0, k1, c2, c3 = request_key(seed_ptr, seed_low, seed_high, offset_ptr, offset_low, offset_high, requests,
                                 in_chain, SEED_PER_REQUEST, OFFSET_FROM_TENSOR, OFFSET_PER_REQUEST)
    # Index 0: chain_verify's own acceptance uniform; index 1: the rejected position's second draw.
    first, _, _, _ = random_words(k0, k1, c2, c3, ACCEPT_STREAM, positions, positions * 0)
    second, _, _, _ = random_words(k0, k1, c2, c3, ACCEPT_STREAM, positions, positions * 0 + 1)

    token = tl.load(ids_ptr + request * stride_ids_b + positions, mask=in_chain, other=-1).to(tl.int64)
    valid = in_chain & (token >= 0) & (token < vocab_size)
    safe_token = tl.where(valid, token, 0)
    target_at = tl.load(target_ptr + request * stride_target_b + positions.to(tl.int64) * stride_target_k
                        + safe_token, mask=valid, other=0.0).to(tl.float32)
    draft_at = tl.load(draft_ptr + request * stride_draft_b + positions.to(tl.int64) * stride_draft_k
                       + safe_token, mask=valid, other=0.0).to(tl.float32)

    emitted = tl.load(num_accepted_ptr + request)
    uniform = uniform_from_word(tl.where(positions == emitted, second, first))
    # chain_verify's acceptance test: a token with q(t) not > 0 is judged against the point mass on it (v1.3).
    judged = valid & (positions >= emitted) & acceptance_of_uniform(uniform, target_at,
                                                                    proposal_probability(draft_at), False, False)
    accepted = emitted + tl.sum(judged.to(tl.int32), axis=0)
    if ACCUMULATE:
        accepted += tl.load(accepted_count_ptr + request).to(tl.int32)
        emitted += tl.load(emitted_count_ptr + request).to(tl.int32)
    tl.store(accepted_count_ptr + request, accepted.to(accepted_count_ptr.dtype.element_ty))
    tl.store(emitted_count_ptr + request, emitted.to(emitted_count_ptr.dtype.element_ty))
