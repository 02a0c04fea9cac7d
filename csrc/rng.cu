// Diagnostic RNG op: exposes the Philox words and the uniforms of
// include/specdec/rng.cuh so tests can compare them, bit for bit, with
// specdec_kernels/rng.py. A GPU launcher and a host loop run the same
// SPECDEC_HOST_DEVICE element function.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "specdec/rng.cuh"

namespace specdec {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kMaxGridY = 65535;

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void rng_fill_element(const RequestKey& key, uint32_t rng_stream,
                                                              uint32_t position, int64_t index, int64_t flat,
                                                              uint32_t* words, float* uniforms) {
  const PhiloxWords w = random_words(key, rng_stream, position, static_cast<uint32_t>(index));
  // Four scalar stores rather than one uint4: a diagnostic op, and the
  // caller's buffer need not be 16-byte aligned.
  words[4 * flat + 0] = w.w0;
  words[4 * flat + 1] = w.w1;
  words[4 * flat + 2] = w.w2;
  words[4 * flat + 3] = w.w3;
  uniforms[flat] = uniform_from_word(w.w0);
}

// grid.y walks the rows (b, p), grid.x the indices of a row; both loops
// stride so any size fits in a bounded grid.
__global__ void rng_fill_kernel(RngArgs rng, int64_t batch_size, uint32_t rng_stream,
                                const int64_t* __restrict__ positions, int64_t num_positions,
                                int64_t num_indices, uint32_t* __restrict__ words, float* __restrict__ uniforms) {
  const int64_t num_rows = batch_size * num_positions;
  for (int64_t row = blockIdx.y; row < num_rows; row += gridDim.y) {
    const int64_t request = row / num_positions;
    const RequestKey key = load_request_key(rng, request);
    const uint32_t position = static_cast<uint32_t>(positions[row % num_positions]);
    for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < num_indices;
         index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      rng_fill_element(key, rng_stream, position, index, row * num_indices + index, words, uniforms);
    }
  }
}

int64_t blocks_for(int64_t n, int64_t max_blocks) {
  return std::max<int64_t>(1, std::min<int64_t>((n + kThreadsPerBlock - 1) / kThreadsPerBlock, max_blocks));
}

}  // namespace

cudaError_t launch_rng_fill(const RngArgs& rng, int64_t batch_size, uint32_t rng_stream,
                            const int64_t* positions, int64_t num_positions, int64_t num_indices,
                            uint32_t* words, float* uniforms, cudaStream_t cuda_stream) {
  const int64_t num_rows = batch_size * num_positions;
  if (num_rows == 0 || num_indices == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(blocks_for(num_indices, 1024)),
                  static_cast<unsigned>(std::min(num_rows, kMaxGridY)));
  rng_fill_kernel<<<grid, kThreadsPerBlock, 0, cuda_stream>>>(rng, batch_size, rng_stream, positions,
                                                              num_positions, num_indices, words, uniforms);
  return cudaGetLastError();
}

void rng_fill_host(const RngArgs& rng, int64_t batch_size, uint32_t rng_stream, const int64_t* positions,
                   int64_t num_positions, int64_t num_indices, uint32_t* words, float* uniforms) {
  for (int64_t request = 0; request < batch_size; ++request) {
    const RequestKey key = load_request_key(rng, request);
    for (int64_t p = 0; p < num_positions; ++p) {
      const uint32_t position = static_cast<uint32_t>(positions[p]);
      const int64_t row = request * num_positions + p;
      for (int64_t index = 0; index < num_indices; ++index) {
        rng_fill_element(key, rng_stream, position, index, row * num_indices + index, words, uniforms);
      }
    }
  }
}

}  // namespace specdec
