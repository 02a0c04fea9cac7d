// Tree attention on tensor cores: the block program for 16-bit inputs
// (bfloat16, float16) and head dims 64 and 128. Same grid, splits, key
// ranges, masking rules, partial states and merge as the SIMT program of
// tree_attention.cuh (whose helpers it uses); what differs is how a key tile
// is folded into the rows.
//
// Rows and tiles. Each warp owns 16 rows of the block's row tile (8 warps:
// 128 rows on the GPU, as the Triton kernel's largest tile, so the cache is
// streamed once per request and KV head when N * Hq / Hkv <= 128). A key
// tile is 32 keys. Q, K and V are kept in shared memory in their 16-bit
// dtype, rows padded by 16 bytes so that the 8 rows of each ldmatrix matrix
// hit 32 distinct banks.
//
// Pipeline. K and V have two buffers: while the warps fold tile t, the
// copies of tile t + 1 are in flight. The query tile's copies join tile 0's
// group, so Q waits on no round trip of its own. When Q and both caches
// have contiguous, 16-byte aligned heads (the common case: the launcher
// checks) every copy is a 16-byte cp.async; otherwise another
// instantiation copies element by element, with the same data in shared
// memory. Every thread locates the keys it copies itself, so locating needs
// no barrier of its own; two barriers a tile remain: one after the copies
// of tile t have landed, one before its buffer is refilled.
//
// Per key tile, each warp:
//   1. S = Q K^T on tensor cores (warp_mma.cuh's m16n8k16: D / 16 k-steps
//      by 4 key columns of 8), float32; per k-step one ldmatrix.x4 gives
//      Q's A fragment and two give K's B fragments (two key columns each);
//   2. masks S in registers (a key not stored, a dead row, an ancestor bit
//      not set: -inf; prefix keys read no mask bit, a tree tile one ancestor
//      word per row), takes the tile's row maxima over the 4 lanes that
//      share a fragment row, and turns S into P = 2^(S - max) (base 2: the
//      scale is premultiplied by log2 e). Each lane keeps a partial row sum;
//      the 4 are added at the end;
//   3. O = O * rescale + P V on tensor cores: the float32 fragments of S
//      are exactly the A fragments P needs once rounded to the input dtype
//      (as the Triton kernel's weights.to(v.dtype), and FlashAttention's),
//      so P never goes through shared memory; V's B fragments come two dim
//      columns per ldmatrix.x4.trans.
// The accumulators are D / 2 float32 registers per lane (64 at D = 128).
// ptxas (CUDA 13.0, sm_80 / sm_90a, 16-byte copies): 228 / 178 registers
// at D = 128 and 154 / 138 at D = 64 (the element-wise instantiation: 228 /
// 182 and 154 / 138; with the one-launch merge), no spills, no stack; one
// block of 8 warps per SM either way (70 KB of shared memory at D = 128, 37
// KB at D = 64). Static model (bench/sass_model.py, sm_90a, bf16, D = 128):
// 787 instructions a warp per 32-key tile, 64 of them HMMA (1326 before
// ldmatrix and the cp.async Q). Occupancy and tile sizes are not tuned:
// nothing has run on a GPU yet.
//
// Numerics: inputs and P are 16-bit, products exact, sums in float32; the
// tensor cores' summation order is theirs, so the GPU and the host twin
// agree within float32 rounding, not bit for bit. Tests hold both to the
// op's tolerance (twice the same-dtype PyTorch error against float64).
//
// On the host the same program runs with HostWarpBlock: one std::thread per
// warp holding its 32 lanes (warp_mma.cuh), two warps a block.
//
// This header includes no torch header.
#pragma once

#include <cstdint>
#include <cstring>

#include "specdec/async_copy.cuh"
#include "specdec/common.cuh"
#include "specdec/tree_attention.cuh"
#include "specdec/warp_mma.cuh"

