// Attention of draft-tree queries over a paged KV cache (sk.tree_attention),
// the CUDA twin of kernels/tree_attention.py; specdec_kernels/reference/
// tree_attention.py is the definition of correct.
//
// Design
// ------
// Two block programs share this file's grid, key ranges, masking rules,
// partial states and merge: 16-bit inputs at D = 64 and 128 run the
// tensor-core program of tree_attention_mma.cuh (on GPUs of compute
// capability 8.0 and later); float32 inputs, D = 256 and older GPUs run the
// SIMT program below, on CUDA cores. Neither has been timed against the
// Triton kernel yet, so backend="auto" keeps choosing Triton.
//
// The SIMT program:
//
// Grid: (B * Hkv * row_tiles, num_splits) blocks. Block (program, split)
// owns one request, one KV head, one row tile and one slice of the prefix.
// As in the Triton kernel, the rows of a tile are (node, query head) pairs
// of the query heads sharing the KV head, node-major: row r is node
// r / group, query head kv_head * group + r % group. Every K/V tile a block
// loads serves all its rows, so when N * group fits one row tile (128 rows
// at D = 64, 64 at D = 128, 32 at D = 256) the cache is read once per
// request and KV head.
//
// Per key tile (one key per lane, warp-size keys), four phases between
// block barriers, with the tiles in shared memory as float32:
//   1. the first warp-size threads locate their key: block id and slot
//      through the block table, or "not stored" (-1);
//   2. the block loads K and V of the tile (zeros where not stored, so an
//      invisible key contributes exactly 0, never NaN), 16 bytes a load when
//      the caches' heads are contiguous and 16-byte aligned;
//   3. warp w owns rows w, w + warps, ...; lane n scores key n against each
//      of its rows (the query tile is read by broadcast; K rows are padded
//      to D + 1 floats so the 32 lanes hit 32 banks), the warp reduces the
//      tile's maximum and sum (online softmax in base 2: the scale is
//      premultiplied by log2(e)) and writes the weights to shared memory;
//   4. lanes switch to dimensions: lane l accumulates dims l, l + warp
//      size, ... of each of its rows from the weights and V.
// Accumulators are float32 registers: rows_per_warp * D / 32 = 32 per lane
// on the GPU for every D. Unlike the verification kernels this op is
// checked against float64 within a tolerance, not bit for bit: plain float
// arithmetic, which nvcc may fuse into multiply-adds (the host does not).
//
// Keys come in two ranges. The prefix (positions < prefix_lens[b]) is
// visible to every live node: no mask bit is read there. Split s of S takes
// the s-th of S equal, tile-aligned slices of it. The tree block (positions
// prefix_lens[b] + j, j < num_nodes[b]: a padding node's slot is never
// read) belongs to the last split, which reads bit j of each row's packed
// ancestor words (TreeInfo.mask). With one split the
// block writes the normalised output; with more, each writes its partial
// state (acc, max, sum) and a second launch (tree_attention_merge_kernel)
// combines them in split order: no arrival counters to keep zeroed between
// calls, and the same result whatever the block schedule. The split count
// comes from shapes and the (cached) SM count only: no value is read on the
// host.
//
// Defined outcomes for bad values (the reference's): a key whose position
// is negative, whose block-table column is past max_blocks or whose block
// id is outside [0, num_blocks) is invisible and never read; rows of nodes
// at or past num_nodes[b] and rows that see no key are zero. Offsets that
// multiply a stride are int64; every input is read through its strides.
//
// The block program is written against the Block interface (block.cuh):
// DeviceBlock runs it in the kernel; csrc/tree_attention.cu runs it on the
// host (host_block.cuh) as the CPU implementation of
// torch.ops.specdec_C.tree_attention. This header includes no torch header.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_runtime_api.h>

#include "specdec/block.cuh"
#include "specdec/common.cuh"
#include "specdec/index.cuh"

namespace specdec {

// The dtype of q, the caches and the output.
enum class AttentionDtype : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// A [.., .., .., D] tensor read through its strides (in elements).
struct StridedValues {
  const void* data = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};
};

