// chain_verify's staged truncation: the thresholds of a request's rows
// measured by all of its blocks together, one stage (a pass over the
// vocabulary, cut into the plan's slices) at a time, through the stage
// records of stage_records.cuh. Design: chain_verify.cuh, "Top-k, top-p and
// min-p"; the arithmetic is truncation.cuh's whole-row search, so the
// thresholds and reciprocals are the same bits.
//
// Records of one request (int64 words), rows = K + 1 whatever the request's
// n, so every request's records are at a fixed place:
//   kChainStages headers of kStageWords words (slices taken, published);
//   then per stage, per row, its payload:
//     kChainStatsStage     none (logits: the existing per-slice statistics)
//     kChainMaxKeyStage    the largest key (an atomic max)
//     kChainTopKStage..+3  a radix pass of the top-k search: 256 bins of
//                          (high31, low31) sums (only nonzero bins are
//                          added), then the search's state after the pass
//                          (found bits, measure above), written alike by
//                          every block from the same totals
//     kChainTopKMassStage  the mass of the top-k set (top-p's goal)
//     kChainTopPStage..+3  the top-p search's passes, as top-k's
//     kChainKeptMassStage  the kept row's mass (the reciprocal)
// Stages a request's parameters do not need are skipped by all of its blocks
// (the same parameters, the same decision) and stay at zero. The request's
// last block puts its records back to zero.
//
// This header includes no torch header.
#pragma once

#include <cstdint>

#include "specdec/block.cuh"
#include "specdec/common.cuh"
#include "specdec/sampling.cuh"
#include "specdec/stage_records.cuh"
#include "specdec/truncation.cuh"

namespace specdec {

constexpr int kChainStatsStage = 0;
constexpr int kChainMaxKeyStage = 1;
constexpr int kChainTopKStage = 2;
constexpr int kChainTopKMassStage = kChainTopKStage + kRadixPasses;
constexpr int kChainTopPStage = kChainTopKMassStage + 1;
constexpr int kChainKeptMassStage = kChainTopPStage + kRadixPasses;
constexpr int kChainStages = kChainKeptMassStage + 1;

// A radix pass's payload per row: the bins, then the state after the pass.
constexpr int64_t kRadixStateWord = 2 * kRadixBins;
constexpr int64_t kRadixRowWords = kRadixStateWord + 3;

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool chain_radix_stage(int stage) {
  return (stage >= kChainTopKStage && stage < kChainTopKMassStage) ||
         (stage >= kChainTopPStage && stage < kChainKeptMassStage);
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t chain_stage_row_words(int stage) {
  if (stage == kChainStatsStage) return 0;
  if (stage == kChainMaxKeyStage) return 1;
  return chain_radix_stage(stage) ? kRadixRowWords : 2;  // a split mass
}

// Where stage `stage`'s payload starts in a request's records. (A closed
// form of the sum instead of the loop made the staged kernel spill 44-60
// bytes at its 128-register cap on sm_80.)
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t chain_stage_payload(int stage, int64_t rows) {
  int64_t offset = kChainStages * kStageWords;
  for (int s = 0; s < stage; ++s) offset += rows * chain_stage_row_words(s);
  return offset;
}

// int64 words of one request's records (rows = K + 1).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t chain_stage_request_words(int64_t rows) {
  return chain_stage_payload(kChainStages, rows);
}

namespace chain_verify_detail {

// Elements per thread and step of a truncation search's reads.
constexpr int kTruncationSpan = 4;

// One request's records and slices.
struct StagedRecords {
  int64_t* records;  // the request's chain_stage_request_words(rows) words
  int64_t rows;      // K + 1: the payload stride
  int64_t splits;
  int64_t chunks_per_split;
  int64_t vocab_size;
  WaitFault fault;  // where a wait that gives up reports it

  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t* header(int stage) const { return records + stage * kStageWords; }
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t* payload(int stage, int64_t row) const {
    return records + chain_stage_payload(stage, rows) + row * chain_stage_row_words(stage);
  }
};

// One stage: work(slice, lo, hi) for each slice this block takes, each
// published after its work, then the wait for every slice (stage_records.cuh).
template <class Block, class Work>
SPECDEC_HOST_DEVICE void run_stage(const Block& block, const StagedRecords& staged, int stage, Work&& work) {
  int64_t* header = staged.header(stage);
  for (int64_t slice = take_slice(block, header); slice < staged.splits; slice = take_slice(block, header)) {
    const int64_t lo = slice * staged.chunks_per_split * kChunkSize;
    const int64_t end = lo + staged.chunks_per_split * kChunkSize;
    work(slice, lo, end < staged.vocab_size ? end : staged.vocab_size);
    publish_slice(block, header);
  }
  wait_for_slices(block, header, staged.splits, staged.fault);
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE SplitTotal recorded_mass(const int64_t* payload) {
  return {static_cast<uint64_t>(record_word(payload, 0)), static_cast<uint64_t>(record_word(payload, 1))};
}

// The search's state after the radix pass whose row payload this is.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE truncation_detail::RadixState recorded_state(const int64_t* payload) {
  return {static_cast<uint32_t>(record_word(payload, kRadixStateWord)),
          {static_cast<uint64_t>(record_word(payload, kRadixStateWord + 1)),
           static_cast<uint64_t>(record_word(payload, kRadixStateWord + 2))}};
}

// Thread 0 adds a slice's split mass (its nonzero halves) to a row's payload.
template <class Block>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void add_mass(const Block& block, int64_t* payload, SplitTotal mass) {
  if (mass.high31 != 0) block.add_relaxed(payload, static_cast<int64_t>(mass.high31));
  if (mass.low31 != 0) block.add_relaxed(payload + 1, static_cast<int64_t>(mass.low31));
}

// The key a search starting at `first_stage` found for `row` (0 when off).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int32_t search_result(const StagedRecords& staged, bool on, int first_stage,
                                                              int64_t row) {
  return on ? static_cast<int32_t>(recorded_state(staged.payload(first_stage + kRadixPasses - 1, row)).found) : 0;
}

// The threshold of row `row` once its search stages are complete: the same
// combination as truncation.cuh's row_truncation.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int32_t staged_threshold(const StagedRecords& staged,
                                                                 const TruncationParameters& parameters,
                                                                 int64_t row) {
  const int64_t max_key = record_word(staged.payload(kChainMaxKeyStage, row), 0);
  return truncation_detail::combined_threshold(parameters,
                                               search_result(staged, parameters.k_on, kChainTopKStage, row),
                                               search_result(staged, parameters.p_on, kChainTopPStage, row), max_key);
}

