"""Faults the kernels detect, counted on the device, and ``sk.kernel_errors``.

The programs of one request in the split, staged and two-wave plans meet
through counters in the workspace, and a program waits (bounded) only for
work that running programs took. A wait that reaches its bound anyway (a
broken invariant, or counters damaged from outside) *gives up*: it raises
its request's failure flag, and the request's last program counts the fault
here and writes the defined failure outcome (tokens ``-1``, ``num_accepted``
0, ``accepted_nodes`` ``[0, -1, ...]``); every workspace record the call
touched is still put back at zero, so the next call is unaffected. Once a
request is marked failed, its other programs stop waiting for it (their
outcome is decided).

One ``int32 [len(KINDS)]`` buffer per device, shared by every stream and
every captured graph (faults are rare; atomics from any stream may add to
it), read by :func:`kernel_errors` with one synchronisation. The CUDA kernels
use the same word indices (``csrc/include/specdec/faults.cuh``).

Tests force a give-up with :func:`forced_give_up`: the program (Triton) or
block (the CUDA extension, on the host path and on a GPU) of the given
*role* gives up its first wait at once. A role is the program's place in
the launch: ``request * splits + slice`` in the split and staged plans,
``wave * row_blocks * splits + row_block * splits + slice`` in the Triton
kernel's two-wave plan (``launchers/`` say which plan a call takes).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from . import _workspace

# Word i of the device's buffer counts faults of kind KINDS[i].
KINDS = (
    "chain_verify.wait_gave_up",  # a program's bounded wait on the request's other programs gave up
    "tree_verify.wait_gave_up",
)
CHAIN_WAIT_GAVE_UP, TREE_WAIT_GAVE_UP = range(len(KINDS))
NO_FAULT = -1  # the role passed to the kernels when no give-up is forced

_BUFFER_NAME = "kernel_errors"
_COUNTER_BLOCK = 1 << (len(KINDS) - 1).bit_length()  # the power of two the take kernel spans
_forced = threading.local()


def error_counters(device: torch.device) -> torch.Tensor:
    """The device's fault counters, ``int32 [len(KINDS)]``, created zeroed on first use (outside capture)."""
    return _workspace.device_buffer(_BUFFER_NAME, len(KINDS), torch.int32, device)


def kernel_errors(device=None, reset: bool = True) -> dict[str, int]:
    """Counts of the faults the kernels detected on ``device`` since the last reset.

    A fault is, for example, a bounded wait that gave up: the request
    whose program gave up got the failure outcome (tokens ``-1``,
    ``num_accepted`` 0) and the workspace was left as the call found it. The
    counts are read with one synchronisation; ``reset`` takes them and leaves
    zero in one atomic exchange per counter, so a fault counted meanwhile by a
    kernel on another stream is in this reading or in the next one.

    Parameters
    ----------
    device : torch.device or str, optional
        Default: the current CUDA device, or the CPU without CUDA (the CUDA
        extension's host path and the Triton interpreter count there).
    reset : bool
        Zero the counts as they are read (atomically, where Triton runs).

    Returns
    -------
    dict[str, int]
        One entry per kind, e.g. ``{"chain_verify.wait_gave_up": 0, ...}``.

    Examples
    --------
    >>> sk.kernel_errors("cpu")
    {'chain_verify.wait_gave_up': 0, 'tree_verify.wait_gave_up': 0}
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counters = _workspace.existing_device_buffer(_BUFFER_NAME, torch.int32, device)
    if counters is None:  # no kernel that counts faults has run there
        return dict.fromkeys(KINDS, 0)
    counts = _taken(counters) if reset else counters
    return dict(zip(KINDS, counts.tolist()))


def _taken(counters: torch.Tensor) -> torch.Tensor:
    """The counters' values, with zero left in their place by one exchange per word on the current stream.

    Without Triton on the device (the CUDA extension's host path, which
    counts on the calling thread), a copy and a subtraction do it.
    """
    from ._backend import triton_runs_on

    if not triton_runs_on(counters.device):
        taken = counters.clone()
        counters.sub_(taken)
        return taken
    from ._kernels.faults import _take_counters_kernel

    taken = torch.empty_like(counters)
    guard = torch.cuda.device(counters.device) if counters.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        _take_counters_kernel[(1,)](counters, taken, len(KINDS), BLOCK=_COUNTER_BLOCK, num_warps=1)
    return taken


def give_up_role() -> int:
    """The role whose first wait the next launches give up (:data:`NO_FAULT` unless a test forces one)."""
    return getattr(_forced, "role", NO_FAULT)


@contextlib.contextmanager
def forced_give_up(role: int):
    """Tests only: launches in this block make the program or block of ``role`` give up its first wait."""
    previous = give_up_role()
    _forced.role = role
    try:
        yield
    finally:
        _forced.role = previous
