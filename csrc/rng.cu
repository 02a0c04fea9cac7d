// Diagnostic RNG ops: expose the Philox words and the float transforms of
// include/specdec/rng.cuh so tests can compare them, bit for bit, with
// specdec_kernels/rng.py. Each op has a GPU launcher and a host loop that
// run the same SPECDEC_HOST_DEVICE element function.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "specdec/rng.cuh"

namespace specdec {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kMaxGridY = 65535;

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void rng_fill_element(const RequestKey& key, uint32_t rng_stream,
                                                              uint32_t position, int64_t index,
                                                              int64_t flat, uint32_t* words, float* uniforms,
                                                              float* exponentials) {
  const PhiloxWords w = random_words(key, rng_stream, position, static_cast<uint32_t>(index));
  // Four scalar stores rather than one uint4: a diagnostic op, and the
  // caller's buffer need not be 16-byte aligned.
  words[4 * flat + 0] = w.w0;
  words[4 * flat + 1] = w.w1;
  words[4 * flat + 2] = w.w2;
  words[4 * flat + 3] = w.w3;
  uniforms[flat] = uniform_from_word(w.w0);
  exponentials[flat] = exponential_from_words(w.w0, w.w1, w.w2, w.w3);
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void rng_from_words_element(const uint32_t* words, int64_t i,
                                                                    float* uniforms, float* exponentials) {
  const uint32_t w0 = words[4 * i + 0];
  const uint32_t w1 = words[4 * i + 1];
  const uint32_t w2 = words[4 * i + 2];
  const uint32_t w3 = words[4 * i + 3];
  uniforms[i] = uniform_from_word(w0);
  exponentials[i] = exponential_from_words(w0, w1, w2, w3);
}

// grid.y walks the rows (b, p), grid.x the indices of a row; both loops
// stride so any size fits in a bounded grid.
__global__ void rng_fill_kernel(RngArgs rng, int64_t batch_size, uint32_t rng_stream,
                                const int64_t* __restrict__ positions, int64_t num_positions,
                                int64_t num_indices, uint32_t* __restrict__ words, float* __restrict__ uniforms,
                                float* __restrict__ exponentials) {
  const int64_t num_rows = batch_size * num_positions;
  for (int64_t row = blockIdx.y; row < num_rows; row += gridDim.y) {
    const int64_t request = row / num_positions;
    const RequestKey key = load_request_key(rng, request);
    const uint32_t position = static_cast<uint32_t>(positions[row % num_positions]);
    for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < num_indices;
         index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      rng_fill_element(key, rng_stream, position, index, row * num_indices + index, words, uniforms,
                       exponentials);
    }
  }
}

__global__ void rng_from_words_kernel(const uint32_t* __restrict__ words, int64_t n, float* __restrict__ uniforms,
                                      float* __restrict__ exponentials) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    rng_from_words_element(words, i, uniforms, exponentials);
  }
}

int64_t blocks_for(int64_t n, int64_t max_blocks) {
  return std::max<int64_t>(1, std::min<int64_t>((n + kThreadsPerBlock - 1) / kThreadsPerBlock, max_blocks));
}

}  // namespace

cudaError_t launch_rng_fill(const RngArgs& rng, int64_t batch_size, uint32_t rng_stream,
                            const int64_t* positions, int64_t num_positions, int64_t num_indices,
                            uint32_t* words, float* uniforms, float* exponentials, cudaStream_t cuda_stream) {
  const int64_t num_rows = batch_size * num_positions;
  if (num_rows == 0 || num_indices == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(blocks_for(num_indices, 1024)),
                  static_cast<unsigned>(std::min(num_rows, kMaxGridY)));
  rng_fill_kernel<<<grid, kThreadsPerBlock, 0, cuda_stream>>>(rng, batch_size, rng_stream, positions,
                                                              num_positions, num_indices, words, uniforms,
                                                              exponentials);
  return cudaGetLastError();
}

void rng_fill_host(const RngArgs& rng, int64_t batch_size, uint32_t rng_stream, const int64_t* positions,
                   int64_t num_positions, int64_t num_indices, uint32_t* words, float* uniforms,
                   float* exponentials) {
  for (int64_t request = 0; request < batch_size; ++request) {
    const RequestKey key = load_request_key(rng, request);
    for (int64_t p = 0; p < num_positions; ++p) {
      const uint32_t position = static_cast<uint32_t>(positions[p]);
      const int64_t row = request * num_positions + p;
      for (int64_t index = 0; index < num_indices; ++index) {
        rng_fill_element(key, rng_stream, position, index, row * num_indices + index, words, uniforms,
                         exponentials);
      }
    }
  }
}

cudaError_t launch_rng_from_words(const uint32_t* words, int64_t n, float* uniforms, float* exponentials,
                                  cudaStream_t cuda_stream) {
  if (n == 0) return cudaSuccess;
  rng_from_words_kernel<<<static_cast<unsigned>(blocks_for(n, 65535)), kThreadsPerBlock, 0, cuda_stream>>>(
      words, n, uniforms, exponentials);
  return cudaGetLastError();
}

void rng_from_words_host(const uint32_t* words, int64_t n, float* uniforms, float* exponentials) {
  for (int64_t i = 0; i < n; ++i) rng_from_words_element(words, i, uniforms, exponentials);
}

}  // namespace specdec
