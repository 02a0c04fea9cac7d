"""Benchmark of ``sk.compact_kv``: reference, Triton, CUDA (the backends that exist).

Sweep (GPU): B in {1, 8, 64, 256}, tree size N in {16, 64}, accepted path
length L in {4, 12} (nodes after the root), prefix 1024, Hkv = 8, D = 128,
bfloat16, block size 16; ``--quick``: N = 64, L = 8. On a CPU: Hkv = 2,
D = 64, reference only.

Inputs: per request, an accepted path ``[0, a_1 < ... < a_L]`` of random
node indices, then ``-1``; the cache blocks are shuffled across requests.
The op works in place, so every repetition moves the same rows again.

Minimum bytes: for each move whose source differs from its destination
(``a_d != d``), the K and V rows read once and written once; the entries of
``accepted_nodes`` up to and including the first ``-1``; the block-table
entries of the positions moved; ``prefix_lens``.
"""

from __future__ import annotations

import itertools
import math

import torch

import harness
import specdec_kernels as sk

OP = "compact_kv"
BATCH_KEY = "B"
SERIES_KEYS = ("L",)
BLOCK_SIZE = 16
MIN_BYTES_BASIS = "measured: the accepted paths of the inputs"
NOTES = ["min_bytes: moved K/V rows (source != destination) read + written, accepted_nodes up to the first -1, "
         "block-table entries used, prefix_lens; counted from the actual paths."]


def configs(settings: harness.Settings) -> list[dict]:
    heads = dict(P=1024, Hkv=8, D=128) if settings.is_cuda else dict(P=256, Hkv=2, D=64)
    if settings.tiny:
        sizes, heads = itertools.product((1, 2), (8,), (3,)), dict(P=32, Hkv=2, D=64)
    elif not settings.is_cuda:
        sizes = itertools.product((1, 8), (16,), (4,)) if settings.quick else \
            itertools.product((1, 8, 64), (16,), (4, 12))
    elif settings.quick:
        sizes = itertools.product((1, 8, 64, 256), (64,), (8,))
    else:
        sizes = itertools.product((1, 8, 64, 256), (16, 64), (4, 12))
    return [dict(B=b, N=n, L=length, **heads) for b, n, length in sizes]


def providers(settings: harness.Settings) -> list[str]:
    return harness.backend_providers(OP, settings)


class Case:
    def __init__(self, config: dict, settings: harness.Settings):
        self.batch, self.nodes, self.path_length = config["B"], config["N"], config["L"]
        self.prefix, self.kv_heads, self.head_dim = config["P"], config["Hkv"], config["D"]
        self.device = settings.device
        self.dtype = torch.bfloat16
        self.blocks_per_request = math.ceil((self.prefix + self.nodes) / BLOCK_SIZE)

    def make_inputs(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(5000 + index)
        num_blocks = self.batch * self.blocks_per_request
        cache_shape = (num_blocks, BLOCK_SIZE, self.kv_heads, self.head_dim)
        device_generator = torch.Generator(self.device).manual_seed(5000 + index)
        k_cache = torch.randn(cache_shape, generator=device_generator, device=self.device).to(self.dtype)
        v_cache = torch.randn(cache_shape, generator=device_generator, device=self.device).to(self.dtype)
        tables = torch.randperm(num_blocks, generator=generator).to(torch.int32).view(self.batch, -1)
        accepted = torch.full((self.batch, self.nodes), -1, dtype=torch.int32)
        accepted[:, 0] = 0
        for request in range(self.batch):
            path = torch.randperm(self.nodes - 1, generator=generator)[: self.path_length].sort().values + 1
            accepted[request, 1:1 + len(path)] = path.to(torch.int32)
        prefix_lens = torch.full((self.batch,), self.prefix, dtype=torch.int32)
        return {"k_cache": k_cache, "v_cache": v_cache, "block_tables": tables.to(self.device),
                "prefix_lens": prefix_lens.to(self.device), "accepted_nodes": accepted.to(self.device)}

    def graph_skip_reason(self, provider: str) -> str | None:
        if provider == "reference":
            return "not capturable: the reference selects the moves with a boolean mask (a host sync)"
        return None

    def set_bytes(self, inputs: dict) -> int:
        return sum(t.numel() * t.element_size() for t in inputs.values())

    def call(self, provider: str, inputs: dict):
        sk.compact_kv(inputs["k_cache"], inputs["v_cache"], inputs["block_tables"], inputs["prefix_lens"],
                      inputs["accepted_nodes"], backend=provider)
        return inputs

    def check(self, provider: str, inputs: dict) -> bool:
        """One call of ``provider`` and one of the reference, each on a fresh copy, leave equal caches."""
        copies = [{key: value.clone() for key, value in inputs.items()} for _ in range(2)]
        self.call("reference", copies[0])
        self.call(provider, copies[1])
        return all(torch.equal(copies[0][key], copies[1][key]) for key in ("k_cache", "v_cache"))

    def min_bytes(self, inputs: dict, reference_out) -> tuple[float, dict]:
        row = self.kv_heads * self.head_dim * inputs["k_cache"].element_size()
        accepted = inputs["accepted_nodes"].cpu().tolist()
        total = 0
        moves_total = 0
        for path in accepted:
            length = next((d for d, node in enumerate(path) if node < 0), len(path))
            moves = [(self.prefix + node, self.prefix + d) for d, node in enumerate(path[:length]) if node != d]
            columns = {position // BLOCK_SIZE for move in moves for position in move}
            total += len(moves) * row * 2 * 2  # K and V, read + written
            total += min(length + 1, len(path)) * 4 + len(columns) * 4 + 4
            moves_total += len(moves)
        return float(total), {"mean_moves": moves_total / self.batch}


if __name__ == "__main__":
    raise SystemExit(harness.main(ops=[OP]))
