"""The stage records through which the programs of one request share its vocabulary passes (split plan).

A *stage* is one pass over a request's vocabulary: a rejection's totals,
the final sample's chunk results, or a node's *entry*: the statistics of
its rows (logits normalisers, the greedy argmax) and its truncation
thresholds, found by the one program that takes the stage's only slice. Every program of the request walks
the tree (the acceptance tests are a few gathers) and reaches the same
stages in the same order; the pass itself is divided into slices of whole
sampler chunks that the programs *take* from a counter, so no program
waits for one that has not started: each takes slices until none is left,
and then waits only for slices already taken, by programs that are
running. A program that starts late finds every slice taken and only reads
the results, which stay in place until the request's last program ends.

Record of a stage, ``STAGE_WORDS`` int64 (one 128-byte line), at
``history + stage * STAGE_WORDS``; the request has ``tree_size + 2``
records (each node tried or entered is at most one stage: at most
``tree_size`` rejections and entries, then the sample), the last one its
end record (:func:`end_record`):

====  ====================================================================
0     slices taken (a counter, past ``splits`` once all are taken)
1     slices published (``splits`` once the totals are complete)
2-7   the rejection totals, split at bit 31: residual, ``p``, ``q`` without
      the rejected token (integer sums, so the order of the atomic adds
      does not matter)
2-7   an entry instead: the float32 bits of ``p``'s max and ``1 / sum``,
      the greedy token, the truncation threshold, the float64 bits of its
      reciprocal and (``LOGPROBS``) the float32 bits of the raw scores' sum
      (:func:`publish_entry`; the draft is probabilities)
====  ====================================================================

The rejection a stage makes (token, residual-had-mass flag, reciprocals)
is not recorded: every program derives it from the same totals and keeps
the current node's rejections in registers to replay them
(:func:`replay_rejection`), so a pass reads no record per tile.

End record: word 0 counts the programs out, word 1 is the request's claim
(``kernels/stage_records.py``, ``claim``), word 2 is nonzero once a wait
of the request gave up (``wait_for``). The request's first program
claims it and zeroes every other word of its records (:func:`begin_request`),
so a call starts from zeros whatever the words held; the last program to
end puts every record back to zero, the claim too (``tree_size + 2`` lines
of 128 bytes), whatever the programs did (one that gave up a wait goes on
with partial totals and may walk elsewhere).
"""

import triton
import triton.language as tl

from .stage_records import STAGE_WORDS, arrive, claim, claimed, count_give_ups, publish, wait_for_claim

TOTALS_WORD = tl.constexpr(2)
ENTRY_WORD = tl.constexpr(2)
_HIGH_SHIFT = tl.constexpr(32)  # replay reciprocals: p's float32 bits below bit 32, q's above,
_SIGN_SHIFT = tl.constexpr(31)  # and the residual flag in the sign bit of p's (the point-mass flag in q's)
_LOW_MASK = tl.constexpr((1 << 32) - 1)
_MAGNITUDE_MASK = tl.constexpr((1 << 31) - 1)
ENDED_WORD = tl.constexpr(0)  # end record: programs counted out,
CLAIM_WORD = tl.constexpr(1)  # the launch that owns the records,
FAILED_WORD = tl.constexpr(2)  # nonzero once a wait of the request gave up


@triton.jit
def publish_slice(record, residual_high, residual_low, target_high, target_low, drawn_high, drawn_low):
    """Add a slice's totals (``[1]``: the program's one request) into the stage and release it, after every store
    the slice made."""
    tl.atomic_add(record + TOTALS_WORD, tl.sum(residual_high, axis=0), sem="relaxed")
    tl.atomic_add(record + TOTALS_WORD + 1, tl.sum(residual_low, axis=0), sem="relaxed")
    tl.atomic_add(record + TOTALS_WORD + 2, tl.sum(target_high, axis=0), sem="relaxed")
    tl.atomic_add(record + TOTALS_WORD + 3, tl.sum(target_low, axis=0), sem="relaxed")
    tl.atomic_add(record + TOTALS_WORD + 4, tl.sum(drawn_high, axis=0), sem="relaxed")
    tl.atomic_add(record + TOTALS_WORD + 5, tl.sum(drawn_low, axis=0), sem="relaxed")
    publish(record, 1)


