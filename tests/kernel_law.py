"""How the exactness suites hold a kernel to the target's law.

The reference's emitted tokens are checked against the exact joint law
(chi-square, ``markov.py``) on the full sample, and so are a kernel's on a
GPU. On a CPU the kernels run under Triton's interpreter or as host twins,
hundreds of times slower than the reference: there a kernel runs the same
generation loop (same drafts, seeds and offsets) on fewer sequences and must
emit the reference's tokens bit for bit. The reference's law and that
equality together are the kernel's law, and the loop exercises the kernel on
the suites' own inputs. (The interpreter's full-size runs took about half of
CI's test time.)
"""

from __future__ import annotations

import torch

from markov import SIGNIFICANCE

KERNEL_SEQUENCES_ON_CPU = 2_000


def assert_follows_the_law(run, backend: str, device: torch.device, pvalue, num_sequences: int) -> torch.Tensor:
    """``run(backend, num_sequences)`` is the suite's loop, returning the emitted tokens; ``pvalue(tokens)`` the
    chi-square p-value of the law. Returns the backend's tokens (for the caller's further checks)."""
    if backend != "reference" and device.type == "cpu":
        tokens = run(backend, KERNEL_SEQUENCES_ON_CPU)
        expected = run("reference", KERNEL_SEQUENCES_ON_CPU)
        assert torch.equal(tokens, expected), f"{backend} does not emit the reference's tokens"
        return tokens
    tokens = run(backend, num_sequences)
    assert pvalue(tokens) >= SIGNIFICANCE
    return tokens
