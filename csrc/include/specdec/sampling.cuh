// Sampling primitives shared by the verification kernels: the CUDA twin of
// specdec_kernels/reference/_sampling.py (the definition; its docstring and
// docs/rng.md hold the reasoning and the error bound). With the same float32
// weights and the same Philox words, the token equals the reference's bit
// for bit.
//
// The sampler (fixed-point inverse CDF over fixed 1024-token chunks):
//   W_v = trunc(clamp(w_v, 0, 1) * 2**52), NaN -> 0;
//   chunk c: r_c = (w0 << 32) | w1 of Philox (SAMPLE, position, c); the
//     candidate is the number of tokens of the chunk whose inclusive prefix
//     sum is <= umulhi(r_c, T_c), plus the chunk start;
//   chunk choice: R = (w2 << 32) | w3 of Philox (SAMPLE, position, 0),
//     t = floor(R * T / 2**64) with T the 128-bit sum of the chunk totals; the
//     chosen chunk is the number of chunks whose inclusive 128-bit prefix is
//     <= t; T == 0 -> no mass (-1).
// Every sum is an integer sum, so neither the split of the vocabulary across
// blocks nor a reduction order can change the token. Per element a kernel
// only loads, converts and scans: the random words are per chunk.
//
// Also here: the greedy argmax and the softmax statistics of logits, with the
// reference's outcomes for NaN, +-inf and extreme temperatures.
#pragma once

#include <cstdint>

#include "specdec/block.cuh"
#include "specdec/common.cuh"
#include "specdec/rng.cuh"

namespace specdec {

constexpr int64_t kChunkSize = 1024;  // CHUNK_SIZE of the reference: a constant of the package
using uint128_t = unsigned __int128;

// W_v = trunc(clamp(w, 0, 1) * 2**52); NaN and negatives -> 0. The product
// is exact (a power of two) and the conversion truncates, on every backend.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint64_t fixed_point_weight(float weight) {
  const float clamped = weight > 0.0f ? (weight < 1.0f ? weight : 1.0f) : 0.0f;
  return static_cast<uint64_t>(fmul_rn(clamped, 0x1p52f));
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint64_t join_words(uint32_t high, uint32_t low) {
  return (static_cast<uint64_t>(high) << 32) | low;
}

// The draw that picks the token inside chunk `chunk` of the row at `position`.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint64_t chunk_draw(const RequestKey& key, uint32_t position,
                                                            int64_t chunk) {
  const PhiloxWords w = random_words(key, kSampleStream, position, static_cast<uint32_t>(chunk));
  return join_words(w.w0, w.w1);
}

// The draw that picks the chunk (words 2 and 3 of index 0).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint64_t choice_draw(const RequestKey& key, uint32_t position) {
  const PhiloxWords w = random_words(key, kSampleStream, position, 0u);
  return join_words(w.w2, w.w3);
}

// floor(r * total / 2**64) for a 128-bit total: r * hi + umulhi(r, lo), exact
// (r * hi < 2**128 because chunk totals keep hi far below 2**64).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint128_t scale_down(uint64_t r, uint128_t total) {
  const uint64_t high = static_cast<uint64_t>(total >> 64);
  const uint64_t low = static_cast<uint64_t>(total);
  return static_cast<uint128_t>(r) * high + umul64hi(r, low);
}

// ---------------------------------------------------------------------------
// The normaliser (reference _sampling.normalise): the row total S = sum W_v
// as two int64 sums of the weights split at bit 31 (exact in any order),
// float64(S) = float64(high31) * 2**31 + float64(low31), then one float32
// reciprocal per row, r = 1 / float32(S) (a float64 division per entry would
// be a subroutine call on a GPU), and each entry float32(float64(W_v) * r).
// Every step is one IEEE operation rounded to nearest, on the device and on
// the host.

constexpr uint64_t kLow31Mask = (uint64_t{1} << 31) - 1;

