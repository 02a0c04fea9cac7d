"""Reads of target and draft rows shared by the chain and tree kernels: the Triton row core.

``target_probability`` is the processed target value at (row, token), the
one every plan of both kernels reads: the row as given or ``softmax(x / T)``
of logits, then its top-k/top-p/min-p truncation; a new rule on target
rows goes there. ``row_statistics`` is a target row's max, argmax and softmax normaliser,
and ``scan_statistics`` those of a slice of rows ``0..n_b``, stored per
slice (draft rows are always probabilities: they need none);
``request_temperatures`` the requests' greedy flags and ``1 / T``;
``acceptance`` the test of a proposed token; ``target_logprob`` the
log-probability an emitted token is reported with (``emitted_logprob``
reads the value);
``sample_slice`` is the per-element pass of the sampler: loads, subtract,
clamp, scale, convert, one int64 scan per 1024-token chunk, a compare and
a count (``kernels/sampling.py``); no random number per element.
"""

import triton
import triton.language as tl

from .rng import uniform_from_word
from .sampling import chunk_draw, chunk_pick, fixed_point, given_probability, given_values, softmax_weight
from .truncation import truncated_probability

# The sampler's pass is software-pipelined: the loads of the next LOAD_STAGES - 1 chunks are issued (cp.async
# into shared memory) while a chunk is reduced. Without it each iteration waits out its own DRAM latency, and
# at B >= 64 a program's serial chain of tiles, not bandwidth, bounds the kernel (bench/results/sass_model.md:
# predicted 25% -> 38% of copy bandwidth at B = 64, 44% -> 70% at B = 512). Arithmetic is unchanged: the same
# bits, so the interpreter, which ignores it, tests the same program.
LOAD_STAGES = tl.constexpr(3)
# The kernels' LOGPROBS: none, the raw rows' or the processed rows' (``logprobs=``, contract v1.3).
RAW_LOGPROBS = tl.constexpr(1)
PROCESSED_LOGPROBS = tl.constexpr(2)


@triton.jit
def row_pointers(base_ptr, requests, stride_request, position, stride_position):
    """``base + request * stride_request + position * stride_position`` in 64 bits.

    ``K * stride`` passes ``2**31`` for strided inputs; ``aot.py`` checks the
    PTX for any 32-bit use of a stride.
    """
    return row_at(base_ptr + requests.to(tl.int64) * stride_request, position, stride_position)


@triton.jit
def row_at(first_row, position, stride_position):
    """Row ``position`` of requests whose row 0 is at ``first_row``: ``first_row + position * stride`` in 64 bits.

    The chain kernel addresses every row this way, so one kernel serves the
    padded layout and the packed one (only ``first_row`` differs).
    """
    return first_row + tl.cast(position, tl.int64) * stride_position


@triton.jit
def target_probability(row, index, mask, statistics, truncation, LOGITS: tl.constexpr, TRUNCATE: tl.constexpr):
    """The processed target probability at ``index`` of ``row`` (``reference/_rows.target_distributions``).

    ``statistics`` is the row's ``(max, 1 / sum, 1 / T)`` (used with
    ``LOGITS``: ``exp((x - max) / T) / sum``; probabilities are read as
    given), ``truncation`` its ``(threshold, reciprocal, truncating)`` from
    ``kernels/truncation.py`` (applied with ``TRUNCATE`` where
    ``truncating``). Every element broadcasts against ``index``. Masked
    lanes come out 0 (NaN for a logits row without mass), which weigh 0.
    """
    return processed_probability(given_values(row, index, mask, LOGITS), statistics, truncation, LOGITS, TRUNCATE)


@triton.jit
def processed_probability(given, statistics, truncation, LOGITS: tl.constexpr, TRUNCATE: tl.constexpr):
    """:func:`target_probability` of values already read (``sampling.given_values``): a plan that must issue
    the loads before its statistics are known (they come from other programs) reads first."""
    row_max, inverse_norm, inverse_temperature = statistics
    p = given_probability(given, row_max, inverse_norm, inverse_temperature, LOGITS)
    if TRUNCATE:
        threshold, reciprocal, truncating = truncation
        p = truncated_probability(p, threshold, reciprocal, truncating)
    return p


