"""Fail when a CUDA kernel of the extension spills registers beyond its budget (the ptxas ``-v`` report of a build).

The budget: nothing on sm_90a, the H200 the package is tuned for. On sm_80
a kernel may spill at most ``SM80_SPILL_BUDGET`` bytes: the staged chain
kernel sits at its 128-register cap (two blocks per SM) and ptxas's choices
there flip with unrelated changes; its float32 instances store 12 bytes once
and reload them once per stage, not per element (measured in the SASS,
2026-12-03). Usage: ``python scripts/check_cuda_spills.py BUILD_LOG``.
"""

from __future__ import annotations

import re
import sys

SM80_SPILL_BUDGET = 16  # bytes of spill stores per kernel

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def spills(log: str) -> list[tuple[str, str, int, int]]:
    """``(kernel, arch, store bytes, load bytes)`` of every kernel that spills."""
    found, entry = [], None
    for line in log.splitlines():
        match = ENTRY.search(line)
        if match:
            entry = match.groups()
            continue
        match = SPILL.search(line)
        if match and entry is not None:
            stores, loads = map(int, match.groups())
            if stores or loads:
                found.append((*entry, stores, loads))
            entry = None
    return found


def main(path: str) -> int:
    over = []
    for kernel, arch, stores, loads in sorted(set(spills(open(path, errors="replace").read()))):
        allowed = arch == "sm_80" and stores <= SM80_SPILL_BUDGET
        print(f"{'within budget' if allowed else 'OVER BUDGET'}: {arch} {kernel}: {stores} B stores, {loads} B loads")
        if not allowed:
            over.append(kernel)
    if over:
        print(f"FAILED: {len(over)} CUDA kernel(s) spill beyond the budget (scripts/check_cuda_spills.py)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
