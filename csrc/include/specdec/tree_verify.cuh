// Fused tree verification (sk.tree_verify): the walk down the draft tree,
// every acceptance test, the residual updates and the final sample in one
// launch. specdec_kernels/reference/tree_verify.py is the definition of
// correct (its docstring states the decision rule); with probability inputs
// the outputs equal it bit for bit.
//
// Design
// ------
// Grid: one block of 256 threads per request (num_splits with the split
// plan, below), which walks its tree from the root. The children of the current node c are the nodes i with
// parents[i] == c, c < i < n (n = num_nodes clamped to [1, N]) and a token
// in [0, V), tried in increasing index: the next one after the last tried is
// a block-wide min over tiles of 256 nodes, so a search reads each parent
// once per current node, never a serial scan.
//
// Acceptance (sampled requests): u * q(t) < p(t) in float32, u from the
// acceptance stream at position = child, q one-hot on t without a draft or
// where q(t) is not > 0 (a deterministic candidate, v1.3, whose rejection
// leaves q as it is); greedy
// requests (T not > 0) accept t iff it is the argmax of the current node's raw
// target row. On acceptance p and q become the child's input rows.
//
// One vocabulary pass per rejection, applied lazily (the design of the
// Triton kernel, kernels/tree_verify.py). A rejection of t makes one pass
// over the current rows for the exact integer totals (sampling.cuh, "the
// normaliser") of the residual max(0, p - q), of p (its fallback when the
// residual has no mass) and, without replacement with a draft, of q with
// q(t) = 0, and leaves the rejection *pending*: t, whether the residual had
// mass, and the reciprocals r_p and r_q. The current rows are the base rows
// (the node's input rows, or the request's workspace row pair) with the
// pending rejection applied where they are read: p = float32(W * r_p), W the
// fixed-point weight of max(0, p - q) (of p without residual mass), and
// without replacement q = float32(W' * r_q), W' that of q with q(t) = 0:
// the acceptance gathers, the next rejection's pass and the final sample.
// Only a second rejection at a node (one already pending) makes its pass
// also write the current rows into the workspace, which become the base:
// each thread reads its entries before overwriting them, a barrier before
// the pass lets every thread's gathers of the base finish, and one after it
// orders the writes before any other read. So k rejections at a node cost k
// passes, k - 1 of them writing, and an acceptance right after a rejection
// reads nothing more at that node; only nodes on the accepted path whose
// children are tried, and the final node, read a full row.
//
// The emitted token: greedy, the argmax of the final node's raw target row;
// sampled, the fixed-point sample (block_rows.cuh) of the current p at
// position = the final node, the pending rejection applied as each span is
// weighed, each chunk's total and candidate kept in the workspace until the
// 128-bit chunk choice.
//
// Top-k, top-p and min-p (requests with a parameter on, not greedy): every
// target row p is replaced by its truncation (reference _truncation.py)
// before anything reads it. The block finds the threshold and reciprocal of
// the current node's input row once, before its first acceptance test (or
// the final sample), by a radix search in shared memory (truncation.cuh);
// each read of the input row then maps p to float32(W * r) if kept, else 0:
// the acceptance gathers, the rejection passes and the final sample. A
// pending rejection's totals and the workspace rows are made from truncated
// values, so the workspace rows are read as they are. With
// bonus_token_ids, a request whose final node had no child tried and
// rejected emits its bonus id and reads no row for it.
//
// Logits: p = softmax(x / T) from the row's statistics (max and sum,
// gathered online by the block the first time the node needs them), so
// tokens may differ from the reference's near a tie; probabilities are exact.
//
// Small batches (split plan, kSplit; the Triton kernel's design,
// kernels/tree_verify.py and kernels/tree_verify_stages.py). The launcher
// gives each request num_splits blocks (vocabulary_splits: about one block
// per SM in all; on the host the interpreter's constants). Every block walks
// the whole tree: the acceptance tests are gathers, and the logits
// statistics, greedy argmaxes and truncation thresholds are recomputed by
// each with the same code (the same bits). Each vocabulary pass, a
// rejection's totals or the final sample's chunks, is a *stage* shared
// through the request's stage record (tree_verify_stages.cuh): a block
// takes slices of whole 1024 chunks from the record's counter until none is
// left, adds each slice's integer totals atomically (or stores its chunks' results in the request's
// chunk slots) and publishes it (release), then waits (bounded acquire spin)
// until every slice is published. A slice is taken only by a running block,
// so no wait is on a block that has not started (the host runs a request's
// blocks one after another, the writer last: the first to run takes every
// slice, and the writer reads only what another block published). For the
// sample only block 0, the writer, waits and chooses; only it stores
// outputs. A block may start long after the others have moved on, so nothing
// it reads may have been overwritten: no workspace row is written; the
// current rows are the node's input rows with every rejection at the node
// replayed in order (token, residual flag and the float32 reciprocals, which
// every block derives alike from the stage's totals and keeps in shared
// memory, at most kMaxSplitRejections a node), the map apply_pending
// applies, so the same bits. k rejections at a node cost k passes of O(k)
// arithmetic per entry and no record loads. Each block counts itself out at the
// end; the last zeroes the records it used and the counter, so the records
// are zero between calls (zero-initialised once by the launcher's buffers).
//
// Ordering (split plan). Writes a block publishes (the totals' atomics,
// the chunk results of any thread) are ordered by a barrier before thread
// 0's acq_rel counter increment (block.cuh, arrive); the waiting thread 0
// spins on an acquire load, and a barrier hands the view to the block;
// shared words are read from L2 (ld.cg). A wait that gives up (its bound
// hit) raises the request's failure flag in its end record (faults.cuh) and
// its block ends its walk; the request's last block then counts the fault,
// writes the failure outcome (tokens -1, accepted_nodes [0, -1, ...],
// num_accepted 0), and zeroes the records of the most stages any of its
// blocks used, as on every path.
//
// Workspace, int64 words per request, contents need not be initialised:
//   3 * ceil(V / 1024) rounded up to even: per chunk the total and the
//     candidate of the final sample (ChunkSlots);
//   then two float32 rows of round_up(V, 4) entries: the base p, then the
//     base q (written without replacement with a draft only); they hold
//     the current node's rows only after a second rejection there (never
//     in the split plan). Rows start 16-byte aligned (vector loads).
// Split plan only, the stage records (`stages`, zero between calls): per
// request N + 1 records of 16 words (kStageWords; at most N - 1 rejections
// and the sample, then the end record). No [B, N, V] scratch.
//
// Values never cause an out-of-bounds access: parents are compared, never
// followed; tokens outside [0, V) are never gathered; num_nodes is clamped.
// Every offset is int64.
//
// The block program is written against the Block interface (block.cuh):
// DeviceBlock runs it in the kernel; csrc/tree_verify.cu runs it on the host
// (host_block.cuh) as the CPU implementation of torch.ops.specdec_C.tree_verify.
//
// This header includes no torch header.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "specdec/block.cuh"
#include "specdec/block_rows.cuh"
#include "specdec/common.cuh"
#include "specdec/faults.cuh"
#include "specdec/index.cuh"
#include "specdec/rng.cuh"
#include "specdec/sampling.cuh"
#include "specdec/tree_verify_stages.cuh"
#include "specdec/truncation.cuh"