@triton.jit
def target_logprob(given, scored, statistics, raw_sum, truncation, greedy, LOGITS: tl.constexpr,
                   TRUNCATE: tl.constexpr, LOGPROBS: tl.constexpr):
    """The log-probability of values already read (``sampling.given_values``) under their target rows
    (``reference/_logprobs``), the one every plan writes; lanes not ``scored`` come out 0.

    The raw row: ``log_softmax`` of logits, ``(x - max) - log(raw_sum)``
    with ``raw_sum`` the row's ``sum exp(x - max)`` (``T = 1``), or the log
    of a probability. With ``PROCESSED_LOGPROBS`` the processed row
    (:func:`processed_probability`), except where ``greedy`` (the raw value,
    contract v1.3).
    """
    # Lanes not scored read 1 under a unit row: no log(0) or inf - inf (the interpreter warns of both).
    row_max, inverse_norm, inverse_temperature = statistics
    given = tl.where(scored, given, 1.0)
    row_max = tl.where(scored, row_max, 1.0)
    raw_sum = tl.where(scored, raw_sum, 1.0)
    if LOGITS:
        raw = (given - row_max) - tl.log(raw_sum)
    else:
        raw = tl.log(given)
    if LOGPROBS == PROCESSED_LOGPROBS:
        p = processed_probability(given, (row_max, tl.where(scored, inverse_norm, 1.0), inverse_temperature),
                                  truncation, LOGITS, TRUNCATE)
        return tl.where(greedy, raw, tl.log(tl.where(scored, p, 1.0)))
    return raw


@triton.jit
def emitted_logprob(row, token, scored, statistics, raw_sum, truncation, greedy, LOGITS: tl.constexpr,
                    TRUNCATE: tl.constexpr, LOGPROBS: tl.constexpr):
    """The score of an emitted ``token`` under its target ``row`` (:func:`target_logprob` of its value, read
    here): ``-inf`` where the token is -1 (the contract's first rule); other lanes not ``scored`` come out 0."""
    read = scored & (token >= 0)
    given = given_values(row, tl.where(read, token, 0), read, LOGITS)
    value = target_logprob(given, read, statistics, raw_sum, truncation, greedy, LOGITS, TRUNCATE, LOGPROBS)
    return tl.where(token >= 0, value, -float("inf"))


