// The "block" a block program is written against, and its device side.
//
// Kernels that must be checked bit for bit on machines without a GPU are
// written once as a block program templated on a Block type:
// DeviceBlock below runs it in a kernel (8 warps of 32 lanes);
// csrc/chain_verify.cu emulates a block on the host with std::threads (2
// warps of 4 lanes) and barriers. A Block provides:
//
//   kThreads, kWarpSize (static), thread(), num_threads(), warp(), num_warps(), lane(),
//   warp_size();
//   sync()                                   a block barrier;
//   warp_all_reduce(v, op), block_all_reduce(v, op)
//                                            every lane / thread gets the result;
//   block_exclusive_scan(v, add, zero, &total)
//                                            exclusive prefix in thread order,
//                                            and the block total, to every thread;
//   draws()                                  kThreads uint64 words of shared memory;
//   load_published(p)                        a word another block released (int32, int64);
//   take(counter)                            thread 0 counts in (relaxed); every thread
//                                            gets the count before (int64 counters);
//   add_relaxed(word, value)                 thread 0 adds to an int32 or int64 word (relaxed);
//   max_relaxed(word, value)                 thread 0 raises an int64 word to value (relaxed);
//   arrive(counter)                          release, count in, acquire; the count before;
//   arrive_last(counter, expected, failed)   arrive, and whether this is the last of `expected`
//                                            arrivals; a count out of range raises `failed`
//                                            and is taken back out (faults.cuh);
//   raise(flag)                              thread 0 sets bit 0 of an int32 failure flag
//                                            (relaxed; nonzero whatever it held);
//   reset(counter)                           back to zero (the last arrival, or a claimer);
//   claim(word, stamp)                       whether this block is the first of its launch at an
//                                            int64 claim word (faults.cuh): it then resets the
//                                            words the claim guards and calls claimed(word,
//                                            stamp); the others wait_for_claim(word, stamp),
//                                            bounded, true when it gave up;
//   fetch_and_clear(word)                    thread 0 swaps an int32 word with 0; every
//                                            thread gets the value before;
//   wait_at_least(counter, count, fault)     bounded acquire-spin until *counter >= count or
//                                            the request failed; a wait that gives up raises
//                                            the failure flag (faults.cuh); false once the
//                                            request has failed.
//
// The counters of arrive and wait_at_least are int32 or int64 words.
//
// Every member is called by all threads of the block in uniform control
// flow (warp members: by all lanes of a warp).
#pragma once

#include <cstdint>
#include <cstring>

#include "specdec/common.cuh"
#include "specdec/faults.cuh"

// `#pragma unroll` for nvcc only (a plain C++ compiler warns about it).
#if defined(__CUDACC__)
#define SPECDEC_UNROLL _Pragma("unroll")
#else
#define SPECDEC_UNROLL
#endif

namespace specdec {

// The smaller of two int64 (a block_all_reduce combine: a first position).
struct MinInt64 {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};

#if defined(__CUDACC__)
struct DeviceBlock {
  static constexpr int kThreads = 256;
  static constexpr int kWarpSize = 32;
  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kScratchWordsPerWarp = 8;  // largest reduced or scanned value: 32 bytes
  // A waiting block sleeps ~256 ns per turn: the cap is about a second, far
  // beyond any wait on a running block, so hitting it means a broken
  // invariant (or garbage counters), which is reported instead of hanging.
  static constexpr int64_t kMaxSpins = int64_t{1} << 22;

  struct Shared {
    uint64_t draws[kThreads];
    uint32_t scratch[kWarps * kScratchWordsPerWarp];
    int32_t broadcast;
  };
  Shared* shared;

  __device__ __forceinline__ int thread() const { return static_cast<int>(threadIdx.x); }
  __device__ __forceinline__ int num_threads() const { return kThreads; }
  __device__ __forceinline__ int warp() const { return static_cast<int>(threadIdx.x) / 32; }
  __device__ __forceinline__ int num_warps() const { return kWarps; }
  __device__ __forceinline__ int lane() const { return static_cast<int>(threadIdx.x) % 32; }
  __device__ __forceinline__ int warp_size() const { return 32; }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
  __device__ __forceinline__ uint64_t* draws() const { return shared->draws; }

