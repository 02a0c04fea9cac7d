"""Word indices of the device's fault counters (``specdec_kernels/_faults.py`` KINDS; tests check they agree)."""

import triton.language as tl

CHAIN_WAIT_GAVE_UP = tl.constexpr(0)
TREE_WAIT_GAVE_UP = tl.constexpr(1)
