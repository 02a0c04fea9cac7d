"""Fused chain verification: one launch for acceptance, residual sample and bonus.

Design
------
The grid is 1-D: ``WAVES x row_blocks x SPLITS`` programs. A program owns
``ROWS`` requests (several only when the vocabulary is small, bounded so
that the ``[ROWS, BLOCK_K1]`` acceptance tile stays in registers) and one of
``SPLITS`` slices of the vocabulary, each a whole number of the sampler's
1024-token chunks (``kernels/sampling.py``), so even ``B = 1`` spreads a
128k vocabulary over the GPU and the chunks never depend on the grid.

Probabilities (one wave). Every program recomputes, for its requests, the
acceptance tests from gathers of ``p(t_i)`` and ``q(t_i)`` (K values: cheaper
than any cross-program exchange) and so knows the stop position ``j``. It then
reads its slice of row ``j`` only (rows past ``j`` are never read) and
writes, per chunk, the chunk total and candidate of the residual
``max(0, p - q)`` (or of ``p``: bonus row, invalid id;
``kernels/chain_verify_rows.py``). An arrival counter per row block finds
the last program to finish, which chooses among the chunk totals
(``kernels/chain_verify_finish.py``; where a residual has no mass it samples
``p`` itself, a case that valid inputs all but never reach), writes the
outputs and puts the counter back to zero (no memset launch). Greedy
requests need the argmax of every row up to the first mismatch, which no
program can know alone: for them every program records per-slice maxima of
the rows ``0..n_b`` and the last program decides.

Logits. The acceptance tests need the softmax normalisers of the rows up
to the first rejection, which need the whole vocabulary.

* One slice per row (the batch fills the GPU, or ``V <= 1024``): one wave.
  A program walks its rows in order (``_walk_rows``): normalisers of row
  ``i``, acceptance at ``i``, and row ``i + 1`` only for the requests still
  accepting, so it reads exactly the target rows ``0..j`` and the draft rows
  ``0..min(j, n_b - 1)``, then samples row ``j`` (read a second time).
* Several slices per row (small batches): two waves. Wave 1 programs write
  per-slice ``(max, sum exp)`` of the target rows ``0..n_b`` and, for
  sampled requests, of the draft rows ``0..n_b - 1`` (greedy ones: target
  only); since ``j`` is unknown until every normaliser is in, the rows past
  ``j`` up to ``n_b`` are read too (never those past ``n_b``). Wave 2
  programs wait until their row block's wave 1 has published, combine the
  normalisers, then do what a probabilities program does.

Truncation (top-k / top-p / min-p). A threshold needs the whole row.

* Where rows are not split: the walk above, with each target row's
  threshold searched by the program that holds it (``row_truncation``,
  ``kernels/truncation.py``) before its acceptance test.
* Where they are (small batches): the *staged* plan
  (``kernels/chain_verify_stages.py``), one request per program and the
  slices of the untruncated plan. A pass that needs the whole row is a
  stage: the request's programs take its slices from a counter in the
  request's stage record, add their integer partials atomically, publish
  and wait for all (the take/publish/wait of
  ``kernels/stage_records.py``). Stage 0 is the logits normalisers (in
  place of the two waves); the stages after it are the truncation search of
  every row a decision may need, ``0..n_b`` (``0..n_b - 1`` with a bonus id in ``[0, V)``, unless
  ``LOGPROBS`` scores it under row ``n_b``),
  all at once, since the stop is unknown until the thresholds are: rows past
  the stop are read for nothing, the price of not deciding row by row. The
  totals are integer sums, so each program derives the same thresholds and
  reciprocals as the whole-row search, bit for bit. Then every program does
  what a probabilities program does with the truncated rows, and the last
  to arrive zeroes the request's records.

Logprobs (``LOGPROBS``). Every plan ends in one writer, ``write_outputs``,
which scores the emitted tokens (``target_logprob``) from per-position
tiles of the rows' statistics and truncation (``_scored_rows``): the walk
keeps each row's as it reads it; the slice plans have them from the
normalisers they combine (greedy requests' rows too) and the staged
thresholds. ``"raw"`` of logits needs each row's sum at ``T = 1``, which
``row_statistics`` adds in the same pass (the slice plans store it after
the other sums in ``stat_sum``). A bonus id given with bonus rows is scored
under its row, read for that alone.

No program waits on one that may not be running: with two waves a program's
role comes from a ticket (an atomic counter taken at program start), not
from its id, and wave 1 roles take the first tickets, so every wave 1
program a wave 2 program waits for took its ticket earlier: it is running or
done, whatever order the GPU dispatches programs in and however many fit at
once. Staged, roles come from the program id: a program waits only for
slices already taken, by running programs. The interpreter runs programs one
after another in id order, so it never waits at all (staged, a request's
first program takes every slice). A wait is bounded anyway: past
``SPIN_LIMIT`` polls it gives up rather than hang a server, counts the fault
(``specdec_kernels/_faults.py``) and marks its row block failed; the row
block's last program then writes the failure outcome (tokens -1,
``num_accepted`` 0), and puts every counter and record back to zero as on
every path. Before any of it, the programs claim their words for the launch
(``kernels/stage_records.py``, ``claim``; the row block's word in
``claims``, or with two waves, before the tickets, the launch's in
``tickets``): the first resets the row block's (the launch's) counters,
flags and records, whatever they held, and the others wait for it.
Every arrival is preceded by ``tl.debug_barrier()`` so the whole program's
stores are issued before the release (Triton does not promise that barrier
itself), and followed by one so the acquire covers every thread.

Layouts. Every row is addressed from a per-request row 0 (``row_at``):
``_request_rows`` derives the requests' first id, first target row, first
draft row and draft count from ``num_draft_tokens`` (the padded layout,
``[B, K+1, V]``) or, with ``PACKED``, from ``cu_num_draft_tokens`` read on
the device (``chain_verify_packed``: ``[T+B, V]`` rows, read in place). The
random numbers and workspace slots stay those of request ``b`` position
``i``, so both layouts give the same tokens for the same rows.

Offsets that multiply a stride are 64-bit (``row_at``).
"""

