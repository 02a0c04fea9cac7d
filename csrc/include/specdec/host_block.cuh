// The Block interface of block.cuh on the host: SimtHostBlock, and
// run_host_blocks, which runs a block program over a grid of blocks.
//
// kSimtThreads std::threads run the block program together, 2 warps of 4
// lanes (small, so that loops over splits, positions and tiles take several
// turns; a chain_verify chunk is 128 elements per thread), with barriers
// where the GPU has __syncthreads and shuffles. Barriers order all memory,
// so plain loads see other threads' and earlier blocks' writes. Blocks run
// one after another, so nothing ever waits on a block that has not run: a
// wait that would fail gives up at once (faults.cuh).
//
// The CPU implementations of the extension's block programs (csrc/*.cu) run
// on it, so CPU-only machines test the kernels' code.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "specdec/common.cuh"
#include "specdec/faults.cuh"

namespace specdec {

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
        std::fprintf(stderr, "specdec host block emulation: barrier deadlock (a collective reached by "
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
  static constexpr int kWarpSize = kSimtLanes;
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

  SPECDEC_HOST_DEVICE int64_t take(int64_t* counter) const {
    return by_thread_zero([&] { return static_cast<int32_t>((*counter)++); });
  }

  template <class Word>
  SPECDEC_HOST_DEVICE void add_relaxed(Word* word, Word value) const {
    if (tid == 0) *word += value;
  }

  SPECDEC_HOST_DEVICE void max_relaxed(int64_t* word, int64_t value) const {
    if (tid == 0) *word = value > *word ? value : *word;
  }

  template <class Word>
  SPECDEC_HOST_DEVICE int32_t arrive(Word* counter) const {
    return by_thread_zero([&] { return static_cast<int32_t>((*counter)++); });
  }

  // DeviceBlock::arrive_last, blocks in id order: a damaged count is taken
  // back out at once, so the counter goes on from one.
  template <class Word>
  SPECDEC_HOST_DEVICE bool arrive_last(Word* counter, Word expected, int32_t* failed) const {
    return by_thread_zero([&] {
      const Word before = *counter;
      const bool damaged = arrival_out_of_range(before, expected);
      *counter = damaged ? Word{1} : before + 1;
      if (damaged) *failed |= 1;
      return static_cast<int32_t>((damaged ? Word{0} : before) == expected - 1);
    }) != 0;
  }

  SPECDEC_HOST_DEVICE void raise(int32_t* flag) const {
    if (tid == 0) *flag |= 1;
  }

  template <class Word>
  SPECDEC_HOST_DEVICE void reset(Word* counter) const {
    if (tid == 0) *counter = 0;
  }

  // DeviceBlock::claim, blocks in id order: the first block of the launch
  // at the word claims it.
  SPECDEC_HOST_DEVICE bool claim(int64_t* word, int64_t stamp) const {
    return by_thread_zero([&] {
      const bool first = claim_is_stale(*word, stamp);
      if (first) *word = claim_resetting(stamp);
      return static_cast<int32_t>(first);
    }) != 0;
  }

  SPECDEC_HOST_DEVICE void claimed(int64_t* word, int64_t stamp) const {
    by_thread_zero([&] {
      *word = claim_ready(stamp);
      return 0;
    });
  }

  // The claimer has finished (blocks run in id order): a word not ready
  // now never will be, and the wait gives up at once.
  SPECDEC_HOST_DEVICE bool wait_for_claim(const int64_t* word, int64_t stamp) const {
    return by_thread_zero([&] { return static_cast<int32_t>(*word != claim_ready(stamp)); }) != 0;
  }

  SPECDEC_HOST_DEVICE int32_t fetch_and_clear(int32_t* word) const {
    return by_thread_zero([&] {
      const int32_t before = *word;
      *word = 0;
      return before;
    });
  }

  // Blocks run one after another in id order, so every block waited on
  // has finished; a short count is a broken invariant, never waited for: the
  // wait gives up at once, as DeviceBlock's does at its bound.
  template <class Word>
  SPECDEC_HOST_DEVICE bool wait_at_least(const Word* counter, Word count, const WaitFault& fault) const {
    return by_thread_zero([&] {
      const bool failed = *fault.failed != 0;
      const bool gave_up = !failed && (*counter < count || fault.give_up);
      if (gave_up) ++*fault.failed;
      return static_cast<int32_t>(!gave_up && !failed);
    }) != 0;
  }
};

// Runs program(block, index) for index in [0, num_blocks), blocks one after
// another, on kThreads std::threads sharing one State (like shared memory, it
// carries over from block to block as on a GPU multiprocessor): thread t runs
// as Block{&state, t}, and the threads meet at state.block_barrier between
// blocks.
template <class Block, class State, int kThreads, class Program>
void run_emulated_blocks(int64_t num_blocks, Program&& program) {
  State state;
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int tid = 0; tid < kThreads; ++tid) {
    threads.emplace_back([&state, &program, num_blocks, tid] {
      const Block block = {&state, tid};
      for (int64_t index = 0; index < num_blocks; ++index) {
        program(block, index);
        state.block_barrier.wait();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
}

// The SIMT block programs' emulated block (8 threads).
template <class Program>
void run_host_blocks(int64_t num_blocks, Program&& program) {
  run_emulated_blocks<SimtHostBlock, SimtState, kSimtThreads>(num_blocks, program);
}

}  // namespace specdec
