"""A Triton kernel that writes the RNG twin's draws, for tests/test_rng.py."""

import triton
import triton.language as tl

from specdec_kernels._kernels import rng as trng


@triton.jit
def draw_kernel(seed_ptr, seed_low, seed_high, offset_ptr, offset_low, offset_high, positions_ptr, words_ptr,
                uniforms_ptr, num_positions, num_indices, STREAM: tl.constexpr,
                SEED_PER_REQUEST: tl.constexpr, OFFSET_FROM_TENSOR: tl.constexpr,
                OFFSET_PER_REQUEST: tl.constexpr, BLOCK: tl.constexpr):
    request = tl.program_id(0)
    position_slot = tl.program_id(1)
    requests = request + tl.zeros((1,), tl.int32)
    k0, k1, c2, c3 = trng.request_key(seed_ptr, seed_low, seed_high, offset_ptr, offset_low, offset_high,
                                      requests, requests >= 0, SEED_PER_REQUEST, OFFSET_FROM_TENSOR,
                                      OFFSET_PER_REQUEST)
    position = tl.load(positions_ptr + position_slot)
    index = tl.arange(0, BLOCK)
    mask = index < num_indices
    w0, w1, w2, w3 = trng.random_words(k0, k1, c2, c3, STREAM, position + index * 0, index)
    base = (request * num_positions + position_slot) * num_indices + index
    tl.store(words_ptr + base * 4 + 0, w0.to(tl.int32, bitcast=True), mask=mask)
    tl.store(words_ptr + base * 4 + 1, w1.to(tl.int32, bitcast=True), mask=mask)
    tl.store(words_ptr + base * 4 + 2, w2.to(tl.int32, bitcast=True), mask=mask)
    tl.store(words_ptr + base * 4 + 3, w3.to(tl.int32, bitcast=True), mask=mask)
    tl.store(uniforms_ptr + base, trng.uniform_from_word(w0), mask=mask)
