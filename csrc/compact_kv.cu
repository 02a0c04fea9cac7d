// Launcher of compact_kv (include/specdec/compact_kv.cuh holds the design
// and the block program): the copy unit, the split of the features over
// blocks, dispatch on the unit, and the host implementation, which runs the
// same block program on an emulated block.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "specdec/compact_kv.cuh"
#include "specdec/host_block.cuh"

namespace specdec {
namespace {

// Features (units of a cache row) per block on the GPU: a float16 cache with
// 8 heads of 128 dims is 128 16-byte units, 4 blocks per request, so B = 1
// still spreads over a few SMs and B = 64 fills an H200 with 256 blocks.
constexpr int64_t kFeaturesPerBlock = 32;
// The host splits rows into blocks of 2 features, so CPU tests cross blocks
// and, with long paths, tiles.
constexpr int64_t kHostFeaturesPerBlock = 2;

bool divides(int64_t unit, int64_t value) { return value % unit == 0; }

// Whether `ratio` elements can be read as one unit of every row of `cache`:
// a head's elements are contiguous, and every row starts on a unit boundary.
bool can_widen(const CompactKvCache& cache, const CompactKvArgs& args, int64_t ratio) {
  const int64_t unit_bytes = ratio * args.unit_bytes;
  return cache.stride_unit == 1 && divides(ratio, args.units_per_head) &&
         divides(ratio, cache.stride_head) && divides(ratio, cache.stride_slot) &&
         divides(ratio, cache.stride_block) &&
         divides(unit_bytes, static_cast<int64_t>(reinterpret_cast<uintptr_t>(cache.data)));
}

void widen(CompactKvCache& cache, int64_t ratio) {
  cache.stride_block /= ratio;
  cache.stride_slot /= ratio;
  cache.stride_head /= ratio;
  cache.stride_unit = 1;
}

// The widest unit (up to 16 bytes) of both caches, and the splits. Element
// sizes are powers of two up to 16 (the binding checks), so every wider unit
// is whole elements.
CompactKvArgs plan_compact_kv(const CompactKvArgs& args, int64_t features_per_block) {
  CompactKvArgs plan = args;
  for (int64_t unit_bytes = 16; unit_bytes > args.unit_bytes; unit_bytes /= 2) {
    const int64_t ratio = unit_bytes / args.unit_bytes;
    if (can_widen(args.k_cache, args, ratio) && can_widen(args.v_cache, args, ratio)) {
      widen(plan.k_cache, ratio);
      widen(plan.v_cache, ratio);
      plan.unit_bytes = unit_bytes;
      plan.units_per_head = args.units_per_head / ratio;
      break;
    }
  }
  const int64_t num_features = plan.num_heads * plan.units_per_head;
  plan.num_splits = (num_features + features_per_block - 1) / features_per_block;
  plan.features_per_split = (num_features + plan.num_splits - 1) / plan.num_splits;
  return plan;
}

bool nothing_to_move(const CompactKvArgs& args) {
  return args.batch_size == 0 || args.path_width == 0 || args.num_blocks == 0 || args.block_size == 0 ||
         args.max_blocks == 0 || args.num_heads == 0 || args.units_per_head == 0;
}

// Calls body(Unit{}) with the unit type of the plan.
template <class Body>
void dispatch_unit(int64_t unit_bytes, Body&& body) {
  switch (unit_bytes) {
    case 16:
      body(Bytes16{});
      break;
    case 8:
      body(uint64_t{});
      break;
    case 4:
      body(uint32_t{});
      break;
    case 2:
      body(uint16_t{});
      break;
    default:
      body(uint8_t{});
      break;
  }
}

}  // namespace

cudaError_t launch_compact_kv(const CompactKvArgs& args, cudaStream_t stream) {
  if (nothing_to_move(args)) return cudaSuccess;
  const CompactKvArgs plan = plan_compact_kv(args, kFeaturesPerBlock);
  const int64_t blocks = plan.batch_size * plan.num_splits;
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  const size_t table_bytes = static_cast<size_t>(compact_kv_table_bytes(plan.path_width));
  dispatch_unit(plan.unit_bytes, [&](auto unit) {
    using Unit = decltype(unit);
    compact_kv_detail::compact_kv_kernel<Unit>
        <<<static_cast<unsigned>(blocks), DeviceBlock::kThreads, table_bytes, stream>>>(plan);
  });
  return cudaGetLastError();
}

void compact_kv_host(const CompactKvArgs& args) {
  if (nothing_to_move(args)) return;
  const CompactKvArgs plan = plan_compact_kv(args, kHostFeaturesPerBlock);
  // The emulated block's shared memory: one table, reused block after block.
  std::vector<int64_t> table(static_cast<size_t>(compact_kv_table_bytes(plan.path_width)) / sizeof(int64_t));
  dispatch_unit(plan.unit_bytes, [&](auto unit) {
    using Unit = decltype(unit);
    run_host_blocks(plan.batch_size * plan.num_splits, [&plan, &table](const SimtHostBlock& block, int64_t index) {
      compact_kv_detail::compact_kv_block<SimtHostBlock, Unit>(block, plan, table.data(), index);
    });
  });
}

}  // namespace specdec
