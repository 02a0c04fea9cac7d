// Fused chain verification (sk.chain_verify): acceptance tests, the residual
// or bonus sample and the outputs in one launch. The CUDA twin of
// kernels/chain_verify.py; specdec_kernels/reference/chain_verify.py is the
// definition of correct, and with probability inputs the outputs equal it bit
// for bit.
//
// Design
// ------
// Grid: 1-D, `waves x B x num_splits` blocks of 256 threads. Block
// (wave, b, split) owns request b and the contiguous vocabulary slice
// [split * split_size, min((split + 1) * split_size, V)), so B = 1 still
// spreads a 128k vocabulary over the whole GPU (launcher: about two blocks per
// SM, slices of whole 1024-element tiles). One request per block at every V
// (the Triton kernel packs several requests per program when V is small).
// Threads walk their slice a tile (4 elements per thread, coalesced) at a
// time; block reductions are warp shuffles plus one shared word per warp.
//
// Probabilities (one wave). Every block of a sampled request recomputes the
// acceptance tests from gathers (thread i: u_i * q_i(t_i) < p_i(t_i), u_i from
// the ACCEPT stream at position i), so it knows the stop position j without
// talking to the other blocks. It then runs the exponential race over its
// slice of row j only: keys E_v / max(0, p_v - q_v) after the rejection of a
// valid id (else E_v / p_v), E_v from the SAMPLE stream at (j, v), and from
// the same noise the race over p, the fallback when the residual has no mass.
// Ties go to the lower index (argmin of torch); a zero mass is an infinite
// key. The slice's two (key, index) minima and a has-mass flag go to a
// persistent workspace. Greedy requests (T == 0) instead record the slice's
// (max, argmax) of every target row 0..K (the stop needs argmaxes no block
// knows alone).
//
// Workspace: one slot of chain_verify_slot_words(K) int32 words per
// (request, split): the race results, then per-row statistics (field
// constants below). Only thread 0 of a block writes its slot. The caller's
// workspace size caps num_splits (at least one slot per request).
//
// Finishing. After writing, a block arrives at the request's counter
// (__syncthreads; thread 0: __threadfence, atomicAdd, __threadfence, the
// pattern of CUDA's threadFenceReduction sample and of the cooperative-groups
// grid barrier). The block that arrives last combines the slices in the
// workspace (read with __ldcg, so never from a stale L1 line), writes
// output_token_ids[b] and num_accepted[b], and sets the counter back to zero,
// so the next call needs no memset launch.
//
// Logits (two waves). The acceptance tests need the softmax normaliser of
// every row up to the first rejection, which needs the whole vocabulary.
// Wave-1 blocks write their slice's (max, sum exp) of x / T for every target
// row 0..K and draft row 0..K-1 (greedy requests: (max, argmax) of x), then
// arrive. Wave-2 blocks of a sampled request spin (thread 0, acquire load)
// until all num_splits wave-1 blocks of their request have arrived, combine
// the normalisers (warp w handles positions w, w + 8, ...; its lanes the
// splits), decide j, race over their slice with p = exp(x / T - log Z), and
// arrive; the last of the 2 * num_splits arrivals finishes. Every wave-2
// block has a higher linear id than every wave-1 block and blocks are
// dispatched in increasing id (the assumption the Triton kernel and
// CUTLASS's stream-K fixup make too), so a spinning block waits only on
// blocks that are resident or done. A wave-2 block arrives only after seeing
// all wave-1 arrivals, so the finishing block of a sampled request is a
// wave-2 block and knows j. Wave-2 blocks of greedy requests have nothing to
// do: they arrive without waiting (the last arrival, whoever it is,
// finishes from the argmaxes).
//
// Every block of a request computes the same j: the same data through the
// same reduction tree (the combine operations are commutative, so every
// lane of a butterfly shuffle ends with the same bits).
//
// Exactness. Divisions are __fdiv_rn, products and differences that the
// reference rounds separately are __fmul_rn / __fsub_rn (never contracted
// into FMAs), and the random numbers come from rng.cuh. With logits the
// softmax is online (per-slice max and rescaled sums, then log Z), which
// rounds differently from torch.softmax: decisions can differ from the
// reference when a test lands within a few ulp.
//
// Differences from the Triton kernel, none visible in the outputs with
// probabilities: one request per block (no row packing at small V); the
// greedy argmax ranks NaN above every number, like torch.argmax; the logits
// normalisers are merged pairwise ((max, sum) with rescaling) rather than in
// two passes over the splits; acceptance tests with logits run one position
// per warp (lanes over the splits) instead of one program-wide vector.
//
// Values never cause an out-of-bounds access: draft ids outside [0, V) are
// rejections and are never gathered, num_draft_tokens is clamped to [0, K],
// and only rows 0..K (target) and 0..K-1 (draft) are read. Pointer offsets
// are int64.
//
// The block program is written once against a small "block" interface
// (thread/warp ids, warp and block all-reduce, arrive, wait, loads of other
// blocks' results): DeviceBlock runs it in the kernel (8 warps of 32 lanes);
// csrc/chain_verify.cu runs it on the host as the CPU implementation of
// torch.ops.specdec_C.chain_verify, with a block of 2 warps of 4 lanes
// emulated by std::threads and barriers, blocks in id order, small slices.
// So a CPU test checks the kernel's index math, strided loops, warp and lane
// splits of work, workspace layout, acceptance, race and finishing logic on
// machines without a GPU (not the shuffles, the hardware barriers or the
// memory ordering, which DeviceBlock implements).
//
// This header includes no torch header; it compiles under nvcc and, without
// the device parts, under a plain C++ compiler (csrc/bindings.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <cuda_runtime_api.h>

