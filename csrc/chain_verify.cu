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
// positions take several turns; a chunk is 128 elements per thread), with
// barriers where the GPU has __syncthreads and shuffles. Barriers order all
// memory, so plain loads see other threads' and earlier blocks' writes.
// Blocks run one after another, so nothing ever waits on a block that has
// not run: a wait that would fail sets the error flag instead.

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
  uint32_t exchange[kSimtThreads][kSimtWordsPerValue];  // shuffles and scans
  uint32_t scratch[kSimtWarps][kSimtWordsPerValue];     // block reductions
  uint64_t draws[kSimtThreads];
  int32_t broadcast = 0;
};

// The Block interface (block.cuh) on the host. Members are
// SPECDEC_HOST_DEVICE only so that nvcc's device pass accepts the program's
// instantiation with this type; their bodies exist on the host only.
struct SimtHostBlock {
  static constexpr int kThreads = kSimtThreads;
  SimtState* state;
  int tid;

  SPECDEC_HOST_DEVICE int thread() const { return tid; }
  SPECDEC_HOST_DEVICE int num_threads() const { return kSimtThreads; }
  SPECDEC_HOST_DEVICE int warp() const { return tid / kSimtLanes; }
  SPECDEC_HOST_DEVICE int num_warps() const { return kSimtWarps; }
  SPECDEC_HOST_DEVICE int lane() const { return tid % kSimtLanes; }
  SPECDEC_HOST_DEVICE int warp_size() const { return kSimtLanes; }
  SPECDEC_HOST_DEVICE uint64_t* draws() const { return state->draws; }

  SPECDEC_HOST_DEVICE void sync() const {
#if !defined(__CUDA_ARCH__)
    state->block_barrier.wait();
#endif
  }

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

  // Every thread publishes its value and sums those of the threads before it.
  template <class T, class Add>
  SPECDEC_HOST_DEVICE T block_exclusive_scan(T value, Add add, T zero, T* total) const {
    T before = zero;
#if !defined(__CUDA_ARCH__)
    static_assert(sizeof(T) <= 4 * kSimtWordsPerValue, "value too large");
    state->block_barrier.wait();
    std::memcpy(state->exchange[tid], &value, sizeof(T));
    state->block_barrier.wait();
    T sum = zero;
    for (int t = 0; t < kSimtThreads; ++t) {
      T other;
      std::memcpy(&other, state->exchange[t], sizeof(T));
      if (t < tid) before = add(before, other);
      sum = add(sum, other);
    }
    *total = sum;
    state->block_barrier.wait();  // everyone has read `exchange` before its next use
#endif
    return before;
  }

  SPECDEC_HOST_DEVICE int32_t load_published(const int32_t* address) const { return *address; }
  SPECDEC_HOST_DEVICE int64_t load_published(const int64_t* address) const { return *address; }

  // Thread 0 updates, every thread reads the result after a barrier.
  template <class Update>
  SPECDEC_HOST_DEVICE int32_t by_thread_zero(Update update) const {
#if !defined(__CUDA_ARCH__)
    state->block_barrier.wait();
    if (tid == 0) state->broadcast = update();
    state->block_barrier.wait();
#endif
    return state->broadcast;
  }

  SPECDEC_HOST_DEVICE int32_t take_ticket(int32_t* counter, int32_t count) const {
    return by_thread_zero([&] {
      const int32_t ticket = (*counter)++;
      if (ticket == count - 1) *counter = 0;
      return ticket;
    });
  }

  SPECDEC_HOST_DEVICE int32_t arrive(int32_t* counter) const {
    return by_thread_zero([&] { return (*counter)++; });
  }

  SPECDEC_HOST_DEVICE void reset(int32_t* counter) const {
    if (tid == 0) *counter = 0;
  }

  // Blocks run one after another in ticket order, so every block waited on
  // has finished; a short count is a broken invariant and is reported
  // through the error flag, never waited for.
  SPECDEC_HOST_DEVICE bool wait_at_least(const int32_t* counter, int32_t count, int32_t* error) const {
    return by_thread_zero([&] {
      const bool reached = *counter >= count;
      if (!reached) *error |= 1;
      return static_cast<int32_t>(reached);
    }) != 0;
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
  params.plan = plan_chain_verify(args, kBlocksPerMultiprocessor * multiprocessors);
  const int64_t blocks = chain_verify_num_blocks(args, params.plan);
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  dispatch_dtypes(args, [&](auto prob, auto token) {
    using Prob = decltype(prob);
    using Token = decltype(token);
    chain_verify_detail::chain_verify_kernel<Prob, Token>
        <<<static_cast<unsigned>(blocks), DeviceBlock::kThreads, 0, stream>>>(params);
  });
  return cudaGetLastError();
}

const char* chain_verify_host(const ChainVerifyArgs& args) {
  if (args.batch_size == 0) return nullptr;
  ChainVerifyParams params;
  params.args = args;
  params.plan = plan_chain_verify(args, kHostTargetBlocks);
  const int64_t blocks = chain_verify_num_blocks(args, params.plan);
  const int32_t error_before = args.counters[kChainErrorWord];
  SimtState state;
  dispatch_dtypes(args, [&](auto prob, auto token) {
    using Prob = decltype(prob);
    using Token = decltype(token);
    std::vector<std::thread> threads;
    for (int tid = 0; tid < kSimtThreads; ++tid) {
      threads.emplace_back([&state, &params, blocks, tid] {
        const SimtHostBlock block = {&state, tid};
        // Blocks one after another: with tickets, in ticket order.
        for (int64_t index = 0; index < blocks; ++index) {
          chain_verify_detail::chain_verify_block<SimtHostBlock, Prob, Token>(block, params, index);
          state.block_barrier.wait();
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
  });
  return args.counters[kChainErrorWord] != error_before ? "counters found inconsistent (a wait gave up or a ticket was out of range: counters left dirty by a call that never finished?)" : nullptr;
}

}  // namespace specdec
