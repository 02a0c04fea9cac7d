"""The stage protocol: how the programs of one request share a pass over its vocabulary, and how they wait.

Used by the tree kernel's split plan (``kernels/tree_verify_stages.py``),
the chain kernel's staged plan and its truncation search
(``kernels/truncation.py``, ``measured``); the CUDA twin is
``csrc/include/specdec/stage_records.cuh``.

A *stage* is one pass over a request's vocabulary, cut into ``splits``
slices. Its record starts with a header line of ``STAGE_WORDS`` int64:
word ``TAKEN_WORD`` counts the slices taken (past ``splits`` once all are),
word ``PUBLISHED_WORD`` the slices published (``splits`` once the stage is
complete). Every program takes slices until none is left
(:func:`take_slice`), adds its partial results to the record, publishes
them (:func:`publish`, a release after its adds), then waits until all are
published (:func:`wait_for_stage`). A slice is taken only by a running
program and no program waits between taking a slice and publishing it, so
every wait is on programs that are running and ends.

The waits are bounded (:func:`wait_for`) and report giving up in the
request's failure flag; the request's last program (:func:`arrive`) counts
the flag into the device's fault counters and writes the failure outcome
(:func:`count_give_ups`).

Before any of that, the programs of a request (a chain row block) *claim*
it for their launch (:func:`claim`): the first to arrive resets every word
the request uses, whatever they held (a stray write, a launch that never
ended), and the others wait for it, a program that is running. A claim word
holds ``2 * stamp`` while its claimer resets, ``2 * stamp + 1`` once the
words are reset, where ``stamp`` is a number the host draws for each launch
(``specdec_kernels/_workspace.py``, ``launch_stamp``); the request's last
program puts it back to zero.
"""

import triton
import triton.language as tl

from .._backend import triton_interpreter_enabled  # the package's one rule for the interpreter

STAGE_WORDS = tl.constexpr(16)
TAKEN_WORD = tl.constexpr(0)
PUBLISHED_WORD = tl.constexpr(1)
_NOTHING_LEFT = tl.constexpr(1 << 62)  # what take_slice returns for a damaged count: past any ``splits``

# Polls before a wait gives up (each is an L2 round trip, ~1 us: seconds in
# all, far beyond any wait on a program that is running). The interpreter
# runs programs one after another, so a wait not over at its first look
# never will be: it gives up at once there (as the CUDA host path's does)
# instead of spinning for minutes of numpy.
SPIN_LIMIT = tl.constexpr(0 if triton_interpreter_enabled() else 1 << 22)


@triton.jit
def wait_for(counter_ptr, expected, failed_ptr, give_up):
    """Wait (acquire) until ``*counter_ptr >= expected``, or until the request has failed (``*failed_ptr != 0``).

    A wait that reaches ``SPIN_LIMIT`` polls, sees a count no launch makes
    (negative, or past ``expected``), or is told to ``give_up`` (the
    tests' forced fault, ``specdec_kernels/_faults.py``), gives up: it adds
    one to ``*failed_ptr``, the request's failure flag, which the request's
    last program reads, counts into the device's fault counters and clears,
    writing the failure outcome. A failed request's programs stop waiting:
    what they read no longer matters, and each of them would otherwise give
    up only after ``SPIN_LIMIT`` polls of its own. Returns whether the request
    has failed.
    """
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    failed = tl.atomic_add(failed_ptr, 0, sem="relaxed")
    polls = 0
    while (seen >= 0) & (seen < expected) & (failed == 0) & (polls < SPIN_LIMIT) & (give_up == 0):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
        failed = tl.atomic_add(failed_ptr, 0, sem="relaxed")
        polls += 1
    # A count below 0 or past `expected` was never made by a launch (damaged words): given up at once.
    gave_up = (failed == 0) & ((seen != expected) | (give_up != 0))
    if gave_up:
        tl.atomic_add(failed_ptr, 1, sem="relaxed")
    tl.debug_barrier()
    return gave_up | (failed != 0)