import triton
import triton.language as tl

from .chain_verify_finish import greedy_decisions, sampled_tokens, write_outputs
from .chain_verify_rows import (RAW_LOGPROBS, acceptance, inverse_norm, processed_probability, proposal_probability,
                                request_temperatures, row_at, row_statistics, sample_slice, scan_statistics,
                                target_probability)
from .chain_verify_stages import clear_request_records, request_records, staged_statistics, staged_thresholds
from .faults import CHAIN_WAIT_GAVE_UP
from .rng import ACCEPT_STREAM, random_words, request_key
from .sampling import given_values, softmax_weight
from .stage_records import arrive, claim, claimed, count_give_ups, wait_for, wait_for_claim
from .truncation import any_truncation, row_truncation, truncated_probability, truncation_parameters


_SWEEP_BLOCK = tl.constexpr(128)  # row blocks the two-wave plan's resets zero a step
TICKET_WORD = tl.constexpr(0)  # the two-wave plan's words (``tickets``): the next ticket,
END_WORD = tl.constexpr(1)  # the programs ended,
LAUNCH_CLAIM_WORD = tl.constexpr(2)  # and the launch's claim (kernels/stage_records.py)


@triton.jit
def _walk_rows(
    target_rows, draft_rows, requests, active, greedy, sampled, num_drafts, last_row, valid, safe_ids,
    inverse_temperature,
    k0, k1, c2, c3, max_drafts, vocab_size, stride_target_k, stride_draft_k,
    truncating, parameters,
    LOGITS: tl.constexpr, HAS_DRAFT: tl.constexpr, TRUNCATE: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_K1: tl.constexpr, BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr, LOGPROBS: tl.constexpr,
):
    """A program holding whole rows (logits, or truncated targets): decide position by position.

    A request's row ``i`` is read only while the request is still accepting,
    so the rows read are exactly ``0..min(j, last_row)`` (target; ``last_row``
    is ``n_b - 1`` when the engine gives the bonus token, unless ``LOGPROBS``
    scores it under its row) and
    ``0..min(j, n_b - 1)`` (draft, sampled requests). Each target row read gets the statistics the
    acceptance test needs: softmax ``(max, 1 / sum)`` with logits, the
    truncation threshold and reciprocal where ``truncating`` (draft rows are
    probabilities, v1.3: they need none). Returns the stop position, the
    stop row's target statistics and truncation, the greedy requests'
    token, and with ``LOGPROBS`` every row's ``[ROWS, BLOCK_K1]``
    ``(max, 1 / sum, raw sum, threshold, reciprocal)`` (:func:`_scored_rows`).
    """
    positions = tl.arange(0, BLOCK_K1)[None, :]
    going = active
    stop = num_drafts
    stop_max = tl.zeros((ROWS,), tl.float32)
    stop_inverse_norm = tl.zeros((ROWS,), tl.float32)
    stop_threshold = tl.zeros((ROWS,), tl.int32)
    stop_reciprocal = tl.zeros((ROWS,), tl.float64)
    greedy_token = tl.full((ROWS,), -1, tl.int32)
    row_maxes = tl.zeros((ROWS, BLOCK_K1), tl.float32)  # LOGPROBS: every row's statistics
    inverse_norms = tl.zeros((ROWS, BLOCK_K1), tl.float32)
    raw_sums = tl.zeros((ROWS, BLOCK_K1), tl.float32)
    thresholds = tl.zeros((ROWS, BLOCK_K1), tl.int32)
    reciprocals = tl.zeros((ROWS, BLOCK_K1), tl.float64)
    for position in range(0, max_drafts + 1):
        here = positions == position
        token = tl.sum(tl.where(here, safe_ids, 0), axis=1)
        drafted = going & (position < num_drafts) & (tl.max((here & valid).to(tl.int32), axis=1) > 0)
        target_row = row_at(target_rows, position, stride_target_k)
        draft_row = row_at(draft_rows, position, stride_draft_k)
        reading = going & (position <= last_row)
        row_max, row_arg, row_sum, raw_sum = row_statistics(target_row[:, None], reading[:, None],
                                                            inverse_temperature, 0, vocab_size, LOGITS, ROWS, BLOCK_V,
                                                            LOGPROBS == RAW_LOGPROBS)
        row_inverse_norm = inverse_norm(row_sum)
        gather = drafted & sampled
        threshold = stop_threshold
        reciprocal = stop_reciprocal
        if TRUNCATE:
            needs_threshold = reading & (truncating != 0)  # every gathered row of a truncating request
            if tl.max(needs_threshold.to(tl.int32), axis=0) > 0:
                threshold, reciprocal = row_truncation(
                    target_row[:, None], needs_threshold, parameters,
                    (row_max[:, None], row_inverse_norm[:, None], inverse_temperature[:, None]), vocab_size,
                    LOGITS, ROWS, BLOCK_V, SEARCH_BLOCK)
        p = target_probability(target_row, token, gather, (row_max, row_inverse_norm, inverse_temperature),
                               (threshold, reciprocal, truncating != 0), LOGITS, TRUNCATE)
        if HAS_DRAFT:
            q = proposal_probability(tl.load(draft_row + token, mask=gather, other=0.0).to(tl.float32))
        else:
            q = tl.full((ROWS,), 1.0, tl.float32)
        w0, _, _, _ = random_words(k0, k1, c2, c3, ACCEPT_STREAM, requests * 0 + position, requests * 0)
        greedy_arg = tl.where(row_max > -float("inf"), row_arg, -1)
        accepted = drafted & acceptance(w0, p, q, greedy, token == greedy_arg.to(tl.int64))
        stopping = going & ~accepted
        stop = tl.where(stopping, position, stop)
        stop_max = tl.where(stopping, row_max, stop_max)
        stop_inverse_norm = tl.where(stopping, row_inverse_norm, stop_inverse_norm)
        stop_threshold = tl.where(stopping, threshold, stop_threshold)
        stop_reciprocal = tl.where(stopping, reciprocal, stop_reciprocal)
        greedy_token = tl.where(stopping, greedy_arg, greedy_token)
        going = going & accepted
        if LOGPROBS:
            row_maxes = tl.where(here, row_max[:, None], row_maxes)
            inverse_norms = tl.where(here, row_inverse_norm[:, None], inverse_norms)
            if LOGPROBS == RAW_LOGPROBS:
                raw_sums = tl.where(here, raw_sum[:, None], raw_sums)
            else:  # only greedy requests report the raw value: their T is 1
                raw_sums = tl.where(here, row_sum[:, None], raw_sums)
            thresholds = tl.where(here, threshold[:, None], thresholds)
            reciprocals = tl.where(here, reciprocal[:, None], reciprocals)
    return (stop, stop_max, stop_inverse_norm, stop_threshold, stop_reciprocal, greedy_token,
            (row_maxes, inverse_norms, raw_sums, thresholds, reciprocals))