  template <class T>
  __device__ __forceinline__ static T shuffle_xor(T value, int lane_mask) {
    static_assert(sizeof(T) % 4 == 0, "shuffled values are whole 32-bit words");
    uint32_t words[sizeof(T) / 4];
    memcpy(words, &value, sizeof(T));
    SPECDEC_UNROLL
    for (int k = 0; k < static_cast<int>(sizeof(T) / 4); ++k) {
      words[k] = __shfl_xor_sync(0xFFFFFFFFu, words[k], lane_mask);
    }
    memcpy(&value, words, sizeof(T));
    return value;
  }

  template <class T>
  __device__ __forceinline__ static T shuffle_up(T value, int delta) {
    static_assert(sizeof(T) % 4 == 0, "shuffled values are whole 32-bit words");
    uint32_t words[sizeof(T) / 4];
    memcpy(words, &value, sizeof(T));
    SPECDEC_UNROLL
    for (int k = 0; k < static_cast<int>(sizeof(T) / 4); ++k) {
      words[k] = __shfl_up_sync(0xFFFFFFFFu, words[k], delta);
    }
    memcpy(&value, words, sizeof(T));
    return value;
  }

  // Butterfly: every lane ends with the same bits (commutative combines).
  template <class T, class Combine>
  __device__ __forceinline__ T warp_all_reduce(T value, Combine combine) const {
    SPECDEC_UNROLL
    for (int lane_mask = 16; lane_mask > 0; lane_mask >>= 1) {
      value = combine(value, shuffle_xor(value, lane_mask));
    }
    return value;
  }

  // Each thread folds the kWarps warp results in the same order.
  template <class T, class Combine>
  __device__ __forceinline__ T block_all_reduce(T value, Combine combine) const {
    static_assert(sizeof(T) <= 4 * kScratchWordsPerWarp, "value too large for the scratch");
    value = warp_all_reduce(value, combine);
    __syncthreads();  // the previous use of the scratch is over
    if (lane() == 0) memcpy(shared->scratch + warp() * kScratchWordsPerWarp, &value, sizeof(T));
    __syncthreads();
    T result;
    memcpy(&result, shared->scratch, sizeof(T));
    SPECDEC_UNROLL
    for (int w = 1; w < kWarps; ++w) {
      T other;
      memcpy(&other, shared->scratch + w * kScratchWordsPerWarp, sizeof(T));
      result = combine(result, other);
    }
    return result;
  }

  // Kogge-Stone within the warp, then the warp totals through shared memory.
  template <class T, class Add>
  __device__ __forceinline__ T block_exclusive_scan(T value, Add add, T zero, T* total) const {
    static_assert(sizeof(T) <= 4 * kScratchWordsPerWarp, "value too large for the scratch");
    T inclusive = value;
    SPECDEC_UNROLL
    for (int delta = 1; delta < 32; delta <<= 1) {
      const T other = shuffle_up(inclusive, delta);
      if (lane() >= delta) inclusive = add(other, inclusive);
    }
    T exclusive = shuffle_up(inclusive, 1);
    if (lane() == 0) exclusive = zero;
    __syncthreads();  // the previous use of the scratch is over
    if (lane() == 31) memcpy(shared->scratch + warp() * kScratchWordsPerWarp, &inclusive, sizeof(T));
    __syncthreads();
    T before = zero;
    T sum = zero;
    SPECDEC_UNROLL
    for (int w = 0; w < kWarps; ++w) {
      T other;
      memcpy(&other, shared->scratch + w * kScratchWordsPerWarp, sizeof(T));
      if (w < warp()) before = add(before, other);
      sum = add(sum, other);
    }
    *total = sum;
    return add(before, exclusive);
  }