@triton.jit
def end_record(history, tree_size):
    """The request's end record (after its ``tree_size + 1`` stage records)."""
    return history + (tree_size.to(tl.int64) + 1) * STAGE_WORDS


@triton.jit
def stage_totals(record):
    """The six complete totals of a published rejection stage (read from L2)."""
    return (tl.load(record + TOTALS_WORD, cache_modifier=".cg"), tl.load(record + TOTALS_WORD + 1, cache_modifier=".cg"),
            tl.load(record + TOTALS_WORD + 2, cache_modifier=".cg"),
            tl.load(record + TOTALS_WORD + 3, cache_modifier=".cg"),
            tl.load(record + TOTALS_WORD + 4, cache_modifier=".cg"),
            tl.load(record + TOTALS_WORD + 5, cache_modifier=".cg"))


@triton.jit
def publish_entry(record, p_max, p_inverse_norm, greedy_token, threshold, reciprocal, raw_sum,
                  LOGITS: tl.constexpr, LOGPROBS: tl.constexpr):
    """Store a node's entry (``[1]`` values: the program's one request) and release it. The softmax statistics
    only with ``LOGITS`` (and the sum at ``T = 1`` with ``LOGPROBS``): probability rows are read as they are."""
    if LOGITS:
        tl.store(record + ENTRY_WORD, tl.sum(p_max.to(tl.int32, bitcast=True), axis=0).to(tl.int64))
        tl.store(record + ENTRY_WORD + 1, tl.sum(p_inverse_norm.to(tl.int32, bitcast=True), axis=0).to(tl.int64))
        if LOGPROBS:
            tl.store(record + ENTRY_WORD + 5, tl.sum(raw_sum.to(tl.int32, bitcast=True), axis=0).to(tl.int64))
    tl.store(record + ENTRY_WORD + 2, tl.sum(greedy_token, axis=0).to(tl.int64))
    tl.store(record + ENTRY_WORD + 3, tl.sum(threshold, axis=0).to(tl.int64))
    tl.store(record + ENTRY_WORD + 4, tl.sum(reciprocal.to(tl.int64, bitcast=True), axis=0))
    publish(record, 1)


@triton.jit
def _entry_word(record, word):
    """Word ``word`` of a published entry as a ``[1]`` tensor (read from L2)."""
    return tl.load(record + ENTRY_WORD + word + tl.zeros((1,), tl.int32), cache_modifier=".cg")


@triton.jit
def _entry_float(record, word):
    return _entry_word(record, word).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def entry_statistics(record, p_max, p_inverse_norm, raw_sum, LOGITS: tl.constexpr, LOGPROBS: tl.constexpr):
    """The published entry: ``(p_max, p_inverse_norm, greedy_token, threshold,
    reciprocal, raw_sum)``, ``[1]`` each, the bits :func:`publish_entry` stored (the statistics given, without
    ``LOGITS``: fewer values live across the wait, which kept an sm_80 compile from spilling 8 bytes)."""
    if LOGITS:
        p_max = _entry_float(record, 0)
        p_inverse_norm = _entry_float(record, 1)
        if LOGPROBS:
            raw_sum = _entry_float(record, 5)
    return (p_max, p_inverse_norm, _entry_word(record, 2).to(tl.int32),
            _entry_word(record, 3).to(tl.int32), _entry_word(record, 4).to(tl.float64, bitcast=True), raw_sum)