@triton.jit
def _combine_normalisers(stat_max_ptr, stat_sum_ptr, requests, rows, num_splits, max_drafts, inverse_temperature,
                         ROWS: tl.constexpr, BLOCK_K1: tl.constexpr, SPLIT_TILE: tl.constexpr):
    """Row max, ``1 / sum`` and ``sum exp((x - max) / T)`` of rows ``[ROWS, BLOCK_K1]`` from the per-slice
    statistics.

    Vectorised over ``SPLIT_TILE`` slices at a time (one step unless there
    are more slices). A row without mass gets a NaN inverse, so its
    probabilities come out NaN, as the reference's ``0 / 0``.
    """
    positions = tl.arange(0, BLOCK_K1)[None, :, None]
    splits = tl.arange(0, SPLIT_TILE)[None, None, :]
    base = (requests.to(tl.int64)[:, None, None] * BLOCK_K1 + positions) * num_splits
    wanted = rows[:, None, None] & (positions <= max_drafts)
    inverse_temperature = inverse_temperature[:, None]
    row_max = tl.full((ROWS, BLOCK_K1), -float("inf"), tl.float32)
    row_sum = tl.zeros((ROWS, BLOCK_K1), tl.float32)
    for start in range(0, num_splits, SPLIT_TILE):
        mask = wanted & (start + splits < num_splits)
        slice_max = tl.load(stat_max_ptr + base + start + splits, mask=mask, other=-float("inf"),
                            cache_modifier=".cg")
        slice_sum = tl.load(stat_sum_ptr + base + start + splits, mask=mask, other=0.0, cache_modifier=".cg")
        new_max = tl.maximum(row_max, tl.max(slice_max, axis=2))
        row_sum = row_sum * softmax_weight(row_max - new_max, inverse_temperature) + tl.sum(
            slice_sum * softmax_weight(slice_max - new_max[:, :, None], inverse_temperature[:, :, None]), axis=2)
        row_max = new_max
    return row_max, inverse_norm(row_sum), row_sum


@triton.jit
def _draft_tokens(first_ids, active, num_drafts, vocab_size, BLOCK_K1: tl.constexpr):
    """Draft ids ``[ROWS, BLOCK_K1]`` (int64, -1 past ``n_b``), their validity and the ids clamped into range.

    ``first_ids`` points at each request's first id (ids are contiguous).
    """
    positions = tl.arange(0, BLOCK_K1)[None, :]
    in_chain = active[:, None] & (positions < num_drafts[:, None])
    token_ids = tl.load(first_ids[:, None] + positions, mask=in_chain, other=-1).to(tl.int64)
    valid = in_chain & (token_ids >= 0) & (token_ids < vocab_size)
    return in_chain, token_ids, valid, tl.where(valid, token_ids, 0)


