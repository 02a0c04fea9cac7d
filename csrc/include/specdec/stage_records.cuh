// Stage records: how the blocks of one request share a pass over its
// vocabulary without waiting on a block that may not have started. Used by
// tree_verify's split plan (tree_verify_stages.cuh) and chain_verify's staged
// truncation (chain_verify_stages.cuh); the protocol of
// kernels/tree_verify_stages.py.
//
// A stage is one pass over the request's vocabulary, cut into `splits`
// slices. A record starts with a header of two counters:
//   kTakenWord      slices taken (a counter, past `splits` once all are taken)
//   kPublishedWord  slices published (`splits` once the stage is complete)
// Every block takes slices until none is left, adds its partial results to
// the stage (integer atomics: the order of the adds is free), publishes each
// slice (a release after its adds), then waits until all are published. A
// block only waits on slices running blocks took, and a block never waits
// between taking a slice and publishing it, so the wait always ends.
//
// This header includes no torch header.
#pragma once

#include <cstdint>

#include "specdec/block.cuh"
#include "specdec/common.cuh"
#include "specdec/faults.cuh"

namespace specdec {

constexpr int64_t kStageWords = 16;    // one 128-byte line: the header and small payloads
constexpr int64_t kTakenWord = 0;      // slices taken (past `splits` once all are)
constexpr int64_t kPublishedWord = 1;  // slices published

// A word of a stage record another block (or this one's thread 0) wrote:
// from L2, never a stale L1 line.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t record_word(const int64_t* record, int64_t word) {
#if defined(__CUDA_ARCH__)
  return static_cast<int64_t>(__ldcg(reinterpret_cast<const long long*>(record + word)));
#else
  return record[word];
#endif
}

// What take_slice returns for a count below zero (no launch's: damaged
// words): past any `splits`, so no slice index leaves [0, splits).
constexpr int64_t kNothingLeft = int64_t{1} << 62;

// The next untaken slice of the stage at `record` (>= splits once all are
// taken); every thread gets it.
template <class Block>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t take_slice(const Block& block, int64_t* record) {
  const int64_t taken = block.take(record + kTakenWord);
  return taken < 0 ? kNothingLeft : taken;
}

// Releases a slice: every write and atomic add the block made for it.
template <class Block>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void publish_slice(const Block& block, int64_t* record) {
  block.arrive(record + kPublishedWord);
}

// After the request's last arrival, every stage its blocks used is complete
// (published `splits` times) and every other stage untouched (0). Any other
// count was there before the call: damaged words, a count in range too,
// which no wait could tell from a stage in progress. Whether one of the
// `stages` records from `records` (kStageWords words apart) has one; every
// thread gets the answer.
template <class Block>
SPECDEC_HOST_DEVICE bool stages_damaged(const Block& block, const int64_t* records, int64_t stages, int64_t splits) {
  int64_t first_damaged = stages;
  for (int64_t stage = block.thread(); stage < stages; stage += block.num_threads()) {
    const int64_t published = block.load_published(records + stage * kStageWords + kPublishedWord);
    if (published != 0 && published != splits && stage < first_damaged) first_damaged = stage;
  }
  return block.block_all_reduce(first_damaged, MinInt64()) < stages;
}

// Waits until every slice of the stage is published (all were taken by
// running blocks), or until the request failed (faults.cuh); false once it
// has.
template <class Block>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool wait_for_slices(const Block& block, const int64_t* record,
                                                             int64_t splits, const WaitFault& fault) {
  return block.wait_at_least(record + kPublishedWord, splits, fault);
}

}  // namespace specdec