  // Results other blocks published: read from L2, never a stale L1 line.
  __device__ __forceinline__ int32_t load_published(const int32_t* address) const { return __ldcg(address); }
  __device__ __forceinline__ int64_t load_published(const int64_t* address) const {
    return static_cast<int64_t>(__ldcg(reinterpret_cast<const long long*>(address)));
  }

  __device__ __forceinline__ static int32_t atomic_add(int32_t* word, int32_t value) {
    return atomicAdd(word, value);
  }
  __device__ __forceinline__ static int64_t atomic_add(int64_t* word, int64_t value) {
    return static_cast<int64_t>(
        atomicAdd(reinterpret_cast<unsigned long long*>(word), static_cast<unsigned long long>(value)));
  }
  __device__ __forceinline__ static int32_t load_acquire(const int32_t* word) {
    int32_t seen;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(word) : "memory");
    return seen;
  }
  __device__ __forceinline__ static int64_t load_acquire(const int64_t* word) {
    int64_t seen;
    asm volatile("ld.acquire.gpu.global.b64 %0, [%1];" : "=l"(seen) : "l"(word) : "memory");
    return seen;
  }

  // Thread 0 counts in (relaxed: the count orders nothing); every thread
  // gets the count before. The counts read back are small (int32).
  __device__ __forceinline__ int64_t take(int64_t* counter) const {
    __syncthreads();  // the previous use of `broadcast` is over
    if (thread() == 0) shared->broadcast = static_cast<int32_t>(atomic_add(counter, 1));
    __syncthreads();
    return shared->broadcast;
  }

  // Thread 0 adds (relaxed); a later arrive() releases it.
  template <class Word>
  __device__ __forceinline__ void add_relaxed(Word* word, Word value) const {
    if (thread() == 0) atomic_add(word, value);
  }

  // Thread 0 raises *word to at least value (relaxed); a later arrive() releases it.
  __device__ __forceinline__ void max_relaxed(int64_t* word, int64_t value) const {
    if (thread() == 0) atomicMax(reinterpret_cast<long long*>(word), static_cast<long long>(value));
  }