// Row `row`'s truncation once every stage is complete (every thread).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE Truncation staged_truncation(const StagedRecords& staged,
                                                                     const TruncationParameters& parameters,
                                                                     int64_t row) {
  return {staged_threshold(staged, parameters, row),
          total_reciprocal(recorded_mass(staged.payload(kChainKeptMassStage, row))), true};
}

// The four passes of one search (top-k by count, top-p by mass) over every
// row: per slice and row the bins of truncation.cuh's measure_pass, added to
// the stage; once all slices are in, every block loads a row's totals into
// its bins and picks the digit with the same choose_digit as the whole-row
// search, and records the new state (the same bits from every block).
// `load_of(row)` gives row's loader; `goal_of(row)` its goal.
template <class Block, class LoadOf, class GoalOf>
SPECDEC_HOST_DEVICE void staged_search(const Block& block, TruncationHistogram* histogram,
                                       const StagedRecords& staged, int64_t num_rows, int first_stage, bool by_mass,
                                       const LoadOf& load_of, const GoalOf& goal_of) {
  namespace detail = truncation_detail;
  int stage = first_stage;
  for (int top = kKeyBits; top > 0; top -= kRadixBits, ++stage) {
    const detail::RadixPass pass = detail::radix_pass_below(top);
    const auto state_before = [&](int64_t row) {
      return stage == first_stage ? detail::radix_start() : recorded_state(staged.payload(stage - 1, row));
    };
    run_stage(block, staged, stage, [&](int64_t, int64_t lo, int64_t hi) {
      for (int64_t row = 0; row < num_rows; ++row) {
        detail::measure_pass<kTruncationSpan>(block, histogram, lo, hi, load_of(row), state_before(row).found, pass,
                                              by_mass);
        // Only nonzero bins: most digits of a pass past the first hold no
        // token of the prefix, and global atomics are the stage's cost.
        uint64_t* bins = reinterpret_cast<uint64_t*>(staged.payload(stage, row));
        for (int digit = block.thread(); digit < kRadixBins; digit += block.num_threads()) {
          if (histogram->high31[digit] != 0) block_atomic_add(bins + 2 * digit, histogram->high31[digit]);
          if (histogram->low31[digit] != 0) block_atomic_add(bins + 2 * digit + 1, histogram->low31[digit]);
        }
      }
    });
    for (int64_t row = 0; row < num_rows; ++row) {
      const int64_t* bins = staged.payload(stage, row);
      block.sync();  // the previous reads of the bins are over
      for (int digit = block.thread(); digit < kRadixBins; digit += block.num_threads()) {
        histogram->high31.set(digit, static_cast<uint64_t>(record_word(bins, 2 * digit)));
        histogram->low31.set(digit, static_cast<uint64_t>(record_word(bins, 2 * digit + 1)));
      }
      block.sync();
      const detail::RadixState state =
          detail::choose_digit(block, histogram, state_before(row), pass, goal_of(row));
      if (block.thread() == 0) {
        int64_t* payload = staged.payload(stage, row);
        payload[kRadixStateWord] = static_cast<int64_t>(state.found);
        payload[kRadixStateWord + 1] = static_cast<int64_t>(state.above.high31);
        payload[kRadixStateWord + 2] = static_cast<int64_t>(state.above.low31);
      }
      block.sync();  // the state is read back (from L2) by every thread
    }
  }
}