struct TreeAttentionArgs {
  StridedValues q;                 // [B, N, Hq, D]
  StridedValues k_cache, v_cache;  // [num_blocks, block_size, Hkv, D]
  IndexTensor block_tables;        // [B, max_blocks]
  int64_t tables_stride_b = 0, tables_stride_m = 0;
  IndexTensor prefix_lens;  // [B]
  int64_t prefix_stride = 0;
  const int32_t* tree_mask = nullptr;  // [B, N, ceil(N/32)]
  int64_t mask_stride_b = 0, mask_stride_n = 0, mask_stride_w = 0;
  IndexTensor num_nodes;  // [B]; data == nullptr: every node is live
  int64_t num_nodes_stride = 0;
  void* out = nullptr;  // [B, N, Hq, D] contiguous, dtype of q
  // num_splits > 1 only: [B * N * Hq * num_splits, D] and [B * N * Hq * num_splits].
  float* partial_acc = nullptr;
  float* partial_max = nullptr;
  float* partial_sum = nullptr;
  // num_splits > 1: nullptr, a second launch merges the splits; else
  // [>= programs] int32, zero before the call and left zero after it: the
  // last split of a program to finish merges the program's rows (one launch;
  // the tensor-core program only, the launchers clear it for the SIMT one:
  // with the merge in its tail, its D = 256 instantiations spilled 28-44
  // bytes at their 128-register cap, and 100-124 with the merge not inlined).
  int32_t* merge_counters = nullptr;
  float scale_log2 = 0.0f;  // softmax scale * log2(e)
  AttentionDtype dtype = AttentionDtype::kFloat16;
  int64_t batch_size = 0, max_nodes = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t num_blocks = 0, block_size = 1, max_blocks = 0;
  int block_size_log2 = 0;  // block_size is a power of two
  // Set by the launchers: both caches have unit-stride rows whose heads start
  // on 16-byte boundaries, so K and V are read 16 bytes at a time.
  bool cache_loads_16_bytes = false;
  int64_t num_splits = 1;  // the launchers' plan (tree_attention_num_splits)
  int64_t row_tiles = 1;   // set by the launchers
};

// Head dims with a compiled kernel.
constexpr bool tree_attention_supports_head_dim(int64_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}
// Most splits the launcher chooses by itself (forced counts may be larger).
constexpr int64_t kTreeAttentionMaxAutoSplits = 64;

// Fewest rows of a tensor-core program's tile (its host twin: 2 warps of
// 16 rows), the program that reads merge_counters: it has at most
// B * Hkv * ceil(N * Hq / Hkv / this) programs, the size merge_counters need.
constexpr int64_t kTreeAttentionMinTileRows = 32;

// Launchers (csrc/tree_attention.cu). `device`: for the GPU (true) or the
// host program (false), whose tiles are smaller.
// The split count a call with these shapes uses: `requested` when > 0, else
// the launcher's choice (from shapes and, on the GPU, the current device's
// SM count, cached per device). The caller sizes the partial states with it
// and stores it in args.num_splits.
int64_t tree_attention_num_splits(const TreeAttentionArgs& args, int64_t requested, bool device);
// One launch (two with splits) on `stream`; returns the launch status
// (cudaErrorInvalidValue for a head dim without a kernel). Neither
// synchronises.
cudaError_t launch_tree_attention(const TreeAttentionArgs& args, cudaStream_t stream);
// The same block program on the host (host pointers), blocks one after
// another on an emulated block, then the merge; a head dim without a kernel
// computes nothing (the binding rejects it first).
void tree_attention_host(const TreeAttentionArgs& args);

