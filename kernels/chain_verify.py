"""Fused chain verification: one launch for acceptance, residual sample and bonus.

Design
------
The grid is 1-D: ``WAVES x row_blocks x SPLITS`` programs. A program owns
``ROWS`` requests (several only when the vocabulary is small, so that tiny
vocabularies still give each program a full tile) and one of ``SPLITS``
contiguous slices of the vocabulary, so even ``B = 1`` spreads a 128k
vocabulary over the whole GPU.

Probabilities (one wave). Every program recomputes, for its requests, the
acceptance tests from gathers of ``p(t_i)`` and ``q(t_i)`` (K values: cheaper
than any cross-program exchange) and so knows the stop position ``j``. It then
runs the exponential race (``specdec_kernels/rng.py``) over its slice of row
``j`` only: keys ``E_v / max(0, p_v - q_v)`` and, as the no-mass fallback,
``E_v / p_v`` from the same noise. Rows past ``j`` are never read. The
slice's minimum key and index go to a workspace; an atomic counter per row
block finds the last program to finish, which reduces the ``SPLITS`` partial
results (ties to the lower index, as ``torch.argmin``), writes the outputs and
resets the counter to zero for the next call (so no memset launch is needed).
Greedy requests need the argmax of every row up to the first mismatch, which
no program can know alone: their programs record per-slice maxima of all
``K + 1`` rows, and the last program finishes the decision.

Logits (two waves). The acceptance test needs softmax normalisers of every
row up to the first rejection, which need the whole vocabulary. Wave 1
programs write per-slice ``(max, sum exp)`` of each target and draft row and
the per-slice argmax. Since ``j`` is unknown until every normaliser is in,
wave 1 reads all ``K + 1`` rows, more than the rows ``0..j`` the decision
needs; a chain of per-position waves would read less at the cost of a grid
wait per position. Wave 2 programs wait (spin on an acquire load) until
their row block's wave 1 is complete, combine the normalisers, decide ``j``
and race over their slice of row ``j``; the last wave 2 program writes the
outputs. Wave 2 programs have higher linear ids than every wave 1 program,
and blocks are dispatched in increasing id, so the programs waited on are
always resident or done; the interpreter runs programs in id order too.

Bit-exactness with the reference needs the same IEEE operations: compile with
``enable_fp_fusion=False`` and divide with ``div_rn``.
"""

import triton
import triton.language as tl

from .rng import ACCEPT_STREAM, SAMPLE_STREAM, exponential_from_words, random_words, request_key, uniform_from_word


@triton.jit
def _keep_min(best_key, best_index, key, index):
    """Running (min key, index): strictly smaller keys win, so the lower index keeps ties.

    ``best_index < 0`` marks "nothing yet", so an all-infinite row still
    returns its first index, like ``torch.argmin``.
    """
    better = (key < best_key) | (best_index < 0)
    return tl.where(better, key, best_key), tl.where(better, index, best_index)


@triton.jit
def _keep_max(best_value, best_index, value, index):
    better = (value > best_value) | (best_index < 0)
    return tl.where(better, value, best_value), tl.where(better, index, best_index)


@triton.jit
def _row_pointers(base_ptr, requests, stride_request, position, stride_position):
    # position * stride stays below 2**31 (at most (K + 1) * V elements).
    return base_ptr + requests.to(tl.int64) * stride_request + position * stride_position


