"""Sampling-parameter variants of a test case (a dict of an op's arguments), shared by the CUDA tests.

A case holds ``target`` as ``[B, rows, V]``; these helpers add per-request
``top_k`` / ``top_p`` / ``min_p`` / ``bonus_token_ids`` to it, with off
values and extremes mixed in, and read them back in the ops' order.
"""

import torch

SAMPLING_PARAMETERS = ("top_k", "top_p", "min_p", "bonus_token_ids")


def sampling_parameters(case):
    """The case's top_k / top_p / min_p / bonus_token_ids (None where it has none)."""
    return tuple(case.get(name) for name in SAMPLING_PARAMETERS)


PARAMETER_SETS = {
    "top_k": ("top_k",),
    "top_p": ("top_p",),
    "min_p": ("min_p",),
    "all": ("top_k", "top_p", "min_p"),
    "bonus": ("bonus_token_ids",),
    "all+bonus": ("top_k", "top_p", "min_p", "bonus_token_ids"),
}


def parameter_values(names, batch_size, vocab_size, seed, device="cpu"):
    """Per-request values of the parameters ``names``, off values and extremes mixed in:
    top_k in {0 (off), 1, 2, 5, 40, V - 1, V (off)}, top_p in {1 (off), 0 (out of range: off), 1e-6 (the largest and its ties), 0.3, 0.9,
    0.999, NaN (off)}, min_p in {0 (off), 0.05, 0.5, 1}; int32 or int64 top_k and bonus ids by the seed's parity."""
    generator = torch.Generator().manual_seed(seed)
    index_dtype = torch.int64 if seed % 2 else torch.int32

    def pick(values, dtype):
        return torch.tensor(values, dtype=dtype)[torch.randint(0, len(values), (batch_size,), generator=generator)]

    values = {
        "top_k": lambda: pick([0, 1, 2, 5, 40, vocab_size - 1, vocab_size], index_dtype),
        "top_p": lambda: pick([1.0, 0.0, 1e-6, 0.3, 0.9, 0.999, float("nan")], torch.float32),
        "min_p": lambda: pick([0.0, 0.05, 0.5, 1.0], torch.float32),
        "bonus_token_ids": lambda: torch.randint(0, vocab_size, (batch_size,), generator=generator, dtype=index_dtype),
    }
    return {name: values[name]().to(device) for name in names}


def with_parameters(case, names, seed):
    """``case`` (target ``[B, rows, V]``) with :func:`parameter_values` of ``names`` added."""
    batch_size, _, vocab_size = case["target"].shape
    return {**case, **parameter_values(names, batch_size, vocab_size, seed, case["target"].device)}


def quantised(case, levels=20):
    """The target rounded to multiples of 1 / levels: many ties at every threshold."""
    return {**case, "target": torch.round(case["target"] * levels) / levels}


def assert_logits_agree(rates, what):
    """Requests-identical rates of a kernel against the reference with logits and the parameters on: the softmax
    rounds differently from torch's, so a token within an ulp of a threshold or an acceptance test may go the other
    way; anything beyond that is a bug."""
    print(f"host logits agreement with the reference, sampling parameters on ({what}): {rates}")
    assert min(rates) >= 0.9 and sum(rates) / len(rates) >= 0.95, rates