namespace tree_attention_detail {

// Rows a warp owns in a tile: its accumulators are rows * D / warp size
// floats per lane, 32 on the GPU.
constexpr int rows_per_warp(int head_dim) { return 1024 / head_dim; }

template <class Block, int kHeadDim>
struct TileShape {
  static constexpr int kWarps = Block::kThreads / Block::kWarpSize;
  static constexpr int kRowsPerWarp = rows_per_warp(kHeadDim);
  static constexpr int kRows = kWarps * kRowsPerWarp;
  static constexpr int kKeys = Block::kWarpSize;  // one key per lane
  static constexpr int kDimsPerLane = kHeadDim / Block::kWarpSize;
  static constexpr int kKeyStride = kHeadDim + 1;  // K rows padded: lanes reading one dim hit distinct banks
  static_assert(kDimsPerLane * Block::kWarpSize == kHeadDim, "whole dims per lane");
};

// The block's shared memory, carved from one buffer.
struct SharedTiles {
  int64_t* key_block;  // [keys]: block id, -1 when not stored (or past the tile's range)
  int64_t* key_slot;   // [keys]
  float* q;            // [rows, D]
  float* k;            // [keys, D + 1]
  float* v;            // [keys, D]
  float* weights;      // [rows, keys]

  SPECDEC_HOST_DEVICE static SharedTiles carve(void* memory, int rows, int keys, int head_dim) {
    int64_t* words = static_cast<int64_t*>(memory);
    float* floats = reinterpret_cast<float*>(words + 2 * keys);
    float* k = floats + rows * head_dim;
    float* v = k + keys * (head_dim + 1);
    return {words, words + keys, floats, k, v, v + keys * head_dim};
  }

  SPECDEC_HOST_DEVICE static int64_t bytes(int rows, int keys, int head_dim) {
    return 2 * keys * static_cast<int64_t>(sizeof(int64_t)) +
           static_cast<int64_t>(sizeof(float)) *
               (rows * head_dim + keys * (head_dim + 1) + keys * head_dim + rows * keys);
  }
};

template <class Block, int kHeadDim>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t shared_bytes() {
  using Shape = TileShape<Block, kHeadDim>;
  return SharedTiles::bytes(Shape::kRows, Shape::kKeys, kHeadDim);
}

struct MaxFloat {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float operator()(float a, float b) const { return a > b ? a : b; }
};
struct AddFloat {
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float operator()(float a, float b) const { return a + b; }
};

// The running softmax state of the rows a lane works on.
template <int kRowsPerWarp, int kDimsPerLane>
struct RowStates {
  float acc[kRowsPerWarp][kDimsPerLane];  // lane l: dims l, l + warp size, ...
  float max[kRowsPerWarp];                // the same in every lane of the warp
  float sum[kRowsPerWarp];
};

// Where a (request, KV head, row tile) block's rows come from.
struct RowTile {
  int64_t request, kv_head, first_row, group, live_nodes;  // live_nodes in [0, N]

  SPECDEC_HOST_DEVICE int64_t node(int row) const { return (first_row + row) / group; }
  SPECDEC_HOST_DEVICE int64_t head(int row) const { return kv_head * group + (first_row + row) % group; }
  // The row's index in the output and the partial states, [B * N * Hq].
  SPECDEC_HOST_DEVICE int64_t output_row(int row, int64_t max_nodes, int64_t num_q_heads) const {
    return (request * max_nodes + node(row)) * num_q_heads + head(row);
  }
};

// Block `program` of a grid of (request, KV head, row tile of `rows` rows).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE RowTile row_tile_of(const TreeAttentionArgs& args, int64_t program,
                                                            int rows) {
  RowTile tile;
  const int64_t row_tile = program % args.row_tiles;
  tile.kv_head = (program / args.row_tiles) % args.num_kv_heads;
  tile.request = program / args.row_tiles / args.num_kv_heads;
  tile.first_row = row_tile * rows;
  tile.group = args.num_q_heads / args.num_kv_heads;
  tile.live_nodes = args.max_nodes;
  if (args.num_nodes.data != nullptr) {
    const int64_t live = args.num_nodes[tile.request * args.num_nodes_stride];
    tile.live_nodes = live < 0 ? 0 : (live < args.max_nodes ? live : args.max_nodes);
  }
  return tile;
}