// One mass stage: per slice and row the split mass of the keys >= floor_of(row).
template <class Block, class LoadOf, class FloorOf>
SPECDEC_HOST_DEVICE void staged_mass(const Block& block, const StagedRecords& staged, int64_t num_rows, int stage,
                                     const LoadOf& load_of, const FloorOf& floor_of) {
  run_stage(block, staged, stage, [&](int64_t, int64_t lo, int64_t hi) {
    for (int64_t row = 0; row < num_rows; ++row) {
      const SplitTotal mass =
          truncation_detail::mass_at_least<kTruncationSpan>(block, lo, hi, load_of(row), floor_of(row));
      add_mass(block, staged.payload(stage, row), mass);
    }
  });
}

// Every stage of the truncation of rows 0..num_rows-1 (truncation.cuh's
// row_truncation, each pass shared by the request's blocks). Afterwards
// staged_truncation(staged, parameters, row) is the row's truncation.
// `parameters.any()` must hold.
template <class Block, class LoadOf>
SPECDEC_HOST_DEVICE void staged_truncations(const Block& block, TruncationHistogram* histogram,
                                            const StagedRecords& staged, const TruncationParameters& parameters,
                                            int64_t num_rows, const LoadOf& load_of) {
  namespace detail = truncation_detail;
  if (parameters.p_on || parameters.min_p_on) {
    run_stage(block, staged, kChainMaxKeyStage, [&](int64_t, int64_t lo, int64_t hi) {
      for (int64_t row = 0; row < num_rows; ++row) {
        const int64_t max_key = detail::max_key_of<kTruncationSpan>(block, lo, hi, load_of(row));
        block.max_relaxed(staged.payload(kChainMaxKeyStage, row), max_key);
      }
    });
  }
  if (parameters.k_on) {
    staged_search(block, histogram, staged, num_rows, kChainTopKStage, false, load_of,
                  [&](int64_t) { return static_cast<double>(parameters.top_k); });
  }
  const auto threshold_k = [&](int64_t row) { return search_result(staged, parameters.k_on, kChainTopKStage, row); };
  if (parameters.p_on) {
    staged_mass(block, staged, num_rows, kChainTopKMassStage, load_of, threshold_k);
    staged_search(block, histogram, staged, num_rows, kChainTopPStage, true, load_of, [&](int64_t row) {
      return detail::top_p_goal(parameters.top_p, recorded_mass(staged.payload(kChainTopKMassStage, row)));
    });
  }
  staged_mass(block, staged, num_rows, kChainKeptMassStage, load_of,
              [&](int64_t row) { return staged_threshold(staged, parameters, row); });
}

// The request's last block: the records back to zero (every block has read
// them before arriving). The statistics stage's header, and the headers and
// payloads of only the stages staged_truncations ran for these parameters:
// at K = 4 the whole region is about 165 KB, most of it radix bins, on the
// request's critical path, and a call that does not truncate has only the
// first header (chain_stage_stride). Returns whether a header it cleared
// was damaged before the call (stage_records.cuh, stages_damaged).
template <class Block>
SPECDEC_HOST_DEVICE bool clear_used_records(const Block& block, const StagedRecords& staged,
                                            const TruncationParameters& parameters) {
  bool damaged = false;
  const auto clear = [&](int64_t* words, int64_t count) {
    for (int64_t word = block.thread(); word < count; word += block.num_threads()) words[word] = 0;
  };
  const auto clear_headers = [&](int first, int end) {
    damaged = stages_damaged(block, staged.header(first), end - first, staged.splits) || damaged;
    clear(staged.header(first), (end - first) * kStageWords);
  };
  const auto clear_stages = [&](int first, int end) {
    clear_headers(first, end);
    int64_t* const from = staged.payload(first, 0);
    clear(from, staged.payload(end, 0) - from);
  };
  clear_headers(kChainStatsStage, kChainStatsStage + 1);
  if (!parameters.any()) return damaged;
  if (parameters.p_on || parameters.min_p_on) clear_stages(kChainMaxKeyStage, kChainTopKStage);
  if (parameters.k_on) clear_stages(kChainTopKStage, kChainTopKMassStage);
  if (parameters.p_on) clear_stages(kChainTopKMassStage, kChainKeptMassStage);  // top-p's goal and passes
  clear_stages(kChainKeptMassStage, kChainStages);
  return damaged;
}

}  // namespace chain_verify_detail
}  // namespace specdec
