// chain_verify, the combine: decisions from several slices' results (the
// staged plan, greedy), the one-block walks over rows, the last arrival's chunk
// choice and outputs, and the block program that ties the roles together.
// Design and workspace layout: chain_verify.cuh.
#pragma once

#include <cstdint>

#include "specdec/chain_verify_pass.cuh"
#include "specdec/chain_verify_stages.cuh"

namespace specdec {
namespace chain_verify_detail {

// Softmax statistics of a whole row from every slice: the lanes of one warp
// take the splits, then a warp all-reduce. The same tree in every warp and
// every block, so every block gets the same bits.
template <class Block>
SPECDEC_HOST_DEVICE SoftmaxStats merged_stats(const Block& block, const StatSlots& slots, int64_t num_splits,
                                              int64_t row, int64_t max_field, float temperature) {
  SoftmaxStats stats = empty_stats();
  for (int64_t split = block.lane(); split < num_splits; split += block.warp_size()) {
    const SoftmaxStats other = {word_as_float(block.load_published(slots.field(split, row, max_field))),
                                word_as_float(block.load_published(slots.field(split, row, max_field + 1)))};
    stats = MergeStats{temperature}(stats, other);
  }
  return block.warp_all_reduce(stats, MergeStats{temperature});
}

// Argmax of a whole target row from every slice (one warp).
template <class Block>
SPECDEC_HOST_DEVICE ArgBest merged_argmax(const Block& block, const StatSlots& slots, int64_t num_splits,
                                          int64_t row) {
  ArgBest best = empty_argmax();
  for (int64_t split = block.lane(); split < num_splits; split += block.warp_size()) {
    const ArgBest other = {word_as_float(block.load_published(slots.field(split, row, kArgMaxValue))),
                           block.load_published(slots.field(split, row, kArgMaxIndex))};
    best = MaxValue()(best, other);
  }
  return block.warp_all_reduce(best, MaxValue());
}

// A greedy request accepts position i iff its draft is the argmax of row i
// (the greedy token is -1 or a valid id, so an invalid draft never matches).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool greedy_accepts(int64_t draft_token, int64_t greedy) {
  return greedy >= 0 && draft_token == greedy;
}

// The acceptance test of `position` from its target row's statistics (logits) and
// the target row's truncation (off: the row as given).
template <class Prob, class Token>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool row_accepts(const Request<Prob, Token>& request, const RequestKey& key,
                                                         int64_t position, bool logits, const SoftmaxStats& stats,
                                                         const Truncation& truncation) {
  const int64_t token_id = request.token(position);
  if (!request.valid(token_id)) return false;
  const float target_value = to_float(request.target_row(position)[token_id]);
  const float target_prob = truncated_probability(
      logits ? softmax_prob(target_value, stats, request.temperature) : target_value, truncation);
  // The draft is always probabilities (v1.3).
  const float draft_prob =
      request.draft != nullptr ? proposal_probability(to_float(request.draft_row(position)[token_id])) : 1.0f;
  const float uniform = uniform_from_word(random_words(key, kAcceptStream, static_cast<uint32_t>(position), 0u).w0);
  return accept(uniform, draft_prob, target_prob);
}

struct Decision {
  int64_t stop;
  SoftmaxStats stats;     // logits: of target row `stop`
  Truncation truncation;  // of target row `stop` when the request truncates
};

// Several splits, a sampled request of the staged plan:
// warp w tests positions w, w + num_warps, ... from the merged statistics
// (logits) and the rows' truncations, `truncation_of(row)` (all lanes
// compute the same test); then the stop row's statistics and truncation.
template <class Block, class Prob, class Token, class TruncationOf>
SPECDEC_HOST_DEVICE Decision decide_from_slots(const Block& block, const Request<Prob, Token>& request,
                                               const RequestKey& key, bool logits, const StatSlots& slots,
                                               int64_t num_splits, const TruncationOf& truncation_of) {
  const auto stats_of = [&](int64_t row) {
    return logits ? merged_stats(block, slots, num_splits, row, kTargetMax, request.temperature) : empty_stats();
  };
  int64_t stop = request.num_drafts;
  for (int64_t position = block.warp(); position < request.num_drafts; position += block.num_warps()) {
    if (!row_accepts(request, key, position, logits, stats_of(position), truncation_of(position))) {
      stop = MinInt64()(stop, position);
    }
  }
  stop = block.block_all_reduce(stop, MinInt64());
  Decision decision = {stop, empty_stats(), no_truncation()};
  if (stop == request.num_drafts && request.has_bonus) return decision;  // row n has no slots and no sample
  decision.stats = stats_of(stop);
  decision.truncation = truncation_of(stop);
  return decision;
}

// A slice's softmax statistics of target rows 0..num_rows-1, into the
// slice's slots (the staged plan's stage 0).
template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE void record_slice_stats(const Block& block, const Request<Prob, Token>& request,
                                            const StatSlots& slots, int64_t split, int64_t vocab_lo,
                                            int64_t vocab_hi, int64_t num_rows) {
  for (int64_t row = 0; row < num_rows; ++row) {
    const SoftmaxStats stats = slice_stats(block, request.target_row(row), vocab_lo, vocab_hi, request.temperature);
    if (block.thread() == 0) {
      *slots.field(split, row, kTargetMax) = float_as_word(stats.max);
      *slots.field(split, row, kTargetSum) = float_as_word(stats.sum);
    }
  }
}

// The staged plan (chain_verify.cuh, "Top-k, top-p and min-p"), a sampled
// request with logits or a parameter on: stage 0, the per-slice statistics
// (logits), then the truncation stages of rows 0..num_rows-1 (all rows a
// decision may need, computed at once: rows past the stop are read
// speculatively, the price of not serialising on the stop), then the
// decision from the merged results.
template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE Decision staged_decision(const Block& block, const Request<Prob, Token>& request,
                                             const RequestKey& key, bool logits, const StatSlots& slots,
                                             const StagedRecords& staged, TruncationHistogram* histogram,
                                             int64_t num_rows) {
  if (logits) {
    run_stage(block, staged, kChainStatsStage, [&](int64_t slice, int64_t lo, int64_t hi) {
      record_slice_stats(block, request, slots, slice, lo, hi, num_rows);
    });
  }
  if (request.truncating) {
    const int64_t vocab_size = request.vocab_size;
    const float temperature = request.temperature;
    const auto load_of = [&](int64_t row) {
      const SoftmaxStats stats =
          logits ? merged_stats(block, slots, staged.splits, row, kTargetMax, temperature) : empty_stats();
      const Prob* target = request.target_row(row);
      return [=](int64_t first, float (&out)[kTruncationSpan]) {
        load_probability_span(target, first, vocab_size, logits, stats, temperature, out);
      };
    };
    staged_truncations(block, histogram, staged, request.truncation, num_rows, load_of);
  }
  return decide_from_slots(block, request, key, logits, slots, staged.splits, [&](int64_t row) {
    return request.truncating ? staged_truncation(staged, request.truncation, row) : no_truncation();
  });
}

// One split, logits or a truncated target: row i's statistics, then its
// truncation (reference _truncation.py, truncation.cuh), then test i, then
// the next row. Reads target rows 0..stop and draft rows 0..min(stop, n - 1);
// not the bonus row when the engine gives the bonus token. `histogram` is
// the block's shared memory for the search.
template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE Decision walk_rows(const Block& block, const Request<Prob, Token>& request, const RequestKey& key,
                                       bool logits, TruncationHistogram* histogram) {
  for (int64_t row = 0;; ++row) {
    Decision decision = {row, empty_stats(), no_truncation()};
    if (row == request.num_drafts && request.has_bonus) return decision;
    if (logits) decision.stats = slice_stats(block, request.target_row(row), 0, request.vocab_size, request.temperature);
    if (request.truncating) {
      const Prob* target = request.target_row(row);
      decision.truncation = row_truncation<kTruncationSpan>(
          block, histogram, request.truncation, request.vocab_size,
          [&](int64_t first, float (&out)[kTruncationSpan]) {
            load_probability_span(target, first, request.vocab_size, logits, decision.stats,
                                  request.temperature, out);
          });
    }
    if (row == request.num_drafts || !row_accepts(request, key, row, logits, decision.stats, decision.truncation)) {
      return decision;
    }
  }
}

struct Outcome {
  int64_t stop;
  int64_t token;
};

// Greedy, one split: argmax of row i, test i, next row; reads rows 0..stop
// (not the bonus row when the engine gives the bonus token).
template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE Outcome walk_greedy(const Block& block, const Request<Prob, Token>& request, bool logits) {
  for (int64_t row = 0;; ++row) {
    if (row == request.num_drafts && request.has_bonus) return {row, request.bonus_token};
    const int64_t token = greedy_token(slice_argmax(block, request.target_row(row), 0, request.vocab_size), logits);
    if (row == request.num_drafts || !greedy_accepts(request.token(row), token)) return {row, token};
  }
}

// Greedy, several splits (the last arrival): warp w tests positions w,
// w + num_warps, ...; then the argmax of the stop row.
template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE Outcome finish_greedy(const Block& block, const Request<Prob, Token>& request, bool logits,
                                          const StatSlots& slots, int64_t num_splits) {
  int64_t stop = request.num_drafts;
  for (int64_t position = block.warp(); position < request.num_drafts; position += block.num_warps()) {
    const int64_t token = greedy_token(merged_argmax(block, slots, num_splits, position), logits);
    if (!greedy_accepts(request.token(position), token)) stop = MinInt64()(stop, position);
  }
  stop = block.block_all_reduce(stop, MinInt64());
  if (stop == request.num_drafts && request.has_bonus) return {stop, request.bonus_token};  // row n has no slots
  return {stop, greedy_token(merged_argmax(block, slots, num_splits, stop), logits)};  // every warp, same bits
}

template <class Block, class Prob, class Token>
SPECDEC_HOST_DEVICE void write_outputs(const Block& block, const Request<Prob, Token>& request, int64_t max_drafts,
                                       Outcome outcome, int32_t* output_row, int32_t* num_accepted) {
  for (int64_t position = block.thread(); position <= max_drafts; position += block.num_threads()) {
    output_row[position] = position < outcome.stop ? static_cast<int32_t>(request.token(position))
                                                   : (position == outcome.stop ? static_cast<int32_t>(outcome.token) : -1);
  }
  if (block.thread() == 0) *num_accepted = static_cast<int32_t>(outcome.stop);
}

// The failure outcome of a request one of whose waits gave up (faults.cuh):
// tokens -1, num_accepted 0.
template <class Block>
SPECDEC_HOST_DEVICE void write_failure(const Block& block, int64_t max_drafts, int32_t* output_row,
                                       int32_t* num_accepted) {
  for (int64_t position = block.thread(); position <= max_drafts; position += block.num_threads()) {
    output_row[position] = -1;
  }
  if (block.thread() == 0) *num_accepted = 0;
}

// Where request b's rows start (in rows of each tensor's "_b" stride) and its
// draft count. Padded: row 0 of request b is row b, n = num_draft_tokens[b]
// clamped to [0, K]. Packed: start = clamp(cu[b], 0, T) and end =
// clamp(cu[b+1], start, T); ids and draft rows from start, target rows from
// start + b ([T+B, V]) or start ([T, V], no bonus rows: bonus ids given, so
// row n is never read), n = min(end - start, K). A malformed cu is read that way on
// every backend (specdec_kernels/reference/chain_verify_packed.py), so no row
// outside the tensors is read.
struct RequestRows {
  int64_t first_draft;   // ids and draft
  int64_t first_target;  // target
  int64_t num_drafts;
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE RequestRows request_rows(const ChainVerifyArgs& args, int64_t b) {
  const int64_t max_drafts = args.max_drafts;
  if (args.cu_num_draft_tokens.data == nullptr) {
    int64_t num_drafts = args.num_draft_tokens == nullptr ? max_drafts : args.num_draft_tokens[b];
    num_drafts = num_drafts < 0 ? 0 : (num_drafts > max_drafts ? max_drafts : num_drafts);
    return {b, b, num_drafts};
  }
  const int64_t num_tokens = args.num_tokens;
  int64_t start = args.cu_num_draft_tokens[b];
  start = start < 0 ? 0 : (start > num_tokens ? num_tokens : start);
  int64_t end = args.cu_num_draft_tokens[b + 1];
  end = end < start ? start : (end > num_tokens ? num_tokens : end);
  const int64_t count = end - start;
  return {start, args.bonus_rows ? start + b : start, count < max_drafts ? count : max_drafts};
}

// Where the waits of a block of the request whose arrivals counter is
// `arrivals` report giving up (`give_up`: the tests' forced fault, for this
// block). The flag's address is derived from the counter, which stays live
// anyway: its own address kept live into the waits spilled at the cap.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE WaitFault chain_wait_fault(int32_t* arrivals, bool give_up) {
  return {arrivals + kChainFailedAfterArrivals, give_up};
}

// The request's last block, after every wait of it: if one gave up, or an
// arrival count was damaged (counted in args.errors), writes the failure
// outcome and returns true.
template <class Block>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool wrote_failure_outcome(const Block& block, const ChainVerifyArgs& args,
                                                                   int64_t b, int32_t* arrivals, int32_t* output_row) {
  if (!count_give_ups(block, arrivals + kChainFailedAfterArrivals,
                      args.errors == nullptr ? nullptr : args.errors + kChainWaitGaveUp)) {
    return false;
  }
  write_failure(block, args.max_drafts, output_row, args.num_accepted + b);
  return true;
}

// Request b's stage records in the staged plan.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE StagedRecords staged_records(const ChainVerifyParams& params, int64_t b,
                                                                     const WaitFault& fault) {
  const ChainVerifyArgs& args = params.args;
  const int64_t rows = static_cast<int64_t>(args.max_drafts) + 1;
  return {args.stages + b * chain_stage_stride(args), rows, params.plan.num_splits, params.plan.chunks_per_split,
          args.vocab_size, fault};
}

