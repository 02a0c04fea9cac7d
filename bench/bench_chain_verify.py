"""Benchmark of ``sk.chain_verify``: reference, Triton, CUDA (and FlashInfer when importable).

Sweep (GPU): B in {1, 8, 64, 256}, K in {1, 4, 8}, V in {32000, 128256, 151936},
inputs as float32 probabilities and as bfloat16 logits. ``--quick`` keeps
K = 4 and V = 128256. On a CPU: V = 32000, small batches, reference only.
``--targets``: K = 4, V = 128256 at B = 1 (decode: the graph replay time) and
B = 64, 256 (the bandwidth), both inputs, untruncated, padded.

Inputs: target logits ``3 * N(0, 1)``, draft = softmax(target + ``0.5 * N(0, 1)``)
(acceptance about 0.8 per position), draft tokens sampled from the draft.
Providers: the backends, ``plain`` (a plain PyTorch verifier, the baseline the
reference must match on a CPU) and FlashInfer when importable.
The offset is an int64 device tensor, as in a captured decoding loop.

Minimum bytes, per request with ``a`` accepted of ``K`` drafts (``a`` is the
measured ``num_accepted`` of the benchmark inputs, averaged over the first 4 rotated
input sets):

* probabilities: the draft ids read up to the first rejection
  (``min(a + 1, K)``), the gathers ``p_i(t_i)`` and ``q_i(t_i)`` for the ``a``
  accepted positions, the full row of ``p`` at the sampled position ``a``
  plus the full row of ``q`` there when it is a rejection (``a < K``; the
  bonus row needs ``p`` only), and the outputs ``[B, K+1]`` + ``[B]`` int32;
* logits: a softmax needs its whole row, so the full target rows
  ``0..a``; the draft (probabilities, contract v1.3) as above; the same ids
  and outputs.

Layouts: ``padded`` (``sk.chain_verify``) everywhere, and ``packed``
(``sk.chain_verify_packed`` on the same rows, every request with ``K``
drafts, so its target is a view of the padded one and the two rows of a
size time the same work) for a few sizes: the cost of finding the rows from
``cu_num_draft_tokens`` on the device. ``plain`` and FlashInfer run padded only.

Sampling parameters: ``sampling=top-k 50, top-p 0.9`` rows run the same
inputs with ``top_k=50, top_p=0.9`` on every request, beside the untruncated
rows, for the padded layout (the first size of each batch). Their minimum
bytes read every target row up to the sampled one in full (a threshold needs
the whole row). Provider ``sort+<backend>``: PyTorch's sort-based top-k/top-p
(``plain_verifier.sort_top_k_top_p``) on the target, then that backend's
untruncated verification of the renormalised probabilities.

Run alone: ``python bench/bench_chain_verify.py [--quick] [--output DIR]``.
"""

from __future__ import annotations

import itertools

import torch

import harness
import specdec_kernels as sk
from plain_verifier import SORT_PROVIDERS, plain_chain_verify, sort_top_k_top_p

OP = "chain_verify"
BATCH_KEY = "B"
SERIES_KEYS = ("inputs", "sampling")
NO_SAMPLING = "none"
TOP_K_TOP_P = "top-k 50, top-p 0.9"
TOP_K, TOP_P = 50, 0.9
INPUTS = ("probs-fp32", "logits-bf16")
SEED = 1234
SHARPNESS = 3.0
DRAFT_NOISE = 0.5
MIN_BYTES_BASIS = "measured: num_accepted of the benchmark inputs (not the expected count)"
NOTES = [
    "min_bytes uses the measured num_accepted of the benchmark inputs (mean over the first 4 rotated input sets), "
    "not an expected count; mean_accepted in each row is that count.",
    "probabilities: ids up to the first rejection + p(t), q(t) gathers at accepted positions + full p row "
    "(and q row after a rejection) at the sampled position + outputs.",
    "logits: full target rows 0..a (a softmax reads its whole row), the draft as with probabilities + ids + outputs.",
    "matches_reference: bit-exact outputs for probabilities; for logits at least 99% of requests identical "
    "(softmax rounding may differ between backends). flashinfer and plain draw their own random numbers: "
    "not compared.",
    "layout=packed: sk.chain_verify_packed on the same rows (n_b = K for all; + (B+1) int32 of cu in min_bytes).",
    "plain: the textbook PyTorch verifier (torch.rand, torch.multinomial on the residual; bench/plain_verifier.py); "
    "its 'x ref' column is the reference's time over its time.",
]