@triton.jit
def replay_rejection(replay_tokens, replay_reciprocals, slot, token, use_residual, point_mass, p_reciprocal,
                     q_reciprocal):
    """The replay registers with the current node's rejection number ``slot`` set (``[1]`` values: the program's
    one request): the token (int32), and one word of the float32 bits of the two reciprocals (float32 values
    widened, ``normaliser_reciprocal``; positive, so the sign bit of ``p``'s holds the residual flag and that
    of ``q``'s the point-mass flag, a deterministic candidate).

    Every program derives the same rejection from the same stage totals, so
    each keeps the node's rejections in its own registers and reads no record
    to replay them; the registers' length (a power of two) bounds the rejections
    at a node by the tree size (``launchers/tree_verify.py``, ``replay_slots``).
    Three registers a slot a thread at most: with four, Triton 3.6's truncating
    split compile spilled 4 bytes on sm_90a.
    """
    here = tl.arange(0, replay_tokens.shape[0]) == slot
    flagged = _float32_bits(p_reciprocal) | (use_residual.to(tl.int64) << _SIGN_SHIFT)
    flagged |= (_float32_bits(q_reciprocal) | (point_mass.to(tl.int64) << _SIGN_SHIFT)) << _HIGH_SHIFT
    reciprocals = tl.sum(flagged, axis=0)
    return (tl.where(here, tl.sum(token.to(tl.int32), axis=0), replay_tokens),
            tl.where(here, reciprocals, replay_reciprocals))


@triton.jit
def _float32_bits(reciprocal):
    return reciprocal.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64) & _LOW_MASK


@triton.jit
def _float32_of(bits):
    return (bits & _MAGNITUDE_MASK).to(tl.int32).to(tl.float32, bitcast=True).to(tl.float64)


@triton.jit
def _add_words(a_token, a_reciprocals, b_token, b_reciprocals):
    return a_token + b_token, a_reciprocals + b_reciprocals


@triton.jit
def replayed_rejection(replay_tokens, replay_reciprocals, slot):
    """Rejection number ``slot`` of the current node from the replay registers: ``(token, residual flag,
    point-mass flag, p reciprocal, q reciprocal)``, one reduction of the two registers (every other slot adds 0)."""
    here = tl.arange(0, replay_tokens.shape[0]) == slot
    token, reciprocals = tl.reduce((tl.where(here, replay_tokens, 0), tl.where(here, replay_reciprocals, 0)), 0,
                                   _add_words)
    return (token.to(tl.int64), (reciprocals >> _SIGN_SHIFT) & 1, (reciprocals >> (_HIGH_SHIFT + _SIGN_SHIFT)) & 1,
            _float32_of(reciprocals), _float32_of(reciprocals >> _HIGH_SHIFT))


@triton.jit
def begin_request(history, tree_size, stamp):
    """Before a program of the request touches its records: the first of the launch zeroes every word of them
    but the claim (:func:`_zero_records`), the others wait until it has."""
    end = end_record(history, tree_size)
    if claim(end + CLAIM_WORD, stamp):
        _zero_records(history, end, True)
        claimed(end + CLAIM_WORD, stamp)
    elif wait_for_claim(end + CLAIM_WORD, stamp):
        tl.atomic_add(end + FAILED_WORD, 1, sem="relaxed")


@triton.jit
def _zero_records(history, end, KEEP_CLAIM: tl.constexpr):
    """Zero every record of the request, the end record last (its claim word too unless ``KEEP_CLAIM``). Their
    count from the two addresses, live at the end anyway (keeping tree_size live there spilled on sm_80)."""
    records = (end.to(tl.int64, bitcast=True) - history.to(tl.int64, bitcast=True)) // (8 * STAGE_WORDS)
    words = tl.arange(0, STAGE_WORDS)
    for stage in range(0, records + 1):
        zeroed = words >= 0
        if KEEP_CLAIM:
            zeroed = tl.where(stage == records, words != CLAIM_WORD, zeroed)
        tl.store(history + stage * STAGE_WORDS + words, tl.zeros((STAGE_WORDS,), tl.int64), mask=zeroed)


@triton.jit
def end_request(history, tree_size, splits, errors_ptr):
    """Count this program out; the request's last program zeroes every record of the request, counts the waits
    that gave up into ``*errors_ptr``, and returns whether the request failed (the others return False)."""
    end = end_record(history, tree_size)
    tl.debug_barrier()  # every read of the records done before the arrival
    failed = tl.program_id(0) < 0
    if arrive(end + ENDED_WORD, splits, end + FAILED_WORD, True):
        failed = count_give_ups(end + FAILED_WORD, errors_ptr)
        _zero_records(history, end, False)  # every record, not only those the programs used
    return failed