// Before any block of a split request counts: its words are this launch's,
// whatever they held (a launch that never ended, a stray write). The first
// block of the launch resets the arrival count, the failure flag and
// (kStaged) the stage records the request uses; the others wait for it, a
// running block (a wait that gives up fails the request).
template <bool kStaged, class Block>
SPECDEC_HOST_DEVICE void claim_request(const Block& block, const ChainVerifyParams& params, int64_t b,
                                       int32_t* arrivals) {
  const ChainVerifyArgs& args = params.args;
  int64_t* const claim = args.claims + b;
  if (block.claim(claim, args.stamp)) {
    block.reset(arrivals);
    block.reset(arrivals + kChainFailedAfterArrivals);
    if constexpr (kStaged) {
      clear_used_records(block, staged_records(params, b, WaitFault{}),
                         load_truncation_parameters(args.top_k, args.top_p, args.min_p, b, args.vocab_size));
    }
    block.claimed(claim, args.stamp);
  } else if (block.wait_for_claim(claim, args.stamp)) {
    block.raise(arrivals + kChainFailedAfterArrivals);
  }
}

// Whether the request's blocks claim its words (one block alone has nobody
// to count with). Derived where needed, not kept live: registers are at their cap.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool claims_request(const ChainVerifyArgs& args, int64_t num_splits) {
  return num_splits > 1 && args.claims != nullptr;
}