// The prefix positions [start, stop) that split `split` reads, in whole
// tiles of `keys`, and the request's prefix length. A prefix past the
// table's capacity is invisible there anyway: clamping bounds the loop for
// any value.
struct PrefixSlice {
  int64_t prefix, start, stop;
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE PrefixSlice prefix_slice(const TreeAttentionArgs& args, const RowTile& tile,
                                                                 int64_t split, int keys) {
  const int64_t prefix = args.prefix_lens[tile.request * args.prefix_stride];
  const int64_t capacity = args.max_blocks << args.block_size_log2;
  const int64_t prefix_end = prefix < 0 ? 0 : (prefix < capacity ? prefix : capacity);
  const int64_t per_split = ((prefix_end + args.num_splits - 1) / args.num_splits + keys - 1) / keys * keys;
  const int64_t start = split * per_split;
  return {prefix, start, start + per_split < prefix_end ? start + per_split : prefix_end};
}

// The key tiles a block folds, in order: the prefix slice's, then (the last
// split only) the tree block's, up to the request's last live node: a
// padding node's slot is never read, so whatever it holds cannot reach the
// output.
struct KeyTiles {
  PrefixSlice slice;
  int64_t tree_nodes, prefix_tiles, count;
  int keys;

  SPECDEC_HOST_DEVICE KeyTiles(const TreeAttentionArgs& args, const RowTile& tile, const PrefixSlice& prefix,
                               int64_t split, int tile_keys)
      : slice(prefix), tree_nodes(tile.live_nodes), keys(tile_keys) {
    prefix_tiles = slice.stop > slice.start ? (slice.stop - slice.start + keys - 1) / keys : 0;
    count = prefix_tiles + (split == args.num_splits - 1 ? (tree_nodes + keys - 1) / keys : 0);
  }

  // -1 for a prefix tile; for a tree tile its first node (key n is tree
  // node tree_start + n).
  SPECDEC_HOST_DEVICE int64_t tree_start(int64_t t) const { return t < prefix_tiles ? -1 : (t - prefix_tiles) * keys; }

  // Tile t's first position and its keys from there on (the tile takes at
  // most `keys` of them).
  SPECDEC_HOST_DEVICE void get(int64_t t, int64_t* first_position, int64_t* remaining) const {
    const int64_t j = tree_start(t);
    *first_position = j < 0 ? slice.start + t * keys : wrapping_add(slice.prefix, j);
    *remaining = j < 0 ? slice.stop - *first_position : tree_nodes - j;
  }
};

// Where key `n` of a tile of `count` keys from `first_position` is stored:
// its block id, or -1 when it is not (past `count`, a negative position, a
// column past the table, a block id outside [0, num_blocks)), and its slot.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void locate_key(const TreeAttentionArgs& args, int64_t request,
                                                        int64_t first_position, int64_t count, int n,
                                                        int64_t* block_id, int64_t* slot) {
  *block_id = -1;
  *slot = 0;
  const int64_t position = wrapping_add(first_position, n);
  if (n >= count || position < 0) return;
  const int64_t column = position >> args.block_size_log2;
  if (column >= args.max_blocks) return;
  const int64_t id = args.block_tables[request * args.tables_stride_b + column * args.tables_stride_m];
  if (id >= 0 && id < args.num_blocks) {
    *block_id = id;
    *slot = position & (args.block_size - 1);
  }
}

