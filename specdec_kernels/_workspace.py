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


def buffers(device: torch.device, specs: dict[str, tuple[int, torch.dtype]]) -> dict[str, torch.Tensor]:
    """Zero-initialised-once flat buffers, ``{name: (min numel, dtype)}``, for one launch.

    The stream is looked up once per call: this runs on every launch.
    """
    stream = _stream_key(device)
    return {name: _buffer(name, numel, dtype, device, stream) for name, (numel, dtype) in specs.items()}


def _buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device, stream) -> torch.Tensor:
    key = (name, dtype, device, stream)
    current = _buffers.get(key)
    if current is None or current.numel() < numel:
        size = max(numel, 2 * current.numel() if current is not None else 0, 1)
        current = torch.zeros(size, dtype=dtype, device=device)
        _buffers[key] = current
    return current