// The last arrival of a request: its count and its claim back to zero
// (nobody reads them any more).
template <class Block>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void release_request(const Block& block, const ChainVerifyArgs& args,
                                                             int64_t b, int32_t* arrivals, int64_t num_splits) {
  block.reset(arrivals);
  if (claims_request(args, num_splits)) block.reset(args.claims + b);
}

// One block: request b = role / num_splits, slice role % num_splits (the
// role is the block's linear id). kStaged: the staged plan's program
// (plan.staged), a kernel of its own: it has no walk, and the two together
// spilled at the 128-register cap (sm_90a). Only the staged program waits.
template <class Block, class Prob, class Token, bool kStaged>
SPECDEC_HOST_DEVICE void chain_verify_block(const Block& block, const ChainVerifyParams& params, int64_t role,
                                            TruncationHistogram* histogram) {
  const ChainVerifyArgs& args = params.args;
  const ChainVerifyPlan& plan = params.plan;
  const int64_t num_splits = plan.num_splits;
  int32_t* counters = args.counters;
  const bool give_up = kStaged && role == args.fault_role;  // not the role: registers are at their cap
  // 32-bit: the grid has fewer than 2**31 blocks (the launcher checks), and a
  // 64-bit division is a subroutine call whose saved registers spilled.
  const int64_t b = static_cast<int32_t>(role) / static_cast<int32_t>(num_splits);
  const int64_t split = role - b * num_splits;
  const int64_t chunk_lo = split * plan.chunks_per_split;
  const int64_t chunk_end = chunk_lo + plan.chunks_per_split;
  const int64_t chunk_hi = chunk_end < plan.num_chunks ? chunk_end : plan.num_chunks;
  const int64_t vocab_lo = chunk_lo * kChunkSize;
  const int64_t vocab_end = chunk_hi * kChunkSize;
  const int64_t vocab_hi = vocab_end < args.vocab_size ? vocab_end : args.vocab_size;
  const int64_t max_drafts = args.max_drafts;

  const RequestRows rows = request_rows(args, b);
  Request<Prob, Token> request;
  request.ids = static_cast<const Token*>(args.draft_token_ids) + rows.first_draft * args.ids_stride_b;
  request.ids_stride = args.ids_stride_k;
  request.target = static_cast<const Prob*>(args.target) + rows.first_target * args.target_stride_b;
  request.target_stride = args.target_stride_k;
  request.draft =
      args.draft == nullptr ? nullptr : static_cast<const Prob*>(args.draft) + rows.first_draft * args.draft_stride_b;
  request.draft_stride = args.draft_stride_k;
  const RequestTemperature temperature = request_temperature(args.temperature, b);
  request.greedy = temperature.greedy;
  request.temperature = temperature.temperature;
  const int64_t num_drafts = rows.num_drafts;
  request.num_drafts = num_drafts;
  request.vocab_size = args.vocab_size;
  request.truncation = load_truncation_parameters(args.top_k, args.top_p, args.min_p, b, args.vocab_size);
  // Greedy requests ignore the parameters (the argmax is always kept).
  request.truncating = !request.greedy && request.truncation.any();
  // An id outside [0, V) is no bonus (v1.3): with bonus rows the request samples its bonus row as without ids;
  // without them there is no row to fall back on, and its token there is -1.
  const int64_t bonus_id = args.bonus_token_ids.data != nullptr ? args.bonus_token_ids[b] : -1;
  request.has_bonus = args.bonus_token_ids.data != nullptr && (request.valid(bonus_id) || !args.bonus_rows);
  request.bonus_token = request.valid(bonus_id) ? bonus_id : -1;
  // Rows whose statistics the slices record: not the bonus row when the engine gives the bonus token.
  const int64_t last_recorded_row = request.has_bonus ? num_drafts - 1 : num_drafts;

  const ChunkSlots chunk_slots = {args.workspace + 3 * b * plan.num_chunks};
  const int64_t stats_words = chain_verify_stats_words(max_drafts);
  const StatSlots stat_slots = {
      reinterpret_cast<int32_t*>(args.workspace + chain_verify_chunk_words(args.batch_size, args.vocab_size)) +
          b * num_splits * stats_words,
      stats_words};
  int32_t* arrivals = counters + chain_arrivals_word(b);
  const int32_t arrivals_per_call = static_cast<int32_t>(num_splits);
  int32_t* output_row = args.output_token_ids + b * args.output_stride_b;
  if (claims_request(args, num_splits)) claim_request<kStaged>(block, params, b, arrivals);

  if (request.greedy) {
    if (!kStaged && num_splits == 1) {
      write_outputs(block, request, max_drafts, walk_greedy(block, request, args.logits), output_row,
                    args.num_accepted + b);
      return;
    }
    for (int64_t row = 0; row <= last_recorded_row; ++row) {
      const ArgBest best = slice_argmax(block, request.target_row(row), vocab_lo, vocab_hi);
      if (block.thread() == 0) {
        *stat_slots.field(split, row, kArgMaxValue) = float_as_word(best.value);
        *stat_slots.field(split, row, kArgMaxIndex) = best.index;
      }
    }
    if (!block.arrive_last(arrivals, arrivals_per_call, arrivals + kChainFailedAfterArrivals)) return;
    release_request(block, args, b, arrivals, num_splits);
    if (wrote_failure_outcome(block, args, b, arrivals, output_row)) return;  // a damaged arrival count
    write_outputs(block, request, max_drafts, finish_greedy(block, request, args.logits, stat_slots, num_splits),
                  output_row, args.num_accepted + b);
    return;
  }

  const RequestKey key = load_request_key(args.rng, b);
  Decision decision = {num_drafts, empty_stats(), no_truncation()};
  if constexpr (kStaged) {
    if (args.logits || request.truncating) {
      decision = staged_decision(block, request, key, args.logits, stat_slots,
                                 staged_records(params, b, chain_wait_fault(arrivals, give_up)), histogram,
                                 last_recorded_row + 1);
    } else {
      decision.stop = decide_probabilities(block, request, key);
    }
  } else if (args.logits || request.truncating) {
    decision = walk_rows(block, request, key, args.logits, histogram);  // one split (plan_chain_verify)
  } else {
    decision.stop = decide_probabilities(block, request, key);
  }
  const int64_t stop = decision.stop;
  const bool takes_bonus = stop == num_drafts && request.has_bonus;
  // After the rejection of a valid id the emitted token comes from the
  // residual; otherwise (bonus row, invalid id) from p.
  const int64_t stop_token = stop < num_drafts ? request.token(stop) : -1;
  const bool subtract = stop < num_drafts && request.valid(stop_token);
  // The residual subtracts the draft row if the token was drawn from it, else the point mass on the token.
  const bool from_draft =
      subtract && request.draft != nullptr && drawn_from_draft(to_float(request.draft_row(stop)[stop_token]));
  SampleRow<Prob> row;
  row.target = request.target_row(stop);
  row.draft = from_draft ? request.draft_row(stop) : nullptr;
  row.stop_token = subtract && !from_draft ? stop_token : -1;
  row.position = static_cast<uint32_t>(stop);
  row.logits = args.logits;
  row.temperature = request.temperature;
  row.target_stats = decision.stats;
  row.target_truncation = decision.truncation;
  if (subtract) {
    sample_slice<2>(block, row, key, args.vocab_size, chunk_lo, chunk_hi, chunk_slots);
  } else if (!takes_bonus) {
    sample_slice<1>(block, row, key, args.vocab_size, chunk_lo, chunk_hi, chunk_slots);
  }
  if (!block.arrive_last(arrivals, arrivals_per_call, arrivals + kChainFailedAfterArrivals)) return;
  release_request(block, args, b, arrivals, num_splits);
  if constexpr (kStaged) {
    // Every block read the records before arriving: the stages used go back
    // to zero. What was used is found again from the arguments rather than
    // kept live through the sample pass, where registers are at their cap.
    if (clear_used_records(block, staged_records(params, b, WaitFault{}),  // no more waits
                           load_truncation_parameters(args.top_k, args.top_p, args.min_p, b, args.vocab_size))) {
      block.raise(arrivals + kChainFailedAfterArrivals);
    }
  }
  // Every wait of the request is over: one that gave up, or a damaged arrival count, decides the outcome.
  if (wrote_failure_outcome(block, args, b, arrivals, output_row)) return;
  const int64_t token = takes_bonus ? request.bonus_token
                                    : finish_sampled(block, chunk_slots, plan.num_chunks, subtract, key, row.position);
  write_outputs(block, request, max_drafts, {stop, token}, output_row, args.num_accepted + b);
}

}  // namespace chain_verify_detail
}  // namespace specdec
