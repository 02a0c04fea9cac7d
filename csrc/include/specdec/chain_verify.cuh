// Fused chain verification (sk.chain_verify): acceptance tests, the residual
// or bonus sample and the outputs in one launch. The CUDA twin of
// kernels/chain_verify.py; specdec_kernels/reference/chain_verify.py is the
// definition of correct, and with probability inputs the outputs equal it bit
// for bit (the sampler: sampling.cuh).
//
// Design
// ------
// Grid: 1-D, `B x num_splits` blocks of 256 threads. Block (b, split) owns
// request b and a slice of whole 1024-token chunks of
// the vocabulary, so B = 1 still spreads a 128k vocabulary over the GPU
// (launcher: about two blocks per SM) and the chunks, fixed by the package,
// never depend on the grid.
//
// Probabilities. Every block of a sampled request recomputes the
// acceptance tests from gathers, so it knows the stop position j without
// talking to the other blocks; it then samples each of its chunks of row j
// (chain_verify_pass.cuh): per element a load, a subtract (residual
// max(0, p - q) after the rejection of a valid id), the fixed-point
// conversion and one block scan per chunk; per chunk one Philox call. The
// chunk's total and candidate go to the workspace, and after the rejection of
// a valid id also those of p, the fallback when the residual has no mass.
// The last block of the request to arrive chooses the chunk among all chunk
// totals with a block-wide 128-bit scan (chain_verify_finish.cuh).
//
// Greedy requests (T not > 0). With one split, the block walks the rows in
// order and stops at the first draft that is not the argmax: it reads only
// rows 0..j. With several, every block records its slice's argmax of rows
// 0..n (n = num_draft_tokens[b]) and the last arrival decides.
//
// Logits. The acceptance tests need the softmax denominator of every row up
// to the first rejection. With one split (the launcher's choice once the
// batch fills the GPU, or without stage records) the block walks the rows:
// statistics of row i, test i, stop at the first rejection, so only rows
// 0..j of target and draft are read, then the sample pass over row j. With
// several splits, the staged plan's stage 0 (below): the blocks of the
// request share the per-slice (max, sum) of target rows 0..n and draft rows
// 0..n-1 through its stage record, then each decides j from the merged
// statistics and samples its chunks of row j. (A two-wave plan, wave 2
// waiting on wave 1's blocks, did the same with twice the blocks and a
// launch-order ticket; its wait, inlined into the kernel that also walks,
// spilled it at the 128-register cap.)
//
// Waiting. Only the staged plan waits, and only for slices that running
// blocks took (stage_records.cuh), so never on a block that may not have
// started. The wait is bounded: one that gives up fails its request
// (faults.cuh), whose last block then counts the fault and writes the
// failure outcome (tokens -1, num_accepted 0).
//
// Workspace (int64 words, contents need not be initialised):
//   [B, num_chunks, 3]  per chunk: total of way 0 (residual, or p), total of
//                       way 1 (p after a rejection), then the two candidates
//                       as int32;
//   then int32 statistics [B, num_splits, K + 1, 2] (greedy: max, argmax;
//   logits: target max, sum; the draft is always probabilities, v1.3);
//   their room caps num_splits.
// Stage records (staged plan), int64 [B, chain_stage_stride(args)], a
// separate buffer, zero before a call and left at zero.
// Counters, int32 [2 B]: per request its arrivals and its failure flag
// (raised by a wait that gave up), zero before a call and zero after it,
// give-ups included.
//
// Top-k, top-p and min-p (reference _truncation.py): a threshold needs the
// whole row. Two plans:
//
// Staged (the rows split over several blocks and `stages` holds the
// records): B x num_splits blocks, roles from blockIdx. A
// sampled request with a parameter on computes the thresholds of all the
// rows a decision may need at once, rows 0..n-1 and row n unless the engine
// gives the bonus token (rows past the stop are read speculatively: the
// price of not serialising on the stop), stage by stage
// (chain_verify_stages.cuh): with logits first each slice's softmax
// statistics into the statistics slots, merged in slice order by every
// block; then the largest keys, top-k's four radix passes, top-k's kept mass
// (top-p's goal), top-p's four passes and the kept mass. Each stage is a
// pass over the request's slices: a block takes slices from the stage's
// counter until none is left, adds its slices' integer partials (nonzero
// histogram bins) to the stage record with atomics and publishes each slice,
// then waits (bounded) until all are published. A wait only ever waits for
// slices that running blocks took, never for a block that may not have
// started. Every block then derives the digits and thresholds from the same
// totals with truncation.cuh's code: the same bits as the whole-row search.
// Then each block tests the drafts with the truncated p(t), samples its own
// slice of the stop row truncated the same way and arrives; the last
// arrival chooses the chunk, writes the outputs and puts the request's
// records back to zero. Non-truncating requests of the launch take the
// split paths above; with logits they use stage 0.
// A truncated row costs one pass for the largest key, four per search and
// two for masses, each spread over the request's blocks.
//
// Walk (one split: a full batch, or no records): a sampled request with a
// parameter on walks its rows (walk_rows): row i's softmax statistics
// (logits), its threshold and reciprocal by the radix search of
// truncation.cuh in shared memory, then test i with the truncated p(t); the
// sample pass over row `stop` reads p truncated the same way. Only rows
// 0..stop get a threshold. Requests with every parameter off take the
// paths above (one split). bonus_token_ids: a request that accepts all n
// drafts emits its bonus id; no block reads, records or samples row n.
//
// Values never cause an out-of-bounds access: draft ids outside [0, V) are
// rejections and are never gathered, num_draft_tokens is clamped to [0, K],
// and only rows 0..n are read. Every offset is int64.
//
// Layouts. The block program addresses a request's rows from its row 0
// (request_rows): padded, [B, K+1, V] with num_draft_tokens; packed
// (sk.chain_verify_packed), target [T+B, V], draft [T, V] and ids [T] read
// in place, with request b's rows found from cu_num_draft_tokens on the
// device. Random numbers and workspace slots are those of request b
// position i in both, so both give the same tokens for the same rows.
//
// The block program is written against the Block interface (block.cuh):
// DeviceBlock runs it in the kernel; csrc/chain_verify.cu runs it on the host
// as the CPU implementation of torch.ops.specdec_C.chain_verify, so CPU tests
// check the index math, workspace layout, sampler and finishing logic.
//
// This header includes no torch header; it compiles under nvcc and, without
// the device parts, under a plain C++ compiler (csrc/bindings/).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "specdec/common.cuh"
#include "specdec/index.cuh"
#include "specdec/rng.cuh"
#include "specdec/sampling.cuh"
#include "specdec/chain_verify_stages.cuh"
#include "specdec/faults.cuh"

