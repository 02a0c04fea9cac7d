// Whole-row work of one block, shared by the verification kernels: the
// argmax and softmax statistics of a slice of a row, and the fixed-point
// sample of a row (each chunk's total and candidate, then the 128-bit chunk
// choice; sampling.cuh holds the sampler's definition). Every function is a
// block collective written against the Block interface (block.cuh), so the
// host emulation runs the same code.
#pragma once

#include <cstdint>
#include <cstring>

#include "specdec/block.cuh"
#include "specdec/common.cuh"
#include "specdec/rng.cuh"
#include "specdec/sampling.cuh"
#include "specdec/truncation.cuh"

namespace specdec {

constexpr int kElementsPerStep = 4;  // elements per thread per strided step of the row scans

// Per-chunk results of one row, [num_chunks, 3] int64: per chunk the
// totals of ways 0 and 1, then the two candidates as int32.
struct ChunkSlots {
  int64_t* base;

  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t* total(int64_t chunk, int way) const {
    return base + 3 * chunk + way;
  }
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int32_t* candidate(int64_t chunk, int way) const {
    return reinterpret_cast<int32_t*>(base + 3 * chunk + 2) + way;
  }
};

// Argmax of values[lo, hi), block-reduced (every thread gets it). Threads
// read kElementsPerStep elements a step, coalesced.
template <class Block, class Prob>
SPECDEC_HOST_DEVICE ArgBest slice_argmax(const Block& block, const Prob* values, int64_t lo, int64_t hi) {
  const int64_t stride = block.num_threads();
  ArgBest best = empty_argmax();
  for (int64_t base = lo + block.thread(); base < hi; base += kElementsPerStep * stride) {
    float x[kElementsPerStep];
    SPECDEC_UNROLL
    for (int j = 0; j < kElementsPerStep; ++j) {
      const int64_t index = base + j * stride;
      x[j] = index < hi ? to_float(values[index]) : 0.0f;
    }
    SPECDEC_UNROLL
    for (int j = 0; j < kElementsPerStep; ++j) {
      const int64_t index = base + j * stride;
      if (index < hi) best = MaxValue()(best, argmax_candidate(x[j], index));
    }
  }
  return block.block_all_reduce(best, MaxValue());
}

// Softmax statistics of target[lo, hi), block-reduced. Draft rows need
// none: `logits` covers the target only, a draft is always probabilities
// (contract v1.3).
template <class Block, class Prob>
SPECDEC_HOST_DEVICE SoftmaxStats slice_stats(const Block& block, const Prob* target, int64_t lo, int64_t hi,
                                             float temperature) {
  const int64_t stride = block.num_threads();
  SoftmaxStats stats = empty_stats();
  for (int64_t base = lo + block.thread(); base < hi; base += kElementsPerStep * stride) {
    float x[kElementsPerStep];
    SPECDEC_UNROLL
    for (int j = 0; j < kElementsPerStep; ++j) {
      const int64_t index = base + j * stride;
      x[j] = index < hi ? to_float(target[index]) : 0.0f;
    }
    SPECDEC_UNROLL
    for (int j = 0; j < kElementsPerStep; ++j) {
      if (base + j * stride < hi) add_to_stats(stats, x[j], temperature);
    }
  }
  return block.block_all_reduce(stats, MergeStats{temperature});
}

// Whether values[first, first + kPerThread) can be one vector load of its
// kPerThread * sizeof(Prob) bytes: whole (inside the vocabulary) and aligned,
// which it is for every full chunk of a row whose start is aligned (first is
// a multiple of kPerThread).
template <int kPerThread, class Prob>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool vector_loadable(const Prob* values, int64_t first, int64_t vocab_size) {
  return first + kPerThread <= vocab_size &&
         reinterpret_cast<uintptr_t>(values + first) % (sizeof(Prob) * kPerThread) == 0;
}

// values[first, first + kPerThread) as floats, 0 past the vocabulary. On the
// GPU one vector load (16 bytes of fp32, 8 of bf16/fp16) where
// vector_loadable.
template <int kPerThread, class Prob>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void load_span(const Prob* values, int64_t first, int64_t vocab_size,
                                                       float (&out)[kPerThread]) {
#if defined(__CUDA_ARCH__)
  constexpr int kBytes = static_cast<int>(sizeof(Prob)) * kPerThread;
  struct alignas(kBytes) Span {
    Prob value[kPerThread];
  };
  if (vector_loadable<kPerThread>(values, first, vocab_size)) {
    const Span span = *reinterpret_cast<const Span*>(values + first);
    SPECDEC_UNROLL
    for (int j = 0; j < kPerThread; ++j) out[j] = to_float(span.value[j]);
    return;
  }
#endif
  SPECDEC_UNROLL
  for (int j = 0; j < kPerThread; ++j) out[j] = first + j < vocab_size ? to_float(values[first + j]) : 0.0f;
}

// kPerThread values of a row as stored, in whole 32-bit words: what
// sample_slice keeps in registers from a chunk's load, issued a chunk ahead,
// to its weighing. Nothing reads them before: an instruction that reads a
// load's register waits there for the load, and unpacking bf16/fp16 values
// as they arrived made the chunk-ahead loads wait where they were issued.
template <class Prob, int kPerThread>
struct StoredSpan {
  static_assert(sizeof(Prob) * kPerThread % 4 == 0, "a span of whole 32-bit words");
  uint32_t words[sizeof(Prob) * kPerThread / 4];

  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float at(int j) const {
    Prob value;
    memcpy(&value, reinterpret_cast<const unsigned char*>(words) + j * sizeof(Prob), sizeof(Prob));
    return to_float(value);
  }
};

// values[first, first + kPerThread) as stored, zero past the vocabulary: one
// vector load on the GPU where load_span makes one.
template <int kPerThread, class Prob>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void load_stored_span(const Prob* values, int64_t first, int64_t vocab_size,
                                                              StoredSpan<Prob, kPerThread>& out) {
#if defined(__CUDA_ARCH__)
  constexpr int kBytes = static_cast<int>(sizeof(out.words));
  struct alignas(kBytes) Words {
    uint32_t word[kBytes / 4];
  };
  if (vector_loadable<kPerThread>(values, first, vocab_size)) {
    const Words loaded = *reinterpret_cast<const Words*>(values + first);
    SPECDEC_UNROLL
    for (int i = 0; i < kBytes / 4; ++i) out.words[i] = loaded.word[i];
    return;
  }
#endif
  Prob scalar[kPerThread];
  SPECDEC_UNROLL
  for (int j = 0; j < kPerThread; ++j) scalar[j] = first + j < vocab_size ? values[first + j] : Prob{};
  memcpy(out.words, scalar, sizeof(scalar));
}

// kPerThread values already floats (a row type that converts as it loads).
template <int kPerThread>
struct FloatSpan {
  float values[kPerThread];

  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float at(int j) const { return values[j]; }
};

// An input row's probabilities [first, first + kPerThread), 0 past the
// vocabulary: the values themselves, or softmax(x / T) from the row's
// statistics with logits.
template <int kPerThread, class Prob>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void load_probability_span(const Prob* values, int64_t first,
                                                                   int64_t vocab_size, bool logits,
                                                                   const SoftmaxStats& stats, float temperature,
                                                                   float (&out)[kPerThread]) {
  load_span(values, first, vocab_size, out);
  if (!logits) return;
  SPECDEC_UNROLL
  for (int j = 0; j < kPerThread; ++j) out[j] = first + j < vocab_size ? softmax_prob(out[j], stats, temperature) : 0.0f;
}

// The row a target samples from: `target`, minus the `draft` row (or the
// one-hot of `stop_token`) after the rejection of a valid id (chain_verify's
// stop row; tree_verify samples its current row with kWays == 1 through a
// row type of its own).
//
// sample_slice reads a row through two calls per span of kPerThread entries,
// which any row type provides: `load` fetches the values into its
// `Stored<kPerThread>` (issued a chunk ahead of their use) and `weigh` turns
// them into the kWays weight vectors.
template <class Prob>
struct SampleRow {
  template <int kPerThread>
  using Stored = StoredSpan<Prob, kPerThread>;

