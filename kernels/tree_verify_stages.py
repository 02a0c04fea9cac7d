"""The stage records through which the programs of one request share its vocabulary passes (split plan).

A *stage* is one pass over a request's vocabulary: a rejection's totals,
or the final sample's chunk results. Every program of the request walks
the tree (the acceptance tests are a few gathers) and reaches the same
stages in the same order; the pass itself is divided into slices of whole
sampler chunks that the programs *take* from a counter, so no program
waits for one that has not started: each takes slices until none is left,
and then waits only for slices already taken, by programs that are
running. A program that starts late finds every slice taken and only reads
the results, which stay in place until the request's last program ends.

Record of a stage, ``STAGE_WORDS`` int64 (one 128-byte line), at
``history + stage * STAGE_WORDS``; the request has ``tree_size + 1``
records (at most ``tree_size - 1`` rejections and the sample), the last
one its end record (:func:`end_record`):

====  ====================================================================
0     slices taken (a counter, past ``splits`` once all are taken)
1     slices published (``splits`` once the totals are complete)
2-7   the rejection totals, split at bit 31: residual, ``p``, ``q`` without
      the rejected token (integer sums, so the order of the atomic adds
      does not matter)
8-11  the rejection as applied: token, residual-had-mass flag, and the
      float64 bits of the ``p`` and ``q`` reciprocals. Every program writes
      the same values, derived from the same totals.
====  ====================================================================

End record: word 0 counts the programs out, word 1 is the most stages any
program of the request used, word 2 is nonzero once a wait of the request
gave up (``kernels/chain_verify_finish.py``, ``wait_for``). The last program
of the request to end puts the records of that many stages and the end
record back to zero, so the next call starts from zeros without a memset
launch, whatever the programs did: one that gave up a wait goes on with
partial totals and may walk elsewhere, using more stages or fewer.
"""

import triton
import triton.language as tl

from .chain_verify_finish import count_give_ups, wait_for

STAGE_WORDS = tl.constexpr(16)
TAKEN_WORD = tl.constexpr(0)
PUBLISHED_WORD = tl.constexpr(1)
TOTALS_WORD = tl.constexpr(2)
TOKEN_WORD = tl.constexpr(8)
RESIDUAL_WORD = tl.constexpr(9)
P_RECIPROCAL_WORD = tl.constexpr(10)
Q_RECIPROCAL_WORD = tl.constexpr(11)
ENDED_WORD = tl.constexpr(0)  # end record: programs counted out,
STAGES_USED_WORD = tl.constexpr(1)  # the most stages a program used,
FAILED_WORD = tl.constexpr(2)  # nonzero once a wait of the request gave up


@triton.jit
def take_slice(record):
    """The next untaken slice of the stage (``>= splits`` once all are taken)."""
    return tl.atomic_add(record + TAKEN_WORD, 1, sem="relaxed")


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
def publish(record, slices):
    """Release ``slices`` slices of the stage, after every store and atomic add the program made for them
    (the final sample's chunk results; the truncation search's partials)."""
    tl.debug_barrier()  # every thread's stores issued before the release
    tl.atomic_add(record + PUBLISHED_WORD, slices, sem="release")


@triton.jit
def end_record(history, tree_size):
    """The request's end record (after its ``tree_size`` stage records)."""
    return history + tree_size.to(tl.int64) * STAGE_WORDS


@triton.jit
def wait_for_stage(record, splits, failed_ptr, give_up):
    """Wait until every slice of the stage is published (all were taken by running programs), or until the
    request failed (``wait_for``); returns whether it failed."""
    return wait_for(record + PUBLISHED_WORD, splits, failed_ptr, give_up)


@triton.jit
def stage_totals(record):
    """The six complete totals of a published rejection stage (read from L2)."""
    return (tl.load(record + TOTALS_WORD, cache_modifier=".cg"), tl.load(record + TOTALS_WORD + 1, cache_modifier=".cg"),
            tl.load(record + TOTALS_WORD + 2, cache_modifier=".cg"),
            tl.load(record + TOTALS_WORD + 3, cache_modifier=".cg"),
            tl.load(record + TOTALS_WORD + 4, cache_modifier=".cg"),
            tl.load(record + TOTALS_WORD + 5, cache_modifier=".cg"))


@triton.jit
def record_rejection(record, token, use_residual, p_reciprocal, q_reciprocal):
    """Store the rejection (``[1]`` values: the program's one request) as the replay applies it; every program
    stores the same values."""
    tl.store(record + TOKEN_WORD, tl.sum(token.to(tl.int64), axis=0))
    tl.store(record + RESIDUAL_WORD, tl.sum(use_residual.to(tl.int64), axis=0))
    tl.store(record + P_RECIPROCAL_WORD, tl.sum(p_reciprocal.to(tl.int64, bitcast=True), axis=0))
    tl.store(record + Q_RECIPROCAL_WORD, tl.sum(q_reciprocal.to(tl.int64, bitcast=True), axis=0))
    tl.debug_barrier()  # visible to the program's other threads, which read it from L2


@triton.jit
def end_request(history, stages, tree_size, splits, errors_ptr):
    """Count this program out, having used ``stages`` stages; the request's last program zeroes the records
    the request used and its end record, and counts the waits that gave up into ``*errors_ptr``. Returns
    whether this program is the last and the request failed."""
    end = end_record(history, tree_size)
    tl.atomic_max(end + STAGES_USED_WORD, stages.to(tl.int64), sem="relaxed")
    tl.debug_barrier()  # every read of the records done before the arrival
    failed = tl.program_id(0) < 0
    if tl.atomic_add(end + ENDED_WORD, 1, sem="acq_rel") == splits - 1:
        used = tl.atomic_xchg(end + STAGES_USED_WORD, 0, sem="relaxed")
        failed = count_give_ups(end + FAILED_WORD, errors_ptr)
        words = tl.arange(0, STAGE_WORDS)
        for stage in range(0, used):
            tl.store(history + stage * STAGE_WORDS + words, tl.zeros((STAGE_WORDS,), tl.int64))
        tl.store(end + ENDED_WORD, 0)
    return failed