namespace specdec {

// Word indices in the counters buffer (see "Counters" above).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t chain_arrivals_word(int64_t b) { return 2 * b; }
constexpr int64_t kChainFailedAfterArrivals = 1;  // the failure flag: the word after the request's arrivals
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t chain_counter_words(int64_t batch_size) { return 2 * batch_size; }

// Everything a call reads and writes. Tensors are raw pointers; the last dim
// of target/draft and of the outputs is contiguous. Shapes are those of the
// padded layout; the packed one (cu_num_draft_tokens given) is in brackets,
// and its "_b" strides are row strides, equal to the "_k" ones.
struct ChainVerifyArgs {
  const void* draft_token_ids = nullptr;  // [B, K] ([T]) TokenDtype
  int64_t ids_stride_b = 0, ids_stride_k = 0;
  TokenDtype token_dtype = TokenDtype::kInt64;
  const void* target = nullptr;  // [B, K+1, V] ([T+B, V]) ProbDtype
  int64_t target_stride_b = 0, target_stride_k = 0;
  const void* draft = nullptr;  // [B, K, V] ([T, V]), same dtype as target, or nullptr: one-hot drafts
  int64_t draft_stride_b = 0, draft_stride_k = 0;
  ProbDtype prob_dtype = ProbDtype::kFloat32;
  const int32_t* num_draft_tokens = nullptr;  // [B] or nullptr: K (padded)
  IndexTensor cu_num_draft_tokens;            // [B+1] int32 or int64 (packed), data nullptr: padded
  int64_t num_tokens = 0;                     // T (packed)
  bool bonus_rows = true;                     // packed: [T+B, V] target; false: [T, V] (bonus ids given)
  const float* temperature = nullptr;         // [B] or nullptr: 1
  bool logits = false;
  RngArgs rng;
  int32_t* output_token_ids = nullptr;  // [B, K+1]
  int64_t output_stride_b = 0;
  int32_t* num_accepted = nullptr;  // [B]
  int64_t* workspace = nullptr;     // see above; at least chain_verify_chunk_words(B, V)
  int64_t workspace_words = 0;
  int32_t* counters = nullptr;  // [2 B]: per request its arrivals and failure flag
  int32_t* errors = nullptr;    // the device's fault counters (faults.cuh), or nullptr: not counted
  int64_t fault_role = kNoFault;  // tests: the block of this role gives up its waits at once
  int64_t* claims = nullptr;      // [B]: per request the launch's claim of its words (faults.cuh), or nullptr
  int64_t stamp = 0;              // this launch's number (specdec_kernels/_workspace.py, launch_stamp)
  int64_t* stages = nullptr;    // the staged plan's records (chain_verify_stages.cuh), zero before and after a call
  int64_t stage_words = 0;      // its int64 words; less than chain_verify_stage_words(args): no staged plan
  IndexTensor top_k;             // [B] int32/int64, or data nullptr: off
  const float* top_p = nullptr;  // [B] or nullptr: off
  const float* min_p = nullptr;  // [B] or nullptr: off
  IndexTensor bonus_token_ids;   // [B] int32/int64, or data nullptr: sample the bonus row
  int64_t requested_splits = 0;  // 0: the launcher's choice; 1 with logits or top_k/top_p/min_p unless staged
  int64_t batch_size = 0;
  int32_t max_drafts = 0;  // K
  int32_t vocab_size = 0;  // 1 <= V <= 2**30
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t chain_verify_num_chunks(int64_t vocab_size) {
  return (vocab_size + kChunkSize - 1) / kChunkSize;
}

// int64 words of the per-chunk results (the least workspace a call needs).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t chain_verify_chunk_words(int64_t batch_size, int64_t vocab_size) {
  return 3 * batch_size * chain_verify_num_chunks(vocab_size);
}

// int32 words of statistics per (request, split).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t chain_verify_stats_words(int64_t max_drafts) {
  return 2 * (max_drafts + 1);  // chain_verify_detail::kStatFields per row
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool chain_verify_truncates(const ChainVerifyArgs& args) {
  return args.top_k.data != nullptr || args.top_p != nullptr || args.min_p != nullptr;
}

// int64 words of one request's stage records (chain_verify_stages.cuh):
// every stage's when the call truncates, else only the header of the
// statistics stage, all that logits need (192 + 4125 (K + 1) words against 16).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t chain_stage_stride(const ChainVerifyArgs& args) {
  return chain_verify_truncates(args) ? chain_stage_request_words(static_cast<int64_t>(args.max_drafts) + 1)
                                      : kStageWords;
}

