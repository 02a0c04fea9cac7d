"""Benchmark of ``sk.tree_verify``: reference, Triton, CUDA (the backends that exist).

Sweep (GPU): B in {1, 8, 64}, tree size N in {8, 32, 64, 256}, V in {32000, 128256},
float32 probabilities and bfloat16 logits; ``--quick``: N = 32, V = 32000.
On a CPU: V = 32000, small batches, reference only. ``--targets``: B = 8,
N = 64, V = 128256, both inputs, untruncated.

Inputs: EAGLE-like breadth-first trees (``harness.eagle_tree``: top-k 4-8
near the root, depth 4-6; N = 8 is two children a level), the same for
every request. Each
node's children are drawn from the draft row of that node without
replacement (Gumbel top-k); target logits ``3 * N(0, 1)``, draft =
softmax(target + ``0.5 * N(0, 1)``); ``draft_sampling="without_replacement"``.

Minimum bytes, from the measured accepted path of each request: the parents
array, the ids of the children tried, and per node on the path:

* probabilities: a node where a child was rejected needs the full target and
  draft rows (the residual is normalised over the vocabulary); the last node
  needs its full target row (the sample); a node whose first tried child was
  accepted needs only the gathers ``p(t)``, ``q(t)``;
* logits (and truncation): the full target row of every node on the path (a
  softmax or a threshold reads its whole row), the draft as with
  probabilities (it is probabilities, contract v1.3);

plus the outputs (two ``[B, N]`` and one ``[B]`` int32).
"""

from __future__ import annotations

import itertools

import torch

import harness
import specdec_kernels as sk
from plain_verifier import SORT_PROVIDERS, sort_top_k_top_p

OP = "tree_verify"
BATCH_KEY = "B"
SERIES_KEYS = ("inputs", "sampling")
INPUTS = ("probs-fp32", "logits-bf16")
SAMPLING_MODES = ("none", "top-k 50, top-p 0.9")
TOP_K, TOP_P = 50, 0.9
SEED = 4321
SHARPNESS = 3.0
DRAFT_NOISE = 0.5
MIN_BYTES_BASIS = "measured: accepted paths of the benchmark inputs (not the expected count)"
NOTES = [
    "min_bytes uses the measured accepted path of the benchmark inputs (mean over the first 4 rotated input sets); "
    "mean_accepted in each row is the mean accepted depth.",
    "matches_reference: bit-exact for probabilities; for logits at least 99% of requests identical.",
]


TARGETS = [dict(B=8, N=64, V=128256, inputs=inputs, sampling=SAMPLING_MODES[0]) for inputs in INPUTS]


def configs(settings: harness.Settings) -> list[dict]:
    if settings.tiny:
        sizes = itertools.product((1, 2), (8,), (500,))
    elif not settings.is_cuda:
        sizes = itertools.product((1, 4), (16,), (32000,)) if settings.quick else \
            itertools.product((1, 4, 16), (8, 16), (32000,))
    elif settings.quick:
        sizes = itertools.product((1, 8, 64), (32,), (32000,))
    else:
        sizes = itertools.product((1, 8, 64), (8, 32, 64, 256), (32000, 128256))
    sizes = list(sizes)
    plain = [dict(B=b, N=n, V=v, inputs=inputs, sampling=SAMPLING_MODES[0])
             for (b, n, v), inputs in itertools.product(sizes, INPUTS)]
    first_per_batch = {b: (b, n, v) for b, n, v in reversed(sizes)}.values()
    truncated = [dict(B=b, N=n, V=v, inputs=inputs, sampling=SAMPLING_MODES[1])
                 for (b, n, v), inputs in itertools.product(first_per_batch, INPUTS)]
    return plain + truncated


def providers(settings: harness.Settings) -> list[str]:
    backends = harness.backend_providers(OP, settings)
    return backends + [f"sort+{backend}" for backend in backends]


