"""The steps of ``kernels/chain_verify.py`` that read other programs' results.

Run by the program that writes a row block's outputs (the last to arrive,
or the only one when a program holds whole rows). It is vectorised over the slices
and chunks of the row block (``SPLIT_TILE`` slices / ``CHUNK_TILE`` chunks
per step, one step unless the row has more), so the finishing program makes
a few dependent round trips to L2, not one per slice.
"""

import triton
import triton.language as tl

from .chain_verify_rows import emitted_logprob, row_at, sample_slice
from .sampling import choice_draw, choose_chunk, chunk_sums

@triton.jit
def _combine_argmax(stat_max_ptr, stat_arg_ptr, requests, rows, num_splits, max_drafts,
                    ROWS: tl.constexpr, BLOCK_K1: tl.constexpr, SPLIT_TILE: tl.constexpr):
    """Row max and argmax ``[ROWS, BLOCK_K1]`` over the slices (ties to the lower index)."""
    positions = tl.arange(0, BLOCK_K1)[None, :, None]
    splits = tl.arange(0, SPLIT_TILE)[None, None, :]
    base = (requests.to(tl.int64)[:, None, None] * BLOCK_K1 + positions) * num_splits
    wanted = rows[:, None, None] & (positions <= max_drafts)
    row_max = tl.full((ROWS, BLOCK_K1), -float("inf"), tl.float32)
    row_arg = tl.full((ROWS, BLOCK_K1), 2147483647, tl.int32)
    for start in range(0, num_splits, SPLIT_TILE):
        mask = wanted & (start + splits < num_splits)
        slice_max = tl.load(stat_max_ptr + base + start + splits, mask=mask, other=-float("inf"),
                            cache_modifier=".cg")
        slice_arg = tl.load(stat_arg_ptr + base + start + splits, mask=mask, other=2147483647,
                            cache_modifier=".cg")
        tile_max = tl.max(slice_max, axis=2)
        tile_arg = tl.min(tl.where(slice_max == tile_max[:, :, None], slice_arg, 2147483647), axis=2)
        row_arg = tl.where((tile_max > row_max) | ((tile_max == row_max) & (tile_arg < row_arg)), tile_arg, row_arg)
        row_max = tl.maximum(row_max, tile_max)
    return row_max, row_arg


@triton.jit
def sampled_tokens(
    target_rows, chunk_total_ptr, chunk_pick_ptr, requests, sampled, subtract, stop, stop_max, stop_inverse_norm,
    inverse_temperature, k0, k1, c2, c3, num_chunks, vocab_size, stride_target_k,
    truncation_threshold, truncation_reciprocal, truncating,
    LOGITS: tl.constexpr, TRUNCATE: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
    CHUNK_TILE: tl.constexpr,
):
    """The sampled requests' tokens from the chunk results of their stop rows; -1 for a row without mass.

    A residual without mass falls back to ``p``, whose chunk results this
    program then computes itself over the whole row. Rare by construction:
    it needs ``p - q < 2**-52`` at every token, and with normalised ``p`` and
    ``q`` a rejection then has probability ``sum max(0, p - q) < V * 2**-52``;
    so no program pays a second scan per element for it.
    """
    row_offset = requests.to(tl.int64) * num_chunks
    high31, low31 = chunk_sums(chunk_total_ptr, row_offset, sampled, num_chunks, ROWS, CHUNK_TILE)
    without_mass = subtract & (high31 == 0) & (low31 == 0)
    if tl.max(without_mass.to(tl.int32), axis=0) > 0:
        no_subtract = without_mass & False
        sample_slice(
            target_rows, target_rows, chunk_total_ptr, chunk_pick_ptr,
            requests, without_mass, no_subtract, stop, stop, stop_max, stop_inverse_norm,
            inverse_temperature, k0, k1, c2, c3, num_chunks, 0, num_chunks, vocab_size,
            stride_target_k, 0, truncation_threshold, truncation_reciprocal, truncating,
            LOGITS, False, TRUNCATE, BLOCK_V,
        )
        tl.debug_barrier()  # the chunk results just written, visible to every thread
        fallback_high31, fallback_low31 = chunk_sums(chunk_total_ptr, row_offset, without_mass, num_chunks, ROWS,
                                                     CHUNK_TILE)
        high31 = tl.where(without_mass, fallback_high31, high31)
        low31 = tl.where(without_mass, fallback_low31, low31)
    return choose_chunk(chunk_total_ptr, chunk_pick_ptr, row_offset, sampled, num_chunks, high31, low31,
                        choice_draw(k0, k1, c2, c3, stop), ROWS, CHUNK_TILE)