namespace specdec {
namespace tree_attention_detail {

// Elements of a 16-byte copy (the program's dtypes are 16-bit).
constexpr int kSegment = 8;

// Head dims and dtypes the tensor-core program takes (the rest: SIMT).
template <class Value>
constexpr bool mma_supports(int head_dim) {
  return !std::is_same_v<Value, float> && (head_dim == 64 || head_dim == 128);
}

template <class Block, int kHeadDim>
struct MmaShape {
  static constexpr int kRows = Block::kWarps * 16;
  static constexpr int kKeys = 32;
  // Elements: 16 bytes of padding per row, so the 8 rows of an ldmatrix
  // matrix (16 bytes each, 16-byte aligned) start 4 banks apart and hit all 32.
  static constexpr int kStride = kHeadDim + 8;
  static constexpr int kCopiesPerHead = kHeadDim / kSegment;  // 16-byte copies of a Q, K or V row
  static constexpr int kDepthSteps = kHeadDim / 16;  // k-steps of Q K^T
  static constexpr int kKeyColumns = kKeys / 8;      // n-tiles of Q K^T
  static constexpr int kKeySteps = kKeys / 16;       // k-steps of P V
  static constexpr int kDimColumns = kHeadDim / 8;   // n-tiles of P V
};

// The block's shared memory, carved from one buffer: the query tile and two
// buffers of K, V and key flags (the tile being folded, the next arriving).
template <class Value>
struct MmaTiles {
  Value* q;        // [rows, stride]
  Value* kv;       // K of buffers 0 and 1, then V of buffers 0 and 1: [keys, stride] each
  int32_t* flags;  // [2, keys]: 1 where the key is stored
  int keys, stride;

  // Buffers by arithmetic, not arrays of pointers: an array indexed by the
  // runtime buffer number would live in local memory.
  SPECDEC_HOST_DEVICE Value* k(int buffer) const { return kv + buffer * keys * stride; }
  SPECDEC_HOST_DEVICE Value* v(int buffer) const { return kv + (2 + buffer) * keys * stride; }
  SPECDEC_HOST_DEVICE int32_t* stored(int buffer) const { return flags + buffer * keys; }

  SPECDEC_HOST_DEVICE static MmaTiles carve(void* memory, int rows, int keys, int stride) {
    Value* q = static_cast<Value*>(memory);
    Value* kv = q + rows * stride;
    return {q, kv, reinterpret_cast<int32_t*>(kv + 4 * keys * stride), keys, stride};
  }

