// chain_verify, the per-slice pass: what one block computes from its own
// slice of the vocabulary (argmaxes, softmax statistics, the chunk samples of
// the stop row) and the acceptance tests with probabilities. Design and
// workspace layout: chain_verify.cuh. Included by chain_verify_finish.cuh.
#pragma once

#include <cstdint>

#include "specdec/block.cuh"
#include "specdec/block_rows.cuh"
#include "specdec/common.cuh"
#include "specdec/rng.cuh"
#include "specdec/sampling.cuh"

namespace specdec {
namespace chain_verify_detail {

// Statistics fields of one row in a (request, split) slot.
constexpr int64_t kArgMaxValue = 0;  // greedy: float max of the slice
constexpr int64_t kArgMaxIndex = 1;  // greedy: its index
constexpr int64_t kTargetMax = 0;    // logits: target statistics
constexpr int64_t kTargetSum = 1;
constexpr int64_t kStatFields = 2;  // per row (the draft, always probabilities, needs none: v1.3)

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
  int64_t vocab_size;
  TruncationParameters truncation;  // top_k/top_p/min_p of this request
  bool truncating;                  // sampled with a parameter on: every target row it reads is truncated
  bool has_bonus;                   // bonus_token_ids given: emitted when all n drafts are accepted
  int64_t bonus_token;

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

// Statistics of one request: [num_splits, K + 1, kStatFields] int32.
struct StatSlots {
  int32_t* base;
  int64_t slot_words;

  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int32_t* field(int64_t split, int64_t row, int64_t field) const {
    return base + split * slot_words + kStatFields * row + field;
  }
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float word_as_float(int32_t word) {
  return bits_as_float(static_cast<uint32_t>(word));
}
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int32_t float_as_word(float value) {
  return static_cast<int32_t>(float_as_bits(value));
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
    const float draft_prob = request.draft == nullptr || !valid
                                 ? 1.0f
                                 : proposal_probability(to_float(request.draft_row(position)[token_id]));
    const float uniform =
        uniform_from_word(random_words(key, kAcceptStream, static_cast<uint32_t>(position), 0u).w0);
    if (!(valid && accept(uniform, draft_prob, target_prob))) stop = MinInt64()(stop, position);
  }
  return block.block_all_reduce(stop, MinInt64());
}

}  // namespace chain_verify_detail
}  // namespace specdec