@triton.jit
def _request_rows(draft_ids_ptr, target_ptr, draft_ptr, num_drafts_ptr, cu_ptr, requests, active, max_drafts,
                  num_tokens, stride_ids_b, stride_target_b, stride_draft_b,
                  HAS_NUM_DRAFTS: tl.constexpr, PACKED: tl.constexpr, BONUS_ROWS: tl.constexpr, ROWS: tl.constexpr):
    """Where each request's rows start, and its draft count: ``(first_ids, target_rows, draft_rows, num_drafts)``.

    Padded: request ``b``'s row 0 is at ``b * stride_b``. ``PACKED``: its
    drafts are ``cu[b] .. cu[b+1] - 1`` and its target rows start at
    ``cu[b] + b`` (``[T+B, V]``: each request's bonus row follows its
    drafts), or at ``cu[b]`` without ``BONUS_ROWS`` (``[T, V]``, bonus ids
    given, so row ``n_b`` is never read), with ``stride_b`` the row stride; malformed values are
    clamped as ``reference/chain_verify_packed.packed_requests`` says
    (``start`` into ``[0, T]``, ``end`` into ``[start, T]``, the count to at
    most ``K``), so no row outside the tensors is ever read.
    """
    if PACKED:
        start = tl.load(cu_ptr + requests, mask=active, other=0).to(tl.int64)
        end = tl.load(cu_ptr + requests + 1, mask=active, other=0).to(tl.int64)
        start = tl.minimum(tl.maximum(start, 0), num_tokens)
        end = tl.minimum(tl.maximum(end, start), num_tokens)
        num_drafts = tl.minimum(end - start, max_drafts).to(tl.int32)
        first_target = start
        if BONUS_ROWS:
            first_target += requests
        first_draft = start
    else:
        if HAS_NUM_DRAFTS:
            num_drafts = tl.load(num_drafts_ptr + requests, mask=active, other=0)
            num_drafts = tl.minimum(tl.maximum(num_drafts, 0), max_drafts)
        else:
            num_drafts = tl.full((ROWS,), 0, tl.int32) + max_drafts
        first_target = requests.to(tl.int64)
        first_draft = requests.to(tl.int64)
    first_ids = draft_ids_ptr + first_draft * stride_ids_b
    first_target_row = target_ptr + first_target * stride_target_b
    return first_ids, first_target_row, draft_ptr + first_draft * stride_draft_b, num_drafts


@triton.jit
def _bonus_ids(bonus_ptr, requests, active, vocab_size, HAS_BONUS: tl.constexpr, BONUS_ROWS: tl.constexpr):
    """``(gives_bonus, bonus)``: the requests whose engine gives the bonus token, and that token.

    An id outside ``[0, V)`` is no bonus (v1.3): with bonus rows the request
    samples its bonus row as without ids; without them (``[T, V]``) there is
    no row to fall back on, and its token there is ``-1``.
    """
    if HAS_BONUS:
        bonus = tl.load(bonus_ptr + requests, mask=active, other=-1)
        in_vocabulary = (bonus >= 0) & (bonus < vocab_size)
        bonus = tl.where(in_vocabulary, bonus, -1).to(tl.int32)
        gives_bonus = active
        if BONUS_ROWS:
            gives_bonus = active & in_vocabulary
    else:
        bonus = (requests * 0 - 1).to(tl.int32)
        gives_bonus = active & (requests < 0)  # never: a tile & a Python bool is an int mask in the interpreter
    return gives_bonus, bonus


@triton.jit
def _claim_row_block(claim_ptr, stamp, num_splits, arrivals_ptr, failed_ptr, records, truncating, parameters,
                     LOGITS: tl.constexpr, STAGED: tl.constexpr, BLOCK_K1: tl.constexpr):
    """The one-wave plans' claim of the row block's words for the launch: its first program resets the arrival
    count, the failure flag and (staged) the stage records its request will use (zero unless damaged: the last
    program puts them back too), the others wait for it. One program alone (one slice) has nobody to count with
    and claims nothing. Returns whether the wait gave up."""
    gave_up = stamp < 0  # False, as a value: the branches assign one
    if num_splits > 1:
        if claim(claim_ptr, stamp):
            tl.atomic_xchg(arrivals_ptr, 0, sem="relaxed")
            tl.atomic_xchg(failed_ptr, 0, sem="relaxed")
            if STAGED:
                clear_request_records(records, truncating, parameters, LOGITS, BLOCK_K1)
            claimed(claim_ptr, stamp)
        else:
            gave_up = wait_for_claim(claim_ptr, stamp)
    return gave_up


@triton.jit
def _reset_launch(tickets_ptr, wave1_arrivals_ptr, arrivals_ptr, failed_ptr, num_row_blocks):
    """The two-wave plan's words but its claim, to zero: the tickets, the end count, and every row block's
    counters and failure flag (by the launch's claimer, and by its last program)."""
    tl.atomic_xchg(tickets_ptr + TICKET_WORD, 0, sem="relaxed")
    tl.atomic_xchg(tickets_ptr + END_WORD, 0, sem="relaxed")
    for start in range(0, num_row_blocks, _SWEEP_BLOCK):
        row_blocks = start + tl.arange(0, _SWEEP_BLOCK)
        swept = row_blocks < num_row_blocks
        tl.store(wave1_arrivals_ptr + row_blocks, tl.zeros((_SWEEP_BLOCK,), tl.int32), mask=swept)
        tl.store(arrivals_ptr + row_blocks, tl.zeros((_SWEEP_BLOCK,), tl.int32), mask=swept)
        tl.store(failed_ptr + row_blocks, tl.zeros((_SWEEP_BLOCK,), tl.int32), mask=swept)