namespace specdec {

// Everything a call reads and writes. Tensors are raw pointers; the last dim
// of target/draft and of the outputs is contiguous.
struct TreeVerifyArgs {
  const void* tree_token_ids = nullptr;  // [B, N] TokenDtype
  int64_t ids_stride_b = 0, ids_stride_n = 0;
  TokenDtype token_dtype = TokenDtype::kInt64;
  const int32_t* parents = nullptr;  // [B, N]
  int64_t parents_stride_b = 0, parents_stride_n = 0;
  const void* target = nullptr;  // [B, N, V] ProbDtype
  int64_t target_stride_b = 0, target_stride_n = 0;
  const void* draft = nullptr;  // [B, N, V], same dtype as target, or nullptr: deterministic candidates
  int64_t draft_stride_b = 0, draft_stride_n = 0;
  ProbDtype prob_dtype = ProbDtype::kFloat32;
  const int32_t* num_nodes = nullptr;  // [B] or nullptr: N
  const float* temperature = nullptr;  // [B] or nullptr: 1
  bool logits = false;
  bool without_replacement = true;  // draft_sampling (with a draft only)
  IndexTensor top_k;                // [B] int32/int64, or data nullptr: off
  const float* top_p = nullptr;     // [B] or nullptr: off
  const float* min_p = nullptr;     // [B] or nullptr: off
  IndexTensor bonus_token_ids;      // [B] int32/int64, or data nullptr: always sample
  RngArgs rng;
  int32_t* accepted_nodes = nullptr;  // [B, N]
  int64_t accepted_stride_b = 0;
  int32_t* output_token_ids = nullptr;  // [B, N]
  int64_t output_stride_b = 0;
  int32_t* num_accepted = nullptr;  // [B]
  int64_t* workspace = nullptr;     // tree_verify_workspace_words(B, V)
  int64_t* stages = nullptr;        // split plan: tree_verify_stage_words(B, N), zero between calls
  int32_t num_splits = 1;           // blocks per request (1: one block walks a whole request)
  int32_t* errors = nullptr;        // the device's fault counters (faults.cuh), or nullptr: not counted
  int64_t fault_role = kNoFault;    // tests: the block of this role (b * num_splits + rank) gives up its waits
  int64_t stamp = 0;                // split plan: this launch's number (faults.cuh, claims), 0: no claims
  int64_t batch_size = 0;
  int32_t max_nodes = 0;   // N, 1 <= N < 2**24 (the RNG position word)
  int32_t vocab_size = 0;  // 1 <= V <= 2**30
};

// Workspace layout (see above), in int64 words unless said otherwise.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t tree_verify_slot_words(int64_t vocab_size) {
  const int64_t chunks = (vocab_size + kChunkSize - 1) / kChunkSize;
  return (3 * chunks + 1) / 2 * 2;
}
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t tree_verify_row_floats(int64_t vocab_size) {
  return (vocab_size + 3) / 4 * 4;
}
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t tree_verify_request_words(int64_t vocab_size) {
  return tree_verify_slot_words(vocab_size) + tree_verify_row_floats(vocab_size);  // two float rows
}
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t tree_verify_workspace_words(int64_t batch_size, int64_t vocab_size) {
  return batch_size * tree_verify_request_words(vocab_size);
}

