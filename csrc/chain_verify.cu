// Launcher of the fused chain verification (include/specdec/chain_verify.cuh
// holds the design and the kernel): grid choice, dispatch on the distribution
// dtype (float32 / bfloat16 / float16) and the token-id dtype (int32 /
// int64), and the host implementation, which runs the same block program on
// an emulated SIMT block.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "specdec/chain_verify.cuh"
#include "specdec/host_block.cuh"

namespace specdec {
namespace {

// Two blocks per SM per wave (the kernel's __launch_bounds__): B = 1 with
// V = 128256 gives 126 one-chunk blocks on an H200 (132 SMs); larger batches
// get fewer, longer slices, and one block per request once B >= 2 * SMs.
constexpr int64_t kBlocksPerMultiprocessor = 2;
// The host path splits a row over up to 8 blocks per batch, so CPU tests with
// a few thousand tokens combine several slices (the op's `num_splits`
// argument forces any other count).
constexpr int64_t kHostTargetBlocks = 8;
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

// Calls body(Prob{}, Token{}, Staged{}) with the storage types of the call and
// the plan's staging as a std::bool_constant: one instantiation per plan, so
// neither plan pays registers for the other.
template <class Body>
void dispatch_instantiation(const ChainVerifyArgs& args, const ChainVerifyPlan& plan, Body&& body) {
  dispatch_storage_types(args.prob_dtype, args.token_dtype, [&](auto prob, auto token) {
    dispatch_bool(plan.staged, [&](auto staged) { body(prob, token, staged); });
  });
}

}  // namespace

cudaError_t launch_chain_verify(const ChainVerifyArgs& args, cudaStream_t stream) {
  if (args.batch_size == 0) return cudaSuccess;
  int multiprocessors = 0;
  const cudaError_t status = multiprocessor_count(&multiprocessors);
  if (status != cudaSuccess) return status;
  ChainVerifyParams params;
  params.args = args;
  params.plan = plan_chain_verify(args, kBlocksPerMultiprocessor * multiprocessors);
  const int64_t blocks = chain_verify_num_blocks(args, params.plan);
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  dispatch_instantiation(args, params.plan, [&](auto prob, auto token, auto staged) {
    chain_verify_detail::chain_verify_kernel<decltype(prob), decltype(token), decltype(staged)::value>
        <<<static_cast<unsigned>(blocks), DeviceBlock::kThreads, 0, stream>>>(params);
  });
  return cudaGetLastError();
}

void chain_verify_host(const ChainVerifyArgs& args) {
  if (args.batch_size == 0) return;
  ChainVerifyParams params;
  params.args = args;
  params.plan = plan_chain_verify(args, kHostTargetBlocks);
  const int64_t blocks = chain_verify_num_blocks(args, params.plan);
  dispatch_instantiation(args, params.plan, [&](auto prob, auto token, auto staged) {
    // Blocks one after another, in id order. The emulated block's shared
    // memory is reused by each.
    TruncationHistogram histogram;
    run_host_blocks(blocks, [&params, &histogram](const SimtHostBlock& block, int64_t index) {
      chain_verify_detail::chain_verify_block<SimtHostBlock, decltype(prob), decltype(token), decltype(staged)::value>(
          block, params, index, &histogram);
    });
  });
}

}  // namespace specdec