struct SplitTotal {
  uint64_t high31;  // sum of W_v >> 31
  uint64_t low31;   // sum of W_v & (2**31 - 1)
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void add_weight(SplitTotal& total, uint64_t weight) {
  total.high31 += weight >> 31;
  total.low31 += weight & kLow31Mask;
}

struct AddSplitTotals {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE SplitTotal operator()(SplitTotal a, SplitTotal b) const {
    return {a.high31 + b.high31, a.low31 + b.low31};
  }
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool has_mass(SplitTotal total) { return (total.high31 | total.low31) != 0; }

// float64(S) = float64(high31) * 2**31 + float64(low31), each step rounded
// to nearest as the reference's exact_float64 (the halves are exact in
// float64 for V < 2**22, so then only the sum is rounded).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE double split_total_float64(SplitTotal total) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(__dmul_rn(__ll2double_rn(static_cast<long long>(total.high31)), 0x1p31),
                   __ll2double_rn(static_cast<long long>(total.low31)));
#else
  return static_cast<double>(static_cast<int64_t>(total.high31)) * 0x1p31 +
         static_cast<double>(static_cast<int64_t>(total.low31));
#endif
}

// 1 / float32(float64(S)); 1 when S == 0 (then every W_v is 0). Both halves
// are below 2**63 (W_v <= 2**52, V <= 2**30).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float total_reciprocal(SplitTotal total) {
#if defined(__CUDA_ARCH__)
  const float rounded = __double2float_rn(split_total_float64(total));
#else
  const float rounded = static_cast<float>(split_total_float64(total));
#endif
  return fdiv_rn(1.0f, rounded > 0.0f ? rounded : 1.0f);
}

// float32(float64(W) * float64(reciprocal)).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float normalised_weight(uint64_t weight, float reciprocal) {
#if defined(__CUDA_ARCH__)
  return __double2float_rn(__dmul_rn(__ull2double_rn(weight), static_cast<double>(reciprocal)));
#else
  return static_cast<float>(static_cast<double>(weight) * static_cast<double>(reciprocal));
#endif
}

// kWays weight vectors scanned together (the residual and its fallback p
// share one scan).
template <int kWays>
struct WaySums {
  uint64_t value[kWays];
};

template <int kWays>
struct AddWays {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE WaySums<kWays> operator()(WaySums<kWays> a, WaySums<kWays> b) const {
    SPECDEC_UNROLL
    for (int way = 0; way < kWays; ++way) a.value[way] += b.value[way];
    return a;
  }
};

// One chunk of kChunkSize tokens, held by the block: thread i holds the
// kPerThread consecutive weights starting at token i * kPerThread of the
// chunk (thread order is token order, so one exclusive scan of the thread
// sums gives every prefix). For each way, the chunk total goes to every
// thread and the candidate offset (tokens whose inclusive prefix is
// <= umulhi(draw, total)) to the one thread where the prefix crosses the
// threshold: returns a bit mask of the ways whose crossing this thread holds,
// with offsets[way] set for those.
template <class Block, int kWays, int kPerThread>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint32_t pick_in_chunk(const Block& block,
                                                               const uint64_t (&weights)[kWays][kPerThread],
                                                               uint64_t draw, uint64_t (&totals)[kWays],
                                                               int32_t (&offsets)[kWays]) {
  static_assert(kPerThread * Block::kThreads == kChunkSize, "a block holds exactly one chunk");
  WaySums<kWays> mine;
  SPECDEC_UNROLL
  for (int way = 0; way < kWays; ++way) {
    uint64_t sum = 0;
    SPECDEC_UNROLL
    for (int j = 0; j < kPerThread; ++j) sum += weights[way][j];
    mine.value[way] = sum;
  }
  WaySums<kWays> zero;
  SPECDEC_UNROLL
  for (int way = 0; way < kWays; ++way) zero.value[way] = 0;
  WaySums<kWays> total;
  const WaySums<kWays> before = block.block_exclusive_scan(mine, AddWays<kWays>(), zero, &total);
  uint32_t crossings = 0;
  SPECDEC_UNROLL
  for (int way = 0; way < kWays; ++way) {
    totals[way] = total.value[way];
    const uint64_t threshold = umul64hi(draw, total.value[way]);  // < total when total > 0
    // Exactly one thread has before <= threshold < before + mine (none when
    // the total is 0: such a chunk is never chosen).
    if (before.value[way] <= threshold && threshold - before.value[way] < mine.value[way]) {
      uint64_t prefix = before.value[way];
      int32_t count = 0;
      SPECDEC_UNROLL
      for (int j = 0; j < kPerThread; ++j) {
        prefix += weights[way][j];
        count += prefix <= threshold ? 1 : 0;
      }
      offsets[way] = block.thread() * kPerThread + count;
      crossings |= 1u << way;
    }
  }
  return crossings;
}

