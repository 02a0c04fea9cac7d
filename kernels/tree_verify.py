"""Fused tree verification: one launch walks every request's draft tree.

Design
------
A program owns ``ROWS`` requests (one on GPUs, see the launcher; thousands
under the interpreter; small batches share one request among several
programs, see "Small batches" below) and walks their trees as the reference
defines it
(``specdec_kernels/reference/tree_verify.py``), all rows in step: from the
current node each row tries its children in increasing index, each found by
a vectorised min over a tile of ``parents`` (:func:`_next_child`), never a
serial scan of the ``N`` nodes.

Only what is needed is read. With probabilities an acceptance test is two
gathers, ``p(t)`` and ``q(t)``. A rejection needs the whole normalised
residual ``float32(W * r)`` (``r`` the reciprocal of the exact integer
total of the fixed-point weights ``W``), so it makes one pass over the
vocabulary (:func:`_rejection_pass`) for its totals and leaves the
rejection *pending*: the rows are transformed where they are next read
(:func:`_pending_rows`). If the next child is accepted, nothing more is
read at this node; if it is rejected too, its pass also writes the current
rows out to the request's scratch rows (``[B, 1 or 2, V]`` float32 in the
workspace: ``p``, and ``q`` when the rejected token leaves the proposal),
which become the base the next pending rejection applies to; the final
sample applies the last one. So ``k`` rejections at a node cost ``k``
passes (and the sample one more), and the scratch rows stay in L2 for
batches that fit. A full row is read only where a child is rejected, where
the final token is sampled, and with logits or greedy requests (a softmax
normaliser or an argmax needs the row). Nothing ``[B, N, V]`` is written.

The final token is the fixed-point sampler on the current ``p``
(``kernels/sampling.py``), chunk by chunk, so the bits are the
reference's whatever the tile: ``normalise`` and the sampler are exact
integer sums, and each normalised entry is a float64 product with the
row's correctly rounded float32 reciprocal, then one rounding to float32.

Small batches (split plan, ``SPLIT``). ``splits`` programs share each
request (about one program per SM in all, ``launchers/tree_verify.py``).
Every program walks the whole tree: the acceptance tests are gathers. A
node entered whose rows are needed whole (the statistics of logits rows,
a greedy argmax, truncation thresholds) is an *entry* stage: the first
program to take it computes them with the one-program code (the same bits)
and publishes them; the others wait for them. The vocabulary passes, each
rejection's totals and the final sample's chunks, are stages shared through records
in the workspace (``kernels/stage_records.py``, ``kernels/tree_verify_stages.py``): a program takes
slices of whole sampler chunks from the stage's counter until none is left,
adds its slices' integer totals atomically, publishes, and waits until
every slice is published. A slice is taken only by a running program, so a
wait never depends on a program that has not started (the interpreter, which
runs programs one after another, has the first program take every slice).
Because a program may start long after the others have moved on, nothing
it reads may have been overwritten: there are no scratch rows in this plan;
the current rows are the input rows with the node's rejections *replayed*
in order (:func:`_replayed_rows`), the same float32 maps the one-program
plan applies, so the same bits. Every program derives each rejection from
the stage's totals itself and keeps the node's rejections in registers
(``REPLAY_SLOTS`` of them, bounded by the tree size), so a pass reads no
record per tile: ``k`` rejections at a node cost ``k`` passes of ``O(k)``
arithmetic per entry and no record loads. Only the request's
first program stores outputs; its last to end zeroes the records.

Ordering. Within a program, ``tl.debug_barrier()`` orders the scratch,
chunk and record writes before other threads read them, and those reads
bypass L1 (``.cg``). Across programs (split plan only), every release is
preceded by a barrier, so the whole program's stores are issued first, and
every acquire is followed by one (``wait_for``). A wait is bounded: past
its poll limit it gives up, counts the fault (``specdec_kernels/_faults.py``)
and marks the request failed in its end record; the request's last program
then stores the failure outcome (tokens -1, ``num_accepted`` 0) and, as on
every path, zeroes every record a program of the request used.
Offsets that multiply a stride are 64-bit.
"""

import triton
import triton.language as tl

from .chain_verify_rows import (RAW_LOGPROBS, acceptance, drawn_from_draft, emitted_logprob, inverse_norm,
                                proposal_probability, request_temperatures, row_pointers, row_statistics,
                                target_probability)
from .rng import ACCEPT_STREAM, random_words, request_key
from .sampling import (choice_draw, choose_chunk, chunk_draw, chunk_pick, chunk_sums, fixed_point,
                       normaliser_reciprocal, split_sums)
from .faults import TREE_WAIT_GAVE_UP
from .stage_records import STAGE_WORDS, publish, take_slice, wait_for_stage
from .tree_verify_stages import (FAILED_WORD, begin_request, end_record, end_request, entry_statistics,
                                 publish_entry, publish_slice, replay_rejection, replayed_rejection, stage_totals)
from .truncation import any_truncation, row_truncation, truncation_parameters

RESIDUAL_HAD_MASS = tl.constexpr(1)  # pending_kind's flags
POINT_MASS = tl.constexpr(2)