// int64 words of the staged plan's records of a call.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t chain_verify_stage_words(const ChainVerifyArgs& args) {
  return args.batch_size * chain_stage_stride(args);
}

struct ChainVerifyPlan {
  int64_t num_chunks = 1;
  int64_t chunks_per_split = 1;
  int64_t num_splits = 1;
  bool staged = false;  // logits or top_k/top_p/min_p with several splits: stage records
};

// About `target_blocks` blocks (or `requested_splits` per request when > 0),
// never more splits than chunks nor than the workspace has statistics for.
// With logits or top_k/top_p/min_p: the staged plan over the same splits
// when there are several and the stage records fit, else one block per
// request (a softmax normaliser or a threshold needs the whole row).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE ChainVerifyPlan plan_chain_verify(const ChainVerifyArgs& args,
                                                                          int64_t target_blocks) {
  ChainVerifyPlan plan;
  plan.num_chunks = chain_verify_num_chunks(args.vocab_size);
  const int64_t stats_words = 2 * (args.workspace_words - chain_verify_chunk_words(args.batch_size, args.vocab_size));
  const int64_t capacity = stats_words / (args.batch_size * chain_verify_stats_words(args.max_drafts));
  const bool whole_rows = args.logits || chain_verify_truncates(args);
  int64_t wanted =
      args.requested_splits > 0 ? args.requested_splits : (target_blocks + args.batch_size - 1) / args.batch_size;
  wanted = wanted < plan.num_chunks ? wanted : plan.num_chunks;
  wanted = wanted < capacity ? wanted : capacity;
  wanted = wanted > 1 ? wanted : 1;
  plan.staged = whole_rows && wanted > 1 && args.stages != nullptr &&
                args.stage_words >= chain_verify_stage_words(args);
  if (whole_rows && !plan.staged) wanted = 1;  // without stage records, one block per request walks the rows
  plan.chunks_per_split = (plan.num_chunks + wanted - 1) / wanted;
  plan.num_splits = (plan.num_chunks + plan.chunks_per_split - 1) / plan.chunks_per_split;
  return plan;
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t chain_verify_num_blocks(const ChainVerifyArgs& args,
                                                                        const ChainVerifyPlan& plan) {
  return args.batch_size * plan.num_splits;
}

struct ChainVerifyParams {
  ChainVerifyArgs args;
  ChainVerifyPlan plan;
};

// Launchers (csrc/chain_verify.cu). Neither synchronises.
// One launch on `stream`; returns the launch status (cudaGetLastError).
cudaError_t launch_chain_verify(const ChainVerifyArgs& args, cudaStream_t stream);
// The same block program on the host (host pointers): an emulated block of
// std::threads runs the blocks one after another. A wait there never spins:
// one that would have to gives up (faults.cuh), counted in args.errors.
void chain_verify_host(const ChainVerifyArgs& args);

}  // namespace specdec

#include "specdec/chain_verify_finish.cuh"

namespace specdec {
namespace chain_verify_detail {

#if defined(__CUDACC__)
// Two resident blocks per SM, the launcher's target (a 128-register cap).
// kStaged: the staged plan (plan.staged).
template <class Prob, class Token, bool kStaged>
__global__ void __launch_bounds__(DeviceBlock::kThreads, 2) chain_verify_kernel(const ChainVerifyParams params) {
  __shared__ DeviceBlock::Shared shared;
  __shared__ TruncationHistogram histogram;
  const DeviceBlock block = {&shared};
  chain_verify_block<DeviceBlock, Prob, Token, kStaged>(block, params, static_cast<int64_t>(blockIdx.x), &histogram);
}
#endif  // __CUDACC__

}  // namespace chain_verify_detail
}  // namespace specdec
