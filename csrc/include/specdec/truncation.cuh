// Top-k, top-p and min-p truncation of a target row, as block collectives:
// the CUDA twin of kernels/truncation.py. The definition is
// specdec_kernels/reference/_truncation.py (its docstring holds the rule): a
// token is kept iff its key (the bit pattern of its cleaned float32
// probability, which orders like the value) is at least every active
// threshold, and the kept row is renormalised with an exact integer total.
//
// A threshold is "the largest tau whose measure m(tau) reaches a goal",
// m(tau) the count (top-k) or the fixed-point mass (top-p) of the tokens
// with key >= tau. The reference measures top-p's mass within the top-k set
// (key >= max(tau, tau_k)); that is the same for tau >= tau_k, and the
// answer is >= tau_k because m(tau_k) = S reaches top_p * S, so the search
// needs no floor. m does not increase with tau, so tau is
// found from the top bit of the 31-bit keys down, 8 bits per pass (bits
// 30-23, 22-15, 14-7, 6-0): one pass over the row adds every token whose
// key extends the bits found so far into a 256-bin histogram in shared
// memory (32-bit integer atomics on word pairs, split_word_bins.cuh: the
// same sums in any order), then a block scan
// from the top bin finds the largest digit that reaches the goal. Four
// passes per search instead of the Triton kernels' eight (a 16-candidate
// measure per pass). Masses are split at bit 31 as the sampler's totals
// (sampling.cuh), so every sum is exact; a mass is compared with the goal in
// float64 from the exact halves, as the reference does. Counts go through
// the same comparison: they are below 2**31, exact in float64.
//
// Cost per truncated row: one pass for the largest key, four per top-k or
// top-p search, one for top-p's total and one for the kept total: at most
// 11 reads of the row.
//
// This header includes no torch header.
#pragma once

#include <cstdint>

#include "specdec/block.cuh"
#include "specdec/common.cuh"
#include "specdec/index.cuh"
#include "specdec/sampling.cuh"
#include "specdec/split_word_bins.cuh"

namespace specdec {

// How an input row is truncated: kept iff key >= threshold, then
// float32(float64(W) * reciprocal) (sampling.cuh's normalised_weight).
struct Truncation {
  int32_t threshold;
  float reciprocal;
  bool on;  // false: the row is used as given
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE Truncation no_truncation() { return {0, 1.0f, false}; }

// The key of p: the bits of p with NaN and negatives as +0 and values above
// 1 as 1 (the reference's `clean`).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int32_t probability_key(float p) {
  const float cleaned = p > 0.0f ? (p < 1.0f ? p : 1.0f) : 0.0f;
  return static_cast<int32_t>(float_as_bits(cleaned));
}

// The truncated row's entry for probability p (p itself when not truncating).
// fixed_point_weight cleans p the same way, so W is the reference's weight of
// the cleaned row.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float truncated_probability(float p, const Truncation& truncation) {
  if (!truncation.on) return p;
  return probability_key(p) >= truncation.threshold ? normalised_weight(fixed_point_weight(p), truncation.reciprocal)
                                                    : 0.0f;
}

// One request's parameters; each is off at its neutral value (top_k outside
// (0, V), top_p outside (0, 1), min_p outside (0, 1], NaN included) or when not given.
struct TruncationParameters {
  int64_t top_k;
  float top_p, min_p;
  bool k_on, p_on, min_p_on;

  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool any() const { return k_on || p_on || min_p_on; }
};

// `top_k` int32/int64 [B] (data nullptr: not given), `top_p`, `min_p` float32 [B] or nullptr.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE TruncationParameters load_truncation_parameters(
    const IndexTensor& top_k, const float* top_p, const float* min_p, int64_t request, int64_t vocab_size) {
  TruncationParameters parameters;
  parameters.top_k = top_k.data == nullptr ? 0 : top_k[request];
  parameters.top_p = top_p == nullptr ? 1.0f : top_p[request];
  parameters.min_p = min_p == nullptr ? 0.0f : min_p[request];
  parameters.k_on = parameters.top_k > 0 && parameters.top_k < vocab_size;
  // Outside its range (NaN included) a parameter is off, like at its neutral value (contract v1.3).
  parameters.p_on = parameters.top_p > 0.0f && parameters.top_p < 1.0f;
  parameters.min_p_on = parameters.min_p > 0.0f && parameters.min_p <= 1.0f;
  return parameters;
}

constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
constexpr int kKeyBits = 31;  // keys of cleaned probabilities are below 2**30
constexpr int kRadixPasses = (kKeyBits + kRadixBits - 1) / kRadixBits;  // bits 30-23, 22-15, 14-7, 6-0

// Shared memory of one block: per bin, the split sums of what fell in it,
// as 32-bit word pairs (split_word_bins.cuh: no 64-bit shared atomics).
// high31[digit] and low31[digit] read a bin as uint64.
struct TruncationHistogram {
  SplitWordBins<kRadixBins> high31;
  SplitWordBins<kRadixBins> low31;
};

// *address += value, atomically, for global memory (device scope; a native
// 64-bit RED on sm_80/sm_90a, where the same add on shared memory would be a
// compare-and-swap loop). The host emulation's threads share plain memory,
// and its barriers order these adds before any read.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void block_atomic_add(uint64_t* address, uint64_t value) {
#if defined(__CUDA_ARCH__)
  atomicAdd(reinterpret_cast<unsigned long long*>(address), static_cast<unsigned long long>(value));
#else
  __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
#endif
}

namespace truncation_detail {

// visit(key, W) for every token of [lo, hi); load(first, out) gives the
// probabilities [first, first + kWidth) (0 past the vocabulary). `lo` is a
// multiple of kWidth (0, or a chunk boundary).
template <int kWidth, class Block, class Load, class Visit>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void for_each_token(const Block& block, int64_t lo, int64_t hi,
                                                            const Load& load, Visit&& visit) {
  const int64_t step = kWidth * static_cast<int64_t>(block.num_threads());
  for (int64_t first = lo + kWidth * static_cast<int64_t>(block.thread()); first < hi; first += step) {
    float p[kWidth];
    load(first, p);
    SPECDEC_UNROLL
    for (int j = 0; j < kWidth; ++j) {
      if (first + j < hi) visit(probability_key(p[j]), fixed_point_weight(p[j]));
    }
  }
}

// The largest key of [lo, hi), to every thread (0 for an empty range).
template <int kWidth, class Block, class Load>
SPECDEC_HOST_DEVICE int64_t max_key_of(const Block& block, int64_t lo, int64_t hi, const Load& load) {
  int64_t max_key = 0;
  for_each_token<kWidth>(block, lo, hi, load, [&](int32_t key, uint64_t) { max_key = key > max_key ? key : max_key; });
  return block.block_all_reduce(max_key, MaxInt64());
}

// The split mass of the tokens of [lo, hi) with key >= floor, to every thread.
template <int kWidth, class Block, class Load>
SPECDEC_HOST_DEVICE SplitTotal mass_at_least(const Block& block, int64_t lo, int64_t hi, const Load& load,
                                             int32_t floor) {
  SplitTotal mass = {0, 0};
  for_each_token<kWidth>(block, lo, hi, load, [&](int32_t key, uint64_t weight) {
    if (key >= floor) add_weight(mass, weight);
  });
  return block.block_all_reduce(mass, AddSplitTotals());
}

// A digit that reaches the goal, with the measure of the tokens above it.
struct DigitChoice {
  int32_t digit;  // -1: none in this thread's bins
  SplitTotal above;
};

// The larger digit (each digit is one thread's: the choice is unique).
struct LargerDigit {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE DigitChoice operator()(DigitChoice a, DigitChoice b) const {
    return b.digit > a.digit ? b : a;
  }
};

// One of the kRadixPasses passes: bits [shift, top) of the key.
struct RadixPass {
  int top, shift, num_digits;
};

// The pass whose highest bit is top - 1 (searches loop over top, from
// kKeyBits down by kRadixBits).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE RadixPass radix_pass_below(int top) {
  const int shift = top > kRadixBits ? top - kRadixBits : 0;
  return {top, shift, 1 << (top - shift)};
}