// The packed ancestor word of node `node` of `request` that holds tree node
// j: bit j % 32 is set iff the node sees node j.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint32_t ancestor_word(const TreeAttentionArgs& args, int64_t request,
                                                               int64_t node, int64_t j) {
  return static_cast<uint32_t>(
      args.tree_mask[request * args.mask_stride_b + node * args.mask_stride_n + (j >> 5) * args.mask_stride_w]);
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool sees_tree_node(const TreeAttentionArgs& args, int64_t request,
                                                            int64_t node, int64_t j) {
  return ((ancestor_word(args, request, node, j) >> (j & 31)) & 1u) != 0;
}

// `kPerLoad` consecutive elements of a head at `address`: one element, or a
// 16-byte load (the launcher checked alignment and unit strides).
template <class Value, int kPerLoad>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void load_elements(const Value* address, Value (&elements)[kPerLoad]) {
  if constexpr (kPerLoad == 1) {
    elements[0] = *address;
  } else {
    static_assert(kPerLoad * sizeof(Value) == sizeof(Bytes16), "a load is 16 bytes");
    const Bytes16 unit = *reinterpret_cast<const Bytes16*>(address);
    memcpy(elements, &unit, sizeof(unit));
  }
}

// Element `first_dim` of the head `kv_head` of the key at (block_id, slot).
template <class Value>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE const Value* cache_element(const StridedValues& cache, int64_t block_id,
                                                                   int64_t slot, int64_t kv_head, int64_t first_dim) {
  return static_cast<const Value*>(cache.data) + block_id * cache.stride[0] + slot * cache.stride[1] +
         kv_head * cache.stride[2] + first_dim * cache.stride[3];
}

// The share of thread `thread` (of `threads`) in loading a tile's K and V:
// locate(key, &block_id, &slot) says where a key is stored (block_id -1:
// nowhere), and store(key, first_dim, k, v, stored) receives `kPerLoad`
// consecutive elements of each (unset where the key is not stored: the
// store puts zeros there, so an invisible key contributes exactly 0, never
// NaN).
template <class Value, int kHeadDim, int kPerLoad, class Locate, class Store>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void load_key_tile(const TreeAttentionArgs& args, Locate&& locate,
                                                           int64_t kv_head, int keys, int thread, int threads,
                                                           Store&& store) {
  constexpr int kLoadsPerHead = kHeadDim / kPerLoad;
  static_assert(kLoadsPerHead * kPerLoad == kHeadDim, "whole loads per head");
  for (int load = thread; load < keys * kLoadsPerHead; load += threads) {
    const int key = load / kLoadsPerHead;
    const int first_dim = (load - key * kLoadsPerHead) * kPerLoad;
    int64_t block_id;
    int64_t slot;
    locate(key, &block_id, &slot);
    Value k[kPerLoad];
    Value v[kPerLoad];
    if (block_id >= 0) {
      load_elements<Value, kPerLoad>(cache_element<Value>(args.k_cache, block_id, slot, kv_head, first_dim), k);
      load_elements<Value, kPerLoad>(cache_element<Value>(args.v_cache, block_id, slot, kv_head, first_dim), v);
    }
    store(key, first_dim, k, v, block_id >= 0);
  }
}

// Phases 1-4 of the design for one key tile: `count` keys at positions
// first_position + n; `tree_start` >= 0 marks the tree block (key n is
// node tree_start + n, visible to a row iff its mask bit is set).
template <class Block, class Value, int kHeadDim>
SPECDEC_HOST_DEVICE void fold_key_tile(const Block& block, const TreeAttentionArgs& args, const SharedTiles& tiles,
                                       const RowTile& tile, int64_t first_position, int64_t count,
                                       int64_t tree_start,
                                       RowStates<rows_per_warp(kHeadDim), kHeadDim / Block::kWarpSize>& state) {
  using Shape = TileShape<Block, kHeadDim>;
  const int thread = block.thread();
  const int lane = block.lane();
  const int warp = block.warp();

  // 1. Locations.
  if (thread < Shape::kKeys) {
    locate_key(args, tile.request, first_position, count, thread, &tiles.key_block[thread], &tiles.key_slot[thread]);
  }
  block.sync();  // also: the previous tile's phase 4 is done with V and the weights

  // 2. K and V as float32; zeros where not stored. 16 bytes a load when the
  // launcher allows it (contiguous, aligned heads).
  const auto locate = [&](int key, int64_t* block_id, int64_t* slot) {
    *block_id = tiles.key_block[key];
    *slot = tiles.key_slot[key];
  };
  const auto store = [&](int key, int first_dim, const auto& k, const auto& v, bool stored) {
    constexpr int kPerLoad = static_cast<int>(sizeof(k) / sizeof(k[0]));
    SPECDEC_UNROLL
    for (int e = 0; e < kPerLoad; ++e) {
      tiles.k[key * Shape::kKeyStride + first_dim + e] = stored ? to_float(k[e]) : 0.0f;
      tiles.v[key * kHeadDim + first_dim + e] = stored ? to_float(v[e]) : 0.0f;
    }
  };
  if (args.cache_loads_16_bytes) {
    constexpr int kPerWideLoad = static_cast<int>(sizeof(Bytes16) / sizeof(Value));
    load_key_tile<Value, kHeadDim, kPerWideLoad>(args, locate, tile.kv_head, Shape::kKeys, thread, Block::kThreads,
                                                 store);
  } else {
    load_key_tile<Value, kHeadDim, 1>(args, locate, tile.kv_head, Shape::kKeys, thread, Block::kThreads, store);
  }
  block.sync();

  // 3. Scores (lane = key), the tile's max and sum per row, the weights.
  const bool stored = tiles.key_block[lane] >= 0;
  const float* key_row = tiles.k + lane * Shape::kKeyStride;
  SPECDEC_UNROLL
  for (int r = 0; r < Shape::kRowsPerWarp; ++r) {
    const int row = r * Shape::kWarps + warp;
    const int64_t node = tile.node(row);
    if (node >= tile.live_nodes) continue;  // the whole warp: rows are per warp
    const bool visible = stored && (tree_start < 0 || sees_tree_node(args, tile.request, node, tree_start + lane));
    float score = negative_infinity();
    if (visible) {
      const float* query = tiles.q + row * kHeadDim;
      float dot = 0.0f;
      for (int dim = 0; dim < kHeadDim; ++dim) dot += query[dim] * key_row[dim];
      score = dot * args.scale_log2;
    }
    const float tile_max = block.warp_all_reduce(score, MaxFloat());
    const float new_max = state.max[r] > tile_max ? state.max[r] : tile_max;
    // A row that has seen nothing keeps max = -inf; its exponentials are
    // taken against 0, so they are 0, not NaN.
    const float safe_max = new_max == negative_infinity() ? 0.0f : new_max;
    const float weight = visible ? exp2_f32(score - safe_max) : 0.0f;
    const float rescale = exp2_f32(state.max[r] - safe_max);
    state.sum[r] = state.sum[r] * rescale + block.warp_all_reduce(weight, AddFloat());
    state.max[r] = new_max;
    tiles.weights[row * Shape::kKeys + lane] = weight;
    SPECDEC_UNROLL
    for (int i = 0; i < Shape::kDimsPerLane; ++i) state.acc[r][i] *= rescale;
  }
  block.sync();

  // 4. acc += weights . V (lane = dims).
  SPECDEC_UNROLL
  for (int r = 0; r < Shape::kRowsPerWarp; ++r) {
    const int row = r * Shape::kWarps + warp;
    if (tile.node(row) >= tile.live_nodes) continue;
    const float* weights = tiles.weights + row * Shape::kKeys;
    for (int key = 0; key < Shape::kKeys; ++key) {
      const float weight = weights[key];
      const float* value_row = tiles.v + key * kHeadDim + lane;
      SPECDEC_UNROLL
      for (int i = 0; i < Shape::kDimsPerLane; ++i) {
        state.acc[r][i] += weight * value_row[i * Block::kWarpSize];
      }
    }
  }
}

// Element `index` of the merged output ([B * N * Hq, D], row-major): split
// s's output is acc_s / sum_s with weight 2^(max_s - M) sum_s, M the largest
// max_s; splits that saw nothing have max_s = -inf and weight 0, and a row
// no split saw is zero. Splits are folded in order.
template <class Value>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void merge_element(const TreeAttentionArgs& args, int64_t index) {
  const int64_t row = index / args.head_dim;
  const int64_t dim = index - row * args.head_dim;
  const int64_t first = row * args.num_splits;
  float row_max = negative_infinity();
  for (int64_t s = 0; s < args.num_splits; ++s) {
    const float split_max = args.partial_max[first + s];
    row_max = split_max > row_max ? split_max : row_max;
  }
  const float safe_max = row_max == negative_infinity() ? 0.0f : row_max;
  float total = 0.0f;
  float acc = 0.0f;
  for (int64_t s = 0; s < args.num_splits; ++s) {
    const float weight = exp2_f32(args.partial_max[first + s] - safe_max);
    total += weight * args.partial_sum[first + s];
    acc += weight * args.partial_acc[(first + s) * args.head_dim + dim];
  }
  static_cast<Value*>(args.out)[index] = from_float<Value>(total > 0.0f ? fdiv_rn(acc, total) : 0.0f);
}

// Whether this block is the last of its program's splits to have stored
// its partial states (every thread calls it, after its stores). On the GPU
// the stores are released as DeviceBlock::arrive releases them (a barrier,
// then thread 0's acq_rel count), whose acquire makes the other splits'
// stores visible, handed to the block by the second barrier; the last
// arrival puts the counter back to zero (every split has counted in by
// then). No block waits for another, so nothing depends on which blocks are
// resident. The host runs blocks one after another: barriers order the count.
template <class Block>
SPECDEC_HOST_DEVICE bool last_split_arrives(const Block& block, int32_t* counter, int64_t splits, bool first_thread) {
#if defined(__CUDA_ARCH__)
  (void)block;
  __syncthreads();
  int last = 0;
  if (first_thread) {
    last = DeviceBlock::atomic_add_acq_rel(counter, 1) == splits - 1;
    if (last) atomicExch(counter, 0);
  }
  return __syncthreads_or(last) != 0;
#else
  block.sync();
  if (first_thread) ++*counter;
  block.sync();
  const bool last = *counter == splits;
  block.sync();  // every thread has read the count
  if (last && first_thread) *counter = 0;
  return last;
#endif
}

// The merged output of `tile`'s rows (the first `rows` of them), elements
// first, first + stride, ... of [rows, D]; rows past the tree are skipped.
template <class Value>
SPECDEC_HOST_DEVICE void merge_tile(const TreeAttentionArgs& args, const RowTile& tile, int rows, int first,
                                    int stride) {
  for (int element = first; element < rows * args.head_dim; element += stride) {
    const int row = element / static_cast<int>(args.head_dim);
    if (tile.node(row) >= args.max_nodes) continue;
    const int64_t out_row = tile.output_row(row, args.max_nodes, args.num_q_heads);
    merge_element<Value>(args, out_row * args.head_dim + (element - row * args.head_dim));
  }
}

// Whether this block merges its tile's rows: with merge_counters, when it
// is the last split of the tile's program to finish (every thread calls it,
// after its stores; `first_thread`: this thread is thread 0). The program
// is found again from the tile (row_tile_of inverted) rather than keeping
// the block index live through the key loop.
template <class Block>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool merges_here(const Block& block, const TreeAttentionArgs& args,
                                                         const RowTile& tile, int rows, bool first_thread) {
  if (args.num_splits == 1 || args.merge_counters == nullptr) return false;
  const int64_t program = (tile.request * args.num_kv_heads + tile.kv_head) * args.row_tiles + tile.first_row / rows;
  return last_split_arrives(block, args.merge_counters + program, args.num_splits, first_thread);
}

template <class Block, class Value, int kHeadDim>
SPECDEC_HOST_DEVICE void tree_attention_block(const Block& block, const TreeAttentionArgs& args, void* shared_memory,
                                              int64_t program, int64_t split) {
  using Shape = TileShape<Block, kHeadDim>;
  const SharedTiles tiles = SharedTiles::carve(shared_memory, Shape::kRows, Shape::kKeys, kHeadDim);
  const int thread = block.thread();
  const int lane = block.lane();
  const int warp = block.warp();

  const RowTile tile = row_tile_of(args, program, Shape::kRows);

  // The query tile (read after the first key tile's barriers).
  const Value* q = static_cast<const Value*>(args.q.data);
  for (int element = thread; element < Shape::kRows * kHeadDim; element += Block::kThreads) {
    const int row = element / kHeadDim;
    const int dim = element - row * kHeadDim;
    const int64_t node = tile.node(row);
    tiles.q[element] = node < args.max_nodes
                           ? to_float(q[tile.request * args.q.stride[0] + node * args.q.stride[1] +
                                        tile.head(row) * args.q.stride[2] + dim * args.q.stride[3]])
                           : 0.0f;
  }

  RowStates<Shape::kRowsPerWarp, Shape::kDimsPerLane> state;
  SPECDEC_UNROLL
  for (int r = 0; r < Shape::kRowsPerWarp; ++r) {
    state.max[r] = negative_infinity();
    state.sum[r] = 0.0f;
    SPECDEC_UNROLL
    for (int i = 0; i < Shape::kDimsPerLane; ++i) state.acc[r][i] = 0.0f;
  }

  const KeyTiles key_tiles(args, tile, prefix_slice(args, tile, split, Shape::kKeys), split, Shape::kKeys);
  for (int64_t t = 0; t < key_tiles.count; ++t) {
    int64_t first_position, remaining;
    key_tiles.get(t, &first_position, &remaining);
    fold_key_tile<Block, Value, kHeadDim>(block, args, tiles, tile, first_position, remaining,
                                          key_tiles.tree_start(t), state);
  }

  // Outputs, indexed by (request, node, query head) row; rows past the
  // tree are not written, padding rows are zero (acc = sum = 0).
  SPECDEC_UNROLL
  for (int r = 0; r < Shape::kRowsPerWarp; ++r) {
    const int row = r * Shape::kWarps + warp;
    const int64_t node = tile.node(row);
    if (node >= args.max_nodes) continue;
    const int64_t out_row = tile.output_row(row, args.max_nodes, args.num_q_heads);
    if (args.num_splits == 1) {
      Value* out = static_cast<Value*>(args.out) + out_row * kHeadDim + lane;
      const bool seen = state.sum[r] > 0.0f;
      SPECDEC_UNROLL
      for (int i = 0; i < Shape::kDimsPerLane; ++i) {
        out[i * Block::kWarpSize] = from_float<Value>(seen ? fdiv_rn(state.acc[r][i], state.sum[r]) : 0.0f);
      }
    } else {
      const int64_t partial = out_row * args.num_splits + split;
      float* acc = args.partial_acc + partial * kHeadDim + lane;
      SPECDEC_UNROLL
      for (int i = 0; i < Shape::kDimsPerLane; ++i) acc[i * Block::kWarpSize] = state.acc[r][i];
      if (lane == 0) {
        args.partial_max[partial] = state.max[r];
        args.partial_sum[partial] = state.sum[r];
      }
    }
  }
}

#if defined(__CUDACC__)
// Blocks per SM the registers must allow. ptxas -v, sm_80 and sm_90a
// (CUDA 13.0): at 2 (a 128-register cap) D = 256 fits in every dtype
// without spills, and its 101 KB of shared memory lets 2 blocks share an
// H100/H200 SM; D = 64 and 128 spill there in some dtypes (up to 80 bytes),
// so they take 1 (154-192 registers, no spills). Occupancy is not tuned:
// nothing has been timed on a GPU yet.
constexpr int min_blocks_per_multiprocessor(int head_dim) { return head_dim == 256 ? 2 : 1; }

template <class Value, int kHeadDim>
__global__ void __launch_bounds__(DeviceBlock::kThreads, min_blocks_per_multiprocessor(kHeadDim)) tree_attention_kernel(const TreeAttentionArgs args) {
  extern __shared__ __align__(16) unsigned char tree_attention_tiles[];
  // The program uses sync() and warp_all_reduce() only, which need no
  // DeviceBlock::Shared.
  const DeviceBlock block = {nullptr};
  tree_attention_block<DeviceBlock, Value, kHeadDim>(block, args, tree_attention_tiles,
                                                     static_cast<int64_t>(blockIdx.x),
                                                     static_cast<int64_t>(blockIdx.y));
}

template <class Value>
__global__ void __launch_bounds__(256) tree_attention_merge_kernel(const TreeAttentionArgs args, int64_t elements) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < elements;
       index += stride) {
    merge_element<Value>(args, index);
  }
}
#endif  // __CUDACC__

}  // namespace tree_attention_detail
}  // namespace specdec