  const Prob* target;
  const Prob* draft;   // the rejected token's draft row, or nullptr (a deterministic proposal, or nothing to subtract)
  int64_t stop_token;  // the rejected id of a deterministic proposal (subtract its point mass), else -1
  uint32_t position;   // the RNG position (chain: `stop`; tree: the current node)
  bool logits;
  float temperature;
  SoftmaxStats target_stats;  // logits only (the draft is always probabilities)
  Truncation target_truncation;            // of the target row (top-k/top-p/min-p), off when zeroed

  template <int kWays, int kPerThread>
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void load(int64_t first, int64_t vocab_size, Stored<kPerThread>& p,
                                                    Stored<kPerThread>& q) const {
    load_stored_span(target, first, vocab_size, p);
    if (kWays == 2 && draft != nullptr) load_stored_span(draft, first, vocab_size, q);
  }

  template <int kWays, int kPerThread>
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void weigh(int64_t first, int64_t vocab_size, const Stored<kPerThread>& p,
                                                     const Stored<kPerThread>& q,
                                                     uint64_t (&weights)[kWays][kPerThread]) const {
    SPECDEC_UNROLL
    for (int j = 0; j < kPerThread; ++j) {
      const bool inside = first + j < vocab_size;
      float target_prob = p.at(j);
      if (logits) target_prob = inside ? softmax_prob(target_prob, target_stats, temperature) : 0.0f;
      target_prob = truncated_probability(target_prob, target_truncation);
      if (kWays == 2) {
        float draft_prob = q.at(j);
        if (draft == nullptr) draft_prob = first + j == stop_token ? 1.0f : 0.0f;
        // fixed_point_weight maps p - q <= 0 (and NaN) to 0: max(0, p - q).
        weights[0][j] = fixed_point_weight(fsub_rn(target_prob, draft_prob));
        weights[kWays - 1][j] = fixed_point_weight(target_prob);
      } else {
        weights[0][j] = fixed_point_weight(target_prob);
      }
    }
  }
};

// Samples chunks [chunk_lo, chunk_hi) of the row (sampling.cuh): writes each
// chunk's totals and candidates. kWays == 2 after a rejection: way 0 the
// residual, way 1 p (the fallback); kWays == 1: way 0 is p. `Row` is
// SampleRow or another type with its position, load and weigh.
template <int kWays, class Block, class Row>
SPECDEC_HOST_DEVICE void sample_slice(const Block& block, const Row& row, const RequestKey& key,
                                      int64_t vocab_size, int64_t chunk_lo, int64_t chunk_hi,
                                      const ChunkSlots& slots) {
  constexpr int kPerThread = static_cast<int>(kChunkSize) / Block::kThreads;
  uint64_t* draws = block.draws();
  for (int64_t group = chunk_lo; group < chunk_hi; group += block.num_threads()) {
    // One Philox call per chunk, spread over the threads, ahead of the loop.
    if (group + block.thread() < chunk_hi) draws[block.thread()] = chunk_draw(key, row.position, group + block.thread());
    block.sync();
    const int64_t group_end = group + block.num_threads() < chunk_hi ? group + block.num_threads() : chunk_hi;
    // The next chunk's span is loaded before this chunk's scan and its
    // barriers, so two loads per thread are in flight instead of one.
    const int64_t thread_offset = static_cast<int64_t>(block.thread()) * kPerThread;
    using Stored = typename Row::template Stored<kPerThread>;
    Stored next_p;
    Stored next_q{};
    row.template load<kWays>(group * kChunkSize + thread_offset, vocab_size, next_p, next_q);
    for (int64_t chunk = group; chunk < group_end; ++chunk) {
      const int64_t first = chunk * kChunkSize + thread_offset;
      const Stored p = next_p;
      const Stored q = next_q;
      if (chunk + 1 < group_end) row.template load<kWays>(first + kChunkSize, vocab_size, next_p, next_q);
      uint64_t weights[kWays][kPerThread];
      row.template weigh<kWays>(first, vocab_size, p, q, weights);
      uint64_t totals[kWays];
      int32_t offsets[kWays];
      const uint32_t crossings = pick_in_chunk(block, weights, draws[chunk - group], totals, offsets);
      SPECDEC_UNROLL
      for (int way = 0; way < kWays; ++way) {
        if (block.thread() == 0) *slots.total(chunk, way) = static_cast<int64_t>(totals[way]);
        if ((crossings >> way) & 1u) *slots.candidate(chunk, way) = static_cast<int32_t>(chunk * kChunkSize + offsets[way]);
      }
    }
    block.sync();  // the draws are read up to here
  }
}

struct TotalPair {
  Words128 way0, way1;
};

struct AddTotalPair {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE TotalPair operator()(TotalPair a, TotalPair b) const {
    return {AddWords128()(a.way0, b.way0), AddWords128()(a.way1, b.way1)};
  }
};

// The chunk choice once every chunk of the row is sampled (by this block or,
// released, by others): the residual's row total (and p's, after a
// rejection), the fallback to p when the residual has no mass, then the
// chunk by its prefix and that chunk's candidate; -1 without mass.
template <class Block>
SPECDEC_HOST_DEVICE int64_t finish_sampled(const Block& block, const ChunkSlots& slots, int64_t num_chunks,
                                           bool subtract, const RequestKey& key, uint32_t position) {
  uint128_t way0 = 0;
  uint128_t way1 = 0;
  for (int64_t chunk = block.thread(); chunk < num_chunks; chunk += block.num_threads()) {
    way0 += static_cast<uint64_t>(block.load_published(slots.total(chunk, 0)));
    if (subtract) way1 += static_cast<uint64_t>(block.load_published(slots.total(chunk, 1)));
  }
  const TotalPair totals = block.block_all_reduce(TotalPair{split128(way0), split128(way1)}, AddTotalPair());
  const int way = subtract && join128(totals.way0) == 0 ? 1 : 0;
  const uint128_t total = join128(way == 0 ? totals.way0 : totals.way1);
  if (total == 0) return -1;
  const int64_t chunk =
      choose_chunk(block, num_chunks, total, choice_draw(key, position),
                   [&](int64_t c) { return static_cast<uint64_t>(block.load_published(slots.total(c, way))); });
  // chunk >= 0 whenever the totals read are the ones released (exact sums);
  // the check keeps a broken invariant from reading before the workspace.
  return chunk < 0 ? -1 : block.load_published(slots.candidate(chunk, way));
}

}  // namespace specdec