@triton.jit
def _scored_rows(target_rows, stride_target_k, num_drafts, greedy, row_max, row_inverse_norm, raw_sum,
                 inverse_temperature, threshold, reciprocal, truncating, BONUS_ROWS: tl.constexpr,
                 BLOCK_K1: tl.constexpr):
    """What ``write_outputs`` scores the emitted tokens with (``LOGPROBS``): each request's target rows, which of
    its positions have a row (not ``n_b`` in the bonus-free layout), its greedy flag, and its rows' statistics and
    truncation ``[ROWS, BLOCK_K1]``, as ``target_logprob`` takes them."""
    positions = tl.arange(0, BLOCK_K1)[None, :]
    row_given = positions < num_drafts[:, None] + BONUS_ROWS * BLOCK_K1
    return (target_rows, stride_target_k, row_given, greedy, (row_max, row_inverse_norm, inverse_temperature[:, None]),
            raw_sum, (threshold, reciprocal, truncating[:, None] != 0))


@triton.jit
def _takes_bonus(gives_bonus, stop, num_drafts):
    """Requests that accepted all their drafts and emit the engine's bonus token (their bonus row is read only to
    score it, ``LOGPROBS``)."""
    return gives_bonus & (stop == num_drafts)


@triton.jit(do_not_specialize=[
    "seed_low", "seed_high", "offset_low", "offset_high", "batch_size", "max_drafts", "num_tokens", "num_chunks",
    "num_splits", "chunks_per_split", "stride_ids_b", "stride_output_b", "fault_role", "stamp",
])
def _chain_verify_kernel(
    draft_ids_ptr, target_ptr, draft_ptr, num_drafts_ptr, cu_ptr, temperature_ptr,
    top_k_ptr, top_p_ptr, min_p_ptr, bonus_ptr,
    seed_ptr, seed_low, seed_high, offset_ptr, offset_low, offset_high,
    output_ptr, num_accepted_ptr, logprobs_ptr,
    # workspace: chunk results [B, chunks]; statistics [B, BLOCK_K1, SPLITS]; counters; the row blocks' failure
    # flags (nonzero once a wait gave up). The device's fault counters (specdec_kernels/_faults.py) and the role
    # whose first wait gives up (tests; -1: none)
    chunk_total_ptr, chunk_pick_ptr, stat_max_ptr, stat_arg_ptr, stat_sum_ptr,
    tickets_ptr, wave1_arrivals_ptr, arrivals_ptr, failed_ptr, claims_ptr, stages_ptr, errors_ptr, fault_role, stamp,
    batch_size, max_drafts, num_tokens, vocab_size, num_chunks, num_splits, chunks_per_split,
    # Row strides stay specialised (Triton keys only on "== 1" and "% 16"), so a
    # vocabulary stride divisible by 16 gives vector loads without recompiles.
    # Packed: the "_b" strides are row strides too (see _request_rows).
    stride_ids_b, stride_target_b, stride_target_k, stride_draft_b, stride_draft_k, stride_output_b,
    HAS_DRAFT: tl.constexpr, HAS_NUM_DRAFTS: tl.constexpr, PACKED: tl.constexpr, BONUS_ROWS: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr, LOGITS: tl.constexpr, SEED_PER_REQUEST: tl.constexpr, OFFSET_FROM_TENSOR: tl.constexpr,
    OFFSET_PER_REQUEST: tl.constexpr, WALK: tl.constexpr, STAGED: tl.constexpr,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, TRUNCATE: tl.constexpr,
    HAS_BONUS: tl.constexpr, SEARCH_BLOCK: tl.constexpr, LOGPROBS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_V: tl.constexpr, SPLIT_TILE: tl.constexpr,
    CHUNK_TILE: tl.constexpr,
):
    """``WALK`` (one slice per row; logits or ``TRUNCATE``): one wave, :func:`_walk_rows`; otherwise see the
    module docstring. ``TRUNCATE`` needs ``WALK`` or ``STAGED``: a truncation threshold needs the whole row, read
    by one program or shared by the request's programs (``kernels/chain_verify_stages.py``)."""
    if STAGED:
        tl.static_assert(ROWS == 1, "the staged plan holds one request per program")
    ticket_damaged = False
    claim_gave_up = stamp < 0  # False, as a value: the claims' branches assign one
    if LOGITS and not (WALK or STAGED):
        # The launch's words are this launch's before any program takes a ticket, whatever they held.
        if claim(tickets_ptr + LAUNCH_CLAIM_WORD, stamp):
            _reset_launch(tickets_ptr, wave1_arrivals_ptr, arrivals_ptr, failed_ptr, tl.cdiv(batch_size, ROWS))
            claimed(tickets_ptr + LAUNCH_CLAIM_WORD, stamp)
        else:
            claim_gave_up = wait_for_claim(tickets_ptr + LAUNCH_CLAIM_WORD, stamp)
        # Modulo the grid, every role is taken once whatever the word held; a ticket outside it is damage.
        ticket = tl.atomic_add(tickets_ptr + TICKET_WORD, 1, sem="relaxed")
        role = ticket % tl.num_programs(0)  # int64 tickets: contiguous unless a damaged count is within the
        role = tl.where(role < 0, role + tl.num_programs(0), role)  # grid of 2**63
        ticket_damaged = ticket != role
        role = role.to(tl.int32)
    else:
        role = tl.program_id(0)  # nobody waits: any order is fine
    num_row_blocks = tl.cdiv(batch_size, ROWS)
    programs_per_wave = num_row_blocks * num_splits
    wave = role // programs_per_wave
    row_block = (role % programs_per_wave) // num_splits
    split = role % num_splits
    failed_ptr += row_block  # the row block's: a wait of any of its programs that gave up fails all its requests
    if not (WALK or STAGED or LOGITS):  # the one-wave plan: the claim first, with the least live
        claim_gave_up = _claim_row_block(claims_ptr + row_block, stamp, num_splits, arrivals_ptr + row_block,
                                         failed_ptr, stages_ptr, None, None, LOGITS, STAGED, BLOCK_K1)
    give_up = role == fault_role
    chunk_lo = split * chunks_per_split
    chunk_hi = tl.minimum(chunk_lo + chunks_per_split, num_chunks)
    vocab_lo = chunk_lo * BLOCK_V
    vocab_hi = tl.minimum(chunk_hi * BLOCK_V, vocab_size)

    requests = row_block * ROWS + tl.arange(0, ROWS)
    active = requests < batch_size
    greedy, sampled, inverse_temperature = request_temperatures(temperature_ptr, requests, active, HAS_TEMPERATURE,
                                                                ROWS)
    first_ids, target_rows, draft_rows, num_drafts = _request_rows(
        draft_ids_ptr, target_ptr, draft_ptr, num_drafts_ptr, cu_ptr, requests, active, max_drafts, num_tokens,
        stride_ids_b, stride_target_b, stride_draft_b, HAS_NUM_DRAFTS, PACKED, BONUS_ROWS, ROWS)
    # The last target row a decision may read: n_b, or n_b - 1 when the engine gives the bonus token (row n_b is
    # then never read, unless its logprob is asked for; the bonus-free layout has none).
    gives_bonus, bonus = _bonus_ids(bonus_ptr, requests, active, vocab_size, HAS_BONUS, BONUS_ROWS)
    last_row = num_drafts - gives_bonus.to(tl.int32)
    if LOGPROBS and BONUS_ROWS:
        last_row = num_drafts
    raw_sum_ptr = stat_sum_ptr + batch_size.to(tl.int64) * BLOCK_K1 * num_splits  # LOGPROBS raw: T = 1 sums
    positions = tl.arange(0, BLOCK_K1)[None, :]
    parameters = truncation_parameters(top_k_ptr, top_p_ptr, min_p_ptr, requests, active, vocab_size, HAS_TOP_K,
                                       HAS_TOP_P, HAS_MIN_P, ROWS)
    truncating = (sampled & any_truncation(parameters)).to(tl.int32)
    if STAGED:  # its reset needs the requests' truncation
        claim_gave_up = _claim_row_block(claims_ptr + row_block, stamp, num_splits, arrivals_ptr + row_block,
                                         failed_ptr, request_records(stages_ptr, row_block, BLOCK_K1), truncating,
                                         parameters, LOGITS, STAGED, BLOCK_K1)
    if not WALK:
        if claim_gave_up | ticket_damaged:
            tl.atomic_add(failed_ptr, 1, sem="relaxed")

    if WALK:
        in_chain, token_ids, valid, safe_ids = _draft_tokens(first_ids, active, num_drafts, vocab_size,
                                                             BLOCK_K1)
        k0, k1, c2, c3 = request_key(seed_ptr, seed_low, seed_high, offset_ptr, offset_low, offset_high,
                                     requests, active, SEED_PER_REQUEST, OFFSET_FROM_TENSOR, OFFSET_PER_REQUEST)
        stop, stop_max, stop_inverse_norm, stop_threshold, stop_reciprocal, greedy_token, row_tiles = _walk_rows(
            target_rows, draft_rows, requests, active, greedy, sampled, num_drafts, last_row, valid, safe_ids,
            inverse_temperature, k0, k1, c2, c3, max_drafts, vocab_size, stride_target_k, stride_draft_k,
            truncating, parameters, LOGITS, HAS_DRAFT, TRUNCATE, ROWS, BLOCK_K1, BLOCK_V, SEARCH_BLOCK, LOGPROBS)
        row_maxes, inverse_norms, raw_sums, thresholds, reciprocals = row_tiles
        at_stop = positions == stop[:, None]
        subtract = sampled & (tl.max((at_stop & valid).to(tl.int32), axis=1) > 0)
        takes_bonus = _takes_bonus(gives_bonus, stop, num_drafts)
        sampling = sampled & ~takes_bonus
        if tl.max(sampling.to(tl.int32), axis=0) > 0:
            sample_slice(
                target_rows, draft_rows, chunk_total_ptr, chunk_pick_ptr,
                requests, sampling, subtract, stop, tl.sum(tl.where(at_stop, safe_ids, 0), axis=1),
                stop_max, stop_inverse_norm, inverse_temperature, k0, k1, c2, c3, num_chunks, 0, num_chunks,
                vocab_size, stride_target_k, stride_draft_k, stop_threshold, stop_reciprocal, truncating,
                LOGITS, HAS_DRAFT, TRUNCATE, BLOCK_V,
            )
        tl.debug_barrier()  # the chunk results this program wrote, visible to all its threads
        token = tl.where(greedy, greedy_token, sampled_tokens(
            target_rows, chunk_total_ptr, chunk_pick_ptr, requests, sampling, subtract, stop, stop_max,
            stop_inverse_norm, inverse_temperature, k0, k1, c2, c3, num_chunks, vocab_size, stride_target_k,
            stop_threshold, stop_reciprocal, truncating, LOGITS, TRUNCATE, ROWS, BLOCK_V, CHUNK_TILE))
        token = tl.where(takes_bonus, bonus, token)
        write_outputs(output_ptr, num_accepted_ptr, logprobs_ptr, requests, active, stop, token, token_ids,
                      max_drafts, stride_output_b,
                      _scored_rows(target_rows, stride_target_k, num_drafts, greedy, row_maxes, inverse_norms,
                                   raw_sums, inverse_temperature, thresholds, reciprocals, truncating, BONUS_ROWS,
                                   BLOCK_K1),
                      LOGITS, TRUNCATE, LOGPROBS, BLOCK_K1)
    else:
        if LOGITS and not STAGED:
            publishes = wave == 0
        else:
            publishes = False
        if publishes:
            scan_statistics(
                target_rows, stat_max_ptr, stat_arg_ptr, stat_sum_ptr, raw_sum_ptr, requests, active, active,
                last_row, inverse_temperature, split, num_splits, max_drafts, vocab_lo, vocab_hi, stride_target_k,
                LOGITS, ROWS, BLOCK_K1, BLOCK_V, LOGPROBS == RAW_LOGPROBS,
            )
            tl.debug_barrier()
            tl.atomic_add(wave1_arrivals_ptr + row_block, 1, sem="release")
        else:
            records = request_records(stages_ptr, row_block, BLOCK_K1)  # used by STAGED only
            if LOGITS and STAGED:
                staged_statistics(
                    records, target_rows, stat_max_ptr, stat_arg_ptr, stat_sum_ptr, raw_sum_ptr, requests, active,
                    last_row, inverse_temperature, num_chunks, chunks_per_split, num_splits, max_drafts, vocab_size,
                    stride_target_k, failed_ptr, give_up, LOGITS, ROWS, BLOCK_K1, BLOCK_V, LOGPROBS == RAW_LOGPROBS)
            elif LOGITS:
                wait_for(wave1_arrivals_ptr + row_block, num_splits, failed_ptr, give_up)
            elif tl.max(greedy.to(tl.int32), axis=0) > 0:
                scan_statistics(
                    target_rows, stat_max_ptr, stat_arg_ptr, stat_sum_ptr, raw_sum_ptr, requests, active, greedy,
                    last_row, inverse_temperature, split, num_splits, max_drafts, vocab_lo, vocab_hi,
                    stride_target_k, LOGITS, ROWS, BLOCK_K1, BLOCK_V, False,
                )

            # Acceptance tests of sampled requests at every position (gathers only).
            in_chain, token_ids, valid, safe_ids = _draft_tokens(first_ids, active, num_drafts, vocab_size,
                                                                 BLOCK_K1)
            gather = valid & sampled[:, None]
            # Read before the statistics, which may wait on other programs: the loads are in flight meanwhile.
            target_given = given_values(row_at(target_rows[:, None], positions, stride_target_k), safe_ids, gather,
                                        LOGITS)
            if HAS_DRAFT:
                draft_at = proposal_probability(tl.load(
                    row_at(draft_rows[:, None], positions, stride_draft_k) + safe_ids, mask=gather,
                    other=0.0).to(tl.float32))
            else:
                draft_at = tl.full((ROWS, BLOCK_K1), 1.0, tl.float32)
            target_max = tl.zeros((ROWS, BLOCK_K1), tl.float32)
            target_inverse_norm = tl.zeros((ROWS, BLOCK_K1), tl.float32)
            raw_sums = tl.zeros((ROWS, BLOCK_K1), tl.float32)
            if LOGITS:
                # LOGPROBS: greedy requests' rows too (their raw values; T is 1 for them).
                target_max, target_inverse_norm, raw_sums = _combine_normalisers(
                    stat_max_ptr, stat_sum_ptr, requests, active if LOGPROBS else sampled, num_splits, max_drafts,
                    inverse_temperature, ROWS, BLOCK_K1, SPLIT_TILE)
                if LOGPROBS == RAW_LOGPROBS:
                    _, _, raw_sums = _combine_normalisers(
                        stat_max_ptr, raw_sum_ptr, requests, active, num_splits, max_drafts,
                        tl.full((ROWS,), 1.0, tl.float32), ROWS, BLOCK_K1, SPLIT_TILE)
            target_at = processed_probability(target_given, (target_max, target_inverse_norm, inverse_temperature[:, None]),
                                              None, LOGITS, False)
            threshold = tl.zeros((ROWS, BLOCK_K1), tl.int32)
            reciprocal = tl.zeros((ROWS, BLOCK_K1), tl.float64)
            if STAGED and TRUNCATE:
                if tl.max(truncating, axis=0) > 0:
                    threshold, reciprocal = staged_thresholds(
                        records, target_rows, truncating, last_row, parameters,
                        target_max, target_inverse_norm, inverse_temperature, vocab_size, chunks_per_split,
                        num_splits, stride_target_k, failed_ptr, give_up, LOGITS, BLOCK_K1,
                        BLOCK_V, SEARCH_BLOCK)
                    # The core's truncation step (processed_probability's second half), once the thresholds'
                    # stages are done: the whole core applied after them spilled Triton 3.6's logits staged
                    # compile 4-12 bytes at its register cap.
                    target_at = truncated_probability(target_at, threshold, reciprocal, truncating[:, None] != 0)
            k0, k1, c2, c3 = request_key(seed_ptr, seed_low, seed_high, offset_ptr, offset_low, offset_high,
                                         requests, active, SEED_PER_REQUEST, OFFSET_FROM_TENSOR, OFFSET_PER_REQUEST)
            w0, _, _, _ = random_words(k0[:, None], k1[:, None], c2[:, None], c3[:, None], ACCEPT_STREAM, positions,
                                       tl.zeros((ROWS, BLOCK_K1), tl.int32))
            accepted = valid & acceptance(w0, target_at, draft_at, False, False)  # sampled requests only
            stop = tl.min(tl.where(in_chain & ~accepted, positions, BLOCK_K1), axis=1)
            stop = tl.minimum(stop, num_drafts)
            at_stop = positions == stop[:, None]
            subtract = sampled & (tl.max((at_stop & valid).to(tl.int32), axis=1) > 0)
            stop_max = tl.sum(tl.where(at_stop, target_max, 0.0), axis=1)
            stop_inverse_norm = tl.sum(tl.where(at_stop, target_inverse_norm, 0.0), axis=1)
            sampling = sampled & ~_takes_bonus(gives_bonus, stop, num_drafts)
            stop_threshold = tl.sum(tl.where(at_stop, threshold, 0), axis=1)
            stop_reciprocal = tl.sum(tl.where(at_stop, reciprocal, 0.0), axis=1)

            if tl.max(sampling.to(tl.int32), axis=0) > 0:
                sample_slice(
                    target_rows, draft_rows, chunk_total_ptr, chunk_pick_ptr,
                    requests, sampling, subtract, stop, tl.sum(tl.where(at_stop, safe_ids, 0), axis=1),
                    stop_max, stop_inverse_norm, inverse_temperature, k0, k1, c2, c3, num_chunks, chunk_lo,
                    chunk_hi, vocab_size, stride_target_k, stride_draft_k, stop_threshold, stop_reciprocal, truncating, LOGITS, HAS_DRAFT, TRUNCATE, BLOCK_V,
                )

            # The last program of the row block chooses and writes the outputs;
            # it puts the block's counters back to zero for the next call.
            tl.debug_barrier()
            if arrive(arrivals_ptr + row_block, num_splits, failed_ptr, True):
                tl.debug_barrier()
                tl.atomic_add(arrivals_ptr + row_block, -num_splits, sem="relaxed")
                if STAGED or not LOGITS:
                    if num_splits > 1:  # every program of the row block claimed
                        tl.atomic_xchg(claims_ptr + row_block, 0, sem="relaxed")
                # Every wait of the row block is over: a give-up fails its requests.
                failed = count_give_ups(failed_ptr, errors_ptr + CHAIN_WAIT_GAVE_UP)
                if STAGED:
                    clear_request_records(records, truncating, parameters, LOGITS, BLOCK_K1)
                greedy_stop, greedy_token = greedy_decisions(
                    stat_max_ptr, stat_arg_ptr, requests, greedy, token_ids, valid, in_chain, num_drafts,
                    num_splits, max_drafts, LOGITS, ROWS, BLOCK_K1, SPLIT_TILE)
                token = tl.where(greedy, greedy_token, sampled_tokens(
                    target_rows, chunk_total_ptr, chunk_pick_ptr, requests, sampling, subtract, stop, stop_max,
                    stop_inverse_norm, inverse_temperature, k0, k1, c2, c3, num_chunks, vocab_size, stride_target_k,
                    stop_threshold, stop_reciprocal, truncating, LOGITS, TRUNCATE,
                    ROWS, BLOCK_V, CHUNK_TILE))
                stop = tl.where(greedy, greedy_stop, stop)
                token = tl.where(_takes_bonus(gives_bonus, stop, num_drafts), bonus, token)
                stop = tl.where(failed, 0, stop)  # the failure outcome: tokens -1, num_accepted 0
                token = tl.where(failed, -1, token)
                write_outputs(output_ptr, num_accepted_ptr, logprobs_ptr, requests, active, stop, token, token_ids,
                              max_drafts, stride_output_b,
                              _scored_rows(target_rows, stride_target_k, num_drafts, greedy, target_max,
                                           target_inverse_norm, raw_sums, inverse_temperature, threshold, reciprocal,
                                           truncating, BONUS_ROWS, BLOCK_K1),
                              LOGITS, TRUNCATE, LOGPROBS, BLOCK_K1)

        if LOGITS and not STAGED:
            # The last program to end puts the launch's words back to zero, and its claim. The row blocks'
            # outcomes are written by now: a damaged end count is counted as a fault directly.
            num_programs = tl.num_programs(0)
            errors = errors_ptr + CHAIN_WAIT_GAVE_UP
            if arrive(tickets_ptr + END_WORD, num_programs, errors, False):
                _reset_launch(tickets_ptr, wave1_arrivals_ptr, arrivals_ptr, failed_ptr - row_block, num_row_blocks)
                tl.atomic_xchg(tickets_ptr + LAUNCH_CLAIM_WORD, 0, sem="relaxed")
