// Commit the accepted path's K/V in place (sk.compact_kv), one launch. The
// CUDA twin of kernels/compact_kv.py; specdec_kernels/reference/compact_kv.py
// is the definition of correct ("all sources are read before anything is
// written; among moves into one slot the last (b, d) wins").
//
// Design
// ------
// Grid: 1-D, B * num_splits blocks of 256 threads. Block (b, split) owns
// request b and a range of features, a feature being one (head, unit) of a
// cache row; a unit is the widest integer (1 to 16 bytes) that tiles every
// row of both caches (csrc/compact_kv.cu picks it), so a move copies bits
// and a float16 head of 128 dims is 16 vector loads.
//
// 1. The path ends at its first negative entry: a block min-reduction gives
//    its length L (<= N <= kCompactMaxPath).
// 2. The move table (shared memory, one entry per d < L): source and
//    destination (block id, slot), located as the reference does; a move
//    whose source or destination is not stored gets block ids -1.
// 3. Moves into one slot (same block id, destinations j * block_size
//    apart: only when the block table repeats a block): the last d wins, the
//    others are dropped. Then each slot has at most one writer, and a writer
//    whose source is its destination (the root, a prefix already in place)
//    would store the slot's own value: dropped too.
// 4. Copy in tiles of kCompactTileUnits units per cache: L moves x W
//    features, W = kCompactTileUnits / L. Every thread loads its units of K
//    and V into registers, the block barrier orders every load of the block
//    before any store, then every thread stores. So a destination that is the
//    source of another move (a climbing path [0, 2, 3], or any malformed
//    path, a swap included) is read before it is written. Tiles of one block
//    and blocks of one request hold disjoint features, so they never touch
//    the same element and need no ordering between them.
//
// Requests whose block tables are disjoint touch disjoint slots, so the
// result is the reference's. Not reproduced (as in the Triton kernel):
// requests that share a block which one of them writes; the reference reads
// every request's sources before any request writes and lets the last b
// win, which would take a grid-wide barrier or a second launch. Engines
// never share a block that a tree step writes (shared prefix blocks are
// read-only); there, each element written is some move's value.
//
// Defined outcomes for bad values, as in the reference: any negative entry
// ends the path; a move whose source or destination position is negative,
// maps past the block table, or to a block id outside [0, num_blocks) is
// skipped (positions are prefix + node wrapping as torch's int64 add). Only
// block-table columns in [0, max_blocks) are read and only kept moves touch
// the caches, so no value causes an out-of-bounds access. Every offset is
// int64.
//
// The block program is written against the Block interface (block.cuh):
// DeviceBlock runs it in the kernel; csrc/compact_kv.cu runs it on the host
// (host_block.cuh) as the CPU implementation of torch.ops.specdec_C.compact_kv.
// This header includes no torch header.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "specdec/block.cuh"
#include "specdec/common.cuh"
#include "specdec/index.cuh"

namespace specdec {

// The longest path a launch takes: one unit of every move fits the tile.
constexpr int64_t kCompactMaxPath = 1024;
// Units of each cache a block holds between its loads and its stores: 4 per
// thread of 256 on the GPU, with K and V 8 registers of up to 16 bytes.
constexpr int64_t kCompactTileUnits = 1024;

struct CompactKvCache {
  void* data = nullptr;
  // In units: (block, slot, head, unit within the head).
  int64_t stride_block = 0, stride_slot = 0, stride_head = 0, stride_unit = 0;
};

struct CompactKvArgs {
  CompactKvCache k_cache, v_cache;
  int64_t unit_bytes = 1;  // 1, 2, 4, 8 or 16
  int64_t num_blocks = 0, block_size = 0;
  int64_t num_heads = 0, units_per_head = 0;
  IndexTensor block_tables;  // [B, max_blocks]
  int64_t tables_stride_b = 0, tables_stride_m = 0, max_blocks = 0;
  IndexTensor prefix_lens;  // [B]
  int64_t prefix_stride = 0;
  IndexTensor accepted_nodes;  // [B, N], N <= kCompactMaxPath
  int64_t accepted_stride_b = 0, accepted_stride_n = 0, path_width = 0;
  int64_t batch_size = 0;
  int64_t features_per_split = 1;  // set by the launcher
  int64_t num_splits = 1;
};

// Launchers (csrc/compact_kv.cu). Neither synchronises. `args` as the
// binding fills it (element strides, unit_bytes = the element size); the
// launchers widen the unit and plan the splits.
// One launch on `stream`; returns the launch status (cudaGetLastError).
cudaError_t launch_compact_kv(const CompactKvArgs& args, cudaStream_t stream);
// The same block program on the host (host pointers), blocks one after
// another on an emulated block.
void compact_kv_host(const CompactKvArgs& args);

// Bytes of the move table for paths of `path_width` entries.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t compact_kv_table_bytes(int64_t path_width) {
  return 4 * static_cast<int64_t>(sizeof(int64_t)) * path_width;
}

