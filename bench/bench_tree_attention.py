"""Benchmark of ``sk.tree_attention``: reference, Triton, CUDA (the backends that exist).

Sweep (GPU): B in {1, 8, 64, 256}, tree size N in {16, 64}, prefix P in
{1024, 4096}, Hq = 32, Hkv = 8, D = 128, bfloat16, block size 16;
``--quick``: N = 64, P = 2048. On a CPU: Hq = 8, Hkv = 2, D = 64, short
prefixes, reference only.

Inputs: a breadth-first tree (``harness.branching_tree``), its mask from
``sk.build_tree``, a paged cache whose blocks are shuffled across requests.

Minimum bytes: ``q`` read and ``out`` written once, the K and V of every
position a request sees (its ``P`` prefix positions and its ``N`` tree
nodes: each node sees itself, so the union is all of them), the block-table
entries those positions use, the mask and ``prefix_lens``. FLOPs:
``4 * D`` per (query head, visible key) pair (QK^T and PV).
"""

from __future__ import annotations

import itertools
import math

import torch

import harness
import specdec_kernels as sk
from specdec_kernels.reference import build_tree as reference_build_tree

OP = "tree_attention"
BATCH_KEY = "B"
SERIES_KEYS = ("N",)
BLOCK_SIZE = 16
NOTES = [
    "min_bytes: q + out + K/V of the P + N positions each request sees + block-table entries + mask + "
    "prefix_lens (input-independent).",
    "matches_reference: relative L2 error against the reference below 1e-2 (bfloat16).",
]


def configs(settings: harness.Settings) -> list[dict]:
    heads = dict(Hq=32, Hkv=8, D=128) if settings.is_cuda else dict(Hq=8, Hkv=2, D=64)
    if settings.tiny:
        sizes, heads = itertools.product((1, 2), (8,), (64,)), dict(Hq=4, Hkv=2, D=64)
    elif not settings.is_cuda:
        sizes = itertools.product((1, 4), (16,), (512,)) if settings.quick else \
            itertools.product((1, 4, 16), (16,), (512, 2048))
    elif settings.quick:
        sizes = itertools.product((1, 8, 64, 256), (64,), (2048,))
    else:
        sizes = itertools.product((1, 8, 64, 256), (16, 64), (1024, 4096))
    return [dict(B=b, N=n, P=p, **heads) for b, n, p in sizes]


def providers(settings: harness.Settings) -> list[str]:
    return harness.backend_providers(OP, settings)


class Case:
    def __init__(self, config: dict, settings: harness.Settings):
        self.batch, self.nodes, self.prefix = config["B"], config["N"], config["P"]
        self.query_heads, self.kv_heads, self.head_dim = config["Hq"], config["Hkv"], config["D"]
        self.device = settings.device
        self.dtype = torch.bfloat16
        self.blocks_per_request = math.ceil((self.prefix + self.nodes) / BLOCK_SIZE)
        parents = torch.tensor([harness.branching_tree(self.nodes)], dtype=torch.int32)
        mask, depth, _ = reference_build_tree.build_tree(parents)
        self.mask = mask.expand(self.batch, -1, -1).contiguous().to(self.device)
        self.depth_sum = int(depth.sum()) + self.nodes  # visible tree keys summed over nodes

    def make_inputs(self, index: int) -> dict:
        generator = torch.Generator(self.device).manual_seed(4000 + index)
        num_blocks = self.batch * self.blocks_per_request
        cache_shape = (num_blocks, BLOCK_SIZE, self.kv_heads, self.head_dim)
        k_cache = torch.randn(cache_shape, generator=generator, device=self.device).to(self.dtype)
        v_cache = torch.randn(cache_shape, generator=generator, device=self.device).to(self.dtype)
        tables = torch.randperm(num_blocks, generator=generator, device=self.device).to(torch.int32)
        q = torch.randn((self.batch, self.nodes, self.query_heads, self.head_dim), generator=generator,
                        device=self.device).to(self.dtype)
        prefix_lens = torch.full((self.batch,), self.prefix, dtype=torch.int32, device=self.device)
        return {"q": q, "k_cache": k_cache, "v_cache": v_cache,
                "block_tables": tables.view(self.batch, self.blocks_per_request), "prefix_lens": prefix_lens}

    def graph_skip_reason(self, provider: str) -> str | None:
        if provider == "reference":
            return "not capturable: the reference reads prefix_lens.max() on the host"
        return None

    def set_bytes(self, inputs: dict) -> int:
        return sum(t.numel() * t.element_size() for t in inputs.values())

    def call(self, provider: str, inputs: dict):
        return sk.tree_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"],
                                 inputs["prefix_lens"], self.mask, backend=provider)

    def same(self, expected, actual) -> bool:
        expected, actual = expected.float(), actual.float()
        return bool(torch.linalg.vector_norm(actual - expected) <= 1e-2 * torch.linalg.vector_norm(expected))

    def min_bytes(self, inputs: dict, reference_out) -> tuple[float, dict]:
        element = inputs["q"].element_size()
        q_bytes = inputs["q"].numel() * element
        kv_bytes = self.batch * (self.prefix + self.nodes) * self.kv_heads * self.head_dim * element * 2
        tables = self.batch * self.blocks_per_request * 4
        return float(2 * q_bytes + kv_bytes + tables + self.mask.numel() * 4 + self.batch * 4), {}

    def flops(self, inputs: dict) -> float:
        visible = self.nodes * self.prefix + self.depth_sum
        return 4.0 * self.head_dim * self.query_heads * visible * self.batch


if __name__ == "__main__":
    raise SystemExit(harness.main(ops=[OP]))
