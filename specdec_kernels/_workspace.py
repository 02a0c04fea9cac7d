"""Persistent scratch buffers for kernels that combine partial results.

A kernel whose programs meet at an arrival counter needs the counter at zero
when it starts. Zeroing it per call would be a second launch, so the buffers
live across calls and every kernel leaves its counters at zero when it ends.
Buffers are allocated (zeroed) on first use and grow geometrically; they are
keyed by device and stream, so concurrent streams never share counters. Warm
a size up once before CUDA-graph capture so no allocation happens inside it.
"""

from __future__ import annotations

import torch

_buffers: dict[tuple, torch.Tensor] = {}


def _stream_key(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.current_stream(device).stream_id
    return 0


def buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-initialised-once flat buffer of at least ``numel`` elements."""
    key = (name, dtype, device, _stream_key(device))
    current = _buffers.get(key)
    if current is None or current.numel() < numel:
        size = max(numel, 2 * current.numel() if current is not None else 0, 1)
        current = torch.zeros(size, dtype=dtype, device=device)
        _buffers[key] = current
    return current
