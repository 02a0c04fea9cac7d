"""Triton kernels (@triton.jit functions only), installed as ``specdec_kernels._kernels``."""
