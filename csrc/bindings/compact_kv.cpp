// compact_kv: the accepted path's K/V moved in place (csrc/compact_kv.cu).
#include "common.h"
#include "specdec/compact_kv.cuh"

namespace specdec::bindings {
namespace {

void check_compact_kv_args(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& prefix_lens, const at::Tensor& accepted_nodes) {
  constexpr const char* op = "compact_kv";
  const int64_t element_bytes = k_cache.element_size();
  TORCH_CHECK_TYPE(element_bytes == 1 || element_bytes == 2 || element_bytes == 4 || element_bytes == 8 ||
                       element_bytes == 16,
                   "specdec_C::compact_kv: `k_cache` must have elements of 1, 2, 4, 8 or 16 bytes (moves copy "
                   "bits), got ",
                   k_cache.scalar_type());
  TORCH_CHECK_VALUE(k_cache.dim() == 4, "specdec_C::compact_kv: `k_cache` must have shape "
                                        "[num_blocks, block_size, Hkv, D], got ",
                    k_cache.sizes());
  TORCH_CHECK_TYPE(v_cache.scalar_type() == k_cache.scalar_type(), "specdec_C::compact_kv: `v_cache` must be ",
                   k_cache.scalar_type(), " (the dtype of `k_cache`), got ", v_cache.scalar_type());
  check_same_device(v_cache, op, "v_cache", k_cache, "k_cache");
  check_index_tensor(block_tables, op, "block_tables", 2, "[B, max_blocks]");
  check_same_device(block_tables, op, "block_tables", k_cache, "k_cache");
  check_index_tensor(prefix_lens, op, "prefix_lens", 1, "[B]");
  check_same_device(prefix_lens, op, "prefix_lens", k_cache, "k_cache");
  check_index_tensor(accepted_nodes, op, "accepted_nodes", 2, "[B, N]");
  check_same_device(accepted_nodes, op, "accepted_nodes", k_cache, "k_cache");
  if (symbolic(k_cache) || symbolic(v_cache) || symbolic(block_tables) || symbolic(prefix_lens) ||
      symbolic(accepted_nodes)) {
    return;
  }
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "specdec_C::compact_kv: `v_cache` must have shape ",
                    k_cache.sizes(), " (the shape of `k_cache`), got ", v_cache.sizes());
  const int64_t batch_size = accepted_nodes.size(0);
  TORCH_CHECK_VALUE(accepted_nodes.size(1) <= kCompactMaxPath, "specdec_C::compact_kv: `accepted_nodes` must have "
                    "at most ", kCompactMaxPath, " columns (a block holds one unit of every move between its "
                    "loads and its stores), got ", accepted_nodes.sizes());
  TORCH_CHECK_VALUE(block_tables.size(0) == batch_size, "specdec_C::compact_kv: `block_tables` must have shape "
                    "[B, max_blocks] with B = ", batch_size, " (the rows of `accepted_nodes`), got ",
                    block_tables.sizes());
  TORCH_CHECK_VALUE(prefix_lens.size(0) == batch_size, "specdec_C::compact_kv: `prefix_lens` must have shape [B] = [",
                    batch_size, "], got ", prefix_lens.sizes());
}

CompactKvCache compact_kv_cache(const at::Tensor& cache) {
  CompactKvCache view;
  view.data = cache.data_ptr();
  view.stride_block = cache.stride(0);
  view.stride_slot = cache.stride(1);
  view.stride_head = cache.stride(2);
  view.stride_unit = cache.stride(3);
  return view;
}

CompactKvArgs compact_kv_args(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                              const at::Tensor& prefix_lens, const at::Tensor& accepted_nodes) {
  CompactKvArgs args;
  args.k_cache = compact_kv_cache(k_cache);
  args.v_cache = compact_kv_cache(v_cache);
  args.unit_bytes = k_cache.element_size();
  args.num_blocks = k_cache.size(0);
  args.block_size = k_cache.size(1);
  args.num_heads = k_cache.size(2);
  args.units_per_head = k_cache.size(3);
  args.block_tables = index_tensor(block_tables);
  args.tables_stride_b = block_tables.stride(0);
  args.tables_stride_m = block_tables.stride(1);
  args.max_blocks = block_tables.size(1);
  args.prefix_lens = index_tensor(prefix_lens);
  args.prefix_stride = prefix_lens.stride(0);
  args.accepted_nodes = index_tensor(accepted_nodes);
  args.accepted_stride_b = accepted_nodes.stride(0);
  args.accepted_stride_n = accepted_nodes.stride(1);
  args.path_width = accepted_nodes.size(1);
  args.batch_size = accepted_nodes.size(0);
  return args;
}

template <Backend backend>
void compact_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                const at::Tensor& prefix_lens, const at::Tensor& accepted_nodes) {
  check_compact_kv_args(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes);
  const c10::OptionalDeviceGuard device_guard(guarded_device(backend, k_cache.device()));
  if constexpr (backend == Backend::kHost) {
    compact_kv_host(compact_kv_args(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes));
  } else if constexpr (backend == Backend::kCuda) {
    check_launch(launch_compact_kv(compact_kv_args(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes),
                                   current_cuda_stream(k_cache.device())),
                 "compact_kv");
  }
}

}  // namespace
}  // namespace specdec::bindings

TORCH_LIBRARY_FRAGMENT(specdec_C, m) {
  // The accepted path's K/V moved in place (include/specdec/compact_kv.cuh):
  // caches [num_blocks, block_size, Hkv, D] of one dtype (any strides; bits
  // are copied), block_tables [B, max_blocks], prefix_lens [B],
  // accepted_nodes [B, N] with N <= 1024, each int32 or int64.
  m.def("compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_tables, Tensor prefix_lens, "
        "Tensor accepted_nodes) -> ()");
}

SPECDEC_REGISTER_BACKENDS("compact_kv", specdec::bindings::compact_kv)