namespace compact_kv_detail {

// The move table, one entry per path position d, in shared memory.
struct MoveTable {
  int64_t* src_block;  // -1: no move
  int64_t* src_slot;
  int64_t* dst_block;  // -1: not a move (step 2); step 3 drops through src_block only
  int64_t* dst_slot;

  SPECDEC_HOST_DEVICE static MoveTable carve(void* memory, int64_t path_width) {
    int64_t* words = static_cast<int64_t*>(memory);
    return {words, words + path_width, words + 2 * path_width, words + 3 * path_width};
  }
};

// (block id, slot) of cache position `position` of a request, or block id -1
// where the reference's _locate says it is not stored.
struct Location {
  int64_t block, slot;
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE Location locate(const CompactKvArgs& args, int64_t request,
                                                        int64_t position) {
  if (position < 0) return {-1, 0};
  const int64_t column = position / args.block_size;
  if (column >= args.max_blocks) return {-1, 0};
  const int64_t block = args.block_tables[request * args.tables_stride_b + column * args.tables_stride_m];
  if (block < 0 || block >= args.num_blocks) return {-1, 0};
  return {block, position - column * args.block_size};
}

// Unit `index` of a tile of `units` = L x `width` units: its path position d
// and feature, and whether it moves (the table is read only for index < units,
// so only for d < L).
struct TileUnit {
  int64_t d, feature;
  bool moved;
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE TileUnit tile_unit(const MoveTable& table, int64_t index, int64_t units,
                                                          int64_t width, int64_t tile_begin) {
  const int64_t d = index / width;
  return {d, tile_begin + (index - d * width), index < units && table.src_block[d] >= 0};
}

template <class Unit>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE Unit* unit_address(const CompactKvCache& cache, const CompactKvArgs& args,
                                                           int64_t block, int64_t slot, int64_t feature) {
  const int64_t head = feature / args.units_per_head;
  const int64_t unit = feature - head * args.units_per_head;
  return static_cast<Unit*>(cache.data) + block * cache.stride_block + slot * cache.stride_slot +
         head * cache.stride_head + unit * cache.stride_unit;
}

template <class Block, class Unit>
SPECDEC_HOST_DEVICE void compact_kv_block(const Block& block, const CompactKvArgs& args, void* table_memory,
                                          int64_t block_index) {
  constexpr int kItems = static_cast<int>(kCompactTileUnits / Block::kThreads);
  static_assert(kItems * Block::kThreads == kCompactTileUnits, "the tile is whole units per thread");
  static_assert(kCompactTileUnits >= kCompactMaxPath, "one unit of every move fits the tile");
  const int64_t request = block_index / args.num_splits;
  const int64_t split = block_index - request * args.num_splits;
  const int thread = block.thread();
  const int threads = block.num_threads();
  const int64_t path_row = request * args.accepted_stride_b;

  // 1. Path length: the first negative entry, or the width.
  int64_t first_negative = args.path_width;
  for (int64_t d = thread; d < args.path_width; d += threads) {
    if (args.accepted_nodes[path_row + d * args.accepted_stride_n] < 0) {
      first_negative = d;
      break;  // later d of this thread are larger
    }
  }
  const int64_t length = block.block_all_reduce(first_negative, MinInt64());

  // 2. The move table.
  const MoveTable table = MoveTable::carve(table_memory, args.path_width);
  const int64_t prefix = args.prefix_lens[request * args.prefix_stride];
  for (int64_t d = thread; d < length; d += threads) {
    const int64_t node = args.accepted_nodes[path_row + d * args.accepted_stride_n];
    const Location source = locate(args, request, wrapping_add(prefix, node));
    const Location destination = locate(args, request, wrapping_add(prefix, d));
    const bool move = source.block >= 0 && destination.block >= 0;
    table.src_block[d] = move ? source.block : -1;
    table.src_slot[d] = source.slot;
    table.dst_block[d] = move ? destination.block : -1;
    table.dst_slot[d] = destination.slot;
  }
  block.sync();

  // 3. Last move into a slot wins; no slot onto itself. Other threads read
  // dst_block here, so drops go to src_block, which only its owner reads
  // until the barrier.
  for (int64_t d = thread; d < length; d += threads) {
    const int64_t destination = table.dst_block[d];
    if (destination < 0) continue;
    bool keep = !(table.src_block[d] == destination && table.src_slot[d] == table.dst_slot[d]);
    for (int64_t later = d + args.block_size; keep && later < length; later += args.block_size) {
      keep = table.dst_block[later] != destination;
    }
    if (!keep) table.src_block[d] = -1;
  }
  block.sync();

  // 4. Tiles: all loads of a tile, the barrier, then its stores.
  const int64_t feature_begin = split * args.features_per_split;
  int64_t feature_end = feature_begin + args.features_per_split;
  const int64_t num_features = args.num_heads * args.units_per_head;
  feature_end = feature_end < num_features ? feature_end : num_features;
  const int64_t tile_features = length > 0 ? kCompactTileUnits / length : 0;
  for (int64_t tile_begin = feature_begin; length > 0 && tile_begin < feature_end; tile_begin += tile_features) {
    const int64_t width = tile_features < feature_end - tile_begin ? tile_features : feature_end - tile_begin;
    const int64_t units = length * width;
    Unit keys[kItems], values[kItems];
    SPECDEC_UNROLL
    for (int item = 0; item < kItems; ++item) {
      const TileUnit at = tile_unit(table, thread + static_cast<int64_t>(item) * threads, units, width, tile_begin);
      if (at.moved) {
        keys[item] = *unit_address<Unit>(args.k_cache, args, table.src_block[at.d], table.src_slot[at.d], at.feature);
        values[item] = *unit_address<Unit>(args.v_cache, args, table.src_block[at.d], table.src_slot[at.d], at.feature);
      }
    }
    block.sync();
    SPECDEC_UNROLL
    for (int item = 0; item < kItems; ++item) {
      const TileUnit at = tile_unit(table, thread + static_cast<int64_t>(item) * threads, units, width, tile_begin);
      if (at.moved) {
        *unit_address<Unit>(args.k_cache, args, table.dst_block[at.d], table.dst_slot[at.d], at.feature) = keys[item];
        *unit_address<Unit>(args.v_cache, args, table.dst_block[at.d], table.dst_slot[at.d], at.feature) = values[item];
      }
    }
  }
}

#if defined(__CUDACC__)
template <class Unit>
__global__ void __launch_bounds__(DeviceBlock::kThreads) compact_kv_kernel(const CompactKvArgs args) {
  __shared__ DeviceBlock::Shared shared;
  extern __shared__ int64_t table_memory[];
  const DeviceBlock block = {&shared};
  compact_kv_block<DeviceBlock, Unit>(block, args, table_memory, static_cast<int64_t>(blockIdx.x));
}
#endif  // __CUDACC__

}  // namespace compact_kv_detail
}  // namespace specdec
