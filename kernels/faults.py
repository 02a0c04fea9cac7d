"""Word indices of the device's fault counters (``specdec_kernels/_faults.py`` KINDS; tests check they agree),
and the kernel that reads and zeroes them in one step (``sk.kernel_errors(reset=True)``)."""

import triton
import triton.language as tl

CHAIN_WAIT_GAVE_UP = tl.constexpr(0)
TREE_WAIT_GAVE_UP = tl.constexpr(1)


@triton.jit
def _take_counters_kernel(counters_ptr, taken_ptr, num_kinds, BLOCK: tl.constexpr):
    """Moves every counter to ``taken`` and leaves zero in its place, one exchange per word: an increment from
    any stream lands either in what is taken or in what is left, never in neither."""
    kinds = tl.arange(0, BLOCK)
    in_range = kinds < num_kinds
    taken = tl.atomic_xchg(counters_ptr + kinds, tl.zeros([BLOCK], tl.int32), mask=in_range, sem="relaxed")
    tl.store(taken_ptr + kinds, taken, mask=in_range)