// Launchers (csrc/tree_verify.cu). Neither synchronises.
// One launch on `stream`; returns the launch status (cudaGetLastError).
cudaError_t launch_tree_verify(const TreeVerifyArgs& args, cudaStream_t stream);
// The same block program on the host (host pointers), blocks one after
// another. A wait there never spins: one that would have to gives up
// (faults.cuh), counted in args.errors.
void tree_verify_host(const TreeVerifyArgs& args);

namespace tree_verify_detail {

constexpr int64_t kNoNode = INT64_MAX;

template <class Token>
struct Tree {
  const Token* ids;
  int64_t ids_stride;
  const int32_t* parents;
  int64_t parents_stride;
  int64_t num_nodes;  // clamped to [1, N]
  int64_t vocab_size;

  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t token(int64_t node) const {
    return static_cast<int64_t>(ids[node * ids_stride]);
  }
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool valid(int64_t token_id) const {
    return token_id >= 0 && token_id < vocab_size;
  }
};

// The first child of `current` after node `after` (>= current) with a valid
// token, or -1. Thread i looks at node base + i of each tile; the tile loop
// is uniform, so every thread takes part in every reduction.
template <class Block, class Token>
SPECDEC_HOST_DEVICE int64_t next_child(const Block& block, const Tree<Token>& tree, int64_t current, int64_t after) {
  for (int64_t base = after + 1; base < tree.num_nodes; base += block.num_threads()) {
    const int64_t node = base + block.thread();
    int64_t found = kNoNode;
    if (node < tree.num_nodes && static_cast<int64_t>(tree.parents[node * tree.parents_stride]) == current &&
        tree.valid(tree.token(node))) {
      found = node;
    }
    found = block.block_all_reduce(found, MinInt64());
    if (found != kNoNode) return found;
  }
  return -1;
}

// Consecutive entries a thread handles per step of a rejection pass: one
// 16-byte load of a float32 row (8 bytes of bf16/fp16) instead of four
// dependent 4-byte ones, for more bytes in flight per thread.
constexpr int kSpan = 4;

// A base distribution as the walk sees it: an input row (probabilities, or,
// for the target, logits turned into probabilities with the row's
// statistics; a draft is always probabilities, v1.3) or, after a
// second rejection at a node, a normalised float32 row of the workspace.
template <class Prob>
struct Row {
  const Prob* input;  // nullptr: the row is `normalised`
  float* normalised;  // the request's workspace row
  SoftmaxStats stats;  // of `input`, logits only
  Truncation truncation;  // of `input` (top-k/top-p/min-p), off until found

  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float at(int64_t index, bool logits, float temperature) const {
    if (input == nullptr) return normalised[index];
    float value[1] = {to_float(input[index])};
    process_span(index, index + 1, logits, temperature, value);  // a span of one entry, inside the vocabulary
    return value[0];
  }

  // Entries [first, first + kCount), 0 past the vocabulary.
  template <int kCount>
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void span(int64_t first, int64_t vocab_size, bool logits,
                                                    float temperature, float (&out)[kCount]) const {
    stored_span(first, vocab_size, out);
    process_span(first, vocab_size, logits, temperature, out);
  }

  // span's two halves. The sampler issues the loads a chunk ahead and
  // processes them only when it weighs them: a value computed from a load as
  // soon as it is issued makes the load wait there.
  template <int kCount>
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void stored_span(int64_t first, int64_t vocab_size,
                                                           float (&out)[kCount]) const {
    if (input == nullptr) {
      load_span(normalised, first, vocab_size, out);
    } else {
      load_span(input, first, vocab_size, out);
    }
  }