@triton.jit
def greedy_decisions(stat_max_ptr, stat_arg_ptr, requests, greedy, token_ids, valid, in_chain, num_drafts,
                     num_splits, max_drafts, LOGITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K1: tl.constexpr,
                     SPLIT_TILE: tl.constexpr):
    """Stop and token of greedy requests: accept while the draft is the target's argmax, then emit the argmax.

    A row with nothing to choose (max <= 0 for probabilities, -inf for
    logits) has argmax -1, which no valid draft equals.
    """
    positions = tl.arange(0, BLOCK_K1)[None, :]
    greedy_max, greedy_arg = _combine_argmax(stat_max_ptr, stat_arg_ptr, requests, greedy, num_splits, max_drafts,
                                             ROWS, BLOCK_K1, SPLIT_TILE)
    if LOGITS:
        has_choice = greedy_max > -float("inf")
    else:
        has_choice = greedy_max > 0.0
    greedy_arg = tl.where(has_choice, greedy_arg, -1)
    greedy_accept = valid & (token_ids == greedy_arg.to(tl.int64))
    greedy_stop = tl.min(tl.where(in_chain & ~greedy_accept, positions, BLOCK_K1), axis=1)
    greedy_stop = tl.minimum(greedy_stop, num_drafts)
    greedy_token = tl.sum(tl.where(positions == greedy_stop[:, None], greedy_arg, 0), axis=1)
    return greedy_stop, greedy_token


@triton.jit
def write_outputs(output_ptr, num_accepted_ptr, logprobs_ptr, requests, active, stop, token, token_ids, max_drafts,
                  stride_output_b, scored_rows, LOGITS: tl.constexpr, TRUNCATE: tl.constexpr,
                  LOGPROBS: tl.constexpr, BLOCK_K1: tl.constexpr):
    """Accepted drafts, the chosen token at ``stop``, then -1; and ``num_accepted = stop``; with ``LOGPROBS``
    each emitted token's log-probability under its row (``target_logprob``; ``scored_rows`` from the kernel's
    ``_scored_rows``), ``-inf`` where the token is -1 and NaN where its row was not given, in a tensor laid out
    as the tokens."""
    positions = tl.arange(0, BLOCK_K1)[None, :]
    output = tl.where(positions < stop[:, None], token_ids,
                      tl.where(positions == stop[:, None], token[:, None].to(tl.int64), -1))
    written = active[:, None] & (positions <= max_drafts)
    slots = requests[:, None].to(tl.int64) * stride_output_b + positions
    tl.store(output_ptr + slots, output.to(tl.int32), mask=written)
    tl.store(num_accepted_ptr + requests, stop, mask=active)
    if LOGPROBS:
        target_rows, stride_target_k, row_given, greedy, statistics, raw_sum, truncation = scored_rows
        value = emitted_logprob(row_at(target_rows[:, None], positions, stride_target_k), output, written & row_given,
                                statistics, raw_sum, truncation, greedy[:, None], LOGITS, TRUNCATE, LOGPROBS)
        tl.store(logprobs_ptr + slots, tl.where(row_given | (output < 0), value, float("nan")), mask=written)
