// Launcher of the fused chain verification (include/specdec/chain_verify.cuh
// holds the design and the kernel): grid choice, dispatch on the distribution
// dtype (float32 / bfloat16 / float16) and the token-id dtype (int32 /
// int64), and the host implementation that runs the same block program.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "specdec/chain_verify.cuh"

namespace specdec {
namespace {

using chain_verify_detail::BFloat16;
using chain_verify_detail::Float16;
using chain_verify_detail::HostBlock;
using chain_verify_detail::kElementsPerThread;
using chain_verify_detail::kThreads;

// Two blocks per SM per wave, as the Triton launcher: B = 1 with V = 128256
// gives 126 one-tile blocks on an H200 (132 SMs); larger batches get fewer,
// longer slices. A slice is a whole number of 1024-element tiles.
constexpr int64_t kBlocksPerMultiprocessor = 2;
constexpr int32_t kDeviceTile = kThreads * kElementsPerThread;
// The host path uses small slices so CPU tests with a few hundred tokens
// still combine several splits.
constexpr int64_t kHostTargetBlocks = 8;
constexpr int32_t kHostTile = 32;
constexpr int kMaxDevices = 64;

cudaError_t multiprocessor_count(int* count) {
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  if (device >= 0 && device < kMaxDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) {
      *count = cached;
      return cudaSuccess;
    }
  }
  status = cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
  if (status == cudaSuccess && device >= 0 && device < kMaxDevices) {
    cache[device].store(*count, std::memory_order_relaxed);
  }
  return status;
}

int64_t num_blocks(const ChainVerifyArgs& args, const ChainVerifyPlan& plan) {
  return (args.logits ? 2 : 1) * args.batch_size * plan.num_splits;
}

// Calls body(Prob{}, Token{}) with the storage types of the call.
template <class Body>
void dispatch_dtypes(const ChainVerifyArgs& args, Body&& body) {
  const bool wide_ids = args.token_dtype == TokenDtype::kInt64;
  switch (args.prob_dtype) {
    case ProbDtype::kFloat32:
      wide_ids ? body(float{}, int64_t{}) : body(float{}, int32_t{});
      break;
    case ProbDtype::kBFloat16:
      wide_ids ? body(BFloat16{}, int64_t{}) : body(BFloat16{}, int32_t{});
      break;
    case ProbDtype::kFloat16:
      wide_ids ? body(Float16{}, int64_t{}) : body(Float16{}, int32_t{});
      break;
  }
}

}  // namespace

cudaError_t launch_chain_verify(const ChainVerifyArgs& args, cudaStream_t stream) {
  if (args.batch_size == 0) return cudaSuccess;
  int multiprocessors = 0;
  const cudaError_t status = multiprocessor_count(&multiprocessors);
  if (status != cudaSuccess) return status;
  ChainVerifyParams params;
  params.args = args;
  params.plan = plan_chain_verify(args.batch_size, args.vocab_size, args.max_drafts, args.workspace_words,
                                  kBlocksPerMultiprocessor * multiprocessors, kDeviceTile);
  const int64_t blocks = num_blocks(args, params.plan);
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  dispatch_dtypes(args, [&](auto prob, auto token) {
    using Prob = decltype(prob);
    using Token = decltype(token);
    chain_verify_detail::chain_verify_kernel<Prob, Token>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
  });
  return cudaGetLastError();
}

void chain_verify_host(const ChainVerifyArgs& args) {
  if (args.batch_size == 0) return;
  ChainVerifyParams params;
  params.args = args;
  params.plan = plan_chain_verify(args.batch_size, args.vocab_size, args.max_drafts, args.workspace_words,
                                  kHostTargetBlocks, kHostTile);
  const int64_t blocks = num_blocks(args, params.plan);
  const HostBlock block;
  dispatch_dtypes(args, [&](auto prob, auto token) {
    using Prob = decltype(prob);
    using Token = decltype(token);
    // Blocks in id order, as the GPU dispatches them: wave 1 before wave 2.
    for (int64_t index = 0; index < blocks; ++index) {
      chain_verify_detail::chain_verify_block<HostBlock, Prob, Token>(block, params, index);
    }
  });
}

}  // namespace specdec