  __device__ __forceinline__ static int32_t atomic_add_acq_rel(int32_t* word, int32_t value) {
    int32_t before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(before) : "l"(word), "r"(value) : "memory");
    return before;
  }
  __device__ __forceinline__ static int64_t atomic_add_acq_rel(int64_t* word, int64_t value) {
    int64_t before;
    asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;" : "=l"(before) : "l"(word), "l"(value) : "memory");
    return before;
  }
  __device__ __forceinline__ static int32_t load_relaxed(const int32_t* word) {
    int32_t seen;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(word) : "memory");
    return seen;
  }

  // Release this block's writes and count it in; every thread gets the count
  // before the arrival. __syncthreads orders every thread's writes (several
  // threads write chunk candidates) before thread 0's acq_rel atomic, whose
  // release is cumulative over them; its acquire makes what earlier blocks
  // released visible to thread 0, and the second barrier to the block. One
  // atomic in one thread: a fence.sc in every thread (__threadfence) was a
  // full-GPU ordering point per thread on the critical path.
  template <class Word>
  __device__ __forceinline__ int32_t arrive(Word* counter) const {
    __syncthreads();
    if (thread() == 0) shared->broadcast = static_cast<int32_t>(atomic_add_acq_rel(counter, Word{1}));
    __syncthreads();
    return shared->broadcast;
  }

  // arrive(), judged by thread 0 on the full count (faults.cuh, arrival_out_of_range).
  template <class Word>
  __device__ __forceinline__ bool arrive_last(Word* counter, Word expected, int32_t* failed) const {
    __syncthreads();
    if (thread() == 0) {
      const Word before = atomic_add_acq_rel(counter, Word{1});
      const bool damaged = arrival_out_of_range(before, expected);
      if (damaged) {
        raise_flag(failed);
        atomic_add(counter, wrapping_negative(before));
      }
      // A damaged count is this arrival's first (as on Triton): the only block of a one-block request is
      // still its last, and writes the failure outcome.
      shared->broadcast = (damaged ? Word{0} : before) == expected - 1;
    }
    __syncthreads();
    return shared->broadcast != 0;
  }

  __device__ __forceinline__ void raise(int32_t* flag) const {
    if (thread() == 0) raise_flag(flag);
  }
  // Bit 0: +1 would take a damaged -1 down to "no fault".
  __device__ __forceinline__ static void raise_flag(int32_t* flag) { atomicOr(flag, 1); }

  __device__ __forceinline__ void reset(int32_t* counter) const {
    if (thread() == 0) atomicExch(counter, 0);
  }
  __device__ __forceinline__ void reset(int64_t* counter) const {
    if (thread() == 0) atomicExch(reinterpret_cast<unsigned long long*>(counter), 0ull);
  }

  // Thread 0 takes a word not of this launch's stamp over with one
  // compare-and-swap, which one block of the launch wins (no retry loop).
  __device__ __forceinline__ bool claim(int64_t* word, int64_t stamp) const {
    __syncthreads();  // the previous use of `broadcast` is over
    if (thread() == 0) {
      const int64_t seen = load_acquire(word);
      shared->broadcast = claim_is_stale(seen, stamp) &&
                          atomicCAS(reinterpret_cast<unsigned long long*>(word), static_cast<unsigned long long>(seen),
                                    static_cast<unsigned long long>(claim_resetting(stamp))) ==
                              static_cast<unsigned long long>(seen);
    }
    __syncthreads();
    return shared->broadcast != 0;
  }

  // The barrier orders every thread's resets before thread 0's release.
  __device__ __forceinline__ void claimed(int64_t* word, int64_t stamp) const {
    __syncthreads();
    if (thread() == 0) {
      asm volatile("st.release.gpu.global.b64 [%0], %1;" : : "l"(word), "l"(claim_ready(stamp)) : "memory");
    }
  }

  // The claimer is running, so the wait ends; it is bounded anyway.
  __device__ __forceinline__ bool wait_for_claim(const int64_t* word, int64_t stamp) const {
    __syncthreads();  // the previous use of `broadcast` is over
    if (thread() == 0) {
      int64_t seen = load_acquire(word);
      for (int64_t spin = 0; seen != claim_ready(stamp) && spin < kMaxSpins; ++spin) {
        __nanosleep(256);
        seen = load_acquire(word);
      }
      shared->broadcast = seen != claim_ready(stamp);
    }
    __syncthreads();
    return shared->broadcast != 0;
  }

  __device__ __forceinline__ int32_t fetch_and_clear(int32_t* word) const {
    __syncthreads();  // the previous use of `broadcast` is over
    if (thread() == 0) shared->broadcast = atomicExch(word, 0);
    __syncthreads();
    return shared->broadcast;
  }

  // Thread 0 spins on an acquire load (bounded), watching the request's
  // failure flag; the barrier passes the acquired view on to the block.
  // fault.give_up (the tests' forced fault) gives up at once, as on the host
  // path, so the give-up path can be forced on a GPU too.
  template <class Word>
  __device__ __forceinline__ bool wait_at_least(const Word* counter, Word count, const WaitFault& fault) const {
    __syncthreads();  // the previous use of `broadcast` is over
    if (thread() == 0) {
      Word seen = load_acquire(counter);
      int32_t failed = load_relaxed(fault.failed);
      for (int32_t spin = 0; seen < count && failed == 0 && !fault.give_up && spin < kMaxSpins; ++spin) {
        __nanosleep(256);
        seen = load_acquire(counter);
        failed = load_relaxed(fault.failed);
      }
      const bool gave_up = failed == 0 && (seen < count || fault.give_up);
      if (gave_up) atomicAdd(fault.failed, 1);
      shared->broadcast = gave_up || failed != 0 ? 0 : 1;
    }
    __syncthreads();
    return shared->broadcast != 0;
  }
};
#endif  // __CUDACC__

}  // namespace specdec