#include "specdec/common.cuh"
#include "specdec/rng.cuh"

// `#pragma unroll` for nvcc only (a plain C++ compiler warns about it).
#if defined(__CUDACC__)
#define SPECDEC_UNROLL _Pragma("unroll")
#else
#define SPECDEC_UNROLL
#endif

namespace specdec {

enum class ProbDtype : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum class TokenDtype : int32_t { kInt32 = 0, kInt64 = 1 };

// Everything a call reads and writes. Tensors are raw pointers; the last dim
// of target/draft and of the outputs is contiguous.
struct ChainVerifyArgs {
  const void* draft_token_ids = nullptr;  // [B, K] TokenDtype
  int64_t ids_stride_b = 0, ids_stride_k = 0;
  TokenDtype token_dtype = TokenDtype::kInt64;
  const void* target = nullptr;  // [B, K+1, V] ProbDtype
  int64_t target_stride_b = 0, target_stride_k = 0;
  const void* draft = nullptr;  // [B, K, V], same dtype as target, or nullptr: one-hot drafts
  int64_t draft_stride_b = 0, draft_stride_k = 0;
  ProbDtype prob_dtype = ProbDtype::kFloat32;
  const int32_t* num_draft_tokens = nullptr;  // [B] or nullptr: K
  const float* temperature = nullptr;         // [B] or nullptr: 1
  bool logits = false;
  RngArgs rng;
  int32_t* output_token_ids = nullptr;  // [B, K+1]
  int64_t output_stride_b = 0;
  int32_t* num_accepted = nullptr;  // [B]
  // Workspace: int32 words, see chain_verify_slot_words. Contents need not be
  // initialised; its size caps num_splits (at least one slot per request).
  int32_t* workspace = nullptr;
  int64_t workspace_words = 0;
  // [B] arrival counters: zero before the call, zero again after it.
  int32_t* arrivals = nullptr;
  int64_t batch_size = 0;
  int32_t max_drafts = 0;  // K
  int32_t vocab_size = 0;  // 1 <= V <= 2**30
};

// Workspace words per (request, split) slot: the race results, then five
// [K + 1] arrays of per-row statistics.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t chain_verify_slot_words(int32_t max_drafts) {
  return 5 + 5 * (static_cast<int64_t>(max_drafts) + 1);
}

struct ChainVerifyPlan {
  int32_t num_splits = 1;
  int32_t split_size = 1;  // elements per slice (a multiple of `unit`)
};

// Slices of whole `unit`-element tiles so that about `target_blocks` blocks
// run per wave, never more splits than tiles nor than the workspace holds.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE ChainVerifyPlan plan_chain_verify(int64_t batch_size, int32_t vocab_size,
                                                                          int32_t max_drafts,
                                                                          int64_t workspace_words,
                                                                          int64_t target_blocks, int32_t unit) {
  const int64_t capacity = workspace_words / chain_verify_slot_words(max_drafts) / batch_size;
  const int64_t tiles = (vocab_size + static_cast<int64_t>(unit) - 1) / unit;
  int64_t wanted = (target_blocks + batch_size - 1) / batch_size;
  wanted = wanted < tiles ? wanted : tiles;
  wanted = wanted < capacity ? wanted : capacity;
  wanted = wanted > 1 ? wanted : 1;
  const int64_t split_size = (tiles + wanted - 1) / wanted * unit;
  ChainVerifyPlan plan;
  plan.split_size = static_cast<int32_t>(split_size);
  plan.num_splits = static_cast<int32_t>((vocab_size + split_size - 1) / split_size);
  return plan;
}

struct ChainVerifyParams {
  ChainVerifyArgs args;
  ChainVerifyPlan plan;
};

// Launchers (csrc/chain_verify.cu). Neither synchronises.
// One launch on `stream`; returns the launch status (cudaGetLastError).
cudaError_t launch_chain_verify(const ChainVerifyArgs& args, cudaStream_t stream);
// The same block program on the host (host pointers): an emulated block of
// std::threads runs the blocks one after another. Returns nullptr, or what
// went wrong.
const char* chain_verify_host(const ChainVerifyArgs& args);

