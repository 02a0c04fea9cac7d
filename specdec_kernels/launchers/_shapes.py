"""Integer and layout helpers shared by the launchers."""

from __future__ import annotations

import contextlib
import functools

import torch


def next_power_of_2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def device_guard(device: torch.device):
    """Triton launches on the current CUDA device: a context that makes it ``device`` (nothing on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def unit_last_stride(tensor):
    """``tensor``, made contiguous only when its last dim is strided (kernels take row strides)."""
    if tensor is None or tensor.dim() == 0 or tensor.stride(-1) == 1:
        return tensor
    return tensor.contiguous()


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device (cached: the launchers size their grids with it on every call)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def device_capability(device: torch.device) -> int:
    """A CUDA device's compute capability as ``10 * major + minor`` (80: A100, 90: H100/H200)."""
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


# Launch options are tuned on CI's Triton (3.9, python -m specdec_kernels._kernels.aot). Older Triton
# allocates registers differently: the GPU machines' Triton 3.6 spilled in 15 of 96 compiles with them,
# so a launcher may choose other options below this version (each with the compile that justifies it).
TUNED_TRITON = (3, 9)


@functools.lru_cache(maxsize=None)
def older_triton() -> bool:
    """Whether the installed Triton predates ``TUNED_TRITON`` (the GPU machines run 3.6)."""
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return (int(major), int(minor)) < TUNED_TRITON