@triton.jit
def _next_child(parents_ptr, ids_ptr, requests, active, node, last, limit, vocab_size,
                stride_parents_b, stride_parents_n, stride_ids_b, stride_ids_n, BLOCK_N: tl.constexpr):
    """Per row, the smallest ``i`` in ``(last, limit)`` with ``parents[i] == node`` and a token in ``[0, V)``; else ``limit``.

    ``last >= node``, so every match lies after ``node`` and a parent outside
    ``[0, i)`` never matches. The scan starts at the tile of the smallest
    ``last + 1`` of the program's rows.
    """
    nodes = tl.arange(0, BLOCK_N)[None, :]
    parents_row = row_pointers(parents_ptr, requests, stride_parents_b, 0, 0)[:, None]
    ids_row = row_pointers(ids_ptr, requests, stride_ids_b, 0, 0)[:, None]
    searching = active & (last < limit)
    child = limit
    first = tl.min(tl.where(searching, last + 1, 2147483647), axis=0) // BLOCK_N * BLOCK_N
    for start in range(first, tl.max(tl.where(searching, limit, 0), axis=0), BLOCK_N):
        index = start + nodes
        mask = searching[:, None] & (index > last[:, None]) & (index < limit[:, None])
        parent = tl.load(parents_row + index.to(tl.int64) * stride_parents_n, mask=mask, other=-1)
        token = tl.load(ids_row + index.to(tl.int64) * stride_ids_n, mask=mask, other=-1).to(tl.int64)
        found = mask & (parent == node[:, None]) & (token >= 0) & (token < vocab_size)
        child = tl.minimum(child, tl.min(tl.where(found, index, 2147483647), axis=1))
    return child


@triton.jit
def _row_values(row, scratch, index, mask, from_scratch, row_max, row_inverse_norm, inverse_temperature,
                truncation_threshold, truncation_reciprocal, truncating, LOGITS: tl.constexpr,
                TRUNCATE: tl.constexpr):
    """float32 probabilities at ``index`` of each row's current ``p`` (or ``q``): its scratch row, or the input row.

    ``from_scratch`` says which, per row (a mask, so each element is read
    from one of the two). An input row of logits becomes
    ``exp((x - max) / T) / sum`` with the row's statistics; masked lanes come
    out 0 or NaN, which weigh 0. With ``TRUNCATE`` an input row becomes its
    top-k/top-p/min-p truncation where ``truncating`` (scratch rows already are).
    """
    stored = tl.load(scratch + index, mask=mask & from_scratch, other=0.0, cache_modifier=".cg")
    given = target_probability(row, index, mask & (from_scratch == 0), (row_max, row_inverse_norm, inverse_temperature),
                               (truncation_threshold, truncation_reciprocal, truncating != 0), LOGITS, TRUNCATE)
    return tl.where(from_scratch, stored, given)


@triton.jit
def _draft_values(row, scratch, index, mask, from_scratch):
    """:func:`_row_values` of the current ``q``: a draft row is always probabilities (``logits`` covers the
    target only, contract v1.3), never truncated, so no statistics."""
    return _row_values(row, scratch, index, mask, from_scratch, 0.0, 0.0, 1.0, 0, 0.0, 0, False, False)


@triton.jit
def _replayed_rows(target_row, draft_row, index, mask, q_mask, p_max, p_inverse_norm,
                   inverse_temperature, token, truncation_threshold, truncation_reciprocal, truncating,
                   replay_tokens, replay_reciprocals, replayed, LOGITS: tl.constexpr, HAS_DRAFT: tl.constexpr,
                   REMOVE_DRAWN: tl.constexpr, TRUNCATE: tl.constexpr):
    """Split plan: the current ``p`` and ``q`` at ``index``, the input rows with the ``replayed`` rejections of
    the current node applied in order, from the program's replay registers (:func:`replay_rejection`).

    Each rejection applies the same float32 map as a pending rejection of
    :func:`_pending_rows`, so the values are bit for bit those of the rows the
    one-program plan writes out. Nothing is written: the rows a late program
    replays are the inputs, which never change. ``q_mask`` is on wherever a
    replayed residual needs ``q`` (the caller knows the node had rejections).
    """
    never = index != index
    p = _row_values(target_row, target_row, index, mask, never, p_max, p_inverse_norm, inverse_temperature,
                    truncation_threshold, truncation_reciprocal, truncating, LOGITS, TRUNCATE)
    q = p
    if HAS_DRAFT:
        q = _draft_values(draft_row, draft_row, index, q_mask, never)
    for slot in range(0, replayed):
        rejected, residual, point_mass, p_reciprocal, q_reciprocal = replayed_rejection(
            replay_tokens, replay_reciprocals, slot)
        if HAS_DRAFT:
            tried = tl.where(point_mass != 0, tl.where(index == rejected, 1.0, 0.0), q)
        else:
            tried = tl.where(index == rejected, 1.0, 0.0)
        weights = tl.where(residual != 0, fixed_point(p - tried), fixed_point(p))
        p = (weights.to(tl.float64) * p_reciprocal).to(tl.float32)
        if REMOVE_DRAWN:  # a deterministic candidate was not drawn: q stays
            removed = (fixed_point(tl.where(index == rejected, 0.0, q)).to(tl.float64) * q_reciprocal).to(tl.float32)
            q = tl.where(point_mass != 0, q, removed)
    if not HAS_DRAFT:
        q = tl.where(index == token, 1.0, 0.0)
    return p, q


