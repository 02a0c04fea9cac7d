"""Sampling primitives shared by the reference verifiers.

Each primitive is the definition the kernels reproduce bit for bit (with
probability inputs): the acceptance test, the exponential race and the greedy
argmax. See ``specdec_kernels/rng.py`` for where the random words come from.
"""

from __future__ import annotations

import torch

from .. import rng


def probabilities(x: torch.Tensor, temperature: torch.Tensor | None, logits: bool) -> torch.Tensor:
    """float32 distributions ``[B, R, V]`` from probabilities or logits.

    With logits, ``softmax(x / T_b)``; greedy requests (``T_b == 0``) get
    ``softmax(x)`` so that no NaN appears (they only ever use an argmax).
    """
    x = x.to(torch.float32)
    if not logits:
        return x
    if temperature is None:
        return torch.softmax(x, dim=-1)
    safe_temperature = torch.where(temperature > 0, temperature, 1.0).to(torch.float32)
    return torch.softmax(x / safe_temperature.view(-1, *([1] * (x.dim() - 1))), dim=-1)


def greedy_requests(temperature: torch.Tensor | None, batch_size: int, device) -> torch.Tensor:
    """bool ``[B]``: requests decoded greedily (``T_b == 0``)."""
    if temperature is None:
        return torch.zeros(batch_size, dtype=torch.bool, device=device)
    return temperature == 0


def greedy_tokens(x: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim of the raw input, ties to the lowest index.

    Taken on the logits or probabilities as given: the argmax of
    ``softmax(x / T)`` is that of ``x``, and reading ``x`` avoids ties created
    by rounding in the softmax.
    """
    return torch.argmax(x.to(torch.float32), dim=-1)


def accept(uniform: torch.Tensor, target_prob: torch.Tensor, draft_prob: torch.Tensor) -> torch.Tensor:
    """Accept with probability ``min(1, p/q)``: ``u * q < p``.

    A multiply instead of a divide keeps every backend exact (no approximate
    division on GPUs), accepts surely when ``q == 0 < p`` and never when
    ``p == 0``.
    """
    return uniform * draft_prob < target_prob


def acceptance_uniforms(keys: rng.RequestKeys, positions: torch.Tensor) -> torch.Tensor:
    """float32 uniforms of the acceptance stream at ``positions`` (int64, batch first)."""
    words = keys.words(rng.ACCEPT_STREAM, positions, torch.zeros_like(positions))
    return rng.uniform_from_word(words[0])


def race_sample(keys: rng.RequestKeys, position: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Sample ``[B]`` tokens from unnormalised non-negative ``mass [B, V]``.

    Exponential race: ``argmin_v E_v / mass_v`` with ``E_v`` from the sample
    stream at ``(position_b, v)``; ties go to the lower index. Rows without
    mass must be replaced by the caller (here they would return index 0).
    """
    vocab = torch.arange(mass.shape[-1], dtype=torch.int64, device=mass.device)
    words = keys.words(rng.SAMPLE_STREAM, position.view(-1, 1), vocab.view(1, -1))
    noise = rng.exponential_from_words(*words)
    return torch.argmin(rng.race_keys(noise, mass), dim=-1)


def residual(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """Unnormalised residual ``max(0, p - q)``; rows without mass fall back to ``p``."""
    mass = torch.clamp_min(target_row - draft_row, 0.0)
    has_mass = (mass > 0).any(dim=-1, keepdim=True)
    return torch.where(has_mass, mass, target_row)