@triton.jit
def _scan_rows(
    target_ptr, draft_ptr, requests, row_active, safe_temperature,
    stride_target_b, stride_target_k, stride_draft_b, stride_draft_k,
    num_positions, vocab_lo, vocab_hi,
    LOGITS: tl.constexpr, HAS_DRAFT: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per-slice statistics of every row ``0..K`` of ``[ROWS]`` requests.

    Returns, each ``[ROWS, BLOCK_K1]``: the target row's max and argmax
    (ties to the lower index), and with ``LOGITS`` the online ``sum exp(x/T -
    max)`` of the target row and the max / sum of the draft row.
    """
    positions = tl.arange(0, BLOCK_K1)[None, :]
    target_max = tl.full((ROWS, BLOCK_K1), -float("inf"), tl.float32)
    target_arg = tl.full((ROWS, BLOCK_K1), -1, tl.int32)
    target_sum = tl.zeros((ROWS, BLOCK_K1), tl.float32)
    draft_max = tl.full((ROWS, BLOCK_K1), -float("inf"), tl.float32)
    draft_sum = tl.zeros((ROWS, BLOCK_K1), tl.float32)
    vocab = tl.arange(0, BLOCK_V)[None, :]
    for position in range(0, num_positions):
        row_max = tl.full((ROWS,), -float("inf"), tl.float32)
        row_arg = tl.full((ROWS,), -1, tl.int32)
        row_sum = tl.zeros((ROWS,), tl.float32)
        drow_max = tl.full((ROWS,), -float("inf"), tl.float32)
        drow_sum = tl.zeros((ROWS,), tl.float32)
        target_row = _row_pointers(target_ptr, requests, stride_target_b, position, stride_target_k)[:, None]
        draft_row = _row_pointers(draft_ptr, requests, stride_draft_b, position, stride_draft_k)[:, None]
        for start in range(vocab_lo, vocab_hi, BLOCK_V):
            index = start + vocab
            mask = row_active[:, None] & (index < vocab_hi)
            x = tl.load(target_row + index, mask=mask, other=-float("inf")).to(tl.float32)
            if LOGITS:
                x = tl.math.div_rn(x, safe_temperature[:, None])
            tile_max = tl.max(x, axis=1)
            tile_arg = tl.min(tl.where(x == tile_max[:, None], index, 2147483647), axis=1).to(tl.int32)
            if LOGITS:
                new_max = tl.maximum(row_max, tile_max)
                finite_max = tl.where(new_max == -float("inf"), 0.0, new_max)
                row_sum = row_sum * tl.exp(row_max - finite_max) + tl.sum(
                    tl.exp(x - finite_max[:, None]), axis=1)
                if HAS_DRAFT:
                    draft_mask = mask & ((index * 0 + position) < num_positions - 1)
                    y = tl.load(draft_row + index, mask=draft_mask, other=-float("inf")).to(tl.float32)
                    y = tl.math.div_rn(y, safe_temperature[:, None])
                    new_dmax = tl.maximum(drow_max, tl.max(y, axis=1))
                    finite_dmax = tl.where(new_dmax == -float("inf"), 0.0, new_dmax)
                    drow_sum = drow_sum * tl.exp(drow_max - finite_dmax) + tl.sum(
                        tl.exp(y - finite_dmax[:, None]), axis=1)
                    drow_max = new_dmax
            row_max, row_arg = _keep_max(row_max, row_arg, tile_max, tile_arg)
        here = positions == position
        target_max = tl.where(here, row_max[:, None], target_max)
        target_arg = tl.where(here, row_arg[:, None], target_arg)
        target_sum = tl.where(here, row_sum[:, None], target_sum)
        draft_max = tl.where(here, drow_max[:, None], draft_max)
        draft_sum = tl.where(here, drow_sum[:, None], draft_sum)
    return target_max, target_arg, target_sum, draft_max, draft_sum


@triton.jit
def _race_slice(
    target_ptr, draft_ptr, requests, row_active, stop, stop_token, rejected_valid, safe_temperature,
    target_log_norm, draft_log_norm, k0, k1, c2, c3,
    stride_target_b, stride_target_k, stride_draft_b, stride_draft_k,
    vocab_lo, vocab_hi,
    LOGITS: tl.constexpr, HAS_DRAFT: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Exponential race over one vocabulary slice of row ``stop`` of each request.

    Returns ``[ROWS]`` each: min key and index over the residual
    ``max(0, p - q)`` (or ``p`` where ``rejected_valid`` is false), the same
    over ``p`` (the fallback when the residual has no mass), and whether the
    residual had mass in this slice.
    """
    vocab = tl.arange(0, BLOCK_V)[None, :]
    target_row = _row_pointers(target_ptr, requests, stride_target_b, stop, stride_target_k)[:, None]
    draft_row = _row_pointers(draft_ptr, requests, stride_draft_b, stop, stride_draft_k)[:, None]
    residual_key = tl.full((ROWS,), float("inf"), tl.float32)
    residual_arg = tl.full((ROWS,), -1, tl.int32)
    target_key = tl.full((ROWS,), float("inf"), tl.float32)
    target_arg = tl.full((ROWS,), -1, tl.int32)
    has_mass = tl.zeros((ROWS,), tl.int32)
    subtract = rejected_valid[:, None]
    for start in range(vocab_lo, vocab_hi, BLOCK_V):
        index = start + vocab
        mask = row_active[:, None] & (index < vocab_hi)
        p = tl.load(target_row + index, mask=mask, other=0.0).to(tl.float32)
        if LOGITS:
            p = tl.exp(tl.math.div_rn(p, safe_temperature[:, None]) - target_log_norm[:, None])
            p = tl.where(mask, p, 0.0)
        if HAS_DRAFT:
            q = tl.load(draft_row + index, mask=mask & subtract, other=0.0).to(tl.float32)
            if LOGITS:
                q = tl.exp(tl.math.div_rn(q, safe_temperature[:, None]) - draft_log_norm[:, None])
                q = tl.where(mask & subtract, q, 0.0)
        else:
            q = tl.where(subtract & (index == stop_token[:, None]), 1.0, 0.0)
        mass = tl.where(subtract, tl.maximum(p - q, 0.0), p)
        w0, w1, w2, w3 = random_words(k0[:, None], k1[:, None], c2[:, None], c3[:, None], SAMPLE_STREAM,
                                      stop[:, None], index)
        noise = exponential_from_words(w0, w1, w2, w3)
        # E / 0 is +inf; dividing by 1 instead and selecting +inf gives the
        # same keys without a division by zero (which numpy warns about).
        key_mass = tl.where(mask & (mass > 0.0), tl.math.div_rn(noise, tl.where(mass > 0.0, mass, 1.0)), float("inf"))
        key_target = tl.where(mask & (p > 0.0), tl.math.div_rn(noise, tl.where(p > 0.0, p, 1.0)), float("inf"))
        tile_arg = tl.argmin(key_mass, axis=1, tie_break_left=True)
        tile_key = tl.min(key_mass, axis=1)
        residual_key, residual_arg = _keep_min(residual_key, residual_arg, tile_key, (start + tile_arg).to(tl.int32))
        tile_arg = tl.argmin(key_target, axis=1, tie_break_left=True)
        tile_key = tl.min(key_target, axis=1)
        target_key, target_arg = _keep_min(target_key, target_arg, tile_key, (start + tile_arg).to(tl.int32))
        has_mass = has_mass | tl.max((mask & (mass > 0.0)).to(tl.int32), axis=1)
    return residual_key, residual_arg, target_key, target_arg, has_mass


@triton.jit
def _chain_verify_kernel(
    draft_ids_ptr, target_ptr, draft_ptr, num_drafts_ptr, temperature_ptr,
    seed_ptr, seed_value, offset_ptr, offset_value,
    output_ptr, num_accepted_ptr,
    # workspace, indexed [row_block, split, row] (race) or [row_block, split, row, position] (scans)
    race_key_ptr, race_arg_ptr, fallback_key_ptr, fallback_arg_ptr, has_mass_ptr,
    scan_max_ptr, scan_arg_ptr, scan_sum_ptr, scan_dmax_ptr, scan_dsum_ptr,
    arrivals_ptr,
    batch_size, max_drafts, vocab_size, num_splits, split_size,
    stride_ids_b, stride_target_b, stride_target_k, stride_draft_b, stride_draft_k, stride_output_b,
    HAS_DRAFT: tl.constexpr, HAS_NUM_DRAFTS: tl.constexpr, HAS_TEMPERATURE: tl.constexpr,
    LOGITS: tl.constexpr, SEED_PER_REQUEST: tl.constexpr, OFFSET_FROM_TENSOR: tl.constexpr,
    OFFSET_PER_REQUEST: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    num_row_blocks = tl.cdiv(batch_size, ROWS)
    programs_per_wave = num_row_blocks * num_splits
    wave = pid // programs_per_wave
    row_block = (pid % programs_per_wave) // num_splits
    split = pid % num_splits
    vocab_lo = split * split_size
    vocab_hi = tl.minimum(vocab_lo + split_size, vocab_size)

    requests = row_block * ROWS + tl.arange(0, ROWS)
    active = requests < batch_size
    if HAS_TEMPERATURE:
        temperature = tl.load(temperature_ptr + requests, mask=active, other=1.0)
    else:
        temperature = tl.full((ROWS,), 1.0, tl.float32)
    greedy = active & (temperature == 0.0)
    sampled = active & (temperature != 0.0)
    safe_temperature = tl.where(temperature > 0.0, temperature, 1.0)
    if HAS_NUM_DRAFTS:
        num_drafts = tl.load(num_drafts_ptr + requests, mask=active, other=0)
        num_drafts = tl.minimum(tl.maximum(num_drafts, 0), max_drafts)
    else:
        num_drafts = tl.full((ROWS,), 0, tl.int32) + max_drafts

    if LOGITS:
        if wave == 0:
            # Wave 1: publish this slice's statistics of every row (release).
            _scan_and_store(
                target_ptr, draft_ptr, requests, active, safe_temperature,
                scan_max_ptr, scan_arg_ptr, scan_sum_ptr, scan_dmax_ptr, scan_dsum_ptr,
                row_block, split, num_splits, max_drafts, vocab_lo, vocab_hi,
                stride_target_b, stride_target_k, stride_draft_b, stride_draft_k,
                LOGITS, HAS_DRAFT, ROWS, BLOCK_K1, BLOCK_V,
            )
            tl.atomic_add(arrivals_ptr + row_block, 1, sem="release")
        else:
            # Wave 2: wait until wave 1 of this row block has published.
            while tl.atomic_add(arrivals_ptr + row_block, 0, sem="acquire") < num_splits:
                pass
            _decide_and_race(
                target_ptr, draft_ptr, seed_ptr, seed_value, offset_ptr, offset_value,
                output_ptr, num_accepted_ptr,
                race_key_ptr, race_arg_ptr, fallback_key_ptr, fallback_arg_ptr, has_mass_ptr,
                scan_max_ptr, scan_arg_ptr, scan_sum_ptr, scan_dmax_ptr, scan_dsum_ptr, arrivals_ptr,
                draft_ids_ptr, requests, active, greedy, sampled, safe_temperature, num_drafts,
                row_block, split, num_splits, max_drafts, vocab_size, vocab_lo, vocab_hi, stride_ids_b,
                stride_target_b, stride_target_k, stride_draft_b, stride_draft_k, stride_output_b,
                HAS_DRAFT, LOGITS, SEED_PER_REQUEST, OFFSET_FROM_TENSOR, OFFSET_PER_REQUEST,
                ROWS, BLOCK_K1, BLOCK_V,
            )
    else:
        if tl.max(greedy.to(tl.int32), axis=0) > 0:
            _scan_and_store(
                target_ptr, draft_ptr, requests, greedy, safe_temperature,
                scan_max_ptr, scan_arg_ptr, scan_sum_ptr, scan_dmax_ptr, scan_dsum_ptr,
                row_block, split, num_splits, max_drafts, vocab_lo, vocab_hi,
                stride_target_b, stride_target_k, stride_draft_b, stride_draft_k,
                LOGITS, HAS_DRAFT, ROWS, BLOCK_K1, BLOCK_V,
            )
        _decide_and_race(
            target_ptr, draft_ptr, seed_ptr, seed_value, offset_ptr, offset_value,
            output_ptr, num_accepted_ptr,
            race_key_ptr, race_arg_ptr, fallback_key_ptr, fallback_arg_ptr, has_mass_ptr,
            scan_max_ptr, scan_arg_ptr, scan_sum_ptr, scan_dmax_ptr, scan_dsum_ptr, arrivals_ptr,
            draft_ids_ptr, requests, active, greedy, sampled, safe_temperature, num_drafts,
            row_block, split, num_splits, max_drafts, vocab_size, vocab_lo, vocab_hi, stride_ids_b,
            stride_target_b, stride_target_k, stride_draft_b, stride_draft_k, stride_output_b,
            HAS_DRAFT, LOGITS, SEED_PER_REQUEST, OFFSET_FROM_TENSOR, OFFSET_PER_REQUEST,
            ROWS, BLOCK_K1, BLOCK_V,
        )


@triton.jit
def _scan_and_store(
    target_ptr, draft_ptr, requests, rows_to_scan, safe_temperature,
    scan_max_ptr, scan_arg_ptr, scan_sum_ptr, scan_dmax_ptr, scan_dsum_ptr,
    row_block, split, num_splits, max_drafts, vocab_lo, vocab_hi,
    stride_target_b, stride_target_k, stride_draft_b, stride_draft_k,
    LOGITS: tl.constexpr, HAS_DRAFT: tl.constexpr, ROWS: tl.constexpr, BLOCK_K1: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row_max, row_arg, row_sum, drow_max, drow_sum = _scan_rows(
        target_ptr, draft_ptr, requests, rows_to_scan, safe_temperature,
        stride_target_b, stride_target_k, stride_draft_b, stride_draft_k,
        max_drafts + 1, vocab_lo, vocab_hi,
        LOGITS, HAS_DRAFT, ROWS, BLOCK_K1, BLOCK_V,
    )
    positions = tl.arange(0, BLOCK_K1)[None, :]
    scan_slot = ((row_block * num_splits + split) * ROWS + tl.arange(0, ROWS))[:, None] * BLOCK_K1 + positions
    tl.store(scan_max_ptr + scan_slot, row_max)
    tl.store(scan_arg_ptr + scan_slot, row_arg)
    if LOGITS:
        tl.store(scan_sum_ptr + scan_slot, row_sum)
        tl.store(scan_dmax_ptr + scan_slot, drow_max)
        tl.store(scan_dsum_ptr + scan_slot, drow_sum)


@triton.jit
def _decide_and_race(
    target_ptr, draft_ptr, seed_ptr, seed_value, offset_ptr, offset_value,
    output_ptr, num_accepted_ptr,
    race_key_ptr, race_arg_ptr, fallback_key_ptr, fallback_arg_ptr, has_mass_ptr,
    scan_max_ptr, scan_arg_ptr, scan_sum_ptr, scan_dmax_ptr, scan_dsum_ptr, arrivals_ptr,
    draft_ids_ptr, requests, active, greedy, sampled, safe_temperature, num_drafts,
    row_block, split, num_splits, max_drafts, vocab_size, vocab_lo, vocab_hi, stride_ids_b,
    stride_target_b, stride_target_k, stride_draft_b, stride_draft_k, stride_output_b,
    HAS_DRAFT: tl.constexpr, LOGITS: tl.constexpr, SEED_PER_REQUEST: tl.constexpr,
    OFFSET_FROM_TENSOR: tl.constexpr, OFFSET_PER_REQUEST: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Acceptance tests, the race over this slice of the stop row, and (last program) the outputs."""
    # Draft ids and their validity: [ROWS, BLOCK_K1] (column K is the bonus slot).
    positions = tl.arange(0, BLOCK_K1)[None, :]
    in_chain = active[:, None] & (positions < num_drafts[:, None])
    token_ids = tl.load(draft_ids_ptr + requests[:, None].to(tl.int64) * stride_ids_b + positions,
                        mask=in_chain, other=-1).to(tl.int64)
    valid = in_chain & (token_ids >= 0) & (token_ids < vocab_size)
    safe_ids = tl.where(valid, token_ids, 0)

    k0, k1, c2, c3 = request_key(seed_ptr, seed_value, offset_ptr, offset_value, requests, active,
                                 SEED_PER_REQUEST, OFFSET_FROM_TENSOR, OFFSET_PER_REQUEST)

    # Acceptance of sampled requests at every position (gathers only).
    target_at = tl.load((target_ptr + requests.to(tl.int64) * stride_target_b)[:, None]
                        + positions.to(tl.int64) * stride_target_k + safe_ids, mask=valid, other=0.0).to(tl.float32)
    if HAS_DRAFT:
        draft_at = tl.load((draft_ptr + requests.to(tl.int64) * stride_draft_b)[:, None]
                           + positions.to(tl.int64) * stride_draft_k + safe_ids, mask=valid, other=0.0).to(tl.float32)
    else:
        draft_at = tl.full((ROWS, BLOCK_K1), 1.0, tl.float32)
    target_log_norm = tl.zeros((ROWS, BLOCK_K1), tl.float32)
    draft_log_norm = tl.zeros((ROWS, BLOCK_K1), tl.float32)
    if LOGITS:
        target_log_norm, draft_log_norm = _combine_normalisers(
            scan_max_ptr, scan_sum_ptr, scan_dmax_ptr, scan_dsum_ptr, row_block, num_splits, ROWS, BLOCK_K1)
        target_at = tl.where(valid, tl.exp(tl.math.div_rn(target_at, safe_temperature[:, None]) - target_log_norm),
                             0.0)
        if HAS_DRAFT:
            draft_at = tl.where(valid, tl.exp(tl.math.div_rn(draft_at, safe_temperature[:, None]) - draft_log_norm),
                                0.0)
    w0, w1, w2, w3 = random_words(k0[:, None], k1[:, None], c2[:, None], c3[:, None], ACCEPT_STREAM, positions,
                                  tl.zeros((ROWS, BLOCK_K1), tl.int32))
    accepted = valid & (uniform_from_word(w0) * draft_at < target_at)
    stop = tl.min(tl.where(in_chain & ~accepted, positions, BLOCK_K1), axis=1)
    stop = tl.minimum(stop, num_drafts)
    at_stop = positions == stop[:, None]
    rejected_valid = sampled & (tl.max((at_stop & valid).to(tl.int32), axis=1) > 0)
    stop_token = tl.sum(tl.where(at_stop, safe_ids, 0), axis=1)
    stop_target_norm = tl.sum(tl.where(at_stop, target_log_norm, 0.0), axis=1)
    stop_draft_norm = tl.sum(tl.where(at_stop, draft_log_norm, 0.0), axis=1)

    race_slot = (row_block * num_splits + split) * ROWS + tl.arange(0, ROWS)
    if tl.max(sampled.to(tl.int32), axis=0) > 0:
        residual_key, residual_arg, target_key, target_arg, has_mass = _race_slice(
            target_ptr, draft_ptr, requests, sampled, stop, stop_token, rejected_valid, safe_temperature,
            stop_target_norm, stop_draft_norm, k0, k1, c2, c3,
            stride_target_b, stride_target_k, stride_draft_b, stride_draft_k,
            vocab_lo, vocab_hi, LOGITS, HAS_DRAFT, ROWS, BLOCK_V,
        )
        tl.store(race_key_ptr + race_slot, residual_key)
        tl.store(race_arg_ptr + race_slot, residual_arg)
        tl.store(fallback_key_ptr + race_slot, target_key)
        tl.store(fallback_arg_ptr + race_slot, target_arg)
        tl.store(has_mass_ptr + race_slot, has_mass)

    # The last program of the row block (over both waves) combines the slices
    # and resets the counter for the next call.
    arrived = tl.atomic_add(arrivals_ptr + row_block, 1, sem="acq_rel")
    if LOGITS:
        last = num_splits * 2 - 1
    else:
        last = num_splits - 1
    if arrived == last:
        tl.atomic_xchg(arrivals_ptr + row_block, 0, sem="relaxed")
        _finish(
            race_key_ptr, race_arg_ptr, fallback_key_ptr, fallback_arg_ptr, has_mass_ptr,
            scan_max_ptr, scan_arg_ptr, output_ptr, num_accepted_ptr,
            requests, active, greedy, stop, token_ids, positions, row_block, num_splits, stride_output_b,
            max_drafts, in_chain, ROWS, BLOCK_K1,
        )


@triton.jit
def _combine_normalisers(scan_max_ptr, scan_sum_ptr, scan_dmax_ptr, scan_dsum_ptr, row_block, num_splits,
                         ROWS: tl.constexpr, BLOCK_K1: tl.constexpr):
    """``log(sum exp)`` of every target and draft row from the per-slice statistics."""
    slot = (tl.arange(0, ROWS)[:, None] * BLOCK_K1 + tl.arange(0, BLOCK_K1)[None, :])
    target_max = tl.full((ROWS, BLOCK_K1), -float("inf"), tl.float32)
    draft_max = tl.full((ROWS, BLOCK_K1), -float("inf"), tl.float32)
    for split in range(0, num_splits):
        base = (row_block * num_splits + split) * ROWS * BLOCK_K1
        target_max = tl.maximum(target_max, tl.load(scan_max_ptr + base + slot, cache_modifier=".cg"))
        draft_max = tl.maximum(draft_max, tl.load(scan_dmax_ptr + base + slot, cache_modifier=".cg"))
    target_max = tl.where(target_max == -float("inf"), 0.0, target_max)
    draft_max = tl.where(draft_max == -float("inf"), 0.0, draft_max)
    target_sum = tl.zeros((ROWS, BLOCK_K1), tl.float32)
    draft_sum = tl.zeros((ROWS, BLOCK_K1), tl.float32)
    for split in range(0, num_splits):
        base = (row_block * num_splits + split) * ROWS * BLOCK_K1
        target_sum += tl.load(scan_sum_ptr + base + slot, cache_modifier=".cg") * tl.exp(
            tl.load(scan_max_ptr + base + slot, cache_modifier=".cg") - target_max)
        draft_sum += tl.load(scan_dsum_ptr + base + slot, cache_modifier=".cg") * tl.exp(
            tl.load(scan_dmax_ptr + base + slot, cache_modifier=".cg") - draft_max)
    return target_max + tl.log(target_sum), draft_max + tl.log(draft_sum)


@triton.jit
def _finish(
    race_key_ptr, race_arg_ptr, fallback_key_ptr, fallback_arg_ptr, has_mass_ptr,
    scan_max_ptr, scan_arg_ptr, output_ptr, num_accepted_ptr,
    requests, active, greedy, stop, token_ids, positions, row_block, num_splits, stride_output_b,
    max_drafts, in_chain, ROWS: tl.constexpr, BLOCK_K1: tl.constexpr,
):
    """Reduce the slices (lower split wins ties) and write the outputs of the row block."""
    rows = tl.arange(0, ROWS)
    residual_key = tl.full((ROWS,), float("inf"), tl.float32)
    residual_arg = tl.full((ROWS,), -1, tl.int32)
    target_key = tl.full((ROWS,), float("inf"), tl.float32)
    target_arg = tl.full((ROWS,), -1, tl.int32)
    has_mass = tl.zeros((ROWS,), tl.int32)
    greedy_max = tl.full((ROWS, BLOCK_K1), -float("inf"), tl.float32)
    greedy_arg = tl.full((ROWS, BLOCK_K1), -1, tl.int32)
    for split in range(0, num_splits):
        slot = (row_block * num_splits + split) * ROWS + rows
        residual_key, residual_arg = _keep_min(
            residual_key, residual_arg, tl.load(race_key_ptr + slot, cache_modifier=".cg"),
            tl.load(race_arg_ptr + slot, cache_modifier=".cg"))
        target_key, target_arg = _keep_min(
            target_key, target_arg, tl.load(fallback_key_ptr + slot, cache_modifier=".cg"),
            tl.load(fallback_arg_ptr + slot, cache_modifier=".cg"))
        has_mass = has_mass | tl.load(has_mass_ptr + slot, cache_modifier=".cg")
        scan_slot = slot[:, None] * BLOCK_K1 + positions
        greedy_max, greedy_arg = _keep_max(
            greedy_max, greedy_arg, tl.load(scan_max_ptr + scan_slot, mask=greedy[:, None], other=-float("inf"),
                                            cache_modifier=".cg"),
            tl.load(scan_arg_ptr + scan_slot, mask=greedy[:, None], other=-1, cache_modifier=".cg"))
    sampled_token = tl.where(has_mass > 0, residual_arg, target_arg)

    # Greedy requests: accept while the draft is the target's argmax.
    greedy_stop = tl.min(tl.where(in_chain & (token_ids != greedy_arg.to(tl.int64)), positions, BLOCK_K1), axis=1)
    num_drafts_here = tl.sum(in_chain.to(tl.int32), axis=1)
    greedy_stop = tl.minimum(greedy_stop, num_drafts_here)
    greedy_token = tl.sum(tl.where(positions == greedy_stop[:, None], greedy_arg, 0), axis=1)

    final_stop = tl.where(greedy, greedy_stop, stop)
    token = tl.where(greedy, greedy_token, sampled_token)
    output = tl.where(positions < final_stop[:, None], token_ids,
                      tl.where(positions == final_stop[:, None], token[:, None].to(tl.int64), -1))
    width = max_drafts + 1
    tl.store(output_ptr + requests[:, None].to(tl.int64) * stride_output_b + positions, output.to(tl.int32),
             mask=active[:, None] & (positions < width))
    tl.store(num_accepted_ptr + requests, final_stop, mask=active)
