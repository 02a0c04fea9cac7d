// Counter-based random numbers: the CUDA (and host C++) twin of
// specdec_kernels/rng.py, whose docstring holds the bit layout and the
// reasoning; kernels/rng.py is the Triton twin. All three produce the same
// 32-bit words and, from them, the same float32 uniforms, bit for bit (the
// sampler, sampling.cuh, uses the words themselves).
//
// Every function is SPECDEC_HOST_DEVICE: the GPU kernels and the host
// loop in csrc/rng.cu (rng_fill_host, the CPU implementation of
// torch.ops.specdec_C.rng_fill) run the very same code, so a CPU test of the
// host path checks the arithmetic the GPU executes. Floating-point steps use
// fmul_rn / fadd_rn / fsub_rn (common.cuh): separately rounded operations in
// the reference's order, never contracted into FMAs.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "specdec/common.cuh"

namespace specdec {

// Stream ids (the `stream` counter field): no two uses ever share a counter.
constexpr uint32_t kAcceptStream = 0;  // acceptance tests
constexpr uint32_t kSampleStream = 1;  // residual / bonus sample
constexpr uint32_t kDraftStream = 2;   // draft-side sampling

struct PhiloxWords {
  uint32_t w0, w1, w2, w3;
};

// Philox4x32-10 (Salmon et al., SC 2011): 128-bit counter, 64-bit key.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2,
                                                                  uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u;
  constexpr uint32_t kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u;
  constexpr uint32_t kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round_index = 0; round_index < 10; ++round_index) {
    const uint32_t hi0 = umulhi(kM0, c0);
    const uint32_t lo0 = kM0 * c0;
    const uint32_t hi1 = umulhi(kM1, c2);
    const uint32_t lo1 = kM1 * c2;
    const uint32_t next_c0 = hi1 ^ c1 ^ k0;
    const uint32_t next_c2 = hi0 ^ c3 ^ k1;
    c0 = next_c0;
    c1 = lo1;
    c2 = next_c2;
    c3 = lo0;
    k0 += kW0;  // the bump after the last round is unused
    k1 += kW1;
  }
  return {c0, c1, c2, c3};
}

// The per-request key and upper counter words: (k0, k1) = seed,
// (c2, c3) = offset, with the request index folded into c3.
struct RequestKey {
  uint32_t k0, k1, c2, c3;
};

// `seed` and `offset` are 64-bit two's complement; `request_word` is the
// batch row `b` when the seed is shared by the batch and 0 when each request
// has its own seed.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE RequestKey request_key(int64_t seed, int64_t offset,
                                                               uint32_t request_word) {
  const uint64_t seed_bits = static_cast<uint64_t>(seed);
  const uint64_t offset_bits = static_cast<uint64_t>(offset);
  return {static_cast<uint32_t>(seed_bits), static_cast<uint32_t>(seed_bits >> 32),
          static_cast<uint32_t>(offset_bits), static_cast<uint32_t>(offset_bits >> 32) ^ request_word};
}

// Where a kernel finds seed and offset: read from device memory when a
// pointer is given (so a captured CUDA graph sees the values of each replay),
// else the value passed at launch. Mirrors request_key() in kernels/rng.py.
struct RngArgs {
  const int64_t* seed_ptr = nullptr;    // [B] one seed per request, or nullptr: seed_value
  int64_t seed_value = 0;               // one seed shared by the batch
  const int64_t* offset_ptr = nullptr;  // [] or [B], or nullptr: offset_value
  int64_t offset_value = 0;
  bool offset_per_request = false;      // offset_ptr holds [B] (else [])
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE RequestKey load_request_key(const RngArgs& args, int64_t request) {
  const bool seed_per_request = args.seed_ptr != nullptr;
  const int64_t seed = seed_per_request ? args.seed_ptr[request] : args.seed_value;
  const int64_t offset = args.offset_ptr == nullptr
                             ? args.offset_value
                             : args.offset_ptr[args.offset_per_request ? request : 0];
  return request_key(seed, offset, seed_per_request ? 0u : static_cast<uint32_t>(request));
}

// Philox words for (stream, position, index) under one request key.
// `position` < 2**24, `stream` < 256.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE PhiloxWords random_words(const RequestKey& key, uint32_t stream,
                                                                 uint32_t position, uint32_t index) {
  return philox4x32_10(index, position | (stream << 24), key.c2, key.c3, key.k0, key.k1);
}

// float32 uniform in (0, 1): (2 * (w >> 9) + 1) * 2**-24, exact.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float uniform_from_word(uint32_t word) {
  const uint32_t odd = ((word >> 9) << 1) | 1u;  // < 2**24: converts exactly
  return fmul_rn(static_cast<float>(odd), 0x1p-24f);
}

// ---------------------------------------------------------------------------
// Diagnostic ops (csrc/rng.cu). Tensors are raw contiguous pointers.
// Launchers return the launch status (cudaGetLastError) and never
// synchronise.

// For every request b < batch_size, position p < num_positions and index
// i < num_indices (row-major [B, P, I]), the Philox words of
// (b, rng_stream, positions[p], i): words[(b, p, i), 0..3] (uint32 bits) and
// uniforms[b, p, i] = uniform_from_word(w0).
cudaError_t launch_rng_fill(const RngArgs& rng, int64_t batch_size, uint32_t rng_stream,
                            const int64_t* positions, int64_t num_positions, int64_t num_indices,
                            uint32_t* words, float* uniforms, cudaStream_t cuda_stream);

// The same on the host (pointers to host memory), one element after another.
void rng_fill_host(const RngArgs& rng, int64_t batch_size, uint32_t rng_stream, const int64_t* positions,
                   int64_t num_positions, int64_t num_indices, uint32_t* words, float* uniforms);

}  // namespace specdec