class Case:
    UNCOMPARED = SORT_PROVIDERS  # a differently rounded truncation (a float32 sum, not the exact integer one)

    def __init__(self, config: dict, settings: harness.Settings):
        self.batch, self.nodes, self.vocab = config["B"], config["N"], config["V"]
        self.logits = config["inputs"].startswith("logits")
        self.truncated = config.get("sampling", SAMPLING_MODES[0]) != SAMPLING_MODES[0]
        self.device = settings.device
        self.parent_list = harness.eagle_tree(self.nodes)
        self.children = harness.children_lists(self.parent_list)

    def make_inputs(self, index: int) -> dict:
        generator = torch.Generator(self.device).manual_seed(2000 + index)
        shape = (self.batch, self.nodes, self.vocab)
        target_logits = torch.randn(shape, generator=generator, device=self.device) * SHARPNESS
        draft_logits = target_logits + DRAFT_NOISE * torch.randn(shape, generator=generator, device=self.device)
        # The draft is probabilities with either target (contract v1.3), in the target's dtype.
        if self.logits:
            target = target_logits.to(torch.bfloat16)
            draft = torch.softmax(draft_logits.to(torch.bfloat16).float(), -1).to(torch.bfloat16)
        else:
            target, draft = torch.softmax(target_logits, -1), torch.softmax(draft_logits, -1)
        del target_logits, draft_logits
        tokens = self._draw_children(draft, generator)
        parents = torch.tensor(self.parent_list, dtype=torch.int32, device=self.device).expand(self.batch, -1)
        offset = torch.tensor(index, dtype=torch.int64, device=self.device)
        return {"tokens": tokens, "parents": parents.contiguous(), "target": target, "draft": draft,
                "offset": offset}

    def _draw_children(self, draft: torch.Tensor, generator) -> torch.Tensor:
        """Children of every node drawn without replacement from its draft row (Gumbel top-k)."""
        widest = max(len(kids) for kids in self.children)
        tokens = torch.zeros((self.batch, self.nodes), dtype=torch.int32, device=self.device)
        for start in range(0, self.batch, 16):  # bounded temporaries at large B * N * V
            rows = draft[start:start + 16].float()
            log_q = torch.log(rows)
            uniform = torch.rand(log_q.shape, generator=generator, device=self.device).clamp_min_(1e-20)
            top = torch.topk(log_q - torch.log(-torch.log(uniform)), widest, dim=-1).indices
            for node, kids in enumerate(self.children):
                for rank, child in enumerate(kids):
                    tokens[start:start + 16, child] = top[:, node, rank].to(torch.int32)
        return tokens

    def set_bytes(self, inputs: dict) -> int:
        return sum(t.numel() * t.element_size() for t in inputs.values())

    def supports(self, provider: str) -> bool:
        return self.truncated or not provider.startswith("sort+")

    def call(self, provider: str, inputs: dict):
        if provider.startswith("sort+"):  # PyTorch's sort-based truncation, then the untruncated op
            target = torch.softmax(inputs["target"].float(), -1) if self.logits else inputs["target"]
            return sk.tree_verify(inputs["tokens"], inputs["parents"], sort_top_k_top_p(target, TOP_K, TOP_P),
                                  inputs["draft"],
                                  draft_sampling="without_replacement", seed=SEED, offset=inputs["offset"],
                                  backend=provider.removeprefix("sort+"))
        truncation = dict(top_k=TOP_K, top_p=TOP_P) if self.truncated else {}
        return sk.tree_verify(inputs["tokens"], inputs["parents"], inputs["target"], inputs["draft"],
                              logits=self.logits, draft_sampling="without_replacement", seed=SEED,
                              offset=inputs["offset"], backend=provider, **truncation)

    def same(self, expected, actual) -> bool:
        if not self.logits:
            return all(torch.equal(e, a) for e, a in zip(expected, actual))
        rows_equal = (expected[0] == actual[0]).all(-1) & (expected[1] == actual[1]).all(-1)
        return bool(rows_equal.float().mean() >= 0.99)

    def min_bytes(self, inputs: dict, reference_out) -> tuple[float, dict]:
        accepted_nodes = reference_out[0].cpu().tolist()
        num_accepted = reference_out[2].cpu().tolist()
        element = inputs["target"].element_size()
        row = self.vocab * element
        total = 0
        for path, depth in zip(accepted_nodes, num_accepted):
            for step in range(depth + 1):
                kids = self.children[path[step]]
                tried = [child for child in kids if child <= path[step + 1]] if step < depth else kids
                rejections = len(tried) - (1 if step < depth else 0)
                total += len(tried) * 4  # token ids
                if self.logits or self.truncated:  # a softmax or a threshold reads the node's whole target row
                    total += row + (row if rejections > 0 else len(tried) * element)
                elif rejections > 0:
                    total += 2 * row
                elif step == depth:
                    total += row
                else:
                    total += 2 * element
        total += self.batch * self.nodes * 4  # parents
        total += 2 * self.batch * self.nodes * 4 + self.batch * 4  # outputs
        return float(total), {"mean_accepted": sum(num_accepted) / len(num_accepted)}


if __name__ == "__main__":
    raise SystemExit(harness.main(ops=[OP]))