  template <int kCount>
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void process_span(int64_t first, int64_t vocab_size, bool logits,
                                                            float temperature, float (&out)[kCount]) const {
    if (input == nullptr) return;  // a normalised row holds probabilities already
    SPECDEC_UNROLL
    for (int j = 0; j < kCount; ++j) {
      float probability = out[j];
      if (logits) probability = first + j < vocab_size ? softmax_prob(out[j], stats, temperature) : 0.0f;
      out[j] = truncated_probability(probability, truncation);
    }
  }
};

// Everything one request needs besides the tree. kSplit: the split plan,
// where the current rows are the input rows with the rejections at the
// current node (walk.replay, as many as walk.replayed) replayed in order
// instead of a base row and one pending rejection.
template <class Prob, bool kSplit = false>
struct Walk {
  Row<Prob> target;  // base p
  Row<Prob> draft;   // base q; not read without a draft (the candidate is one-hot)
  Pending pending;
  bool has_draft;
  bool remove_drawn;  // without replacement, with a draft
  bool logits;
  float temperature;
  int64_t vocab_size;
  Pending* replay;  // kSplit: the current node's rejections, in order (the block's shared memory)
  int64_t replayed;       // how many

  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool rejected() const {
    return kSplit ? replayed > 0 : pending.token >= 0;
  }

  // The q a rejected candidate was tried against at `index`: the current q
  // if it was drawn from it, else the point mass on `token` (no draft, or a
  // deterministic candidate: q(t) not > 0, v1.3).
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float tried_weight(bool point_mass, int64_t token, int64_t index,
                                                             float q) const {
    return has_draft && !point_mass ? q : (index == token ? 1.0f : 0.0f);
  }

  // The current p and q at `index` from the base ones (q: anything without a
  // draft): p = float32(W * r_p) with W the fixed-point weight of max(0, p -
  // tried) (of p where that had no mass) and, without replacement, q =
  // float32(W' * r_q) with W' the weight of q, 0 at the token. These are the
  // rows _sampling.normalise gives the reference, made where they are read.
  // Past the vocabulary 0 stays 0. Only while a rejection is pending.
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void apply(const Pending& rejection, int64_t index, float& p,
                                                     float& q) const {
    const float tried = tried_weight(rejection.point_mass, rejection.token, index, q);
    // fixed_point_weight maps p - q <= 0 (and NaN) to 0: max(0, p - q).
    p = normalised_weight(fixed_point_weight(rejection.residual ? fsub_rn(p, tried) : p),
                          rejection.target_reciprocal);
    if (remove_drawn && !rejection.point_mass) {  // a deterministic candidate was not drawn: q stays
      q = normalised_weight(index == rejection.token ? 0 : fixed_point_weight(q), rejection.draft_reciprocal);
    }
  }
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void apply_pending(int64_t index, float& p, float& q) const {
    apply(pending, index, p, q);
  }

  // The rejections at the current node applied to [first, first + kCount)
  // of the input rows: the pending one, or (kSplit) each one at the node in
  // order, the same float32 map, so the same bits.
  template <int kCount>
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void apply_rejections(int64_t first, float (&p)[kCount],
                                                                float (&q)[kCount]) const {
    if (kSplit) {
      for (int64_t slot = 0; slot < replayed; ++slot) {
        const Pending rejection = replay[slot];
        SPECDEC_UNROLL
        for (int j = 0; j < kCount; ++j) apply(rejection, first + j, p[j], q[j]);
      }
    } else if (pending.token >= 0) {
      SPECDEC_UNROLL
      for (int j = 0; j < kCount; ++j) apply_pending(first + j, p[j], q[j]);
    }
  }

  // The current p and q at `index` (one entry, the acceptance test's
  // gathers): q one-hot on `drawn` without a draft.
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void at(int64_t index, int64_t drawn, float& p, float& q) const {
    float one_p[1] = {target.at(index, logits, temperature)};
    float one_q[1] = {has_draft ? draft.at(index, false, temperature) : 0.0f};  // a draft is probabilities (v1.3)
    apply_rejections(index, one_p, one_q);
    p = one_p[0];
    q = has_draft ? one_q[0] : (index == drawn ? 1.0f : 0.0f);
  }

  // The current p and q at [first, first + kCount): q one-hot on `drawn`
  // without a draft.
  template <int kCount>
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void spans(int64_t first, int64_t drawn, float (&p)[kCount],
                                                     float (&q)[kCount]) const {
    target.span(first, vocab_size, logits, temperature, p);
    if (has_draft) {
      draft.span(first, vocab_size, false, temperature, q);
    } else {
      SPECDEC_UNROLL
      for (int j = 0; j < kCount; ++j) q[j] = 0.0f;
    }
    apply_rejections(first, p, q);
    if (has_draft) return;
    SPECDEC_UNROLL
    for (int j = 0; j < kCount; ++j) q[j] = first + j == drawn ? 1.0f : 0.0f;
  }
};

// The current p as the sampler reads it (block_rows.cuh's sample_slice,
// kWays == 1): the base rows loaded a chunk ahead, the pending rejection
// applied when weighed: the weights of the row _sampling.normalise gives the
// reference, so the token's bits are the reference's.
template <class Prob, bool kSplit>
struct CurrentTargetRow {
  template <int kPerThread>
  using Stored = FloatSpan<kPerThread>;  // an input row's values converted, or a normalised row's
  Walk<Prob, kSplit> walk;
  uint32_t position;  // the final node