// A 128-bit value as two 64-bit words, for scans and reductions: shuffling
// an unsigned __int128 through memcpy puts it in local memory (ptxas),
// two uint64 stay in registers.
struct Words128 {
  uint64_t lo, hi;
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE Words128 split128(uint128_t value) {
  return {static_cast<uint64_t>(value), static_cast<uint64_t>(value >> 64)};
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint128_t join128(Words128 words) {
  return (static_cast<uint128_t>(words.hi) << 64) | words.lo;
}

struct AddWords128 {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE Words128 operator()(Words128 a, Words128 b) const {
    return split128(join128(a) + join128(b));
  }
};

struct MaxInt64 {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};

// The chosen chunk: the number of chunks whose inclusive 128-bit prefix of
// totals is <= scale_down(draw, total), with `total` > 0 the sum of all
// `num_chunks` totals (total_at(c)). Chunks in groups of one per thread, a
// block scan per group plus the carry of earlier groups. Every thread gets
// the result.
template <class Block, class TotalAt>
SPECDEC_HOST_DEVICE int64_t choose_chunk(const Block& block, int64_t num_chunks, uint128_t total, uint64_t draw,
                                         TotalAt total_at) {
  const uint128_t target = scale_down(draw, total);  // < total
  uint128_t carry = 0;
  int64_t chosen = -1;
  for (int64_t group = 0; group < num_chunks; group += block.num_threads()) {
    const int64_t chunk = group + block.thread();
    const uint64_t value = chunk < num_chunks ? total_at(chunk) : 0;
    Words128 group_total;
    const uint128_t before =
        carry + join128(block.block_exclusive_scan(split128(value), AddWords128(), Words128{0, 0}, &group_total));
    // The one chunk whose prefix crosses the target (zero totals never do).
    if (before <= target && target - before < value) chosen = chunk;
    carry += join128(group_total);
  }
  return block.block_all_reduce(chosen, MaxInt64());
}

// ---------------------------------------------------------------------------
// Greedy: argmax of the raw row, NaN ignored, ties to the lowest index.

constexpr int32_t kNoIndex = 0x7FFFFFFF;

struct ArgBest {
  float value;
  int32_t index;
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE ArgBest empty_argmax() { return {negative_infinity(), kNoIndex}; }

// The larger value, ties to the lower index; NaN never wins (values are
// loaded as -inf when NaN). Commutative and associative bit for bit, so any
// split or reduction tree gives the same result.
struct MaxValue {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE ArgBest operator()(ArgBest a, ArgBest b) const {
    const bool take_b = b.value > a.value || (b.value == a.value && b.index < a.index);
    return take_b ? b : a;
  }
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE ArgBest argmax_candidate(float value, int64_t index) {
  return {value == value ? value : negative_infinity(), static_cast<int32_t>(index)};
}

// The greedy token of a row's argmax; -1 when there is nothing to choose
// (probabilities: max <= 0; logits: max == -inf).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t greedy_token(ArgBest best, bool logits) {
  const bool has_choice = logits ? best.value > negative_infinity() : best.value > 0.0f;
  return has_choice ? best.index : -1;
}

// ---------------------------------------------------------------------------
// Logits: p_v = z_v / sum(z), z_v = exp((x_v - m) / T), m the row's largest
// non-NaN logit and z_v = 0 where (x_v - m) / T is -inf or NaN (the
// reference's `probabilities`). Statistics are gathered online per thread and
// merged; sums are rounded differently from torch's, so logits decisions can
// differ from the reference near a tie, but every degenerate outcome is the
// same: T = inf is uniform over the finite logits, a tiny T never overflows,
// and a row holding +inf or only -inf / NaN has sum 0, so every p is NaN (no
// acceptance, no mass).

struct SoftmaxStats {
  float max;  // largest non-NaN logit seen (-inf if none)
  float sum;  // sum of exp((x - max) / T) over the logits seen
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE SoftmaxStats empty_stats() { return {negative_infinity(), 0.0f}; }

// exp((x - max) / T), or 0 where that shift is -inf or NaN.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float softmax_term(float x, float max, float temperature) {
  const float shift = fdiv_rn(fsub_rn(x, max), temperature);
  return shift > negative_infinity() ? exp_f32(shift) : 0.0f;
}

// sum * exp((from - to) / T) for to >= from; 0 for an empty sum (whose max
// may be -inf, where the shift would be NaN at T = inf).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float rescale_sum(float sum, float from, float to, float temperature) {
  return sum > 0.0f ? fmul_rn(sum, softmax_term(from, to, temperature)) : 0.0f;
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void add_to_stats(SoftmaxStats& stats, float x, float temperature) {
  if (x > stats.max) {
    stats.sum = fadd_rn(rescale_sum(stats.sum, stats.max, x, temperature), 1.0f);
    stats.max = x;
  } else {
    stats.sum = fadd_rn(stats.sum, softmax_term(x, stats.max, temperature));
  }
}

struct MergeStats {
  float temperature;
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE SoftmaxStats operator()(SoftmaxStats a, SoftmaxStats b) const {
    const float max = a.max > b.max ? a.max : b.max;
    return {max, fadd_rn(rescale_sum(a.sum, a.max, max, temperature), rescale_sum(b.sum, b.max, max, temperature))};
  }
};

// The row's denominator: 0 when the row holds +inf (every z is then 0 or
// NaN, like the reference's) or has no finite logit.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float softmax_denominator(SoftmaxStats stats) {
  return stats.max < positive_infinity() ? stats.sum : 0.0f;
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float softmax_prob(float x, SoftmaxStats stats, float temperature) {
  return fdiv_rn(softmax_term(x, stats.max, temperature), softmax_denominator(stats));
}

// A request's temperature under the contract's rule (v1.3), for every op:
// T > 0 samples; any other value (0, a negative marker such as vLLM's -1,
// NaN) is greedy and uses T = 1, as does a call without temperatures
// (reference/_sampling.greedy_requests).
struct RequestTemperature {
  bool greedy;
  float temperature;  // > 0
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE RequestTemperature request_temperature(const float* temperatures,
                                                                               int64_t request) {
  const float temperature = temperatures == nullptr ? 1.0f : temperatures[request];
  const bool samples = temperature > 0.0f;  // false for NaN
  return {!samples, samples ? temperature : 1.0f};
}

// Accept with probability min(1, p / q): u * q < p (never for NaN or p == 0).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool accept(float uniform, float draft_prob, float target_prob) {
  return fmul_rn(uniform, draft_prob) < target_prob;
}

// A proposal can have been drawn from the draft iff q(t) > 0 (contract v1.3;
// reference/_sampling.drawn_from_draft). Any other q(t) (0, negative, NaN: an
// engine's all-zero "target-only" row) is a deterministic proposal, verified
// against the point mass on t: accepted with probability p(t), and its
// rejection leaves p without t.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool drawn_from_draft(float draft_prob) { return draft_prob > 0.0f; }

// The q(t) of the acceptance test: itself if drawn from the draft, else 1.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float proposal_probability(float draft_prob) {
  return drawn_from_draft(draft_prob) ? draft_prob : 1.0f;
}

}  // namespace specdec