@triton.jit
def _pending_rows(target_row, draft_row, p_scratch, q_scratch, index, mask, q_mask, from_scratch,
                  p_max, p_inverse_norm, inverse_temperature,
                  pending, pending_token, pending_residual, pending_point_mass, p_reciprocal, q_reciprocal, token,
                  truncation_threshold, truncation_reciprocal, truncating,
                  LOGITS: tl.constexpr, HAS_DRAFT: tl.constexpr, REMOVE_DRAWN: tl.constexpr, TRUNCATE: tl.constexpr):
    """The current ``p`` and the proposal ``q`` that ``token`` was drawn from, at ``index``.

    The base rows (the inputs, or the scratch rows where ``from_scratch``)
    become the current ones through the rejection pending on each row (where
    ``pending``): ``p = float32(W * r_p)``, ``W`` the fixed-point residual
    against the proposal of ``pending_token`` (or of ``p`` where the residual
    had no mass; the point mass on ``pending_token`` where
    ``pending_point_mass``, a deterministic candidate), and, removing the
    drawn token, ``q`` likewise (not after a deterministic candidate). These are
    the rows ``_sampling.normalise`` gives the reference, computed where they
    are read instead of written out first. Without a draft the proposal is
    one-hot on ``token``. ``q_mask`` masks the draft reads: a caller that
    needs only ``p`` reads the draft only where a rejection is pending.
    """
    p = _row_values(target_row, p_scratch, index, mask, from_scratch, p_max, p_inverse_norm, inverse_temperature,
                    truncation_threshold, truncation_reciprocal, truncating, LOGITS, TRUNCATE)
    if HAS_DRAFT:
        if REMOVE_DRAWN:
            q_from_scratch = from_scratch
        else:
            q_from_scratch = from_scratch != from_scratch  # with replacement q is never rewritten
        q = _draft_values(draft_row, q_scratch, index, q_mask, q_from_scratch)
        tried = tl.where(pending_point_mass != 0, tl.where(index == pending_token, 1.0, 0.0), q)
    else:
        tried = tl.where(index == pending_token, 1.0, 0.0)
    # fixed_point maps the negatives and NaNs of p - q to 0: max(0, p - q) in one step.
    weights = tl.where(pending_residual != 0, fixed_point(p - tried), fixed_point(p))
    p = tl.where(pending != 0, (weights.to(tl.float64) * p_reciprocal).to(tl.float32), p)
    if HAS_DRAFT:
        if REMOVE_DRAWN:
            drawn = fixed_point(tl.where(index == pending_token, 0.0, q))
            q = tl.where((pending != 0) & (pending_point_mass == 0), (drawn.to(tl.float64) * q_reciprocal).to(tl.float32),
                         q)
    else:
        q = tl.where(index == token, 1.0, 0.0)
    return p, q


@triton.jit
def _current_rows(target_row, draft_row, p_scratch, q_scratch, index, mask, q_mask, from_scratch,
                  p_max, p_inverse_norm, inverse_temperature,
                  pending, pending_token, pending_residual, pending_point_mass, p_reciprocal, q_reciprocal, token,
                  truncation_threshold, truncation_reciprocal, truncating, replay_tokens, replay_reciprocals, replayed,
                  LOGITS: tl.constexpr, HAS_DRAFT: tl.constexpr, REMOVE_DRAWN: tl.constexpr, TRUNCATE: tl.constexpr,
                  SPLIT: tl.constexpr):
    """The current ``p`` and ``q`` at ``index``: :func:`_replayed_rows` with ``SPLIT``, else :func:`_pending_rows`."""
    if SPLIT:
        p, q = _replayed_rows(target_row, draft_row, index, mask, q_mask, p_max, p_inverse_norm,
                              inverse_temperature, token, truncation_threshold,
                              truncation_reciprocal, truncating, replay_tokens, replay_reciprocals, replayed,
                              LOGITS, HAS_DRAFT, REMOVE_DRAWN, TRUNCATE)
    else:
        p, q = _pending_rows(target_row, draft_row, p_scratch, q_scratch, index, mask, q_mask, from_scratch,
                             p_max, p_inverse_norm, inverse_temperature,
                             pending, pending_token, pending_residual, pending_point_mass, p_reciprocal, q_reciprocal,
                             token, truncation_threshold, truncation_reciprocal, truncating,
                             LOGITS, HAS_DRAFT, REMOVE_DRAWN, TRUNCATE)
    return p, q