  template <int kWays, int kPerThread>
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void load(int64_t first, int64_t vocab_size, FloatSpan<kPerThread>& p,
                                                    FloatSpan<kPerThread>& q) const {
    static_assert(kWays == 1, "the tree samples its current p alone");
    walk.target.stored_span(first, vocab_size, p.values);
    if (reads_draft()) walk.draft.stored_span(first, vocab_size, q.values);
  }

  template <int kWays, int kPerThread>
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void weigh(int64_t first, int64_t vocab_size, const FloatSpan<kPerThread>& p,
                                                     const FloatSpan<kPerThread>& q,
                                                     uint64_t (&weights)[kWays][kPerThread]) const {
    float target_probs[kPerThread], draft_probs[kPerThread];
    SPECDEC_UNROLL
    for (int j = 0; j < kPerThread; ++j) {
      target_probs[j] = p.values[j];
      draft_probs[j] = q.values[j];
    }
    walk.target.process_span(first, vocab_size, walk.logits, walk.temperature, target_probs);
    if (reads_draft()) walk.draft.process_span(first, vocab_size, false, walk.temperature, draft_probs);
    if constexpr (kSplit) {
      walk.apply_rejections(first, target_probs, draft_probs);
      SPECDEC_UNROLL
      for (int j = 0; j < kPerThread; ++j) weights[0][j] = fixed_point_weight(target_probs[j]);
    } else {
      SPECDEC_UNROLL
      for (int j = 0; j < kPerThread; ++j) {
        if (walk.pending.token >= 0) walk.apply_pending(first + j, target_probs[j], draft_probs[j]);
        weights[0][j] = fixed_point_weight(target_probs[j]);
      }
    }
  }

