// Launcher of tree_attention (include/specdec/tree_attention.cuh holds the
// design and the block program): row tiles and splits, dispatch on the dtype
// and the head dim, the shared-memory opt-in, and the host implementation,
// which runs the same block program on an emulated block.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "specdec/host_block.cuh"
#include "specdec/tree_attention.cuh"
#include "specdec/tree_attention_mma.cuh"
#include "specdec/warp_mma.cuh"

namespace specdec {
namespace {

using tree_attention_detail::merge_element;
using tree_attention_detail::mma_shared_bytes;
using tree_attention_detail::mma_supports;
using tree_attention_detail::shared_bytes;

// Splits: about two blocks per SM, each split at least this many prefix
// keys (the Triton launcher's starting points; neither measured yet).
constexpr int64_t kBlocksPerMultiprocessor = 2;
constexpr int64_t kMinSplitKeys = 512;
// The host pretends to be a 4-block machine with 32-key splits, so CPU
// tests split small contexts (as the Triton launcher under the interpreter).
constexpr int64_t kHostBlocks = 4;
constexpr int64_t kHostMinSplitKeys = 32;
constexpr int kMergeThreads = 256;
constexpr int64_t kMaxMergeBlocks = int64_t{1} << 20;  // a grid-stride loop covers the rest
constexpr int kMaxDevices = 64;

int64_t cdiv(int64_t numerator, int64_t denominator) { return (numerator + denominator - 1) / denominator; }

// An attribute of the current device, asked once per device (the plan is
// made on every call); `fallback` when the runtime cannot say.
template <cudaDeviceAttr kAttribute>
int64_t device_attribute(int fallback) {
  static std::atomic<int> values[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) return fallback;
  if (device >= kMaxDevices) {
    int value = fallback;
    cudaDeviceGetAttribute(&value, kAttribute, device);
    return value;
  }
  int value = values[device].load(std::memory_order_relaxed);
  if (value == 0) {
    if (cudaDeviceGetAttribute(&value, kAttribute, device) != cudaSuccess || value < 1) value = fallback;
    values[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

int64_t multiprocessor_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(1); }

// Whether the call runs the tensor-core program (tree_attention_mma.cuh):
// 16-bit inputs, D = 64 or 128, and on the GPU a device with mma.sync for
// 16-bit inputs (compute capability 8.0 or later); the rest runs the SIMT
// program.
bool uses_mma(const TreeAttentionArgs& args, bool device) {
  if (args.dtype == AttentionDtype::kFloat32 || (args.head_dim != 64 && args.head_dim != 128)) return false;
  return !device || device_attribute<cudaDevAttrComputeCapabilityMajor>(0) >= 8;
}

// Calls body(Value{}, std::integral_constant<int, D>{}) for the args' dtype
// and head dim (one of tree_attention_supports_head_dim's).
template <class Body>
void dispatch_tree_attention(const TreeAttentionArgs& args, Body&& body) {
  const auto with_dim = [&](auto value) {
    switch (args.head_dim) {
      case 64:
        body(value, std::integral_constant<int, 64>{});
        break;
      case 128:
        body(value, std::integral_constant<int, 128>{});
        break;
      case 256:
        body(value, std::integral_constant<int, 256>{});
        break;
    }
  };
  switch (args.dtype) {
    case AttentionDtype::kFloat32:
      with_dim(float{});
      break;
    case AttentionDtype::kBFloat16:
      with_dim(BFloat16{});
      break;
    case AttentionDtype::kFloat16:
      with_dim(Float16{});
      break;
  }
}

// Rows of a tile for this head dim (the block type's tile shape).
template <class Block>
int64_t simt_tile_rows(int64_t head_dim) {
  return (Block::kThreads / Block::kWarpSize) * tree_attention_detail::rows_per_warp(static_cast<int>(head_dim));
}
static_assert(HostWarpBlock::kWarps * 16 >= kTreeAttentionMinTileRows &&
                  DeviceWarpBlock::kWarps * 16 >= kTreeAttentionMinTileRows,
              "merge_counters are sized by the smallest tensor-core tile");

int64_t tile_rows(const TreeAttentionArgs& args, bool device, bool mma) {
  if (device) return mma ? DeviceWarpBlock::kWarps * 16 : simt_tile_rows<DeviceBlock>(args.head_dim);
  return mma ? HostWarpBlock::kWarps * 16 : simt_tile_rows<SimtHostBlock>(args.head_dim);
}

// Whether every head of `values` (q or a cache) is contiguous and starts on
// a 16-byte boundary (`element_bytes` divides 16).
bool heads_in_16_bytes(const StridedValues& values, int64_t element_bytes) {
  const int64_t per_load = 16 / element_bytes;
  return values.stride[3] == 1 && values.stride[0] % per_load == 0 && values.stride[1] % per_load == 0 &&
         values.stride[2] % per_load == 0 && reinterpret_cast<uintptr_t>(values.data) % 16 == 0;
}

int64_t element_bytes(AttentionDtype dtype) { return dtype == AttentionDtype::kFloat32 ? 4 : 2; }

// Whether the tensor-core program copies Q, K and V 16 bytes at a time
// (its kLoads16Bytes instantiation): all three have contiguous, aligned heads.
bool mma_loads_16_bytes(const TreeAttentionArgs& planned) {
  return planned.cache_loads_16_bytes && heads_in_16_bytes(planned.q, element_bytes(planned.dtype));
}

TreeAttentionArgs plan(const TreeAttentionArgs& args, bool device, bool mma) {
  TreeAttentionArgs planned = args;
  if (!mma) planned.merge_counters = nullptr;  // the SIMT program merges by a second launch only
  planned.row_tiles = cdiv(args.max_nodes * (args.num_q_heads / args.num_kv_heads), tile_rows(args, device, mma));
  const int64_t bytes = element_bytes(args.dtype);
  planned.cache_loads_16_bytes = heads_in_16_bytes(args.k_cache, bytes) && heads_in_16_bytes(args.v_cache, bytes);
  return planned;
}

bool nothing_to_compute(const TreeAttentionArgs& args) {
  return args.batch_size == 0 || args.max_nodes == 0 || args.num_q_heads == 0;
}

// Lets the kernel instantiation use `bytes` of dynamic shared memory on the
// current device (above 48 KiB it must opt in), once per device.
cudaError_t allow_shared_memory(const void* kernel, int64_t bytes, std::atomic<uint64_t>& done_devices) {
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (done_devices.load(std::memory_order_relaxed) & bit) != 0) return cudaSuccess;
  status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (status == cudaSuccess) done_devices.fetch_or(bit, std::memory_order_relaxed);
  return status;
}

}  // namespace

int64_t tree_attention_num_splits(const TreeAttentionArgs& args, int64_t requested, bool device) {
  if (requested > 0) return requested;
  if (nothing_to_compute(args)) return 1;
  const int64_t row_tiles = plan(args, device, uses_mma(args, device)).row_tiles;
  const int64_t blocks = args.batch_size * args.num_kv_heads * row_tiles;
  const int64_t wanted = device ? kBlocksPerMultiprocessor * multiprocessor_count() : kHostBlocks;
  // The table's span bounds every prefix: the count comes from shapes only.
  const int64_t capacity = args.max_blocks * args.block_size;
  int64_t splits = cdiv(wanted, blocks);
  const int64_t by_length = cdiv(capacity, device ? kMinSplitKeys : kHostMinSplitKeys);
  splits = splits < by_length ? splits : by_length;
  splits = splits < kTreeAttentionMaxAutoSplits ? splits : kTreeAttentionMaxAutoSplits;
  return splits > 1 ? splits : 1;
}

namespace {

// Runs `kernel` (a (blocks, splits) grid of `threads` threads and `bytes` of
// dynamic shared memory), then, unless its last splits merge, the merge of
// the splits.
template <class Value, class Kernel>
cudaError_t launch_with_merge(const TreeAttentionArgs& planned, Kernel kernel, int threads, int64_t bytes,
                              std::atomic<uint64_t>& opted_in_devices, cudaStream_t stream) {
  cudaError_t status = allow_shared_memory(reinterpret_cast<const void*>(kernel), bytes, opted_in_devices);
  if (status != cudaSuccess) return status;
  const int64_t programs = planned.batch_size * planned.num_kv_heads * planned.row_tiles;
  const dim3 grid(static_cast<unsigned>(programs), static_cast<unsigned>(planned.num_splits));
  kernel<<<grid, threads, static_cast<size_t>(bytes), stream>>>(planned);
  status = cudaGetLastError();
  if (status != cudaSuccess || planned.num_splits == 1 || planned.merge_counters != nullptr) return status;
  const int64_t elements = planned.batch_size * planned.max_nodes * planned.num_q_heads * planned.head_dim;
  const int64_t merge_blocks = cdiv(elements, kMergeThreads);
  tree_attention_detail::tree_attention_merge_kernel<Value>
      <<<static_cast<unsigned>(merge_blocks < kMaxMergeBlocks ? merge_blocks : kMaxMergeBlocks), kMergeThreads, 0,
         stream>>>(planned, elements);
  return cudaGetLastError();
}

// The merge of the splits' partial states into the output, on the host
// (unless the block program's last splits merged).
template <class Value>
void merge_on_host(const TreeAttentionArgs& planned) {
  if (planned.num_splits == 1 || planned.merge_counters != nullptr) return;
  const int64_t elements = planned.batch_size * planned.max_nodes * planned.num_q_heads * planned.head_dim;
  for (int64_t index = 0; index < elements; ++index) merge_element<Value>(planned, index);
}

}  // namespace

cudaError_t launch_tree_attention(const TreeAttentionArgs& args, cudaStream_t stream) {
  if (nothing_to_compute(args)) return cudaSuccess;
  if (!tree_attention_supports_head_dim(args.head_dim)) return cudaErrorInvalidValue;
  const bool mma = uses_mma(args, true);
  const TreeAttentionArgs planned = plan(args, true, mma);
  const int64_t programs = planned.batch_size * planned.num_kv_heads * planned.row_tiles;
  if (programs > 0x7FFFFFFF || planned.num_splits > 65535) return cudaErrorInvalidConfiguration;
  cudaError_t status = cudaSuccess;
  dispatch_tree_attention(planned, [&](auto value, auto dim) {
    using Value = decltype(value);
    constexpr int kHeadDim = decltype(dim)::value;
    if constexpr (mma_supports<Value>(kHeadDim)) {
      if (mma) {
        dispatch_bool(mma_loads_16_bytes(planned), [&](auto wide) {
          static std::atomic<uint64_t> opted_in_devices{0};
          status = launch_with_merge<Value>(
              planned, tree_attention_detail::tree_attention_mma_kernel<Value, kHeadDim, decltype(wide)::value>,
              DeviceWarpBlock::kWarps * kMmaWarpSize, mma_shared_bytes<DeviceWarpBlock, Value, kHeadDim>(),
              opted_in_devices, stream);
        });
        return;
      }
    }
    static std::atomic<uint64_t> opted_in_devices{0};
    status = launch_with_merge<Value>(planned, tree_attention_detail::tree_attention_kernel<Value, kHeadDim>,
                                      DeviceBlock::kThreads, shared_bytes<DeviceBlock, kHeadDim>(), opted_in_devices,
                                      stream);
  });
  return status;
}

void tree_attention_host(const TreeAttentionArgs& args) {
  if (nothing_to_compute(args)) return;
  const bool mma = uses_mma(args, false);
  const TreeAttentionArgs planned = plan(args, false, mma);
  const int64_t blocks = planned.batch_size * planned.num_kv_heads * planned.row_tiles * planned.num_splits;
  dispatch_tree_attention(planned, [&](auto value, auto dim) {
    using Value = decltype(value);
    constexpr int kHeadDim = decltype(dim)::value;
    if constexpr (mma_supports<Value>(kHeadDim)) {
      // The emulated block's shared memory, reused block after block.
      std::vector<int64_t> tiles(static_cast<size_t>(cdiv(mma_shared_bytes<HostWarpBlock, Value, kHeadDim>(), 8)));
      dispatch_bool(mma_loads_16_bytes(planned), [&](auto wide) {
        run_host_warp_blocks(blocks, [&](const HostWarpBlock& block, int64_t index) {
          tree_attention_detail::tree_attention_mma_block<HostWarpBlock, Value, kHeadDim, decltype(wide)::value>(
              block, planned, tiles.data(), index / planned.num_splits, index % planned.num_splits);
        });
      });
    } else {
      std::vector<int64_t> tiles(static_cast<size_t>(cdiv(shared_bytes<SimtHostBlock, kHeadDim>(), 8)));
      run_host_blocks(blocks, [&](const SimtHostBlock& block, int64_t index) {
        tree_attention_detail::tree_attention_block<SimtHostBlock, Value, kHeadDim>(
            block, planned, tiles.data(), index / planned.num_splits, index % planned.num_splits);
      });
    }
    merge_on_host<Value>(planned);
  });
}

}  // namespace specdec