// A search between passes: the key bits found so far and the measure of the
// tokens whose bits above the next pass's exceed them.
struct RadixState {
  uint32_t found;
  SplitTotal above;
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE RadixState radix_start() { return {0u, {0, 0}}; }

// Measures one pass: the bins of `histogram` get, per digit of the pass's
// bits, the count (by_mass false) or the split mass of the tokens of [lo, hi)
// whose higher bits are found's. The measuring code of the whole-row
// search and of chain_verify's staged one (a slice per block).
template <int kWidth, class Block, class Load>
SPECDEC_HOST_DEVICE void measure_pass(const Block& block, TruncationHistogram* histogram, int64_t lo, int64_t hi,
                                      const Load& load, uint32_t found, RadixPass pass, bool by_mass) {
  block.sync();  // the previous reads of the bins are over
  for (int digit = block.thread(); digit < kRadixBins; digit += block.num_threads()) {
    histogram->high31.set(digit, 0);
    histogram->low31.set(digit, 0);
  }
  block.sync();
  for_each_token<kWidth>(block, lo, hi, load, [&](int32_t key, uint64_t weight) {
    const uint32_t bits = static_cast<uint32_t>(key);
    if ((bits >> pass.top) != (found >> pass.top)) return;
    const int digit = static_cast<int>((bits >> pass.shift) & static_cast<uint32_t>(pass.num_digits - 1));
    // Bounds of the 32-bit words (split_word_bins.cuh). A count bin holds at
    // most hi - lo <= V < 2**32 tokens (a row of 2**32 float32 would be
    // 16 GiB; the sampler's totals assume V <= 2**30), so its low word never
    // wraps. A mass piece is below 2**32 (W <= 2**52: W >> 31 <= 2**21, the
    // low piece < 2**31), and a bin's sums, at most V * 2**21 and below
    // V * 2**31, stay below 2**64 for V <= 2**30.
    if (!by_mass) {
      histogram->low31.add_below_2_32(digit, 1u);
      return;
    }
    const uint32_t high = static_cast<uint32_t>(weight >> 31);
    const uint32_t low = static_cast<uint32_t>(weight & kLow31Mask);
    if (high != 0) histogram->high31.add(digit, high);
    if (low != 0) histogram->low31.add(digit, low);
  });
  block.sync();
}

// One half of split totals, scanned on its own (choose_digit).
struct AddUint64 {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint64_t operator()(uint64_t a, uint64_t b) const { return a + b; }
};

// The search after a pass whose whole-row bins are in `histogram`: the
// largest digit whose tokens, with those above it, reach the goal. Thread t
// of group g takes digit num_digits - 1 - (g + t): thread order is
// descending digit order, so an exclusive scan gives each digit the measure
// of the digits above it.
template <class Block>
SPECDEC_HOST_DEVICE RadixState choose_digit(const Block& block, const TruncationHistogram* histogram,
                                            RadixState state, RadixPass pass, double goal) {
  SplitTotal carry = state.above;
  DigitChoice choice = {-1, {0, 0}};
  for (int group = 0; group < pass.num_digits; group += block.num_threads()) {
    const int index = group + block.thread();
    const int digit = pass.num_digits - 1 - index;
    const SplitTotal own = index < pass.num_digits ? SplitTotal{histogram->high31[digit], histogram->low31[digit]}
                                                   : SplitTotal{0, 0};
    // The halves are scanned one after the other, not as one 16-byte
    // value: this scan is the peak of live registers in tree_verify's
    // kernel (nvdisasm -plr), and with one scan tree_verify_kernel<*,
    // int64, split> spilled 12 B at its 128-register cap on sm_90a. Two
    // scans: no spill; the tree kernels with int32 ids went from 126-128
    // to 96-110 registers, and no kernel uses more than before.
    SplitTotal group_total;
    SplitTotal scanned;
    scanned.high31 = block.block_exclusive_scan(own.high31, AddUint64(), uint64_t{0}, &group_total.high31);
    scanned.low31 = block.block_exclusive_scan(own.low31, AddUint64(), uint64_t{0}, &group_total.low31);
    const SplitTotal before = AddSplitTotals()(carry, scanned);
    if (index < pass.num_digits && split_total_float64(AddSplitTotals()(before, own)) >= goal) {
      choice = LargerDigit()(choice, DigitChoice{digit, before});
    }
    carry = AddSplitTotals()(carry, group_total);
  }
  choice = block.block_all_reduce(choice, LargerDigit());
  if (choice.digit < 0) return state;
  return {state.found | (static_cast<uint32_t>(choice.digit) << pass.shift), choice.above};
}

// The largest tau with m(tau) >= goal (see the top of the file): m counts
// tokens (by_mass false) or sums their weights. The digit 0 always reaches
// the goal (k < V tokens; top_p * S <= S) except for a NaN goal (top_p =
// -inf with S = 0, whose truncated row has no mass whatever the threshold):
// then 0 is taken, as the Triton kernels do.
template <int kWidth, class Block, class Load>
SPECDEC_HOST_DEVICE int32_t largest_key(const Block& block, TruncationHistogram* histogram, int64_t vocab_size,
                                        const Load& load, double goal, bool by_mass) {
  RadixState state = radix_start();
  // A loop over `top`, not over the pass index: the latter spilled 28 bytes
  // in chain_verify's kernel at its 128-register cap (sm_90a).
  for (int top = kKeyBits; top > 0; top -= kRadixBits) {
    const RadixPass pass = radix_pass_below(top);
    measure_pass<kWidth>(block, histogram, 0, vocab_size, load, state.found, pass, by_mass);
    state = choose_digit(block, histogram, state, pass, goal);
  }
  return static_cast<int32_t>(state.found);
}

// top_p's goal from the mass of the top-k set (float64, as the reference).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE double top_p_goal(float top_p, SplitTotal top_k_mass) {
  const double total = split_total_float64(top_k_mass);
#if defined(__CUDA_ARCH__)
  return __dmul_rn(static_cast<double>(top_p), total);
#else
  return static_cast<double>(top_p) * total;
#endif
}