  // The draft row is read only after a rejection at the node (its q enters the residual).
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool reads_draft() const { return walk.rejected() && walk.has_draft; }
};

// One pass over entries [lo, hi) of the current rows (lo a multiple of
// kSpan; hi the vocabulary size or a multiple of a chunk) for the rejection
// of token `drawn`: the exact totals of the fixed-point weights of
// max(0, p - q) (q the point mass on `drawn` where `point_mass`), of p and,
// without replacement, of q without `drawn`,
// block-reduced. `writing` also stores the current rows into the
// workspace (never in the split plan). Entries past the vocabulary load as
// 0 and weigh 0.
template <class Block, class Prob, bool kSplit>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE PassTotals rejection_pass(const Block& block,
                                                                  const Walk<Prob, kSplit>& walk, int64_t drawn,
                                                                  bool point_mass, int64_t lo, int64_t hi,
                                                                  bool writing) {
  const int64_t step = kSpan * static_cast<int64_t>(block.num_threads());
  const int64_t start = lo + kSpan * static_cast<int64_t>(block.thread());
  RejectionTotals totals = {{0, 0}, {0, 0}};
  SplitTotal draft_total = {0, 0};
  for (int64_t first = start; first < hi; first += step) {
    float p[kSpan], q[kSpan];
    walk.spans(first, drawn, p, q);
    SPECDEC_UNROLL
    for (int j = 0; j < kSpan; ++j) {
      const int64_t index = first + j;
      // Each thread reads its entries before it overwrites them, and no
      // other thread reads them until the barrier after the pass.
      if (writing && index < walk.vocab_size) {
        walk.target.normalised[index] = p[j];
        if (walk.remove_drawn) walk.draft.normalised[index] = q[j];
      }
      // max(0, p - q): negatives weigh 0
      const float tried = walk.tried_weight(point_mass, drawn, index, q[j]);
      add_weight(totals.residual, fixed_point_weight(fsub_rn(p[j], tried)));
      add_weight(totals.target, fixed_point_weight(p[j]));
      if (walk.remove_drawn && index != drawn) add_weight(draft_total, fixed_point_weight(q[j]));
    }
  }
  totals = block.block_all_reduce(totals, AddRejectionTotals());
  if (walk.remove_drawn) draft_total = block.block_all_reduce(draft_total, AddSplitTotals());
  return {totals, draft_total};
}

// The rejection of token `drawn`, in one pass over the current rows
// (rejection_pass), which makes it the pending rejection. Were a rejection
// pending already (a second one at this node), the pass also writes the
// current rows into the workspace, which become the base rows.
template <class Block, class Prob>
SPECDEC_HOST_DEVICE void reject(const Block& block, Walk<Prob>& walk, int64_t drawn, bool point_mass) {
  const bool writing = walk.pending.token >= 0;
  // Every thread's gathers of this try read the base rows, maybe the very
  // entries (of the workspace) this pass overwrites.
  if (writing) block.sync();
  const PassTotals pass = rejection_pass(block, walk, drawn, point_mass, 0, walk.vocab_size, writing);
  if (writing) {
    block.sync();  // the next read (a gather, a pass, the sample) may read any entry
    walk.target.input = nullptr;
    if (walk.remove_drawn) walk.draft.input = nullptr;
  }
  walk.pending = rejection_of(drawn, point_mass, pass);
}

// Split plan: the rejection of `drawn` as one stage. The block takes slices
// of the pass from the stage's counter until none is left, adds each
// slice's totals and publishes it, then waits for every slice (each taken by
// a running block) and derives the rejection from the totals, as every
// block does, into the node's replay list in shared memory: the walk
// replays it from there, reading no record per span. False once the request
// has failed (a wait gave up): the walk ends there.
template <class Block, class Prob>
SPECDEC_HOST_DEVICE bool reject_split(const Block& block, Walk<Prob, true>& walk, int64_t drawn, bool point_mass,
                                      SplitPlan& plan) {
  int64_t* record = plan.records + plan.stage * kStageWords;
  const int64_t slice_entries = plan.chunks_per_split * kChunkSize;
  for (int64_t slice = take_slice(block, record); slice < plan.splits; slice = take_slice(block, record)) {
    const int64_t lo = slice * slice_entries;
    const int64_t hi = lo + slice_entries < walk.vocab_size ? lo + slice_entries : walk.vocab_size;
    publish_totals(block, record, rejection_pass(block, walk, drawn, point_mass, lo, hi, false));
  }
  const bool complete = wait_for_stage(block, plan, record);
  const Pending rejection = rejection_of(drawn, point_mass, stage_totals(block, record));
  // The slot's last readers (a replay at an earlier node) passed the barriers of this pass.
  if (block.thread() == 0) walk.replay[walk.replayed] = rejection;
  block.sync();  // every thread replays it
  ++walk.replayed;
  ++plan.stage;
  return complete;
}

template <class Block, class Prob>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t greedy_choice(const Block& block, const Prob* target_row,
                                                              int64_t vocab_size, bool logits) {
  return greedy_token(slice_argmax(block, target_row, 0, vocab_size), logits);
}

// The fixed-point sample of the current p at `position`; -1 without mass.
template <class Block, class Prob>
SPECDEC_HOST_DEVICE int64_t sample_target(const Block& block, const Walk<Prob>& walk, const RequestKey& key,
                                          uint32_t position, const ChunkSlots& slots) {
  const int64_t num_chunks = (walk.vocab_size + kChunkSize - 1) / kChunkSize;
  const CurrentTargetRow<Prob, false> row = {walk, position};
  sample_slice<1>(block, row, key, walk.vocab_size, 0, num_chunks, slots);
  return finish_sampled(block, slots, num_chunks, false, key, position);
}

// Split plan: the sample as one stage. The block samples the chunks of the
// slices it takes into the request's chunk slots and publishes each; only
// the writer (the request's block 0) waits for every slice and chooses the
// chunk. Returns -1 in the other blocks.
template <class Block, class Prob>
SPECDEC_HOST_DEVICE int64_t sample_target_split(const Block& block, const Walk<Prob, true>& walk,
                                                const RequestKey& key, uint32_t position, const ChunkSlots& slots,
                                                SplitPlan& plan, bool writer) {
  const int64_t num_chunks = (walk.vocab_size + kChunkSize - 1) / kChunkSize;
  const CurrentTargetRow<Prob, true> row = {walk, position};
  int64_t* record = plan.records + plan.stage * kStageWords;
  ++plan.stage;
  for (int64_t slice = take_slice(block, record); slice < plan.splits; slice = take_slice(block, record)) {
    const int64_t lo = slice * plan.chunks_per_split;
    const int64_t hi = lo + plan.chunks_per_split < num_chunks ? lo + plan.chunks_per_split : num_chunks;
    sample_slice<1>(block, row, key, walk.vocab_size, lo, hi, slots);
    publish_slice(block, record);  // releases the slice's chunk results
  }
  if (!writer) return -1;
  wait_for_stage(block, plan, record);
  return finish_sampled(block, slots, num_chunks, false, key, position);
}

// The truncation of the current node's input target row (its statistics
// ready, for logits), every thread gets it.
template <class Block, class Prob, bool kSplit>
SPECDEC_HOST_DEVICE Truncation target_truncation(const Block& block, TruncationHistogram* histogram,
                                                 const TreeVerifyArgs& args, int64_t b,
                                                 const Walk<Prob, kSplit>& walk) {
  Row<Prob> row = walk.target;
  row.truncation = no_truncation();  // the search reads the row as given
  const TruncationParameters parameters =
      load_truncation_parameters(args.top_k, args.top_p, args.min_p, b, walk.vocab_size);
  return row_truncation<kSpan>(block, histogram, parameters, walk.vocab_size,
                               [&](int64_t first, float (&out)[kSpan]) {
                                 row.span(first, walk.vocab_size, walk.logits, walk.temperature, out);
                               });
}

// One block: request `b`'s walk and outputs. `histogram` is the block's
// shared memory for the truncation search. kSplit: the split plan, block
// `rank` of the request's args.num_splits (rank 0 stores the outputs), and
// `replay` the block's shared memory for the current node's rejections
// (kMaxSplitRejections; args.max_nodes <= kMaxSplitNodes).
template <class Block, class Prob, class Token, bool kSplit>
SPECDEC_HOST_DEVICE void tree_verify_block(const Block& block, const TreeVerifyArgs& args, int64_t b, int64_t rank,
                                           TruncationHistogram* histogram, Pending* replay) {
  const int64_t max_nodes = args.max_nodes;
  const int64_t vocab_size = args.vocab_size;
  Tree<Token> tree;
  tree.ids = static_cast<const Token*>(args.tree_token_ids) + b * args.ids_stride_b;
  tree.ids_stride = args.ids_stride_n;
  tree.parents = args.parents + b * args.parents_stride_b;
  tree.parents_stride = args.parents_stride_n;
  const int64_t count = args.num_nodes == nullptr ? max_nodes : args.num_nodes[b];
  tree.num_nodes = count < 1 ? 1 : (count > max_nodes ? max_nodes : count);
  tree.vocab_size = vocab_size;

  const Prob* target = static_cast<const Prob*>(args.target) + b * args.target_stride_b;
  const Prob* draft = args.draft == nullptr ? nullptr : static_cast<const Prob*>(args.draft) + b * args.draft_stride_b;
  const RequestTemperature temperature = request_temperature(args.temperature, b);
  const bool greedy = temperature.greedy;

  int64_t* request_words = args.workspace + b * tree_verify_request_words(vocab_size);
  const ChunkSlots slots = {request_words};
  float* residual_row = reinterpret_cast<float*>(request_words + tree_verify_slot_words(vocab_size));

  Walk<Prob, kSplit> walk;
  walk.target = {target, residual_row, empty_stats(), no_truncation()};
  walk.draft = {draft, residual_row + tree_verify_row_floats(vocab_size), empty_stats(), no_truncation()};
  walk.pending = no_pending();
  walk.has_draft = draft != nullptr;
  walk.remove_drawn = draft != nullptr && args.without_replacement;
  walk.logits = args.logits;
  walk.temperature = temperature.temperature;
  walk.vocab_size = vocab_size;
  SplitPlan plan = {nullptr, {nullptr, false}, 1, 0, 0};
  if (kSplit) {
    plan.records = args.stages + kStageWords * b * (max_nodes + 1);
    plan.fault = {reinterpret_cast<int32_t*>(plan.records + max_nodes * kStageWords + kFailedWord),
                  b * args.num_splits + rank == args.fault_role};
    plan.splits = args.num_splits;
    const int64_t num_chunks = (vocab_size + kChunkSize - 1) / kChunkSize;
    plan.chunks_per_split = (num_chunks + plan.splits - 1) / plan.splits;
    if (args.stamp != 0) begin_request(block, plan, max_nodes, args.stamp);
  }
  walk.replay = replay;
  walk.replayed = 0;
  const bool writer = !kSplit || rank == 0;  // the one block that stores the request's outputs
  const RequestKey key = load_request_key(args.rng, b);
  // Greedy requests ignore the parameters (the argmax is always kept).
  const bool truncating =
      !greedy && load_truncation_parameters(args.top_k, args.top_p, args.min_p, b, vocab_size).any();

  int32_t* accepted_row = args.accepted_nodes + b * args.accepted_stride_b;
  int32_t* output_row = args.output_token_ids + b * args.output_stride_b;
  if (writer && block.thread() == 0) accepted_row[0] = 0;

  int64_t current = 0;
  int64_t depth = 0;
  int64_t choice = -2;           // greedy: the current node's argmax once known (-2: not yet)
  bool stats_ready = false;      // logits: statistics of the current node's input rows
  bool truncation_ready = false;  // truncating: walk.target.truncation is the current node's
  bool rejected_here = false;     // a child of the current node was tried and rejected
  bool failed = false;            // split plan: a wait of the request gave up (the outcome is decided)
  for (int64_t after = 0;;) {
    const int64_t child = next_child(block, tree, current, after);
    if (child < 0) break;
    after = child;
    const int64_t token = tree.token(child);
    bool accepted;
    if (greedy) {
      if (choice == -2) choice = greedy_choice(block, target + current * args.target_stride_n, vocab_size, args.logits);
      accepted = token == choice;
    } else {
      if (walk.logits && !stats_ready) {
        // Still the input rows: a rejection needs the statistics first.
        walk.target.stats = slice_stats(block, walk.target.input, 0, vocab_size, walk.temperature);
        stats_ready = true;
      }
      if (truncating && !truncation_ready) {
        walk.target.truncation = target_truncation(block, histogram, args, b, walk);
        truncation_ready = true;
      }
      float target_prob, draft_prob;
      walk.at(token, token, target_prob, draft_prob);
      const float uniform = uniform_from_word(random_words(key, kAcceptStream, static_cast<uint32_t>(child), 0u).w0);
      // A candidate with q(t) not > 0 was not drawn from q: tested against the point mass on t (v1.3).
      const bool point_mass = !drawn_from_draft(draft_prob);
      accepted = accept(uniform, proposal_probability(draft_prob), target_prob);
      if (!accepted) {
        if constexpr (kSplit) {
          failed = !reject_split(block, walk, token, point_mass, plan);
          if (failed) break;
        } else {
          reject(block, walk, token, point_mass);
        }
      }
    }
    rejected_here = !accepted;
    if (!accepted) continue;
    ++depth;
    if (writer && block.thread() == 0) {
      accepted_row[depth] = static_cast<int32_t>(child);
      output_row[depth - 1] = static_cast<int32_t>(token);
    }
    current = child;
    walk.target.input = target + child * args.target_stride_n;
    walk.draft.input = draft == nullptr ? nullptr : draft + child * args.draft_stride_n;
    walk.pending = no_pending();
    walk.replayed = 0;  // the rejections so far were at other nodes
    choice = -2;
    stats_ready = false;
    walk.target.truncation = no_truncation();
    truncation_ready = false;
  }

  // An id outside [0, V) is no bonus (v1.3): the final node's row is sampled as without ids.
  const int64_t bonus = args.bonus_token_ids.data != nullptr ? args.bonus_token_ids[b] : -1;
  int64_t emitted;
  if (failed) {
    emitted = -1;  // the request's last block writes the failure outcome
  } else if (bonus >= 0 && bonus < args.vocab_size && !rejected_here) {
    emitted = bonus;  // the path ends at a leaf: the engine's token, no row read
  } else if (greedy) {
    emitted = choice != -2 ? choice : greedy_choice(block, target + current * args.target_stride_n, vocab_size,
                                                    args.logits);
  } else {
    if (walk.logits && !stats_ready && walk.target.input != nullptr) {
      walk.target.stats = slice_stats(block, walk.target.input, 0, vocab_size, walk.temperature);
    }
    if (truncating && !truncation_ready) walk.target.truncation = target_truncation(block, histogram, args, b, walk);
    if constexpr (kSplit) {
      emitted = sample_target_split(block, walk, key, static_cast<uint32_t>(current), slots, plan, writer);
    } else {
      emitted = sample_target(block, walk, key, static_cast<uint32_t>(current), slots);
    }
  }
  if (writer) {
    if (block.thread() == 0) {
      output_row[depth] = static_cast<int32_t>(emitted);
      args.num_accepted[b] = static_cast<int32_t>(depth);
    }
    for (int64_t slot = depth + 1 + block.thread(); slot < max_nodes; slot += block.num_threads()) {
      accepted_row[slot] = -1;
      output_row[slot] = -1;
    }
  }
  int32_t* errors = args.errors == nullptr ? nullptr : args.errors + kTreeWaitGaveUp;
  if (kSplit && end_request(block, plan, max_nodes, errors)) {
    // The request's last block, and a wait of the request gave up: the
    // failure outcome, over whatever the writer stored (before its arrival).
    for (int64_t slot = block.thread(); slot < max_nodes; slot += block.num_threads()) {
      accepted_row[slot] = slot == 0 ? 0 : -1;
      output_row[slot] = -1;
    }
    if (block.thread() == 0) args.num_accepted[b] = 0;
  }
}

#if defined(__CUDACC__)
// Two resident blocks per SM (a 128-register cap): one block per request, so
// large batches keep every SM busy.
template <class Prob, class Token, bool kSplit>
__global__ void __launch_bounds__(DeviceBlock::kThreads, 2) tree_verify_kernel(const TreeVerifyArgs args) {
  __shared__ DeviceBlock::Shared shared;
  __shared__ TruncationHistogram histogram;
  __shared__ Pending replay[kSplit ? kMaxSplitRejections : 1];  // 24 KB split
  const DeviceBlock block = {&shared};
  const int64_t index = static_cast<int64_t>(blockIdx.x);
  const int64_t splits = kSplit ? args.num_splits : 1;
  tree_verify_block<DeviceBlock, Prob, Token, kSplit>(block, args, index / splits, index % splits, &histogram,
                                                      replay);
}
#endif  // __CUDACC__

}  // namespace tree_verify_detail
}  // namespace specdec
