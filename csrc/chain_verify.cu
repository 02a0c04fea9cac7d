// Launcher of the fused chain verification (include/specdec/chain_verify.cuh
// holds the design and the kernel): grid choice, dispatch on the distribution
// dtype (float32 / bfloat16 / float16) and the token-id dtype (int32 /
// int64), and the host implementation, which runs the same block program on
// an emulated SIMT block.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "specdec/chain_verify.cuh"

namespace specdec {
namespace {

using chain_verify_detail::BFloat16;
using chain_verify_detail::Float16;
using chain_verify_detail::kElementsPerThread;
using chain_verify_detail::kThreads;

// Two blocks per SM per wave, as the Triton launcher: B = 1 with V = 128256
// gives 126 one-tile blocks on an H200 (132 SMs); larger batches get fewer,
// longer slices. A slice is a whole number of 1024-element tiles.
constexpr int64_t kBlocksPerMultiprocessor = chain_verify_detail::kMinBlocksPerMultiprocessor;
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

// ---------------------------------------------------------------------------
// Host emulation of a block: kSimtThreads std::threads run the block program
// together, 2 warps of 4 lanes (small, so that loops over splits and
// positions take several turns), with barriers where the GPU has
// __syncthreads and shuffles. Barriers order all memory, so plain loads see
// other threads' and earlier blocks' writes.

constexpr int kSimtWarps = 2;
constexpr int kSimtLanes = 4;
constexpr int kSimtThreads = kSimtWarps * kSimtLanes;
constexpr int kSimtWordsPerValue = 8;
// A collective reached by only part of the block would hang on the GPU; the
// emulation reports it instead of hanging the caller.
constexpr auto kSimtDeadlock = std::chrono::seconds(120);

template <int kParties>
class SpinBarrier {
 public:
  void wait() {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == kParties) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      std::this_thread::yield();
      if (spins % 4096 == 4095 && std::chrono::steady_clock::now() - start > kSimtDeadlock) {
        std::fprintf(stderr, "specdec chain_verify host emulation: barrier deadlock (a collective reached by "
                             "part of a block only)\n");
        std::abort();
      }
    }
  }

 private:
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
};

struct SimtState {
  SpinBarrier<kSimtThreads> block_barrier;
  SpinBarrier<kSimtLanes> warp_barriers[kSimtWarps];
  uint32_t exchange[kSimtThreads][kSimtWordsPerValue];  // shuffles
  uint32_t scratch[kSimtWarps][kSimtWordsPerValue];     // block reductions
  int32_t broadcast = 0;
  std::atomic<bool> wait_failed{false};
};

// The Block interface (chain_verify.cuh) on the host. Members are
// SPECDEC_HOST_DEVICE only so that nvcc's device pass accepts the program's
// instantiation with this type; their bodies exist on the host only.
struct SimtHostBlock {
  SimtState* state;
  int tid;

  SPECDEC_HOST_DEVICE int thread() const { return tid; }
  SPECDEC_HOST_DEVICE int num_threads() const { return kSimtThreads; }
  SPECDEC_HOST_DEVICE int warp() const { return tid / kSimtLanes; }
  SPECDEC_HOST_DEVICE int num_warps() const { return kSimtWarps; }
  SPECDEC_HOST_DEVICE int lane() const { return tid % kSimtLanes; }
  SPECDEC_HOST_DEVICE int warp_size() const { return kSimtLanes; }

  // Butterfly over the warp's lanes, as DeviceBlock::warp_all_reduce.
  template <class T, class Combine>
  SPECDEC_HOST_DEVICE T warp_all_reduce(T value, Combine combine) const {
#if !defined(__CUDA_ARCH__)
    static_assert(sizeof(T) <= 4 * kSimtWordsPerValue, "value too large");
    for (int lane_mask = kSimtLanes / 2; lane_mask > 0; lane_mask >>= 1) {
      std::memcpy(state->exchange[tid], &value, sizeof(T));
      state->warp_barriers[warp()].wait();
      T other;
      std::memcpy(&other, state->exchange[tid ^ lane_mask], sizeof(T));
      state->warp_barriers[warp()].wait();
      value = combine(value, other);
    }
#endif
    return value;
  }

  // As DeviceBlock::block_all_reduce: lane 0 of each warp publishes, every
  // thread folds the warps in order.
  template <class T, class Combine>
  SPECDEC_HOST_DEVICE T block_all_reduce(T value, Combine combine) const {
#if !defined(__CUDA_ARCH__)
    value = warp_all_reduce(value, combine);
    state->block_barrier.wait();
    if (lane() == 0) std::memcpy(state->scratch[warp()], &value, sizeof(T));
    state->block_barrier.wait();
    std::memcpy(&value, state->scratch[0], sizeof(T));
    for (int w = 1; w < kSimtWarps; ++w) {
      T other;
      std::memcpy(&other, state->scratch[w], sizeof(T));
      value = combine(value, other);
    }
#endif
    return value;
  }

  SPECDEC_HOST_DEVICE int32_t load_published(const int32_t* address) const { return *address; }

  SPECDEC_HOST_DEVICE int32_t arrive(int32_t* counter) const {
#if !defined(__CUDA_ARCH__)
    state->block_barrier.wait();
    if (tid == 0) state->broadcast = (*counter)++;
    state->block_barrier.wait();
    return state->broadcast;
#else
    return 0;
#endif
  }

  SPECDEC_HOST_DEVICE void reset(int32_t* counter) const {
    if (tid == 0) *counter = 0;
  }

  // Blocks run in id order, so every wave-1 block has arrived; anything else
  // would be a wrong count and is reported.
  SPECDEC_HOST_DEVICE bool wait_at_least(const int32_t* counter, int32_t count) const {
#if !defined(__CUDA_ARCH__)
    if (tid == 0 && *counter < count) state->wait_failed.store(true);
    state->block_barrier.wait();
#endif
    return true;
  }
};

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

const char* chain_verify_host(const ChainVerifyArgs& args) {
  if (args.batch_size == 0) return nullptr;
  ChainVerifyParams params;
  params.args = args;
  params.plan = plan_chain_verify(args.batch_size, args.vocab_size, args.max_drafts, args.workspace_words,
                                  kHostTargetBlocks, kHostTile);
  const int64_t blocks = num_blocks(args, params.plan);
  SimtState state;
  dispatch_dtypes(args, [&](auto prob, auto token) {
    using Prob = decltype(prob);
    using Token = decltype(token);
    std::vector<std::thread> threads;
    for (int tid = 0; tid < kSimtThreads; ++tid) {
      threads.emplace_back([&state, &params, blocks, tid] {
        const SimtHostBlock block = {&state, tid};
        // Blocks in id order, as the GPU dispatches them: wave 1 before wave 2.
        for (int64_t index = 0; index < blocks; ++index) {
          chain_verify_detail::chain_verify_block<SimtHostBlock, Prob, Token>(block, params, index);
          state.block_barrier.wait();
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
  });
  return state.wait_failed.load() ? "a wave-2 block found its request's wave 1 incomplete" : nullptr;
}

}  // namespace specdec