TARGETS = [dict(B=b, K=4, V=128256, inputs=inputs, layout="padded", sampling=NO_SAMPLING)
           for b in (1, 64, 256) for inputs in INPUTS]


def configs(settings: harness.Settings) -> list[dict]:
    if settings.tiny:
        sizes = itertools.product((1, 4), (2,), (1000,))
        packed_sizes = [(4, 2, 1000)]
    elif not settings.is_cuda:
        sizes = itertools.product((1, 8), (4,), (32000,)) if settings.quick else \
            itertools.product((1, 8, 32), (1, 4), (32000,))
        packed_sizes = [(8, 4, 32000)]
    else:
        sizes = itertools.product((1, 8, 64, 256), (4,), (128256,)) if settings.quick else \
            itertools.product((1, 8, 64, 256), (1, 4, 8), (32000, 128256, 151936))
        packed_sizes = [(b, 4, 128256) for b in (1, 8, 64, 256)]
    sizes = list(sizes)
    plain = [dict(B=b, K=k, V=v, inputs=inputs, layout=layout, sampling=NO_SAMPLING)
             for layout, layout_sizes in (("padded", sizes), ("packed", packed_sizes))
             for (b, k, v), inputs in itertools.product(layout_sizes, INPUTS)]
    first_per_batch = {b: (b, k, v) for b, k, v in reversed(sizes)}.values()
    truncated = [dict(B=b, K=k, V=v, inputs=inputs, layout="padded", sampling=TOP_K_TOP_P)
                 for (b, k, v), inputs in itertools.product(first_per_batch, INPUTS)]
    return plain + truncated


def _flashinfer():
    try:
        import flashinfer.sampling

        return flashinfer.sampling
    except Exception:
        return None


def providers(settings: harness.Settings) -> list[str]:
    backends = harness.backend_providers(OP, settings)
    names = backends + ["plain"] + [f"sort+{backend}" for backend in backends]
    if settings.is_cuda and _flashinfer() is not None:
        names.append("flashinfer")
    return names


