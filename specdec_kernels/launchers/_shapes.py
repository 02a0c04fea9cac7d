"""Integer and layout helpers shared by the launchers."""

from __future__ import annotations

import functools

import torch


def next_power_of_2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def unit_last_stride(tensor):
    """``tensor``, made contiguous only when its last dim is strided (kernels take row strides)."""
    if tensor is None or tensor.dim() == 0 or tensor.stride(-1) == 1:
        return tensor
    return tensor.contiguous()


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device (cached: the launchers size their grids with it on every call)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