  SPECDEC_HOST_DEVICE static int64_t bytes(int rows, int keys, int stride) {
    return static_cast<int64_t>(sizeof(Value)) * stride * (rows + 4 * keys) +
           2 * keys * static_cast<int64_t>(sizeof(int32_t));
  }
};

template <class Block, class Value, int kHeadDim>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t mma_shared_bytes() {
  using Shape = MmaShape<Block, kHeadDim>;
  return MmaTiles<Value>::bytes(Shape::kRows, Shape::kKeys, Shape::kStride);
}

// Elements [0, kSegment) of a head, from `source` (element stride `stride`)
// to 16-byte aligned shared memory at `destination`; zeros where !valid,
// with nothing read (`source` must still be a valid address then). One
// 16-byte asynchronous copy when kLoads16Bytes (the launcher checked unit
// strides and alignment), else element by element, complete at once.
template <bool kLoads16Bytes, class Value>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void copy_segment(Value* destination, const Value* source, int64_t stride,
                                                          bool valid) {
  static_assert(kSegment * sizeof(Value) == sizeof(Bytes16), "a segment is 16 bytes");
  if constexpr (kLoads16Bytes) {
    copy_16_bytes_async(destination, source, valid);
  } else {
    SPECDEC_UNROLL
    for (int e = 0; e < kSegment; ++e) destination[e] = valid ? source[e * stride] : Value{0};
  }
}

// The running softmax state of a warp's rows, per held lane: lane (g, t)
// holds rows g and g + 8 of the warp (half 0 and 1) and, of each, the
// output dims 8c + 2t, 8c + 2t + 1 of every dim column c.
template <class Block, int kHeadDim>
struct MmaRowStates {
  static constexpr int kHeld = Block::kHeldLanes;
  float acc[MmaShape<Block, kHeadDim>::kDimColumns][kHeld][4];
  float max[2][kHeld];  // the same in the 4 lanes of a quad
  float sum[2][kHeld];  // this lane's share of the row sum
  int64_t node[2][kHeld];  // the rows' tree nodes
  // Rows are node-major, so the warp's first row holds its smallest node:
  // a warp whose rows are all dead skips the work.
  bool warp_live;
};

// The fragment row (0..15) of half `half` of lane `lane`.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int fragment_row(int lane, int half) { return lane / 4 + 8 * half; }

// Issues the copies of the query tile, uncommitted: they join the first key
// tile's group, so Q costs no wait of its own. Rows past the tree are zeros.
// Thread i copies segment i % kCopiesPerHead of rows i / kCopiesPerHead +
// j * kRowStep; it finds the first row's (node, head) by one division and
// steps to the next by additions, so no copy waits on a division.
template <class Block, class Value, int kHeadDim, bool kLoads16Bytes>
SPECDEC_HOST_DEVICE void issue_query_tile(const Block& block, const TreeAttentionArgs& args,
                                          const MmaTiles<Value>& tiles, const RowTile& tile) {
  using Shape = MmaShape<Block, kHeadDim>;
  constexpr int kThreads = Block::kWarps * kMmaWarpSize;
  constexpr int kRowStep = kThreads / Shape::kCopiesPerHead;
  static_assert(kRowStep * Shape::kCopiesPerHead == kThreads && Shape::kRows % kRowStep == 0,
                "whole rows per step, whole steps per tile");
  const Value* q = static_cast<const Value*>(args.q.data);
  // kRowStep rows are node_step whole nodes and head_step more query heads
  // (32-bit: a group wider than kRowStep steps by heads only).
  const int node_step = tile.group > kRowStep ? 0 : kRowStep / static_cast<int>(tile.group);
  const int64_t head_step = kRowStep - node_step * tile.group;
  for (int h = 0; h < Block::kHeldLanes; ++h) {
    const int thread = block.thread(h);
    const int first_dim = thread % Shape::kCopiesPerHead * kSegment;
    const int first_row = thread / Shape::kCopiesPerHead;
    int64_t node = tile.node(first_row);
    int64_t head = tile.first_row + first_row - node * tile.group;  // within the group
    SPECDEC_UNROLL
    for (int step = 0; step < Shape::kRows / kRowStep; ++step) {
      const bool in_tree = node < args.max_nodes;
      const Value* source = q + tile.request * args.q.stride[0] + node * args.q.stride[1] +
                            (tile.kv_head * tile.group + head) * args.q.stride[2] + first_dim * args.q.stride[3];
      copy_segment<kLoads16Bytes>(tiles.q + (first_row + step * kRowStep) * Shape::kStride + first_dim,
                                  in_tree ? source : q, args.q.stride[3], in_tree);
      node += node_step;
      head += head_step;
      if (head >= tile.group) {
        head -= tile.group;
        ++node;
      }
    }
  }
}

// Issues the copies of key tile `t` into `buffer` (16 bytes each when
// kLoads16Bytes), then commits each thread's copies as one group. Every
// thread locates the keys it copies itself (the block table is read once
// per segment, from cache), so no barrier separates locating from copying.
template <class Block, class Value, int kHeadDim, bool kLoads16Bytes>
SPECDEC_HOST_DEVICE void issue_key_tile(const Block& block, const TreeAttentionArgs& args,
                                        const MmaTiles<Value>& tiles, int buffer, const RowTile& tile,
                                        const KeyTiles& key_tiles, int64_t t) {
  using Shape = MmaShape<Block, kHeadDim>;
  constexpr int kThreads = Block::kWarps * kMmaWarpSize;
  constexpr int kCopies = Shape::kKeys * Shape::kCopiesPerHead;
  static_assert(kCopies % kThreads == 0, "whole copies per thread: no loop exit to test");
  int64_t first_position, remaining;
  key_tiles.get(t, &first_position, &remaining);
  Value* keys = tiles.k(buffer);
  Value* values = tiles.v(buffer);
  int32_t* stored = tiles.stored(buffer);
  for (int h = 0; h < Block::kHeldLanes; ++h) {
    SPECDEC_UNROLL
    for (int i = 0; i < kCopies / kThreads; ++i) {
      const int copy = block.thread(h) + i * kThreads;
      const int key = copy / Shape::kCopiesPerHead;
      const int first_dim = (copy - key * Shape::kCopiesPerHead) * kSegment;
      int64_t block_id, slot;
      locate_key(args, tile.request, first_position, remaining, key, &block_id, &slot);
      const bool found = block_id >= 0;
      copy_segment<kLoads16Bytes>(
          keys + key * Shape::kStride + first_dim,
          found ? cache_element<Value>(args.k_cache, block_id, slot, tile.kv_head, first_dim)
                : static_cast<const Value*>(args.k_cache.data),
          args.k_cache.stride[3], found);
      copy_segment<kLoads16Bytes>(
          values + key * Shape::kStride + first_dim,
          found ? cache_element<Value>(args.v_cache, block_id, slot, tile.kv_head, first_dim)
                : static_cast<const Value*>(args.v_cache.data),
          args.v_cache.stride[3], found);
      if (first_dim == 0) stored[key] = found ? 1 : 0;
    }
  }
  async_copy_commit();
}

// Folds the key tile in `buffer` into the warp's rows; `tree_start` >= 0
// marks the tree block (key n is node tree_start + n).
template <class Block, class Value, int kHeadDim>
SPECDEC_HOST_DEVICE void fold_key_tile_mma(const Block& block, const TreeAttentionArgs& args,
                                           const MmaTiles<Value>& tiles, int buffer, const RowTile& tile,
                                           int64_t tree_start, MmaRowStates<Block, kHeadDim>& state) {
  using Shape = MmaShape<Block, kHeadDim>;
  constexpr int kHeld = Block::kHeldLanes;
  const int warp_row = block.warp() * 16;
  if (!state.warp_live) return;  // no block barrier below
  const Value* keys = tiles.k(buffer);
  const Value* values = tiles.v(buffer);

  // 1. S = Q K^T.
  float scores[Shape::kKeyColumns][kHeld][4];
  SPECDEC_UNROLL
  for (int c = 0; c < Shape::kKeyColumns; ++c) {
    for (int h = 0; h < kHeld; ++h) {
      SPECDEC_UNROLL
      for (int i = 0; i < 4; ++i) scores[c][h][i] = 0.0f;
    }
  }
  // ldmatrix addresses: lane 8i + r gives row r of matrix i (warp_mma.cuh).
  // Q's A fragment: matrices (rows 0-7, 8-15) x (dims 0-7, 8-15) of the
  // warp's 16 rows and the step's 16 dims. K, stored key-major, gives the B
  // fragments of key columns 2p and 2p + 1 in one load: matrices (dims 0-7,
  // 8-15) x (keys 0-7, 8-15) of the pair's 16 keys.
  const Value* queries = tiles.q + warp_row * Shape::kStride;
  SPECDEC_UNROLL
  for (int step = 0; step < Shape::kDepthSteps; ++step) {
    uint32_t a[kHeld][4];
    warp_load_matrices<false>(
        block,
        [&](int lane) { return queries + (lane % 8 + lane / 8 % 2 * 8) * Shape::kStride + step * 16 + lane / 16 * 8; },
        a);
    SPECDEC_UNROLL
    for (int pair = 0; pair < Shape::kKeyColumns / 2; ++pair) {
      uint32_t loaded[kHeld][4];
      warp_load_matrices<false>(
          block,
          [&](int lane) {
            return keys + (pair * 16 + lane / 16 * 8 + lane % 8) * Shape::kStride + step * 16 + lane / 8 % 2 * 8;
          },
          loaded);
      SPECDEC_UNROLL
      for (int n = 0; n < 2; ++n) {
        uint32_t b[kHeld][2];
        b_fragment_of(loaded, n, b);
        warp_mma<Block, Value>(block, scores[2 * pair + n], a, b);
      }
    }
  }

  // 2. Mask, tile maxima, P = 2^(S - max), rescale. Lane (g, t) holds keys
  // 8c + 2t + e of rows g and g + 8.
  float tile_max[2][kHeld];
  for (int h = 0; h < kHeld; ++h) {
    const int lane = block.held_lane(h);
    bool stored[Shape::kKeyColumns][2];
    SPECDEC_UNROLL
    for (int c = 0; c < Shape::kKeyColumns; ++c) {
      SPECDEC_UNROLL
      for (int e = 0; e < 2; ++e) stored[c][e] = tiles.stored(buffer)[8 * c + 2 * (lane % 4) + e] != 0;
    }
    SPECDEC_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int64_t node = state.node[half][h];
      const bool live = node < tile.live_nodes;
      // Tree tiles start at multiples of 32 nodes: one ancestor word covers
      // the tile. Prefix tiles read no mask bit.
      const uint32_t ancestors =
          tree_start >= 0 && live ? ancestor_word(args, tile.request, node, tree_start) : 0xFFFFFFFFu;
      float row_max = negative_infinity();
      SPECDEC_UNROLL
      for (int c = 0; c < Shape::kKeyColumns; ++c) {
        SPECDEC_UNROLL
        for (int e = 0; e < 2; ++e) {
          const int key = 8 * c + 2 * (lane % 4) + e;
          const bool visible = live && stored[c][e] && ((ancestors >> key) & 1u) != 0;
          float& score = scores[c][h][2 * half + e];
          score = visible ? score * args.scale_log2 : negative_infinity();
          row_max = score > row_max ? score : row_max;
        }
      }
      tile_max[half][h] = row_max;
    }
  }
  SPECDEC_UNROLL
  for (int half = 0; half < 2; ++half) quad_all_reduce(block, tile_max[half], MaxFloat());
  for (int h = 0; h < kHeld; ++h) {
    SPECDEC_UNROLL
    for (int half = 0; half < 2; ++half) {
      const float old_max = state.max[half][h];
      const float new_max = old_max > tile_max[half][h] ? old_max : tile_max[half][h];
      // A row that has seen nothing keeps max = -inf; its exponentials are
      // taken against 0, so they are 0, not NaN.
      const float safe_max = new_max == negative_infinity() ? 0.0f : new_max;
      const float rescale = exp2_f32(old_max - safe_max);
      float row_sum = state.sum[half][h] * rescale;
      SPECDEC_UNROLL
      for (int c = 0; c < Shape::kKeyColumns; ++c) {
        SPECDEC_UNROLL
        for (int e = 0; e < 2; ++e) {
          float& weight = scores[c][h][2 * half + e];
          weight = exp2_f32(weight - safe_max);  // -inf (invisible) gives 0
          row_sum += weight;
        }
      }
      state.sum[half][h] = row_sum;
      state.max[half][h] = new_max;
      SPECDEC_UNROLL
      for (int c = 0; c < Shape::kDimColumns; ++c) {
        state.acc[c][h][2 * half] *= rescale;
        state.acc[c][h][2 * half + 1] *= rescale;
      }
    }
  }