namespace chain_verify_detail {

constexpr int kThreads = 256;
constexpr int kMinBlocksPerMultiprocessor = 2;
constexpr int kWarps = kThreads / 32;
constexpr int kElementsPerThread = 4;         // per tile: a tile is 1024 elements
constexpr int kScratchWordsPerWarp = 8;       // largest reduced value: 32 bytes
constexpr int32_t kNoIndex = 0x7FFFFFFF;

// Workspace slot fields.
constexpr int64_t kRaceKey = 0;      // float: min E / mass over the slice
constexpr int64_t kRaceIndex = 1;    // int: its index
constexpr int64_t kFallbackKey = 2;  // float: min E / p (race over p)
constexpr int64_t kFallbackIndex = 3;
constexpr int64_t kHasMass = 4;  // int: the residual has mass in the slice
// Per-row arrays, each [K + 1], start at 5 + field * (K + 1).
constexpr int64_t kTargetMax = 0;    // float: max of x / T (greedy: of x)
constexpr int64_t kTargetArg = 1;    // int: argmax (greedy)
constexpr int64_t kTargetSum = 2;    // float: sum exp(x / T - max)
constexpr int64_t kDraftMax = 3;     // float: the same for draft rows 0..K-1
constexpr int64_t kDraftSum = 4;

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float positive_infinity() { return bits_as_float(0x7F800000u); }
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float negative_infinity() { return bits_as_float(0xFF800000u); }

// a / b, correctly rounded (the reference's float32 division).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float fdiv_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float exp_f32(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);  // the accurate expf (no --use_fast_math)
#else
  return std::exp(x);
#endif
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float log_f32(float x) {
#if defined(__CUDA_ARCH__)
  return logf(x);
#else
  return std::log(x);
#endif
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float max_f32(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return std::fmax(a, b);
#endif
}

// 16-bit storage types (bit patterns; no cuda_fp16.h / cuda_bf16.h needed).
struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float to_float(float value) { return value; }

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float to_float(BFloat16 value) {
  return bits_as_float(static_cast<uint32_t>(value.bits) << 16);
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float to_float(Float16 value) {
#if defined(__CUDA_ARCH__)
  float result;
  asm("cvt.f32.f16 %0, %1;" : "=f"(result) : "h"(value.bits));
  return result;
#else
  // Exact: every half is a float.
  const uint32_t sign = static_cast<uint32_t>(value.bits & 0x8000u) << 16;
  const uint32_t exponent = (value.bits >> 10) & 0x1Fu;
  const uint32_t mantissa = value.bits & 0x3FFu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;  // zero or subnormal, exact
    return bits_as_float(float_as_bits(magnitude) | sign);
  }
  if (exponent == 0x1F) return bits_as_float(sign | 0x7F800000u | (mantissa << 13));
  return bits_as_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
#endif
}

// (value, index) pairs and their combines. Every combine is commutative
// bit for bit, so a butterfly shuffle leaves the same result in every lane,
// and associative (a total order), so the split order does not matter.
struct ArgBest {
  float value;
  int32_t index;
};

// Exponential race: the smaller key, ties to the lower index (torch.argmin).
// Keys are never NaN (a key is E / mass with mass > 0, else +inf).
struct MinKey {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE ArgBest operator()(ArgBest a, ArgBest b) const {
    const bool take_b = b.value < a.value || (b.value == a.value && b.index < a.index);
    return take_b ? b : a;
  }
};

// Greedy argmax as torch.argmax: the larger value, NaN above everything,
// ties (and NaNs) to the lower index.
struct MaxValue {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE ArgBest operator()(ArgBest a, ArgBest b) const {
    const bool a_nan = a.value != a.value;
    const bool b_nan = b.value != b.value;
    const bool take_b = (a_nan || b_nan)
                            ? (b_nan && (!a_nan || b.index < a.index))
                            : (b.value > a.value || (b.value == a.value && b.index < a.index));
    return take_b ? b : a;
  }
};

struct MinInt64 {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};

// Online softmax statistics: sum exp(x - max) over the elements seen.
struct SoftmaxStats {
  float max;
  float sum;
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE SoftmaxStats empty_stats() { return {negative_infinity(), 0.0f}; }

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void add_to_stats(SoftmaxStats& stats, float x) {
  if (x > stats.max) {
    stats.sum = fadd_rn(fmul_rn(stats.sum, exp_f32(fsub_rn(stats.max, x))), 1.0f);
    stats.max = x;
  } else if (x > negative_infinity()) {
    stats.sum = fadd_rn(stats.sum, exp_f32(fsub_rn(x, stats.max)));
  }
}

struct MergeStats {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE SoftmaxStats operator()(SoftmaxStats a, SoftmaxStats b) const {
    const float max = max_f32(a.max, b.max);
    if (!(max > negative_infinity())) return empty_stats();
    return {max, fadd_rn(fmul_rn(a.sum, exp_f32(fsub_rn(a.max, max))), fmul_rn(b.sum, exp_f32(fsub_rn(b.max, max))))};
  }
};

// log of the softmax denominator, so p = exp(x / T - log_normaliser).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float log_normaliser(SoftmaxStats stats) {
  return fadd_rn(stats.max, log_f32(stats.sum));
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float softmax_at(float x, float temperature, float log_norm) {
  return exp_f32(fsub_rn(fdiv_rn(x, temperature), log_norm));
}

struct StatsPair {
  SoftmaxStats target;
  SoftmaxStats draft;
};

struct MergeStatsPair {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE StatsPair operator()(StatsPair a, StatsPair b) const {
    return {MergeStats()(a.target, b.target), MergeStats()(a.draft, b.draft)};
  }
};

struct RaceBest {
  ArgBest residual;  // race over the residual (or p when nothing was rejected)
  ArgBest fallback;  // race over p
  int32_t has_mass;
};

struct CombineRace {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE RaceBest operator()(RaceBest a, RaceBest b) const {
    return {MinKey()(a.residual, b.residual), MinKey()(a.fallback, b.fallback), a.has_mass | b.has_mass};
  }
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE RaceBest empty_race() {
  return {{positive_infinity(), kNoIndex}, {positive_infinity(), kNoIndex}, 0};
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float word_as_float(int32_t word) {
  return bits_as_float(static_cast<uint32_t>(word));
}
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int32_t float_as_word(float value) {
  return static_cast<int32_t>(float_as_bits(value));
}

// ---------------------------------------------------------------------------
// Block interface. A Block provides: thread(), num_threads(), warp(),
// num_warps(), lane(), warp_size(); warp_all_reduce(value, combine) and
// block_all_reduce(value, combine), which every thread (lane) gets the result
// of; load_published(address) for results of other blocks; arrive(counter)
// (returns the count before this block's arrival, to every thread);
// reset(counter); wait_at_least(counter, count). DeviceBlock below runs the
// kernel; csrc/chain_verify.cu emulates one on the host with std::threads.

#if defined(__CUDACC__)
// Block interface, device side. Every member is called by all threads of the
// block in uniform control flow (warp members: by all lanes of the warp).
struct DeviceBlock {
  uint32_t* scratch;  // shared: kWarps * kScratchWordsPerWarp + 1 words

  __device__ __forceinline__ int thread() const { return static_cast<int>(threadIdx.x); }
  __device__ __forceinline__ int num_threads() const { return kThreads; }
  __device__ __forceinline__ int warp() const { return static_cast<int>(threadIdx.x) / 32; }
  __device__ __forceinline__ int num_warps() const { return kWarps; }
  __device__ __forceinline__ int lane() const { return static_cast<int>(threadIdx.x) % 32; }
  __device__ __forceinline__ int warp_size() const { return 32; }

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
    if (lane() == 0) memcpy(scratch + warp() * kScratchWordsPerWarp, &value, sizeof(T));
    __syncthreads();
    T result;
    memcpy(&result, scratch, sizeof(T));
    SPECDEC_UNROLL
    for (int w = 1; w < kWarps; ++w) {
      T other;
      memcpy(&other, scratch + w * kScratchWordsPerWarp, sizeof(T));
      result = combine(result, other);
    }
    return result;
  }

  // Results other blocks published: read from L2, never a stale L1 line.
  __device__ __forceinline__ int32_t load_published(const int32_t* address) const { return __ldcg(address); }

  // Release this block's workspace writes and count it in; every thread gets
  // the count before the arrival. The fence after the atomic makes the last
  // block's later reads see what the earlier blocks released.
  __device__ __forceinline__ int32_t arrive(int32_t* counter) const {
    uint32_t* broadcast = scratch + kWarps * kScratchWordsPerWarp;
    __syncthreads();
    if (thread() == 0) {
      __threadfence();
      const int32_t before = atomicAdd(counter, 1);
      __threadfence();
      *broadcast = static_cast<uint32_t>(before);
    }
    __syncthreads();
    return static_cast<int32_t>(*broadcast);
  }

  __device__ __forceinline__ void reset(int32_t* counter) const {
    if (thread() == 0) atomicExch(counter, 0);
  }

  // Thread 0 spins on an acquire load; the barrier passes the acquired view
  // on to the block.
  __device__ __forceinline__ bool wait_at_least(const int32_t* counter, int32_t count) const {
    if (thread() == 0) {
      while (true) {
        int32_t seen;
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        if (seen >= count) break;
        __nanosleep(64);
      }
      __threadfence();
    }
    __syncthreads();
    return true;
  }
};
#endif  // __CUDACC__

// ---------------------------------------------------------------------------
// The block program. `Block` is DeviceBlock or the host emulation.

template <class Prob, class Token>
struct Request {
  const Token* ids;       // row b of draft_token_ids
  int64_t ids_stride;     // between positions
  const Prob* target;     // target[b]
  int64_t target_stride;  // between rows
  const Prob* draft;      // draft[b] or nullptr
  int64_t draft_stride;
  int64_t num_drafts;  // n, clamped to [0, K]
  float temperature;   // > 0 (1 for greedy requests and without temperatures)
  bool greedy;
  int32_t vocab_size;

  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t token(int64_t position) const {
    return static_cast<int64_t>(ids[position * ids_stride]);
  }
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool valid(int64_t token_id) const {
    return token_id >= 0 && token_id < vocab_size;
  }
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE const Prob* target_row(int64_t position) const {
    return target + position * target_stride;
  }
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE const Prob* draft_row(int64_t position) const {
    return draft + position * draft_stride;
  }
};

// Workspace slot of (request, split).
struct Slots {
  int32_t* base;  // slot (b, 0)
  int64_t words;  // per slot
  int64_t rows;   // K + 1

  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int32_t* slot(int64_t split) const { return base + split * words; }
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t row_field(int64_t field, int64_t row) const {
    return 5 + field * rows + row;
  }
};

// Per-slice (max, argmax) of x for every target row 0..K (greedy requests).
template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE void scan_argmax(const Block& block, const Request<Prob, Token>& request, int64_t max_drafts,
                                     int64_t vocab_lo, int64_t vocab_hi, const Slots& slots, int32_t* slot) {
  const int64_t stride = static_cast<int64_t>(block.num_threads());
  for (int64_t row = 0; row <= max_drafts; ++row) {
    const Prob* values = request.target_row(row);
    ArgBest best = {negative_infinity(), kNoIndex};
    for (int64_t base = vocab_lo + block.thread(); base < vocab_hi; base += kElementsPerThread * stride) {
      float x[kElementsPerThread];
      SPECDEC_UNROLL
      for (int j = 0; j < kElementsPerThread; ++j) {
        const int64_t index = base + j * stride;
        x[j] = index < vocab_hi ? to_float(values[index]) : 0.0f;
      }
      SPECDEC_UNROLL
      for (int j = 0; j < kElementsPerThread; ++j) {
        const int64_t index = base + j * stride;
        if (index < vocab_hi) best = MaxValue()(best, {x[j], static_cast<int32_t>(index)});
      }
    }
    best = block.block_all_reduce(best, MaxValue());
    if (block.thread() == 0) {
      slot[slots.row_field(kTargetMax, row)] = float_as_word(best.value);
      slot[slots.row_field(kTargetArg, row)] = best.index;
    }
  }
}

// Per-slice online softmax statistics of x / T for every target row 0..K and
// draft row 0..K-1 (wave 1 of sampled requests with logits).
template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE void scan_softmax(const Block& block, const Request<Prob, Token>& request, int64_t max_drafts,
                                      int64_t vocab_lo, int64_t vocab_hi, const Slots& slots, int32_t* slot) {
  const int64_t stride = static_cast<int64_t>(block.num_threads());
  for (int64_t row = 0; row <= max_drafts; ++row) {
    const Prob* target_values = request.target_row(row);
    const bool with_draft = request.draft != nullptr && row < max_drafts;  // block-uniform
    const Prob* draft_values = with_draft ? request.draft_row(row) : nullptr;
    StatsPair stats = {empty_stats(), empty_stats()};
    for (int64_t base = vocab_lo + block.thread(); base < vocab_hi; base += kElementsPerThread * stride) {
      float x[kElementsPerThread];
      float y[kElementsPerThread];
      SPECDEC_UNROLL
      for (int j = 0; j < kElementsPerThread; ++j) {
        const int64_t index = base + j * stride;
        x[j] = index < vocab_hi ? to_float(target_values[index]) : 0.0f;
        y[j] = with_draft && index < vocab_hi ? to_float(draft_values[index]) : 0.0f;
      }
      SPECDEC_UNROLL
      for (int j = 0; j < kElementsPerThread; ++j) {
        const int64_t index = base + j * stride;
        if (index < vocab_hi) {
          add_to_stats(stats.target, fdiv_rn(x[j], request.temperature));
          if (with_draft) add_to_stats(stats.draft, fdiv_rn(y[j], request.temperature));
        }
      }
    }
    stats = block.block_all_reduce(stats, MergeStatsPair());
    if (block.thread() == 0) {
      slot[slots.row_field(kTargetMax, row)] = float_as_word(stats.target.max);
      slot[slots.row_field(kTargetSum, row)] = float_as_word(stats.target.sum);
      if (with_draft) {
        slot[slots.row_field(kDraftMax, row)] = float_as_word(stats.draft.max);
        slot[slots.row_field(kDraftSum, row)] = float_as_word(stats.draft.sum);
      }
    }
  }
}

// Softmax statistics of a whole row from every slice: the lanes of one warp
// take the splits, then a warp all-reduce. The same tree in every warp and
// every block, so every block gets the same bits.
template <class Block>
SPECDEC_HOST_DEVICE SoftmaxStats row_stats(const Block& block, const Slots& slots, int64_t num_splits,
                                           int64_t max_field, int64_t sum_field, int64_t row) {
  SoftmaxStats stats = empty_stats();
  for (int64_t split = block.lane(); split < num_splits; split += block.warp_size()) {
    const int32_t* slot = slots.slot(split);
    stats = MergeStats()(stats, {word_as_float(block.load_published(slot + slots.row_field(max_field, row))),
                                 word_as_float(block.load_published(slot + slots.row_field(sum_field, row)))});
  }
  return block.warp_all_reduce(stats, MergeStats());
}

// Argmax of a whole target row from every slice (one warp).
template <class Block>
SPECDEC_HOST_DEVICE ArgBest row_argmax(const Block& block, const Slots& slots, int64_t num_splits, int64_t row) {
  ArgBest best = {negative_infinity(), kNoIndex};
  for (int64_t split = block.lane(); split < num_splits; split += block.warp_size()) {
    const int32_t* slot = slots.slot(split);
    best = MaxValue()(best, {word_as_float(block.load_published(slot + slots.row_field(kTargetMax, row))),
                             block.load_published(slot + slots.row_field(kTargetArg, row))});
  }
  return block.warp_all_reduce(best, MaxValue());
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool accept(float uniform, float draft_prob, float target_prob) {
  return fmul_rn(uniform, draft_prob) < target_prob;
}

// Stop position of a sampled request with probability inputs: thread i
// tests position i; the first position not accepted (n if none).
template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE int64_t decide_probabilities(const Block& block, const Request<Prob, Token>& request,
                                                 const RequestKey& key) {
  int64_t stop = request.num_drafts;
  for (int64_t position = block.thread(); position < request.num_drafts; position += block.num_threads()) {
    const int64_t token_id = request.token(position);
    const bool valid = request.valid(token_id);
    const float target_prob = valid ? to_float(request.target_row(position)[token_id]) : 0.0f;
    const float draft_prob =
        request.draft == nullptr ? 1.0f : (valid ? to_float(request.draft_row(position)[token_id]) : 0.0f);
    const float uniform =
        uniform_from_word(random_words(key, kAcceptStream, static_cast<uint32_t>(position), 0u).w0);
    if (!(valid && accept(uniform, draft_prob, target_prob))) stop = MinInt64()(stop, position);
  }
  return block.block_all_reduce(stop, MinInt64());
}

// The same with logits: warp w tests positions w, w + num_warps, ... from
// the combined normalisers (all lanes compute the same test).
template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE int64_t decide_logits(const Block& block, const Request<Prob, Token>& request,
                                          const RequestKey& key, const Slots& slots, int64_t num_splits) {
  int64_t stop = request.num_drafts;
  for (int64_t position = block.warp(); position < request.num_drafts; position += block.num_warps()) {
    const float target_log_norm =
        log_normaliser(row_stats(block, slots, num_splits, kTargetMax, kTargetSum, position));
    float draft_log_norm = 0.0f;
    if (request.draft != nullptr) {
      draft_log_norm = log_normaliser(row_stats(block, slots, num_splits, kDraftMax, kDraftSum, position));
    }
    const int64_t token_id = request.token(position);
    const bool valid = request.valid(token_id);
    const float target_prob =
        valid ? softmax_at(to_float(request.target_row(position)[token_id]), request.temperature, target_log_norm)
              : 0.0f;
    float draft_prob = 1.0f;
    if (request.draft != nullptr) {
      draft_prob = valid ? softmax_at(to_float(request.draft_row(position)[token_id]), request.temperature,
                                      draft_log_norm)
                         : 0.0f;
    }
    const float uniform =
        uniform_from_word(random_words(key, kAcceptStream, static_cast<uint32_t>(position), 0u).w0);
    if (!(valid && accept(uniform, draft_prob, target_prob))) stop = MinInt64()(stop, position);
  }
  return block.block_all_reduce(stop, MinInt64());
}

// Exponential race over [vocab_lo, vocab_hi) of row `stop`: the slice's
// minima over the residual (or p) and over p, and whether the residual has
// mass here. `subtract`: a valid id was rejected at `stop`.
template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE RaceBest race_slice(const Block& block, const Request<Prob, Token>& request,
                                        const RequestKey& key, int64_t stop, bool subtract, int64_t stop_token,
                                        bool logits, float target_log_norm, float draft_log_norm, int64_t vocab_lo,
                                        int64_t vocab_hi) {
  const int64_t stride = static_cast<int64_t>(block.num_threads());
  const Prob* target_values = request.target_row(stop);
  // The draft row exists only when a draft was rejected (stop < n <= K).
  const bool read_draft = subtract && request.draft != nullptr;
  const Prob* draft_values = read_draft ? request.draft_row(stop) : nullptr;
  RaceBest best = empty_race();
  for (int64_t base = vocab_lo + block.thread(); base < vocab_hi; base += kElementsPerThread * stride) {
    float p[kElementsPerThread];
    float q[kElementsPerThread];
    SPECDEC_UNROLL
    for (int j = 0; j < kElementsPerThread; ++j) {
      const int64_t index = base + j * stride;
      p[j] = index < vocab_hi ? to_float(target_values[index]) : 0.0f;
      q[j] = read_draft && index < vocab_hi ? to_float(draft_values[index]) : 0.0f;
    }
    SPECDEC_UNROLL
    for (int j = 0; j < kElementsPerThread; ++j) {
      const int64_t index = base + j * stride;
      if (index < vocab_hi) {
        float target_prob = p[j];
        if (logits) target_prob = softmax_at(target_prob, request.temperature, target_log_norm);
        float mass = target_prob;
        if (subtract) {
          float draft_prob;
          if (request.draft == nullptr) {
            draft_prob = index == stop_token ? 1.0f : 0.0f;
          } else {
            draft_prob = logits ? softmax_at(q[j], request.temperature, draft_log_norm) : q[j];
          }
          mass = max_f32(fsub_rn(target_prob, draft_prob), 0.0f);
        }
        const PhiloxWords w =
            random_words(key, kSampleStream, static_cast<uint32_t>(stop), static_cast<uint32_t>(index));
        const float noise = exponential_from_words(w.w0, w.w1, w.w2, w.w3);
        const int32_t index32 = static_cast<int32_t>(index);
        const float residual_key = mass > 0.0f ? fdiv_rn(noise, mass) : positive_infinity();
        best.residual = MinKey()(best.residual, {residual_key, index32});
        best.has_mass |= static_cast<int32_t>(mass > 0.0f);
        if (subtract) {
          const float target_key = target_prob > 0.0f ? fdiv_rn(noise, target_prob) : positive_infinity();
          best.fallback = MinKey()(best.fallback, {target_key, index32});
        }
      }
    }
  }
  best = block.block_all_reduce(best, CombineRace());
  // Without a rejection the residual is p itself.
  if (!subtract) best.fallback = best.residual;
  return best;
}

// The last block of a request: combine the slices, write the outputs.
template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE void finish(const Block& block, const Request<Prob, Token>& request, int64_t max_drafts,
                                const Slots& slots, int64_t num_splits, int64_t sampled_stop,
                                int32_t* output_row, int32_t* num_accepted) {
  int64_t stop;
  int32_t token;
  if (request.greedy) {
    // Accept while the draft is the argmax of its row; emit the argmax.
    stop = request.num_drafts;
    for (int64_t position = block.warp(); position < request.num_drafts; position += block.num_warps()) {
      const ArgBest best = row_argmax(block, slots, num_splits, position);
      if (request.token(position) != static_cast<int64_t>(best.index)) stop = MinInt64()(stop, position);
    }
    stop = block.block_all_reduce(stop, MinInt64());
    token = row_argmax(block, slots, num_splits, stop).index;  // every warp, same bits
  } else {
    RaceBest best = empty_race();
    for (int64_t split = block.thread(); split < num_splits; split += block.num_threads()) {
      const int32_t* slot = slots.slot(split);
      const RaceBest other = {
          {word_as_float(block.load_published(slot + kRaceKey)), block.load_published(slot + kRaceIndex)},
          {word_as_float(block.load_published(slot + kFallbackKey)), block.load_published(slot + kFallbackIndex)},
          block.load_published(slot + kHasMass)};
      best = CombineRace()(best, other);
    }
    best = block.block_all_reduce(best, CombineRace());
    stop = sampled_stop;
    // No residual mass anywhere: the sample is drawn from p.
    token = best.has_mass != 0 ? best.residual.index : best.fallback.index;
  }
  for (int64_t position = block.thread(); position <= max_drafts; position += block.num_threads()) {
    output_row[position] = position < stop ? static_cast<int32_t>(request.token(position))
                                           : (position == stop ? token : -1);
  }
  if (block.thread() == 0) *num_accepted = static_cast<int32_t>(stop);
}

// One block: (wave, request, split) from its linear id.
template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE void chain_verify_block(const Block& block, const ChainVerifyParams& params,
                                            int64_t block_index) {
  const ChainVerifyArgs& args = params.args;
  const int64_t num_splits = params.plan.num_splits;
  const int64_t blocks_per_wave = args.batch_size * num_splits;
  const int64_t wave = block_index / blocks_per_wave;
  const int64_t within_wave = block_index - wave * blocks_per_wave;
  const int64_t b = within_wave / num_splits;
  const int64_t split = within_wave - b * num_splits;
  const int64_t vocab_lo = split * params.plan.split_size;
  const int64_t vocab_end = vocab_lo + params.plan.split_size;
  const int64_t vocab_hi = vocab_end < args.vocab_size ? vocab_end : args.vocab_size;
  const int64_t max_drafts = args.max_drafts;

  Request<Prob, Token> request;
  request.ids = static_cast<const Token*>(args.draft_token_ids) + b * args.ids_stride_b;
  request.ids_stride = args.ids_stride_k;
  request.target = static_cast<const Prob*>(args.target) + b * args.target_stride_b;
  request.target_stride = args.target_stride_k;
  request.draft =
      args.draft == nullptr ? nullptr : static_cast<const Prob*>(args.draft) + b * args.draft_stride_b;
  request.draft_stride = args.draft_stride_k;
  const float temperature = args.temperature == nullptr ? 1.0f : args.temperature[b];
  request.greedy = temperature == 0.0f;
  request.temperature = temperature > 0.0f ? temperature : 1.0f;  // also NaN and < 0, like the reference
  int64_t num_drafts = args.num_draft_tokens == nullptr ? max_drafts : args.num_draft_tokens[b];
  num_drafts = num_drafts < 0 ? 0 : (num_drafts > max_drafts ? max_drafts : num_drafts);
  request.num_drafts = num_drafts;
  request.vocab_size = args.vocab_size;

  const Slots slots = {args.workspace + b * num_splits * chain_verify_slot_words(args.max_drafts),
                       chain_verify_slot_words(args.max_drafts), max_drafts + 1};
  int32_t* slot = slots.slot(split);
  int32_t* counter = args.arrivals + b;

  int64_t stop = num_drafts;
  if (request.greedy) {
    if (wave == 0) scan_argmax(block, request, max_drafts, vocab_lo, vocab_hi, slots, slot);
  } else if (args.logits && wave == 0) {
    scan_softmax(block, request, max_drafts, vocab_lo, vocab_hi, slots, slot);
  } else {
    if (args.logits) block.wait_at_least(counter, static_cast<int32_t>(num_splits));
    const RequestKey key = load_request_key(args.rng, b);
    stop = args.logits ? decide_logits(block, request, key, slots, num_splits)
                       : decide_probabilities(block, request, key);
    // After the rejection of a valid id the emitted token comes from the
    // residual; otherwise (bonus row, invalid id) from p.
    const int64_t stop_token = stop < num_drafts ? request.token(stop) : -1;
    const bool subtract = stop < num_drafts && request.valid(stop_token);
    float target_log_norm = 0.0f;
    float draft_log_norm = 0.0f;
    if (args.logits) {
      target_log_norm = log_normaliser(row_stats(block, slots, num_splits, kTargetMax, kTargetSum, stop));
      if (subtract && request.draft != nullptr) {
        draft_log_norm = log_normaliser(row_stats(block, slots, num_splits, kDraftMax, kDraftSum, stop));
      }
    }
    const RaceBest best = race_slice(block, request, key, stop, subtract, subtract ? stop_token : 0, args.logits,
                                     target_log_norm, draft_log_norm, vocab_lo, vocab_hi);
    if (block.thread() == 0) {
      slot[kRaceKey] = float_as_word(best.residual.value);
      slot[kRaceIndex] = best.residual.index;
      slot[kFallbackKey] = float_as_word(best.fallback.value);
      slot[kFallbackIndex] = best.fallback.index;
      slot[kHasMass] = best.has_mass;
    }
  }

  const int32_t arrivals_per_call = static_cast<int32_t>((args.logits ? 2 : 1) * num_splits);
  if (block.arrive(counter) != arrivals_per_call - 1) return;
  // Last arrival of this call: nobody reads the counter any more.
  block.reset(counter);
  finish(block, request, max_drafts, slots, num_splits, stop,
         args.output_token_ids + b * args.output_stride_b, args.num_accepted + b);
}

#if defined(__CUDACC__)
// Two resident blocks per SM, the launcher's target (register cap 128). With
// only __launch_bounds__(256) ptxas (CUDA 13) picked 80 registers and spilled
// in the 16-bit sm_80 variants; with the explicit minimum it uses 85-92 and
// spills nothing.
template <class Prob, class Token>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerMultiprocessor)
    chain_verify_kernel(const ChainVerifyParams params) {
  __shared__ uint32_t scratch[kWarps * kScratchWordsPerWarp + 1];
  const DeviceBlock block = {scratch};
  chain_verify_block<DeviceBlock, Prob, Token>(block, params, static_cast<int64_t>(blockIdx.x));
}
#endif  // __CUDACC__

}  // namespace chain_verify_detail
}  // namespace specdec
