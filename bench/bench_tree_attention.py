"""Benchmark of ``sk.tree_attention``: reference, Triton, CUDA (the backends that exist), and peers.

``triton-merge-in-kernel`` and ``cuda-merge-in-kernel``: the kernel with a
split context merged by the last split program of each tile (one launch;
Triton: small row tiles only, ``launchers/tree_attention.py``) instead of the
default second launch: both forms are timed so that the default can follow
the measurement (issue 9).

Sweep (GPU, issue 9): B in {1, 8, 32}, tree size N in {8, 32, 64}, prefix
P in {1024, 8192, 32768}, (Hq, Hkv) in {(32, 8), (64, 8)}, D = 128,
bfloat16, block size 16; ``--quick`` and ``--targets``: B in {1, 32}, N = 64,
P = 8192, (32, 8). On a CPU: Hq = 8, Hkv = 2, D = 64, short prefixes,
reference and SDPA only.

Peers: ``sdpa`` (PyTorch's scaled_dot_product_attention on the cache
gathered densely, with the dense mask from ``sk.tree_mask_dense``; the
gather and the mask are built with the inputs, not timed) and, when
installed on a GPU, ``flashinfer`` (``BatchPrefillWithPagedKVCacheWrapper``
on the same paged cache with the packed mask from
``sk.tree_mask_flashinfer``; planned with the inputs, not timed).

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
from specdec_kernels.launchers import tree_attention as tree_attention_launchers
from specdec_kernels.reference import build_tree as reference_build_tree

OP = "tree_attention"
BATCH_KEY = "B"
SERIES_KEYS = ("N", "P", "Hq")
BLOCK_SIZE = 16
NOTES = [
    "min_bytes: q + out + K/V of the P + N positions each request sees + block-table entries + mask + "
    "prefix_lens (input-independent).",
    "matches_reference: relative L2 error against the reference below 1e-2 (bfloat16).",
    "sdpa: dense K/V gathered and the dense mask built with the inputs (not timed); flashinfer: planned with the "
    "inputs (not timed), eager timing only (its wrapper is not planned for CUDA graphs).",
]
FLASHINFER_WORKSPACE_BYTES = 128 << 20


TARGETS = [dict(B=b, N=64, P=8192, Hq=32, Hkv=8, D=128) for b in (1, 32)]


def configs(settings: harness.Settings) -> list[dict]:
    if settings.tiny:
        return [dict(B=b, N=8, P=64, Hq=4, Hkv=2, D=64) for b in (1, 2)]
    if not settings.is_cuda:
        sizes = itertools.product((1, 4), (16,), (512,)) if settings.quick else \
            itertools.product((1, 4, 16), (16,), (512, 2048))
        return [dict(B=b, N=n, P=p, Hq=8, Hkv=2, D=64) for b, n, p in sizes]
    if settings.quick:
        return list(TARGETS)
    sizes, heads = itertools.product((1, 8, 32), (8, 32, 64), (1024, 8192, 32768)), ((32, 8), (64, 8))
    return [dict(B=b, N=n, P=p, Hq=hq, Hkv=hkv, D=128) for (b, n, p), (hq, hkv) in itertools.product(sizes, heads)]


def _flashinfer():
    try:
        import flashinfer

        return flashinfer
    except Exception:
        return None


# Providers of a backend with the split merged by its last program, by backend.
MERGE_IN_KERNEL = {"triton-merge-in-kernel": "triton", "cuda-merge-in-kernel": "cuda"}


def providers(settings: harness.Settings) -> list[str]:
    names = harness.backend_providers(OP, settings)
    names += [provider for provider, backend in MERGE_IN_KERNEL.items() if backend in names]
    names.append("sdpa")
    if settings.is_cuda and _flashinfer() is not None:
        names.append("flashinfer")
    return names


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
        self.peers = [name for name in providers(settings) if name in ("sdpa", "flashinfer")
                      and (settings.providers is None or name in settings.providers)]

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
        inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache,
                  "block_tables": tables.view(self.batch, self.blocks_per_request), "prefix_lens": prefix_lens}
        if "sdpa" in self.peers:
            inputs.update(self._dense_inputs(inputs))
        if "flashinfer" in self.peers:
            inputs["flashinfer"] = self._flashinfer_wrapper(inputs)
        return inputs

    def _dense_inputs(self, inputs: dict) -> dict:
        """K/V ``[B, Hkv, P + N, D]`` read through the block table, and the ``[B, 1, N, P + N]`` mask."""
        length = self.prefix + self.nodes
        positions = torch.arange(length, device=self.device)
        blocks = inputs["block_tables"].long()[:, positions // BLOCK_SIZE]
        slots = (positions % BLOCK_SIZE).expand(self.batch, -1)
        visible = torch.cat([torch.ones(self.batch, self.nodes, self.prefix, dtype=torch.bool, device=self.device),
                             sk.tree_mask_dense(self.mask)], 2)
        return {"dense_k": inputs["k_cache"][blocks, slots].transpose(1, 2).contiguous(),
                "dense_v": inputs["v_cache"][blocks, slots].transpose(1, 2).contiguous(),
                "dense_mask": visible[:, None]}

    def _flashinfer_wrapper(self, inputs: dict):
        """FlashInfer's paged prefill planned on this set's block table: request ``b`` has ``N`` query rows and
        ``P + N`` keys (its blocks in table order), with the tree's packed custom mask."""
        flashinfer = _flashinfer()
        length = self.prefix + self.nodes
        int32 = dict(dtype=torch.int32, device=self.device)
        workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        packed_mask, _ = sk.tree_mask_flashinfer(self.mask, inputs["prefix_lens"])
        wrapper.plan(
            torch.arange(self.batch + 1, **int32) * self.nodes,
            torch.arange(self.batch + 1, **int32) * self.blocks_per_request,
            inputs["block_tables"].flatten(),
            torch.full((self.batch,), length - (self.blocks_per_request - 1) * BLOCK_SIZE, **int32),
            self.query_heads, self.kv_heads, self.head_dim, BLOCK_SIZE,
            packed_custom_mask=packed_mask, q_data_type=self.dtype, kv_data_type=self.dtype,
        )
        return wrapper

    def graph_skip_reason(self, provider: str) -> str | None:
        if provider == "reference":
            return "not capturable: the reference reads prefix_lens.max() on the host"
        if provider == "flashinfer":
            return "not capturable: the wrapper is planned without use_cuda_graph"
        return None

    def set_bytes(self, inputs: dict) -> int:
        return sum(t.numel() * t.element_size() for t in inputs.values() if isinstance(t, torch.Tensor))

    def call(self, provider: str, inputs: dict):
        if provider == "sdpa":
            out = torch.nn.functional.scaled_dot_product_attention(
                inputs["q"].transpose(1, 2), inputs["dense_k"], inputs["dense_v"], attn_mask=inputs["dense_mask"],
                enable_gqa=True)
            return out.transpose(1, 2)
        if provider == "flashinfer":
            out = inputs["flashinfer"].run(inputs["q"].flatten(0, 1), (inputs["k_cache"], inputs["v_cache"]))
            return out.view(inputs["q"].shape)
        if provider in MERGE_IN_KERNEL:
            merge_in_kernel, tree_attention_launchers.MERGE_IN_KERNEL = tree_attention_launchers.MERGE_IN_KERNEL, True
            try:
                return sk.tree_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"],
                                         inputs["prefix_lens"], self.mask, backend=MERGE_IN_KERNEL[provider])
            finally:
                tree_attention_launchers.MERGE_IN_KERNEL = merge_in_kernel
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