@triton.jit
def arrive(counter_ptr, expected, fault_ptr, FLAG: tl.constexpr):
    """Count this program in at ``*counter_ptr`` (acquire-release); returns whether it is the last of
    ``expected``. A count no launch makes (negative, or ``expected`` or more: damaged words) is a fault: the
    program raises ``*fault_ptr`` (with ``FLAG``, the request's failure flag, so that its last program writes
    the failure outcome and counts the fault: bit 0 is set, as adding one would take a damaged -1 back to "no
    fault"; else a word of the fault counters, which counts one) and takes the damage back out (subtracts what it
    saw, so the programs after it count from one; the damaged arrival is the first)."""
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    damaged = (arrived < 0) | (arrived >= expected)
    if FLAG:
        tl.atomic_or(fault_ptr, 1, mask=damaged, sem="relaxed")
    else:
        tl.atomic_add(fault_ptr, 1, mask=damaged, sem="relaxed")
    tl.atomic_add(counter_ptr, -arrived, mask=damaged, sem="relaxed")
    return tl.where(damaged, 0, arrived) == expected - 1


@triton.jit
def claim(claim_ptr, stamp):
    """Whether this program is the first of its launch at ``*claim_ptr``: it then resets the words the claim
    guards and calls :func:`claimed`; the other programs call :func:`wait_for_claim`. Any word not of this
    launch's stamp (zero, another launch's, damage) is taken over with one compare-and-swap, which at most one
    program of the launch wins."""
    seen = tl.atomic_add(claim_ptr, 0, sem="acquire")
    first = seen != seen  # False, as a value: the branch assigns one
    if (seen >> 1) != stamp:
        first = tl.atomic_cas(claim_ptr, seen, 2 * stamp, sem="acq_rel") == seen
    return first


@triton.jit
def claimed(claim_ptr, stamp):
    """The claimer has reset the words: release them to the programs waiting in :func:`wait_for_claim`."""
    tl.debug_barrier()  # every thread's stores issued before the release
    tl.atomic_xchg(claim_ptr, 2 * stamp + 1, sem="release")


@triton.jit
def wait_for_claim(claim_ptr, stamp):
    """Wait (acquire) until the claimer has reset the words. The claimer is running, so the wait ends; one that
    still reaches ``SPIN_LIMIT`` polls returns True, and the caller fails its request."""
    ready = 2 * stamp + 1
    seen = tl.atomic_add(claim_ptr, 0, sem="acquire")
    polls = 0
    while (seen != ready) & (polls < SPIN_LIMIT):
        seen = tl.atomic_add(claim_ptr, 0, sem="acquire")
        polls += 1
    tl.debug_barrier()
    return seen != ready


@triton.jit
def count_give_ups(failed_ptr, errors_ptr):
    """The last program of a request (or row block), after every wait: clears its failure flag, counts the
    request (row block) as one fault in the device's fault counters if any of its waits gave up, and returns
    whether one did."""
    gave_up = tl.atomic_xchg(failed_ptr, 0, sem="relaxed")
    if gave_up != 0:  # one fault a failed request (or row block): the flag may hold any value when damaged
        tl.atomic_add(errors_ptr, 1, sem="relaxed")
    return gave_up != 0


@triton.jit
def take_slice(record):
    """The next untaken slice of the stage (``>= splits`` once all are taken). A negative count was never made by
    a launch (damaged words): it takes nothing, so no slice index leaves ``[0, splits)``; the stage's wait then
    ends the request with the failure outcome, or finds the slices published by the programs that took them."""
    taken = tl.atomic_add(record + TAKEN_WORD, 1, sem="relaxed")
    return tl.where(taken < 0, _NOTHING_LEFT, taken)


@triton.jit
def publish(record, slices):
    """Release ``slices`` slices of the stage, after every store and atomic add the program made for them
    (the final sample's chunk results; the truncation search's partials)."""
    tl.debug_barrier()  # every thread's stores issued before the release
    tl.atomic_add(record + PUBLISHED_WORD, slices, sem="release")


@triton.jit
def wait_for_stage(record, splits, failed_ptr, give_up):
    """Wait until every slice of the stage is published (all were taken by running programs), or until the
    request failed (``wait_for``); returns whether it failed."""
    return wait_for(record + PUBLISHED_WORD, splits, failed_ptr, give_up)