class Case:
    # plain and flashinfer draw their own random numbers; sort+<backend> verifies a differently rounded
    # truncation (a float32 sum, not the exact integer one)
    UNCOMPARED = ("plain", "flashinfer", *SORT_PROVIDERS)

    def __init__(self, config: dict, settings: harness.Settings):
        self.batch, self.max_drafts, self.vocab = config["B"], config["K"], config["V"]
        self.logits = config["inputs"].startswith("logits")
        self.packed = config.get("layout") == "packed"
        self.truncated = config.get("sampling", NO_SAMPLING) != NO_SAMPLING
        self.device = settings.device

    def make_inputs(self, index: int) -> dict:
        generator = torch.Generator(self.device).manual_seed(1000 + index)
        shape = (self.batch, self.max_drafts + 1, self.vocab)
        target_logits = torch.randn(shape, generator=generator, device=self.device) * SHARPNESS
        draft_logits = target_logits[:, :-1] + DRAFT_NOISE * torch.randn(
            (self.batch, self.max_drafts, self.vocab), generator=generator, device=self.device)
        # The draft is probabilities with either target (contract v1.3), in the target's dtype.
        if self.logits:
            target = target_logits.to(torch.bfloat16)
            draft = torch.softmax(draft_logits.to(torch.bfloat16).float(), -1).to(torch.bfloat16)
        else:
            target, draft = torch.softmax(target_logits, -1), torch.softmax(draft_logits, -1)
        del target_logits, draft_logits
        ids = torch.multinomial(draft.float().view(-1, self.vocab), 1, generator=generator)
        ids = ids.view(self.batch, self.max_drafts).to(torch.int32)
        offset = torch.tensor(index, dtype=torch.int64, device=self.device)
        if self.packed:  # every request has K drafts: the packed rows are the padded ones, as views
            cu = torch.arange(0, self.batch + 1, dtype=torch.int32, device=self.device) * self.max_drafts
            return {"ids": ids.view(-1), "cu": cu, "target": target.view(-1, self.vocab),
                    "draft": draft.view(-1, self.vocab), "offset": offset}
        return {"ids": ids, "target": target, "draft": draft, "offset": offset}

    def set_bytes(self, inputs: dict) -> int:
        return sum(t.numel() * t.element_size() for t in inputs.values())

    def supports(self, provider: str) -> bool:
        if provider.startswith("sort+"):
            return self.truncated
        if provider in self.UNCOMPARED and (self.packed or self.truncated):
            return False
        return provider != "flashinfer" or not self.logits  # FlashInfer takes probabilities

    def call(self, provider: str, inputs: dict):
        if provider == "plain":
            return plain_chain_verify(inputs["ids"], inputs["target"], inputs["draft"], logits=self.logits)
        if provider == "flashinfer":
            return _flashinfer().chain_speculative_sampling(inputs["draft"], inputs["ids"], inputs["target"])
        if provider.startswith("sort+"):
            target = torch.softmax(inputs["target"].float(), -1) if self.logits else inputs["target"]
            return sk.chain_verify(inputs["ids"], sort_top_k_top_p(target, TOP_K, TOP_P), inputs["draft"], seed=SEED,
                                   offset=inputs["offset"], backend=provider.removeprefix("sort+"))
        truncation = dict(top_k=TOP_K, top_p=TOP_P) if self.truncated else {}
        if self.packed:
            return sk.chain_verify_packed(inputs["ids"], inputs["cu"], inputs["target"], inputs["draft"],
                                          max_num_draft_tokens=self.max_drafts, logits=self.logits, seed=SEED,
                                          offset=inputs["offset"], backend=provider, **truncation)
        return sk.chain_verify(inputs["ids"], inputs["target"], inputs["draft"], logits=self.logits, seed=SEED,
                               offset=inputs["offset"], backend=provider, **truncation)

    def same(self, expected, actual) -> bool:
        if not self.logits:
            return torch.equal(expected[0], actual[0]) and torch.equal(expected[1], actual[1])
        rows_equal = (expected[0] == actual[0]).all(dim=-1) & (expected[1] == actual[1])
        return bool(rows_equal.float().mean() >= 0.99)

    def min_bytes(self, inputs: dict, reference_out) -> tuple[float, dict]:
        accepted = reference_out[1].to(torch.int64).cpu()
        drafts, vocab = self.max_drafts, self.vocab
        element = inputs["target"].element_size()
        ids_read = torch.clamp(accepted + 1, max=drafts) * inputs["ids"].element_size()
        rejected = (accepted < drafts).to(torch.int64)
        if self.logits or self.truncated:  # a softmax or a threshold reads its whole target row
            per_request = ids_read + (accepted + 1 + rejected) * vocab * element + accepted * element
        else:
            per_request = ids_read + accepted * 2 * element + (1 + rejected) * vocab * element
        outputs = self.batch * (drafts + 1) * 4 + self.batch * 4
        if self.packed:
            outputs += inputs["cu"].numel() * inputs["cu"].element_size()
        return float(per_request.sum()) + outputs, {"mean_accepted": float(accepted.float().mean())}


if __name__ == "__main__":
    raise SystemExit(harness.main(ops=[OP]))