// The threshold of the active parameters from tau_k (0 when off), tau_p and
// the largest key. A top-p goal of 0 is reached by every tau: tau_p is capped
// at the largest key, which keeps the largest probability and its ties.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int32_t combined_threshold(const TruncationParameters& parameters,
                                                                  int32_t threshold_k, int32_t threshold_p,
                                                                  int64_t max_key) {
  int32_t threshold = threshold_k;
  if (parameters.p_on) {
    const int32_t capped = threshold_p < max_key ? threshold_p : static_cast<int32_t>(max_key);
    threshold = capped > threshold ? capped : threshold;
  }
  if (parameters.min_p_on) {
    const int32_t threshold_m = probability_key(fmul_rn(parameters.min_p, bits_as_float(static_cast<uint32_t>(max_key))));
    threshold = threshold_m > threshold ? threshold_m : threshold;
  }
  return threshold;
}

}  // namespace truncation_detail

// The truncation of one row (reference _truncation.truncate), every thread
// gets it: the largest key, then tau_k, tau_p (within the top-k set) and
// tau_m, the largest of the active ones as the threshold, and the reciprocal
// of the kept row's exact total. `load(first, out)` gives the row's float32
// probabilities [first, first + kWidth), untruncated. `parameters.any()`
// must hold.
template <int kWidth, class Block, class Load>
SPECDEC_HOST_DEVICE Truncation row_truncation(const Block& block, TruncationHistogram* histogram,
                                              const TruncationParameters& parameters, int64_t vocab_size,
                                              const Load& load) {
  namespace detail = truncation_detail;
  const int64_t max_key = detail::max_key_of<kWidth>(block, 0, vocab_size, load);
  int32_t threshold_k = 0;
  if (parameters.k_on) {
    threshold_k = detail::largest_key<kWidth>(block, histogram, vocab_size, load,
                                              static_cast<double>(parameters.top_k), false);
  }
  int32_t threshold_p = 0;
  if (parameters.p_on) {
    const double goal =
        detail::top_p_goal(parameters.top_p, detail::mass_at_least<kWidth>(block, 0, vocab_size, load, threshold_k));
    threshold_p = detail::largest_key<kWidth>(block, histogram, vocab_size, load, goal, true);
  }
  const int32_t threshold = detail::combined_threshold(parameters, threshold_k, threshold_p, max_key);
  const SplitTotal kept = detail::mass_at_least<kWidth>(block, 0, vocab_size, load, threshold);
  return {threshold, total_reciprocal(kept), true};
}

}  // namespace specdec