  // 3. O += P V: S's fragments for keys 16s..16s+15 are P's A fragment.
  SPECDEC_UNROLL
  for (int step = 0; step < Shape::kKeySteps; ++step) {
    uint32_t a[kHeld][4];
    for (int h = 0; h < kHeld; ++h) {
      const float(&low)[4] = scores[2 * step][h];
      const float(&high)[4] = scores[2 * step + 1][h];
      a[h][0] = pack_pair(from_float<Value>(low[0]), from_float<Value>(low[1]));
      a[h][1] = pack_pair(from_float<Value>(low[2]), from_float<Value>(low[3]));
      a[h][2] = pack_pair(from_float<Value>(high[0]), from_float<Value>(high[1]));
      a[h][3] = pack_pair(from_float<Value>(high[2]), from_float<Value>(high[3]));
    }
    // V, stored key-major, is B with k along its rows: one transposing load
    // gives dim columns 2p and 2p + 1, matrices (keys 0-7, 8-15) x (dims
    // 0-7, 8-15) of the step's 16 keys and the pair's 16 dims.
    SPECDEC_UNROLL
    for (int pair = 0; pair < Shape::kDimColumns / 2; ++pair) {
      uint32_t loaded[kHeld][4];
      warp_load_matrices<true>(
          block,
          [&](int lane) {
            return values + (step * 16 + lane / 8 % 2 * 8 + lane % 8) * Shape::kStride + pair * 16 + lane / 16 * 8;
          },
          loaded);
      SPECDEC_UNROLL
      for (int n = 0; n < 2; ++n) {
        uint32_t b[kHeld][2];
        b_fragment_of(loaded, n, b);
        warp_mma<Block, Value>(block, state.acc[2 * pair + n], a, b);
      }
    }
  }
}

// kLoads16Bytes: Q and both caches have unit-stride heads on 16-byte
// boundaries (the launcher checks), so every copy is a 16-byte cp.async;
// otherwise every copy is element by element. Two instantiations rather than
// a branch per copy: the fast one holds no element-wise load at all.
template <class Block, class Value, int kHeadDim, bool kLoads16Bytes>
SPECDEC_HOST_DEVICE void tree_attention_mma_block(const Block& block, const TreeAttentionArgs& args,
                                                  void* shared_memory, int64_t program, int64_t split) {
  using Shape = MmaShape<Block, kHeadDim>;
  constexpr int kHeld = Block::kHeldLanes;
  constexpr int kThreads = Block::kWarps * kMmaWarpSize;
  const MmaTiles<Value> tiles = MmaTiles<Value>::carve(shared_memory, Shape::kRows, Shape::kKeys, Shape::kStride);
  const RowTile tile = row_tile_of(args, program, Shape::kRows);
  const int warp_row = block.warp() * 16;

  MmaRowStates<Block, kHeadDim> state;
  state.warp_live = tile.node(warp_row) < tile.live_nodes;
  for (int h = 0; h < kHeld; ++h) {
    SPECDEC_UNROLL
    for (int half = 0; half < 2; ++half) {
      state.max[half][h] = negative_infinity();
      state.sum[half][h] = 0.0f;
      state.node[half][h] = tile.node(warp_row + fragment_row(block.held_lane(h), half));
    }
    SPECDEC_UNROLL
    for (int c = 0; c < Shape::kDimColumns; ++c) {
      SPECDEC_UNROLL
      for (int i = 0; i < 4; ++i) state.acc[c][h][i] = 0.0f;
    }
  }

  // Software pipeline over the key tiles: tile t + 1 is in flight while
  // tile t is folded, in the other buffer.
  // The query tile travels in the first key tile's group.
  const KeyTiles key_tiles(args, tile, prefix_slice(args, tile, split, Shape::kKeys), split, Shape::kKeys);
  if (key_tiles.count > 0) {
    issue_query_tile<Block, Value, kHeadDim, kLoads16Bytes>(block, args, tiles, tile);
    issue_key_tile<Block, Value, kHeadDim, kLoads16Bytes>(block, args, tiles, 0, tile, key_tiles, 0);
  }
  for (int64_t t = 0; t < key_tiles.count; ++t) {
    const int buffer = static_cast<int>(t & 1);
    if (t + 1 < key_tiles.count) {
      issue_key_tile<Block, Value, kHeadDim, kLoads16Bytes>(block, args, tiles, buffer ^ 1, tile, key_tiles, t + 1);
      async_copy_wait<1>();  // this thread's copies of tile t are done
    } else {
      async_copy_wait<0>();
    }
    block.sync();  // every thread's copies of tile t (and, at t = 0, the query tile) are visible
    fold_key_tile_mma<Block, Value, kHeadDim>(block, args, tiles, buffer, tile, key_tiles.tree_start(t), state);
    block.sync();  // every warp is done with `buffer` before tile t + 2 refills it
  }

  // Outputs, as the SIMT program: rows past the tree are not written,
  // padding rows are zero (acc = sum = 0).
  SPECDEC_UNROLL
  for (int half = 0; half < 2; ++half) quad_all_reduce(block, state.sum[half], AddFloat());
  for (int h = 0; h < kHeld; ++h) {
    const int lane = block.held_lane(h);
    SPECDEC_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row + fragment_row(lane, half);
      if (state.node[half][h] >= args.max_nodes) continue;
      const int64_t out_row = tile.output_row(row, args.max_nodes, args.num_q_heads);
      const float row_sum = state.sum[half][h];
      const int first_dim = 2 * (lane % 4);
      if (args.num_splits == 1) {
        Value* out = static_cast<Value*>(args.out) + out_row * kHeadDim + first_dim;
        const bool seen = row_sum > 0.0f;
        SPECDEC_UNROLL
        for (int c = 0; c < Shape::kDimColumns; ++c) {
          SPECDEC_UNROLL
          for (int e = 0; e < 2; ++e) {
            out[8 * c + e] = from_float<Value>(seen ? fdiv_rn(state.acc[c][h][2 * half + e], row_sum) : 0.0f);
          }
        }
      } else {
        const int64_t partial = out_row * args.num_splits + split;
        float* acc = args.partial_acc + partial * kHeadDim + first_dim;
        SPECDEC_UNROLL
        for (int c = 0; c < Shape::kDimColumns; ++c) {
          acc[8 * c] = state.acc[c][h][2 * half];
          acc[8 * c + 1] = state.acc[c][h][2 * half + 1];
        }
        if (lane % 4 == 0) {
          args.partial_max[partial] = state.max[half][h];
          args.partial_sum[partial] = row_sum;
        }
      }
    }
  }
  if (merges_here(block, args, tile, Shape::kRows, block.thread(0) == 0)) {
    for (int h = 0; h < kHeld; ++h) merge_tile<Value>(args, tile, Shape::kRows, block.thread(h), kThreads);
  }
}

#if defined(__CUDACC__)
template <class Value, int kHeadDim, bool kLoads16Bytes>
__global__ void __launch_bounds__(DeviceWarpBlock::kWarps * kMmaWarpSize, 1)
    tree_attention_mma_kernel(const TreeAttentionArgs args) {
  extern __shared__ __align__(16) unsigned char tree_attention_mma_tiles[];
  const DeviceWarpBlock block;
  tree_attention_mma_block<DeviceWarpBlock, Value, kHeadDim, kLoads16Bytes>(block, args, tree_attention_mma_tiles,
                                                             static_cast<int64_t>(blockIdx.x),
                                                             static_cast<int64_t>(blockIdx.y));
}
#endif  // __CUDACC__

}  // namespace tree_attention_detail
}  // namespace specdec