@triton.jit
def sample_slice(
    target_rows, draft_rows, chunk_total_ptr, chunk_pick_ptr,
    requests, sampled, subtract, stop, stop_token, stop_max, stop_inverse_norm, inverse_temperature, k0, k1, c2, c3, num_chunks, chunk_lo, chunk_hi, vocab_size,
    stride_target_k, stride_draft_k,
    truncation_threshold, truncation_reciprocal, truncating,
    LOGITS: tl.constexpr, HAS_DRAFT: tl.constexpr, TRUNCATE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Chunk totals and candidates of chunks ``[chunk_lo, chunk_hi)`` of row ``stop``, stored at ``[request, chunk]``.

    ``target_rows`` / ``draft_rows`` point at each request's row 0 (rows
    ``stride_target_k`` / ``stride_draft_k`` apart). The weights are the
    residual ``max(0, p - q)`` where ``subtract``, else ``p``, with ``q`` the
    point mass on ``stop_token`` where that was not drawn from the draft; with
    ``LOGITS`` the target rows are logits normalised by the stop row's
    ``(max, 1 / sum)`` (draft rows are always probabilities, v1.3). ``sampled`` masks the requests. With ``TRUNCATE``
    ``p`` is the stop row's top-k/top-p/min-p truncation where ``truncating``
    (``kernels/truncation.py``).
    """
    vocab = tl.arange(0, BLOCK_V)[None, :]
    target_row = row_at(target_rows, stop, stride_target_k)[:, None]
    draft_row = row_at(draft_rows, stop, stride_draft_k)
    slot = requests.to(tl.int64) * num_chunks
    # The residual subtracts the draft row where the stop token was drawn from it, else the point mass on the
    # token (no draft, or q(t) not > 0: a deterministic proposal, v1.3).
    # One int a row, -1 where nothing is: a mask and the token kept across the loop spilled under Triton 3.6.
    point_token = tl.where(subtract, stop_token, -1).to(tl.int32)
    if HAS_DRAFT:
        draft_at_token = tl.load(draft_row + stop_token, mask=subtract, other=0.0).to(tl.float32)
        from_draft = (subtract & drawn_from_draft(draft_at_token))[:, None]
        point_token = tl.where(from_draft, -1, point_token[:, None])
    else:
        point_token = point_token[:, None]
    draft_row = draft_row[:, None]
    # Not with TRUNCATE: its kernels sit at the register cap, and the stages' buffers' addresses spill them.
    for chunk in tl.range(chunk_lo, chunk_hi, num_stages=1 if TRUNCATE else LOAD_STAGES):
        index = chunk * BLOCK_V + vocab
        mask = sampled[:, None] & (index < vocab_size)
        p = target_probability(target_row, index, mask,
                               (stop_max[:, None], stop_inverse_norm[:, None], inverse_temperature[:, None]),
                               (truncation_threshold[:, None], truncation_reciprocal[:, None], truncating[:, None] != 0),
                               LOGITS, TRUNCATE)
        if HAS_DRAFT:
            q = tl.load(draft_row + index, mask=mask & from_draft, other=0.0).to(tl.float32)
        else:
            q = tl.zeros((1, BLOCK_V), tl.float32)
        q = tl.where(index == point_token, 1.0, q)
        # fixed_point maps the negatives and NaNs of p - q to 0: max(0, p - q) in one step.
        total, offset = chunk_pick(fixed_point(p - q), chunk_draw(k0, k1, c2, c3, stop, chunk))
        tl.store(chunk_total_ptr + slot + chunk, total, mask=sampled)
        tl.store(chunk_pick_ptr + slot + chunk, chunk * BLOCK_V + offset, mask=sampled)


@triton.jit
def drawn_from_draft(draft_at_token):
    """Proposals that can have been drawn from the draft: ``q(t) > 0`` (``reference/_sampling.drawn_from_draft``)."""
    return draft_at_token > 0.0


@triton.jit
def proposal_probability(draft_at_token):
    """The ``q(t)`` of the acceptance test: itself if drawn from the draft, else 1, the point mass on ``t``."""
    return tl.where(drawn_from_draft(draft_at_token), draft_at_token, 1.0)


@triton.jit
def acceptance(word, target_at_token, proposal_at_token, greedy, greedy_hit):
    """The acceptance test of a proposed token, the one every plan of both kernels runs (``reference/_rows``).

    ``u * q(t) < p(t)``, ``u`` the uniform of the acceptance stream's
    ``word`` and ``q(t)`` from :func:`proposal_probability` (1 for a point
    mass); where ``greedy`` holds, ``greedy_hit`` (the token is the raw row's
    argmax) instead. The callers mask the proposals that were not made.
    """
    return acceptance_of_uniform(uniform_from_word(word), target_at_token, proposal_at_token, greedy, greedy_hit)


@triton.jit
def acceptance_of_uniform(uniform, target_at_token, proposal_at_token, greedy, greedy_hit):
    """:func:`acceptance` with the uniform already drawn (the FlashInfer counters choose between two words)."""
    return tl.where(greedy, greedy_hit, uniform * proposal_at_token < target_at_token)


@triton.jit
def scan_statistics(
    target_rows, stat_max_ptr, stat_arg_ptr, stat_sum_ptr, raw_sum_ptr, requests, active, read_target, last_row,
    inverse_temperature, split, num_splits, max_drafts, vocab_lo, vocab_hi, stride_target_k,
    LOGITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_V: tl.constexpr,
    RAW_SUM: tl.constexpr,
):
    """:func:`row_statistics` of this slice of target rows ``0..last_row``, stored at ``[request, position, split]``
    (the ``RAW_SUM`` sums in ``raw_sum_ptr``'s slots).

    ``read_target`` masks the requests whose rows are read; rows past
    ``last_row`` (``n_b``, or ``n_b - 1`` when the engine gives the bonus token) are not read.
    """
    slot = requests.to(tl.int64) * BLOCK_K1 * num_splits + split
    for position in range(0, max_drafts + 1):
        row_max, row_arg, row_sum, raw_sum = row_statistics(
            row_at(target_rows, position, stride_target_k)[:, None], (read_target & (position <= last_row))[:, None],
            inverse_temperature, vocab_lo, vocab_hi, LOGITS, ROWS, BLOCK_V, RAW_SUM)
        here = slot + position * num_splits
        tl.store(stat_max_ptr + here, row_max, mask=active)
        tl.store(stat_arg_ptr + here, row_arg, mask=active)
        if LOGITS:
            tl.store(stat_sum_ptr + here, row_sum, mask=active)
            if RAW_SUM:
                tl.store(raw_sum_ptr + here, raw_sum, mask=active)


@triton.jit
def row_statistics(target_row, read_target, inverse_temperature, vocab_lo, vocab_hi,
                   LOGITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr, RAW_SUM: tl.constexpr = False):
    """Statistics of ``[vocab_lo, vocab_hi)`` of one target row of each request (``[ROWS, 1]`` row pointers).

    ``(max, argmax, sum, raw_sum)``: the row's max (NaN ignored) and argmax
    (ties to the lower index); with ``LOGITS`` also ``sum exp((x - max) / T)``
    and, with ``RAW_SUM``, ``sum exp(x - max)`` (``T = 1``: raw logprobs'
    normaliser, in the same pass; else 0). Draft rows need none: they are
    always probabilities (v1.3). ``read_target`` (``[ROWS, 1]``) masks the
    rows read.
    """
    vocab = tl.arange(0, BLOCK_V)[None, :]
    row_max = tl.full((ROWS,), -float("inf"), tl.float32)
    row_arg = tl.full((ROWS,), 2147483647, tl.int32)
    row_sum = tl.zeros((ROWS,), tl.float32)
    raw_sum = tl.zeros((ROWS,), tl.float32)
    for start in range(vocab_lo, vocab_hi, BLOCK_V):
        index = start + vocab
        in_slice = index < vocab_hi
        x = tl.load(target_row + index, mask=read_target & in_slice, other=-float("inf")).to(tl.float32)
        x = tl.where(x == x, x, -float("inf"))
        tile_max = tl.max(x, axis=1)
        tile_arg = tl.min(tl.where(x == tile_max[:, None], index, 2147483647), axis=1)
        row_arg = tl.where((tile_max > row_max) | ((tile_max == row_max) & (tile_arg < row_arg)), tile_arg, row_arg)
        if LOGITS:
            new_max = tl.maximum(row_max, tile_max)
            row_sum = row_sum * softmax_weight(row_max - new_max, inverse_temperature) + tl.sum(
                softmax_weight(x - new_max[:, None], inverse_temperature[:, None]), axis=1)
            if RAW_SUM:
                raw_sum = raw_sum * softmax_weight(row_max - new_max, 1.0) + tl.sum(
                    softmax_weight(x - new_max[:, None], 1.0), axis=1)
        row_max = tl.maximum(row_max, tile_max)
    return row_max, row_arg, row_sum, raw_sum


@triton.jit
def inverse_norm(row_sum):
    """``1 / row_sum``, NaN for a row without mass, so its probabilities come out NaN like the reference's ``0 / 0``.

    div_rn: ``/`` is approximate on GPUs, and ``T = inf`` (``p = 1 / n``) must
    match the reference exactly. NaN rather than ``1 / 0 = inf``: ``0 * inf``
    is NaN too, but warns in the interpreter.
    """
    safe_sum = tl.where(row_sum > 0.0, row_sum, 1.0)
    return tl.where(row_sum > 0.0, tl.math.div_rn(tl.zeros_like(safe_sum) + 1.0, safe_sum), float("nan"))


@triton.jit
def request_temperatures(temperature_ptr, requests, active, HAS_TEMPERATURE: tl.constexpr, ROWS: tl.constexpr):
    """``(greedy, sampled, 1 / T)`` of the requests, the contract's rule for every op (v1.3).

    ``T > 0`` samples; any other value (``0``, a negative marker such as
    vLLM's ``-1``, NaN) is greedy and uses ``T = 1``; no temperatures is
    ``T = 1`` for all (``reference/_sampling.greedy_requests``).
    div_rn: ``/`` is approximate on GPUs, and ``T = inf`` must give ``1 / T = 0`` exactly.
    """
    if HAS_TEMPERATURE:
        temperature = tl.load(temperature_ptr + requests, mask=active, other=1.0)
    else:
        temperature = tl.full((ROWS,), 1.0, tl.float32)
    samples = temperature > 0.0  # false for NaN
    greedy = active & ~samples
    sampled = active & samples
    inverse_temperature = tl.math.div_rn(tl.full((ROWS,), 1.0, tl.float32), tl.where(samples, temperature, 1.0))
    return greedy, sampled, inverse_temperature
