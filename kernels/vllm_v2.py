"""Triton kernels of the vLLM model runner V2 adapter: the step's layout in, vLLM's outputs out.

``specdec_kernels/adapters/vllm_v2.py`` verifies a V2 step with one
``chain_verify_packed`` launch. ``_vllm_v2_prepare_kernel`` turns V2's
per-state tensors into the op's per-request inputs in one launch (the
drafts' ids and, from ``draft_logits``, their probabilities; each
request's seed, offset and temperature; the draft counts), and
``_vllm_v2_outputs_kernel`` writes vLLM's ``sampled`` (int64) and
``num_sampled`` from the op's outputs. Outcomes are the adapter's torch
path's (bit for bit, except the draft softmax: the chain kernel's softmax
of a logits row, ``row_statistics`` and ``row_probabilities``, float32 with
its own rounding, and NaN logits weighing 0) for every ``cu_num_logits``
vLLM makes. Every index read on the device is clamped into its tensor and
every write masked into its buffer, whatever the values; a malformed ``cu``
(decreasing) that packs two requests' drafts at one place leaves there the
draft of one of them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chain_verify_rows import inverse_norm, row_statistics
from .sampling import row_probabilities


@triton.jit
def _clamp(index, size):
    return tl.minimum(tl.maximum(index, 0), tl.maximum(size - 1, 0))


@triton.jit
def _vllm_v2_prepare_kernel(
    cu_num_logits_ptr, draft_sampled_ptr, pos_ptr, idx_mapping_ptr, expanded_idx_ptr, expanded_pos_ptr,
    temperature_ptr, seed_ptr, draft_logits_ptr,
    cu_drafts_ptr, draft_ids_ptr, draft_probs_ptr, seeds_ptr, offsets_ptr, temperatures_ptr,
    num_logits, num_states, draft_steps, vocab_size,
    stride_draft_state, stride_draft_step, stride_probs,
    HAS_DRAFT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program ``(b, c)``: request ``b``'s drafts ``c, c + C, ...`` (``C`` the grid's columns); ``c = 0`` also
    writes the request's counts, seed, offset and temperature.

    Request ``b`` owns logits rows ``cu[b] .. cu[b+1] - 1``; its draft ``j``
    is packed at ``cu[b] - b + j``, judges ``draft_sampled[cu[b] + j + 1]``
    and, with ``HAS_DRAFT``, was drawn from ``softmax(draft_logits[state,
    step])`` with the row's ``expanded_idx_mapping`` and
    ``expanded_local_pos``, over the first ``vocab_size`` tokens.
    """
    request = tl.program_id(0).to(tl.int64)
    column = tl.program_id(1)
    num_requests = tl.num_programs(0)
    start = tl.load(cu_num_logits_ptr + request).to(tl.int64)
    end = tl.load(cu_num_logits_ptr + request + 1).to(tl.int64)
    first_draft = start - request
    if column == 0:
        tl.store(cu_drafts_ptr + request, first_draft)
        if request == num_requests - 1:
            tl.store(cu_drafts_ptr + request + 1, end - num_requests)
        state = _clamp(tl.load(idx_mapping_ptr + request).to(tl.int64), num_states)
        tl.store(seeds_ptr + request, tl.load(seed_ptr + state))
        temperature = tl.load(temperature_ptr + state)
        tl.store(temperatures_ptr + request, tl.where(temperature == 0.0, 0.0, 1.0))
        tl.store(offsets_ptr + request, tl.load(pos_ptr + _clamp(start, num_logits)).to(tl.int64))

    num_drafts = num_logits - num_requests
    vocab = tl.arange(0, BLOCK_V)
    for step in range(column, end - start - 1, tl.num_programs(1)):
        draft = first_draft + step
        row = start + step
        packed = (draft >= 0) & (draft < num_drafts)
        token = tl.load(draft_sampled_ptr + _clamp(row + 1, num_logits)).to(tl.int64)
        tl.store(draft_ids_ptr + draft, token, mask=packed)
        if HAS_DRAFT:
            state = _clamp(tl.load(expanded_idx_ptr + _clamp(row, num_logits)).to(tl.int64), num_states)
            draft_step = _clamp(tl.load(expanded_pos_ptr + _clamp(row, num_logits)).to(tl.int64), draft_steps)
            # The draft row as a one-row tile: the chain kernel's statistics and softmax of a logits row at T = 1.
            one_row = tl.zeros([1], tl.int64)
            logits_row = (draft_logits_ptr + state * stride_draft_state + draft_step * stride_draft_step
                          + one_row)[:, None]
            unit = tl.full([1], 1.0, tl.float32)
            row_max, _, row_sum, _ = row_statistics(logits_row, (one_row == 0)[:, None], unit, 0, vocab_size, True, 1,
                                                 BLOCK_V)
            scale = inverse_norm(row_sum)
            probs_row = draft_probs_ptr + draft * stride_probs
            # The mask as a tile from the start (a scalar & a tile is refused by the interpreter's stores).
            packed_lanes = (vocab * 0 + draft >= 0) & (vocab * 0 + draft < num_drafts)
            for vocab_start in range(0, vocab_size, BLOCK_V):
                index = (vocab_start + vocab)[None, :]
                in_vocab = index < vocab_size
                p = row_probabilities(logits_row, index, in_vocab, row_max[:, None], scale[:, None], unit[:, None],
                                      True)
                tl.store(probs_row + index, p, mask=packed_lanes[None, :] & in_vocab)


@triton.jit
def _vllm_v2_outputs_kernel(
    tokens_ptr, num_accepted_ptr, sampled_ptr, num_sampled_ptr, width, stride_tokens, stride_sampled,
    BLOCK_W: tl.constexpr,
):
    """vLLM's ``sampled [B, K+1]`` int64 (the op's tokens) and ``num_sampled = num_accepted + 1``."""
    request = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK_W)
    in_width = columns < width
    tokens = tl.load(tokens_ptr + request * stride_tokens + columns, mask=in_width)
    tl.store(sampled_ptr + request * stride_sampled + columns, tokens.to(tl.int64), mask=in_width)
    tl.store(num_sampled_ptr + request, tl.load(num_accepted_ptr + request) + 1)
