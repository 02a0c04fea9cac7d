"""Benchmark of ``sk.build_tree``: reference, Triton, CUDA (the backends that exist).

Sweep (GPU): B in {1, 8, 64, 256}, N in {8, 32, 64, 256}; ``--quick``: N = 64.
On a CPU: small batches, reference only. ``--targets``: B = 64, N = 64.

Inputs: EAGLE-like trees (``harness.eagle_tree``: top-k 4-8 near the root,
depth 4-6), the same for every request, and random ``prefix_lens``. Minimum bytes: read ``parents`` ``[B, N]`` and
``prefix_lens`` ``[B]`` (int32), write ``mask`` ``[B, N, ceil(N/32)]`` int32,
``depth`` ``[B, N]`` int32 and ``positions`` ``[B, N]`` int64. This op is
a few microseconds at most sizes: the graph time is the one that matters.
"""

from __future__ import annotations

import itertools

import torch

import harness
import specdec_kernels as sk

OP = "build_tree"
BATCH_KEY = "B"
SERIES_KEYS = ("N",)
NOTES = ["min_bytes: parents + prefix_lens read, mask + depth + positions written (input-independent)."]


TARGETS = [dict(B=64, N=64)]


def configs(settings: harness.Settings) -> list[dict]:
    if settings.tiny:
        sizes = itertools.product((1, 4), (8,))
    elif not settings.is_cuda:
        sizes = itertools.product((1, 8), (8, 64)) if settings.quick else itertools.product((1, 8, 64), (8, 64))
    elif settings.quick:
        sizes = itertools.product((1, 8, 64, 256), (64,))
    else:
        sizes = itertools.product((1, 8, 64, 256), (8, 32, 64, 256))
    return [dict(B=b, N=n) for b, n in sizes]


def providers(settings: harness.Settings) -> list[str]:
    return harness.backend_providers(OP, settings)


class Case:
    def __init__(self, config: dict, settings: harness.Settings):
        self.batch, self.nodes = config["B"], config["N"]
        self.device = settings.device

    def make_inputs(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(3000 + index)
        parents = torch.tensor(harness.eagle_tree(self.nodes), dtype=torch.int32).expand(self.batch, -1)
        prefix = torch.randint(0, 4096, (self.batch,), generator=generator)
        return {"parents": parents.contiguous().to(self.device),
                "prefix_lens": prefix.to(torch.int32).to(self.device)}

    def set_bytes(self, inputs: dict) -> int:
        return sum(t.numel() * t.element_size() for t in inputs.values())

    def call(self, provider: str, inputs: dict):
        return sk.build_tree(inputs["parents"], prefix_lens=inputs["prefix_lens"], backend=provider)

    def same(self, expected, actual) -> bool:
        return all(torch.equal(e, a) for e, a in zip(expected, actual))

    def min_bytes(self, inputs: dict, reference_out) -> tuple[float, dict]:
        words = (self.nodes + 31) // 32
        read = self.batch * self.nodes * 4 + self.batch * 4
        written = self.batch * self.nodes * (words * 4 + 4 + 8)
        return float(read + written), {}


if __name__ == "__main__":
    raise SystemExit(harness.main(ops=[OP]))