@triton.jit
def _rejection_pass(target_row, draft_row, p_scratch, q_scratch, rejecting, writing, from_scratch,
                    p_max, p_inverse_norm, inverse_temperature,
                    pending, pending_token, pending_residual, pending_point_mass, p_reciprocal, q_reciprocal, token,
                    point_mass,
                    truncation_threshold, truncation_reciprocal, truncating, replay_tokens, replay_reciprocals, replayed,
                    first, end, LOGITS: tl.constexpr, HAS_DRAFT: tl.constexpr, REMOVE_DRAWN: tl.constexpr,
                    TRUNCATE: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    """One pass over the rejecting rows' entries ``[first, end)``: the split totals of the fixed-point weights of
    ``max(0, p - q)``, of ``p`` and of ``q`` without ``token``, for the current ``p`` and ``q`` (``q`` the
    point mass on ``token`` in the residual where ``point_mass``: a deterministic candidate).

    Rows that are ``writing`` (a rejection was already pending) also store
    their current rows in the scratch rows, which become their base. Each
    tile is read before it is overwritten, so the scratch rows may be both
    the source and the destination. Row arguments are ``[ROWS, 1]``.
    """
    vocab = tl.arange(0, BLOCK_V)[None, :]
    residual_high = tl.zeros((ROWS,), tl.int64)
    residual_low = tl.zeros((ROWS,), tl.int64)
    target_high = tl.zeros((ROWS,), tl.int64)
    target_low = tl.zeros((ROWS,), tl.int64)
    drawn_high = tl.zeros((ROWS,), tl.int64)
    drawn_low = tl.zeros((ROWS,), tl.int64)
    for start in range(first, end, BLOCK_V):
        index = start + vocab
        mask = rejecting & (index < end)
        p, q = _current_rows(target_row, draft_row, p_scratch, q_scratch, index, mask, mask, from_scratch,
                             p_max, p_inverse_norm, inverse_temperature,
                             pending, pending_token, pending_residual, pending_point_mass, p_reciprocal, q_reciprocal,
                             token, truncation_threshold, truncation_reciprocal, truncating,
                             replay_tokens, replay_reciprocals, replayed, LOGITS, HAS_DRAFT, REMOVE_DRAWN, TRUNCATE, SPLIT)
        tl.store(p_scratch + index, p, mask=mask & writing)
        if REMOVE_DRAWN:
            tl.store(q_scratch + index, q, mask=mask & writing)
        tried = q
        if HAS_DRAFT:
            tried = tl.where(point_mass != 0, tl.where(index == token, 1.0, 0.0), q)
        high, low = split_sums(fixed_point(p - tried))
        residual_high += high
        residual_low += low
        high, low = split_sums(fixed_point(p))
        target_high += high
        target_low += low
        if REMOVE_DRAWN:
            high, low = split_sums(fixed_point(tl.where(index == token, 0.0, q)))
            drawn_high += high
            drawn_low += low
    return residual_high, residual_low, target_high, target_low, drawn_high, drawn_low


@triton.jit
def _sample_chunks(target_row, draft_row, p_scratch, q_scratch, sampled, from_scratch, p_max, p_inverse_norm,
                   inverse_temperature, pending, pending_token, pending_residual, pending_point_mass,
                   p_reciprocal, q_reciprocal, truncation_threshold, truncation_reciprocal, truncating,
                   replay_tokens, replay_reciprocals, replayed, chunk_total_ptr, chunk_pick_ptr, slot, k0, k1, c2, c3, node,
                   first_chunk, end_chunk, vocab_size, LOGITS: tl.constexpr, HAS_DRAFT: tl.constexpr,
                   REMOVE_DRAWN: tl.constexpr, TRUNCATE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_V: tl.constexpr):
    """The fixed-point sampler's chunk total and candidate of each row's current ``p`` at position ``node``,
    for chunks ``[first_chunk, end_chunk)``, stored at ``slot + chunk``.

    ``BLOCK_V`` is the sampler's chunk (or the whole vocabulary below one):
    one tile per chunk. Row arguments are ``[ROWS, 1]``.
    """
    vocab = tl.arange(0, BLOCK_V)[None, :]
    for chunk in range(first_chunk, end_chunk):
        index = chunk * BLOCK_V + vocab
        mask = sampled[:, None] & (index < vocab_size)
        p, _ = _current_rows(target_row, draft_row, p_scratch, q_scratch, index, mask, mask & (pending != 0),
                             from_scratch, p_max, p_inverse_norm, inverse_temperature,
                             pending, pending_token, pending_residual, pending_point_mass, p_reciprocal, q_reciprocal,
                             pending_token, truncation_threshold, truncation_reciprocal, truncating,
                             replay_tokens, replay_reciprocals, replayed, LOGITS, HAS_DRAFT, REMOVE_DRAWN, TRUNCATE, SPLIT)
        total, offset = chunk_pick(fixed_point(p), chunk_draw(k0, k1, c2, c3, node, chunk))
        tl.store(chunk_total_ptr + slot + chunk, total, mask=sampled)
        tl.store(chunk_pick_ptr + slot + chunk, chunk * BLOCK_V + offset, mask=sampled)


@triton.jit
def _choose_sample(chunk_total_ptr, chunk_pick_ptr, slot, sampled, k0, k1, c2, c3, node, num_chunks,
                   ROWS: tl.constexpr, CHUNK_TILE: tl.constexpr):
    """The fixed-point sample from the chunk results at ``slot`` (every chunk stored): 128-bit chunk choice;
    -1 without mass."""
    tl.debug_barrier()  # the chunk results, visible to every thread
    high31, low31 = chunk_sums(chunk_total_ptr, slot, sampled, num_chunks, ROWS, CHUNK_TILE)
    return choose_chunk(chunk_total_ptr, chunk_pick_ptr, slot, sampled, num_chunks, high31, low31,
                        choice_draw(k0, k1, c2, c3, node), ROWS, CHUNK_TILE)


@triton.jit
def _node_statistics(target_row, needs_statistics, needs_threshold, inverse_temperature, parameters, vocab_size,
                     p_max, p_inverse_norm, greedy_token, truncation_threshold, truncation_reciprocal, p_raw_sum,
                     LOGITS: tl.constexpr, TRUNCATE: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr, LOGPROBS: tl.constexpr):
    """What a node entered needs from its whole target rows, each read by this program: the statistics
    ``(p_max, p_inverse_norm, greedy_token)`` where ``needs_statistics``, then the truncation
    ``(threshold, reciprocal)`` where ``needs_threshold``, and with ``LOGPROBS`` the raw scores' sum at
    ``T = 1`` (``row_statistics``; ``"processed"``: the sum at ``1 / T``, which only greedy requests, at
    ``T = 1``, score with); the other rows keep the values given. The draft rows need none: they are
    probabilities (contract v1.3)."""
    if tl.max(needs_statistics.to(tl.int32), axis=0) > 0:
        row_max, row_arg, row_sum, raw_sum = row_statistics(target_row[:, None], needs_statistics[:, None],
                                                            inverse_temperature, 0, vocab_size, LOGITS, ROWS, BLOCK_V,
                                                            LOGPROBS == RAW_LOGPROBS)
        if LOGITS:
            has_choice = row_max > -float("inf")
        else:
            has_choice = row_max > 0.0
        p_max = tl.where(needs_statistics, row_max, p_max)
        p_inverse_norm = tl.where(needs_statistics, inverse_norm(row_sum), p_inverse_norm)
        greedy_token = tl.where(needs_statistics, tl.where(has_choice, row_arg, -1), greedy_token)
        if LOGPROBS == RAW_LOGPROBS:
            p_raw_sum = tl.where(needs_statistics, raw_sum, p_raw_sum)
        elif LOGPROBS:
            p_raw_sum = tl.where(needs_statistics, row_sum, p_raw_sum)
    if TRUNCATE:
        if tl.max(needs_threshold.to(tl.int32), axis=0) > 0:
            threshold, reciprocal = row_truncation(
                target_row[:, None], needs_threshold, parameters,
                (p_max[:, None], p_inverse_norm[:, None], inverse_temperature[:, None]), vocab_size,
                LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)
            truncation_threshold = tl.where(needs_threshold, threshold, truncation_threshold)
            truncation_reciprocal = tl.where(needs_threshold, reciprocal, truncation_reciprocal)
    return p_max, p_inverse_norm, greedy_token, truncation_threshold, truncation_reciprocal, p_raw_sum


@triton.jit
def _scores(target_row, token, scored, p_max, p_inverse_norm, inverse_temperature, p_raw_sum, truncation_threshold,
            truncation_reciprocal, truncating, greedy, LOGITS: tl.constexpr, TRUNCATE: tl.constexpr,
            LOGPROBS: tl.constexpr):
    """``LOGPROBS``: the score of each row's ``token`` under its current node's target row (``emitted_logprob``,
    with the node's statistics and truncation)."""
    return emitted_logprob(target_row, token, scored, (p_max, p_inverse_norm, inverse_temperature), p_raw_sum,
                           (truncation_threshold, truncation_reciprocal, truncating != 0), greedy, LOGITS, TRUNCATE,
                           LOGPROBS)


@triton.jit(do_not_specialize=[
    "seed_low", "seed_high", "offset_low", "offset_high", "batch_size", "tree_size", "num_chunks",
    "num_splits", "chunks_per_split", "fault_role", "stamp",
    "stride_ids_b", "stride_parents_b", "stride_accepted_b", "stride_output_b",
])
def _tree_verify_kernel(
    ids_ptr, parents_ptr, target_ptr, draft_ptr, num_nodes_ptr, temperature_ptr,
    top_k_ptr, top_p_ptr, min_p_ptr, bonus_ptr,
    seed_ptr, seed_low, seed_high, offset_ptr, offset_low, offset_high,
    accepted_ptr, output_ptr, num_accepted_ptr, logprobs_ptr,
    # workspace: scratch rows [B, SCRATCH_ROWS, V] float32; chunk results [B, chunks];
    # split plan: stage records [B, N + 1, STAGE_WORDS] int64. The device's fault counters
    # (specdec_kernels/_faults.py) and the role whose first wait gives up (tests; -1: none)
    scratch_ptr, chunk_total_ptr, chunk_pick_ptr, stages_ptr, errors_ptr, fault_role, stamp,
    batch_size, tree_size, vocab_size, num_chunks, num_splits, chunks_per_split,
    stride_ids_b, stride_ids_n, stride_parents_b, stride_parents_n,
    stride_target_b, stride_target_n, stride_draft_b, stride_draft_n, stride_accepted_b, stride_output_b,
    HAS_DRAFT: tl.constexpr, HAS_NUM_NODES: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, LOGITS: tl.constexpr,
    REMOVE_DRAWN: tl.constexpr, SEED_PER_REQUEST: tl.constexpr, OFFSET_FROM_TENSOR: tl.constexpr,
    OFFSET_PER_REQUEST: tl.constexpr, SCRATCH_ROWS: tl.constexpr,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, TRUNCATE: tl.constexpr,
    HAS_BONUS: tl.constexpr, SPLIT: tl.constexpr, SEARCH_BLOCK: tl.constexpr, LOGPROBS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK_TILE: tl.constexpr, REPLAY_SLOTS: tl.constexpr,
):
    """``ROWS`` requests per program, or with ``SPLIT`` one slice-sharing program of one request; see the
    module docstring."""
    if SPLIT:  # ROWS == 1
        request = tl.program_id(0) // num_splits
        rank = tl.program_id(0) % num_splits + tl.zeros((ROWS,), tl.int32)
        writer = tl.max(rank, axis=0) == 0  # the one program that stores the request's outputs
    else:
        request = tl.program_id(0) * ROWS
    requests = request + tl.arange(0, ROWS)
    active = requests < batch_size
    if SPLIT:
        writes = active & (rank == 0)
    else:
        writes = active
    # The stage records of the request (split plan), and the walk's place in them.
    history = stages_ptr + request.to(tl.int64) * (tree_size + 2) * STAGE_WORDS
    failed_ptr = end_record(history, tree_size) + FAILED_WORD  # nonzero once a wait of the request gave up
    give_up = tl.program_id(0) == fault_role
    if SPLIT:
        begin_request(history, tree_size, stamp)
    stage = tl.program_id(0) * 0  # the next stage
    replayed = stage  # the current node's rejections (split plan)
    greedy, sampled, inverse_temperature = request_temperatures(temperature_ptr, requests, active, HAS_TEMPERATURE,
                                                                ROWS)
    if HAS_NUM_NODES:
        limit = tl.load(num_nodes_ptr + requests, mask=active, other=1).to(tl.int64)
        limit = tl.minimum(tl.maximum(limit, 1), tree_size).to(tl.int32)
    else:
        limit = tl.full((ROWS,), 0, tl.int32) + tree_size
    k0, k1, c2, c3 = request_key(seed_ptr, seed_low, seed_high, offset_ptr, offset_low, offset_high,
                                 requests, active, SEED_PER_REQUEST, OFFSET_FROM_TENSOR, OFFSET_PER_REQUEST)
    parameters = truncation_parameters(top_k_ptr, top_p_ptr, min_p_ptr, requests, active, vocab_size, HAS_TOP_K,
                                       HAS_TOP_P, HAS_MIN_P, ROWS)
    truncating = (sampled & any_truncation(parameters)).to(tl.int32)
    ids_row = row_pointers(ids_ptr, requests, stride_ids_b, 0, 0)
    p_scratch = scratch_ptr + requests.to(tl.int64) * SCRATCH_ROWS * vocab_size
    q_scratch = p_scratch + (SCRATCH_ROWS - 1) * vocab_size
    accepted_row = accepted_ptr + requests.to(tl.int64) * stride_accepted_b
    output_row = output_ptr + requests.to(tl.int64) * stride_output_b
    logprobs_row = logprobs_ptr + requests.to(tl.int64) * stride_output_b  # LOGPROBS: laid out as the tokens

    # Per-row walk state, int32 where it can be: flags kept as predicates
    # across the walk made ptxas spill (a thread has 7 predicate registers).
    node = tl.zeros((ROWS,), tl.int32)
    last = tl.where(active, node, limit)  # the child tried last; limit once the row's walk is over
    depth = node
    statistics_node = node - 1  # the node whose statistics are loaded
    scratch_node = node - 1  # the node whose current rows the scratch rows hold (the base rows there)
    pending_node = node - 1  # the node with a rejection not yet applied to its base rows
    pending_token = tl.zeros((ROWS,), tl.int64)
    # The pending rejection's kind, two flags in one register (a register more spilled under Triton 3.6):
    # RESIDUAL_HAD_MASS (else p is renormalised as it is) and POINT_MASS (a deterministic candidate, v1.3).
    pending_kind = node
    p_reciprocal = tl.zeros((ROWS,), tl.float64)
    q_reciprocal = p_reciprocal
    p_max = tl.zeros((ROWS,), tl.float32)
    p_inverse_norm = p_max
    greedy_token = node - 1
    truncation_threshold = node  # of the node whose statistics are loaded, for truncating rows
    truncation_reciprocal = p_reciprocal
    p_raw_sum = p_max  # LOGPROBS: the node's raw scores' normaliser
    rejected_here = node  # 1 once a child of the current node was tried and rejected
    failed = node  # split plan: 1 once a wait of the request gave up (the walk ends: the outcome is decided)
    # Split plan: the current node's rejections, as replay_rejection keeps them.
    replay_tokens = tl.zeros((REPLAY_SLOTS,), tl.int32)
    replay_reciprocals = tl.zeros((REPLAY_SLOTS,), tl.int64)
    tl.store(accepted_row, node, mask=writes)
    while tl.max((last < limit).to(tl.int32), axis=0) > 0:
        child = _next_child(parents_ptr, ids_ptr, requests, active, node, last, limit, vocab_size,
                            stride_parents_b, stride_parents_n, stride_ids_b, stride_ids_n, BLOCK_N)
        trying = (last < limit) & (child < limit)
        target_row = row_pointers(target_ptr, requests, stride_target_b, node, stride_target_n)
        draft_row = row_pointers(draft_ptr, requests, stride_draft_b, node, stride_draft_n)
        entering = (last < limit) & (statistics_node != node)
        if LOGITS:
            needs_statistics = entering
        else:
            needs_statistics = entering & greedy
        if TRUNCATE:
            needs_threshold = entering & (truncating != 0)
        else:
            needs_threshold = entering & False
        entry = (target_row, needs_statistics, needs_threshold, inverse_temperature, parameters, vocab_size, p_max,
                 p_inverse_norm, greedy_token, truncation_threshold, truncation_reciprocal, p_raw_sum)
        if SPLIT:
            # One program (the first to take the stage) reads the row for every program of the request, which
            # wait for it: one pass over the row (and the truncation search's) per node entered instead of one
            # per program. Not sliced: the logits normaliser is a float32 sum in the one-program plan's tile
            # order, whose bits a sum of slices would not keep; the thresholds are found with that normaliser.
            if tl.max((needs_statistics | needs_threshold).to(tl.int32), axis=0) > 0:
                record = history + stage * STAGE_WORDS
                if take_slice(record) == 0:
                    publish_entry(record, *_node_statistics(*entry, LOGITS, TRUNCATE, ROWS, BLOCK_V,
                                                            SEARCH_BLOCK, LOGPROBS), LOGITS, LOGPROBS)
                failed |= wait_for_stage(record, 1, failed_ptr, give_up).to(tl.int32)
                (p_max, p_inverse_norm, greedy_token, truncation_threshold, truncation_reciprocal,
                 p_raw_sum) = entry_statistics(record, p_max, p_inverse_norm, p_raw_sum, LOGITS, LOGPROBS)
                stage += 1
        else:
            (p_max, p_inverse_norm, greedy_token, truncation_threshold, truncation_reciprocal,
             p_raw_sum) = _node_statistics(*entry, LOGITS, TRUNCATE, ROWS, BLOCK_V, SEARCH_BLOCK, LOGPROBS)
        statistics_node = tl.where(entering, node, statistics_node)

        # A node's base rows are the inputs until a second rejection there
        # writes the current rows out; a rejection is applied where the rows
        # are next read (the next child's gathers, the next pass, the sample).
        from_scratch = scratch_node == node
        pending = (pending_node == node).to(tl.int32)
        safe_child = tl.where(trying, child, 0)
        token = tl.load(ids_row + safe_child.to(tl.int64) * stride_ids_n, mask=trying, other=0).to(tl.int64)
        gather = trying & sampled
        target_at, draft_at = _current_rows(
            target_row, draft_row, p_scratch, q_scratch, token, gather, gather, from_scratch, p_max, p_inverse_norm,
            inverse_temperature, pending, pending_token, pending_kind & RESIDUAL_HAD_MASS, pending_kind & POINT_MASS,
            p_reciprocal,
            q_reciprocal, token, truncation_threshold, truncation_reciprocal, truncating, replay_tokens, replay_reciprocals, replayed,
            LOGITS, HAS_DRAFT, REMOVE_DRAWN, TRUNCATE, SPLIT)
        point_mass = node * 0 + 1  # without a draft every candidate is deterministic
        if HAS_DRAFT:
            # A candidate with q(t) not > 0 was not drawn from q: tested against the point mass on t (v1.3).
            point_mass = (~drawn_from_draft(draft_at)).to(tl.int32)
            draft_at = proposal_probability(draft_at)
        word, _, _, _ = random_words(k0, k1, c2, c3, ACCEPT_STREAM, safe_child, safe_child * 0)
        accepted = trying & acceptance(word, target_at, draft_at, greedy, token == greedy_token.to(tl.int64))
        rejecting = gather & (accepted == 0)
        if tl.max(rejecting.to(tl.int32), axis=0) > 0:
            if SPLIT:
                writing = rejecting & False  # nothing is written but the totals
            else:
                writing = rejecting & (pending != 0)
            pass_rows = (
                target_row[:, None], draft_row[:, None], p_scratch[:, None], q_scratch[:, None], rejecting[:, None],
                writing[:, None], from_scratch[:, None], p_max[:, None], p_inverse_norm[:, None],
                inverse_temperature[:, None], pending[:, None], pending_token[:, None],
                (pending_kind & RESIDUAL_HAD_MASS)[:, None], (pending_kind & POINT_MASS)[:, None],
                p_reciprocal[:, None], q_reciprocal[:, None],
                token[:, None], point_mass[:, None], truncation_threshold[:, None], truncation_reciprocal[:, None], truncating[:, None],
                replay_tokens, replay_reciprocals, replayed)
            if SPLIT:
                # The request's programs share the pass, slice by slice.
                record = history + stage * STAGE_WORDS
                taken = take_slice(record)
                while taken < num_splits:
                    first = taken * chunks_per_split * BLOCK_V
                    slice_totals = _rejection_pass(*pass_rows, first,
                                                   tl.minimum(first + chunks_per_split * BLOCK_V, vocab_size),
                                                   LOGITS, HAS_DRAFT, REMOVE_DRAWN, TRUNCATE, SPLIT, ROWS, BLOCK_V)
                    publish_slice(record, *slice_totals)
                    taken = take_slice(record)
                failed |= wait_for_stage(record, num_splits, failed_ptr, give_up).to(tl.int32)
                residual_high, residual_low, target_high, target_low, drawn_high, drawn_low = stage_totals(record)
            else:
                residual_high, residual_low, target_high, target_low, drawn_high, drawn_low = _rejection_pass(
                    *pass_rows, 0, vocab_size, LOGITS, HAS_DRAFT, REMOVE_DRAWN, TRUNCATE, SPLIT, ROWS, BLOCK_V)
                tl.debug_barrier()  # the rows written, visible to every thread
            use_residual = (residual_high != 0) | (residual_low != 0)
            scratch_node = tl.where(writing, node, scratch_node)
            pending_node = tl.where(rejecting, node, pending_node)
            pending_token = tl.where(rejecting, token, pending_token)
            pending_kind = tl.where(rejecting, tl.where(use_residual, RESIDUAL_HAD_MASS, 0) + point_mass * POINT_MASS,
                                    pending_kind)
            p_reciprocal = tl.where(rejecting, normaliser_reciprocal(tl.where(use_residual, residual_high, target_high),
                                                           tl.where(use_residual, residual_low, target_low)),
                                    p_reciprocal)
            q_reciprocal = tl.where(rejecting, normaliser_reciprocal(drawn_high, drawn_low), q_reciprocal)
            if SPLIT:
                replay_tokens, replay_reciprocals = replay_rejection(
                    replay_tokens, replay_reciprocals, replayed, pending_token, pending_kind & RESIDUAL_HAD_MASS,
                    (pending_kind & POINT_MASS) != 0,
                    p_reciprocal, q_reciprocal)
                replayed += 1
                stage += 1

        rejected_here = tl.where(accepted, 0, tl.where(trying, 1, rejected_here))
        depth += accepted.to(tl.int32)
        tl.store(accepted_row + depth, child, mask=accepted & writes)
        tl.store(output_row + depth - 1, token.to(tl.int32), mask=accepted & writes)
        if LOGPROBS:
            tl.store(logprobs_row + depth - 1, _scores(
                target_row, token, accepted & writes, p_max, p_inverse_norm, inverse_temperature, p_raw_sum,
                truncation_threshold, truncation_reciprocal, truncating, greedy, LOGITS, TRUNCATE, LOGPROBS),
                mask=accepted & writes)
        node = tl.where(accepted, child, node)
        if SPLIT:
            replayed = tl.where(tl.max(accepted.to(tl.int32), axis=0) > 0, 0, replayed)
        last = tl.where((last < limit) & (failed == 0), child, limit)

    target_row = row_pointers(target_ptr, requests, stride_target_b, node, stride_target_n)
    draft_row = row_pointers(draft_ptr, requests, stride_draft_b, node, stride_draft_n)
    token = greedy_token
    if HAS_BONUS:
        # A path ending where no child was rejected takes the engine's token: that row is not sampled. An id
        # outside [0, V) is no bonus (v1.3): the row is sampled as without ids.
        bonus = tl.load(bonus_ptr + requests, mask=active, other=-1)
        takes_bonus = active & (rejected_here == 0) & (bonus >= 0) & (bonus < vocab_size)
        token = tl.where(takes_bonus, bonus.to(tl.int32), token)
        sampled = sampled & ~takes_bonus
    sampled = sampled & (failed == 0)
    if tl.max(sampled.to(tl.int32), axis=0) > 0:
        slot = requests.to(tl.int64) * num_chunks
        sample_rows = (
            target_row[:, None], draft_row[:, None], p_scratch[:, None], q_scratch[:, None], sampled,
            (scratch_node == node)[:, None], p_max[:, None], p_inverse_norm[:, None],
            inverse_temperature[:, None], (pending_node == node).to(tl.int32)[:, None],
            pending_token[:, None], (pending_kind & RESIDUAL_HAD_MASS)[:, None], (pending_kind & POINT_MASS)[:, None],
            p_reciprocal[:, None],
            q_reciprocal[:, None], truncation_threshold[:, None], truncation_reciprocal[:, None], truncating[:, None],
            replay_tokens, replay_reciprocals, replayed, chunk_total_ptr, chunk_pick_ptr, slot, k0, k1, c2, c3, node)
        if SPLIT:
            record = history + stage * STAGE_WORDS
            taken = take_slice(record)
            while taken < num_splits:
                first_chunk = taken * chunks_per_split
                _sample_chunks(*sample_rows, first_chunk, tl.minimum(first_chunk + chunks_per_split, num_chunks),
                               vocab_size, LOGITS, HAS_DRAFT, REMOVE_DRAWN, TRUNCATE, SPLIT, BLOCK_V)
                publish(record, 1)
                taken = take_slice(record)
            stage += 1
            if writer:  # only the writer needs the token
                wait_for_stage(record, num_splits, failed_ptr, give_up)
                sampled_token = _choose_sample(chunk_total_ptr, chunk_pick_ptr, slot, sampled, k0, k1, c2, c3, node,
                                               num_chunks, ROWS, CHUNK_TILE)
                token = tl.where(sampled, sampled_token, token)
        else:
            _sample_chunks(*sample_rows, 0, num_chunks, vocab_size, LOGITS, HAS_DRAFT, REMOVE_DRAWN, TRUNCATE, SPLIT,
                           BLOCK_V)
            sampled_token = _choose_sample(chunk_total_ptr, chunk_pick_ptr, slot, sampled, k0, k1, c2, c3, node,
                                           num_chunks, ROWS, CHUNK_TILE)
            token = tl.where(sampled, sampled_token, token)
    tl.store(num_accepted_ptr + requests, depth, mask=writes)
    if LOGPROBS:
        score = _scores(target_row, token.to(tl.int64), writes, p_max, p_inverse_norm, inverse_temperature, p_raw_sum,
                        truncation_threshold, truncation_reciprocal, truncating, greedy, LOGITS, TRUNCATE, LOGPROBS)
    nodes = tl.arange(0, BLOCK_N)[None, :]
    for start in range(0, tree_size, BLOCK_N):
        index = start + nodes
        in_tree = writes[:, None] & (index < tree_size)
        tl.store(accepted_row[:, None] + index, tl.full((ROWS, BLOCK_N), -1, tl.int32),
                 mask=in_tree & (index > depth[:, None]))
        tl.store(output_row[:, None] + index, tl.where(index == depth[:, None], token[:, None], -1),
                 mask=in_tree & (index >= depth[:, None]))
        if LOGPROBS:
            tl.store(logprobs_row[:, None] + index, tl.where(index == depth[:, None], score[:, None], -float("inf")),
                     mask=in_tree & (index >= depth[:, None]))
    if SPLIT:
        if end_request(history, tree_size, num_splits, errors_ptr + TREE_WAIT_GAVE_UP):
            # The request's last program, and a wait of the request gave up: the failure outcome, over whatever
            # its writer stored (every store of it happened before its arrival).
            for start in range(0, tree_size, BLOCK_N):
                index = start + nodes
                in_tree = active[:, None] & (index < tree_size)
                tl.store(accepted_row[:, None] + index, tl.where(index == 0, 0, -1), mask=in_tree)
                tl.store(output_row[:, None] + index, tl.full((ROWS, BLOCK_N), -1, tl.int32), mask=in_tree)
                if LOGPROBS:
                    tl.store(logprobs_row[:, None] + index, tl.full((ROWS, BLOCK_N), -float("inf"), tl.float32),
                             mask=in_tree)
            tl.store(num_accepted_ptr + requests, tl.zeros((ROWS,), tl.int32), mask=active)
