// The stage records through which the blocks of one request share its
// vocabulary passes in tree_verify's split plan (tree_verify.cuh, "Small
// batches"): the layout and protocol of kernels/tree_verify_stages.py.
//
// A stage is one pass over a request's vocabulary: a rejection's totals, or
// the final sample's chunk results. Its record, kStageWords int64 words:
//   0     slices taken (a counter, past `splits` once all are taken)
//   1     slices published (`splits` once the totals are complete)
//   2-7   the rejection totals, split at bit 31: residual, p, q without the
//         rejected token (integer sums: the order of the adds is free)
// Every block derives the rejection (Pending) from those totals alike and
// keeps the current node's rejections in shared memory to replay them, so
// the rejection is not recorded. The rejections the walk applies (Pending)
// and the totals a pass makes (PassTotals) live here with the records.
//
// This header includes no torch header.
#pragma once

#include <cstdint>

#include "specdec/block.cuh"
#include "specdec/common.cuh"
#include "specdec/sampling.cuh"
#include "specdec/stage_records.cuh"

namespace specdec {

// Split plan: the stage records (kernels/tree_verify_stages.py's layout),
// kStageWords int64 words each; request b's N + 1 records start at
// kStageWords * b * (N + 1), the last its end record (below).
// Words 0-1, the slice counters: stage_records.cuh.
constexpr int64_t kTotalsWord = 2;      // six words: residual, p, q without the token; high31 then low31
// The split plan's trees have at most this many nodes (launchers/tree_verify.py
// MAX_SPLIT_TREE_NODES; the binding checks it), so a node has at most
// kMaxSplitRejections rejections to replay.
constexpr int64_t kMaxSplitNodes = 1024;
constexpr int64_t kMaxSplitRejections = kMaxSplitNodes - 1;
// The end record: blocks counted out, the most stages a block of the
// request used, its failure flag (int32, raised by a wait that gave up), and
// the launch's claim of the records.
constexpr int64_t kEndedWord = 0;
constexpr int64_t kStagesUsedWord = 1;
constexpr int64_t kFailedWord = 2;
constexpr int64_t kClaimWord = 3;  // the launch's claim of the request's records (faults.cuh)
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t tree_verify_stage_words(int64_t split_requests, int64_t max_nodes) {
  return kStageWords * split_requests * (max_nodes + 1);
}

namespace tree_verify_detail {

// The last rejection at the current node, not yet applied to its base rows:
// the current rows are the base rows with it applied where they are read.
struct Pending {
  int64_t token;            // the rejected token; -1: none
  bool residual;            // max(0, p - q) had mass (else p is renormalised as it is)
  bool point_mass;          // a deterministic candidate (q(t) not > 0, v1.3): q is one-hot on `token` and stays
  float target_reciprocal;  // of the total of p's new weights
  float draft_reciprocal;   // of the total of q's weights without `token` (without replacement)
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE Pending no_pending() { return {-1, false, false, 1.0f, 1.0f}; }

struct RejectionTotals {
  SplitTotal residual, target;
};

struct AddRejectionTotals {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE RejectionTotals operator()(RejectionTotals a, RejectionTotals b) const {
    return {AddSplitTotals()(a.residual, b.residual), AddSplitTotals()(a.target, b.target)};
  }
};

struct PassTotals {
  RejectionTotals totals;
  SplitTotal draft;  // q without the rejected token (without replacement)
};

// The rejection of `drawn` made from its totals, as the walk applies it.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE Pending rejection_of(int64_t drawn, bool point_mass, const PassTotals& pass) {
  const bool use_residual = has_mass(pass.totals.residual);
  return {drawn, use_residual, point_mass,
          total_reciprocal(use_residual ? pass.totals.residual : pass.totals.target), total_reciprocal(pass.draft)};
}

// Split plan: a request's blocks and their place in its stage records.
struct SplitPlan {
  int64_t* records;    // the request's N + 1 records; record N is its end record
  WaitFault fault;     // where a wait that gives up reports it
  int64_t splits;      // blocks per request = slices per stage
  int64_t chunks_per_split;
  int64_t stage;       // the next stage
};

// Adds a slice's totals (every thread has them) into the stage and releases it.
template <class Block>
SPECDEC_HOST_DEVICE void publish_totals(const Block& block, int64_t* record, const PassTotals& pass) {
  const uint64_t words[6] = {pass.totals.residual.high31, pass.totals.residual.low31, pass.totals.target.high31,
                             pass.totals.target.low31,    pass.draft.high31,          pass.draft.low31};
  SPECDEC_UNROLL
  for (int word = 0; word < 6; ++word) {
    block.add_relaxed(record + kTotalsWord + word, static_cast<int64_t>(words[word]));
  }
  publish_slice(block, record);  // releases the adds
}

// Waits until every slice of the stage is published (all were taken by
// running blocks), or until the request failed; false once it has.
template <class Block>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool wait_for_stage(const Block& block, const SplitPlan& plan,
                                                            const int64_t* record) {
  return wait_for_slices(block, record, plan.splits, plan.fault);
}

// The complete totals of a published rejection stage (read from L2).
template <class Block>
SPECDEC_HOST_DEVICE PassTotals stage_totals(const Block& block, const int64_t* record) {
  uint64_t words[6];
  SPECDEC_UNROLL
  for (int word = 0; word < 6; ++word) {
    words[word] = static_cast<uint64_t>(block.load_published(record + kTotalsWord + word));
  }
  return {{{words[0], words[1]}, {words[2], words[3]}}, {words[4], words[5]}};
}

// Split plan, before any block of the request touches its records: they
// are this launch's, whatever they held (a launch that never ended, a stray
// write). The first block of the launch zeroes every word of them but the
// claim; the others wait for it, a running block (a wait that gives up fails
// the request).
template <class Block>
SPECDEC_HOST_DEVICE void begin_request(const Block& block, const SplitPlan& plan, int64_t max_nodes, int64_t stamp) {
  const int64_t claim_word = max_nodes * kStageWords + kClaimWord;
  if (block.claim(plan.records + claim_word, stamp)) {
    for (int64_t word = block.thread(); word < (max_nodes + 1) * kStageWords; word += block.num_threads()) {
      if (word != claim_word) plan.records[word] = 0;
    }
    block.claimed(plan.records + claim_word, stamp);
  } else if (block.wait_for_claim(plan.records + claim_word, stamp)) {
    block.raise(plan.fault.failed);
  }
}

// Split plan: counts the block out; the request's last block puts the
// records of the most stages any block used (a block that gave up a wait
// stopped early, and another may have gone on past it) and the end record
// back to zero, and counts the waits that gave up into `errors`. True in
// the last block when the request failed.
template <class Block>
SPECDEC_HOST_DEVICE bool end_request(const Block& block, const SplitPlan& plan, int64_t max_nodes, int32_t* errors) {
  int64_t* end = plan.records + max_nodes * kStageWords;
  block.max_relaxed(end + kStagesUsedWord, plan.stage);
  // After every read of the records; a damaged count raises the failure flag.
  if (!block.arrive_last(end + kEndedWord, plan.splits, plan.fault.failed)) return false;
  // At most the request's records before its end record, whatever the word held when the call started.
  const int64_t recorded = block.load_published(end + kStagesUsedWord);
  const bool used_damaged = recorded > max_nodes;
  const int64_t used = used_damaged ? max_nodes : (recorded < 0 ? 0 : recorded);
  if (used_damaged || stages_damaged(block, plan.records, used, plan.splits)) block.raise(plan.fault.failed);
  const bool failed = count_give_ups(block, plan.fault.failed, errors);
  // After a fault every record: it may have left any of them damaged.
  const int64_t cleared = failed ? max_nodes : used;
  for (int64_t word = block.thread(); word < cleared * kStageWords; word += block.num_threads()) {
    plan.records[word] = 0;
  }
  if (block.thread() == 0) {
    end[kEndedWord] = 0;
    end[kStagesUsedWord] = 0;
    end[kClaimWord] = 0;
  }
  return failed;
}

}  // namespace tree_verify_detail
}  // namespace specdec
