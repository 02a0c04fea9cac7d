// tree_attention: attention of tree nodes over a paged KV cache
// (csrc/tree_attention.cu). The output and, with splits, the partial states
// are allocated here.
#include <ATen/ops/empty.h>

#include <cmath>

#include "common.h"
#include "specdec/build_tree.cuh"  // kMaskWordBits
#include "specdec/tree_attention.cuh"

namespace specdec::bindings {
namespace {

constexpr int64_t kTreeAttentionMaxSplits = 65535;  // gridDim.y

void check_tree_attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& prefix_lens,
                               const at::Tensor& tree_mask, const std::optional<at::Tensor>& num_nodes,
                               int64_t num_splits, const std::optional<at::Tensor>& merge_counters) {
  constexpr const char* op = "tree_attention";
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "specdec_C::tree_attention: `q` must be Float, BFloat16 or Half, got ", dtype);
  TORCH_CHECK_VALUE(q.dim() == 4, "specdec_C::tree_attention: `q` must have shape [B, N, Hq, D], got ", q.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4, "specdec_C::tree_attention: `k_cache` must have shape "
                    "[num_blocks, block_size, Hkv, D], got ", k_cache.sizes());
  TORCH_CHECK_TYPE(k_cache.scalar_type() == dtype, "specdec_C::tree_attention: `k_cache` must be ", dtype,
                   " (the dtype of `q`), got ", k_cache.scalar_type());
  TORCH_CHECK_TYPE(v_cache.scalar_type() == dtype, "specdec_C::tree_attention: `v_cache` must be ", dtype,
                   " (the dtype of `q`), got ", v_cache.scalar_type());
  check_same_device(k_cache, op, "k_cache", q, "q");
  check_same_device(v_cache, op, "v_cache", q, "q");
  check_index_tensor(block_tables, op, "block_tables", 2, "[B, max_blocks]");
  check_same_device(block_tables, op, "block_tables", q, "q");
  check_index_tensor(prefix_lens, op, "prefix_lens", 1, "[B]");
  check_same_device(prefix_lens, op, "prefix_lens", q, "q");
  check_dtype(tree_mask, op, "tree_mask", at::kInt);
  TORCH_CHECK_VALUE(tree_mask.dim() == 3, "specdec_C::tree_attention: `tree_mask` must have shape "
                    "[B, N, ceil(N/32)], got ", tree_mask.sizes());
  check_same_device(tree_mask, op, "tree_mask", q, "q");
  if (num_nodes.has_value()) {
    check_index_tensor(*num_nodes, op, "num_nodes", 1, "[B]");
    check_same_device(*num_nodes, op, "num_nodes", q, "q");
  }
  TORCH_CHECK_VALUE(num_splits >= 0 && num_splits <= kTreeAttentionMaxSplits, "specdec_C::tree_attention: "
                    "`num_splits` must be in [0, ", kTreeAttentionMaxSplits, "] (0: the launcher's choice), got ",
                    num_splits);
  if (merge_counters.has_value()) {
    check_dtype(*merge_counters, op, "merge_counters", at::kInt);
    check_same_device(*merge_counters, op, "merge_counters", q, "q");
  }
  if (symbolic(q) || symbolic(k_cache) || symbolic(v_cache) || symbolic(block_tables) || symbolic(prefix_lens) ||
      symbolic(tree_mask) || symbolic(num_nodes) || symbolic(merge_counters)) {
    return;
  }
  const int64_t batch_size = q.size(0);
  const int64_t max_nodes = q.size(1);
  const int64_t head_dim = q.size(3);
  TORCH_CHECK_VALUE(tree_attention_supports_head_dim(head_dim), "specdec_C::tree_attention: `q` must have a head "
                    "dimension D in (64, 128, 256) (the compiled kernels), got shape ", q.sizes());
  TORCH_CHECK_VALUE(k_cache.size(3) == head_dim, "specdec_C::tree_attention: `k_cache` must have shape "
                    "[num_blocks, block_size, Hkv, D] with D = ", head_dim, " (the head dim of `q`), got ",
                    k_cache.sizes());
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "specdec_C::tree_attention: `v_cache` must have shape ",
                    k_cache.sizes(), " (the shape of `k_cache`), got ", v_cache.sizes());
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK_VALUE(kv_heads >= 1 && q.size(2) % kv_heads == 0, "specdec_C::tree_attention: query heads must be a "
                    "multiple of KV heads (Hq % Hkv == 0); got Hq = ", q.size(2), " (`q`), Hkv = ", kv_heads,
                    " (`k_cache`)");
  const int64_t block_size = k_cache.size(1);
  TORCH_CHECK_VALUE(block_size >= 1 && (block_size & (block_size - 1)) == 0, "specdec_C::tree_attention: "
                    "`k_cache` must have a power-of-two block size (dim 1), got shape ", k_cache.sizes());
  TORCH_CHECK_VALUE(block_tables.size(0) == batch_size, "specdec_C::tree_attention: `block_tables` must have "
                    "shape [B, max_blocks] with B = ", batch_size, " (the batch of `q`), got ", block_tables.sizes());
  TORCH_CHECK_VALUE(prefix_lens.size(0) == batch_size, "specdec_C::tree_attention: `prefix_lens` must have shape "
                    "[B] = [", batch_size, "], got ", prefix_lens.sizes());
  const int64_t words = (max_nodes + (kMaskWordBits - 1)) / kMaskWordBits;
  TORCH_CHECK_VALUE(tree_mask.size(0) == batch_size && tree_mask.size(1) == max_nodes && tree_mask.size(2) == words,
                    "specdec_C::tree_attention: `tree_mask` must have shape [B, N, ceil(N/32)] = [", batch_size,
                    ", ", max_nodes, ", ", words, "], got ", tree_mask.sizes());
  TORCH_CHECK_VALUE(!num_nodes.has_value() || num_nodes->size(0) == batch_size, "specdec_C::tree_attention: "
                    "`num_nodes` must have shape [B] = [", batch_size, "], got ", num_nodes->sizes());
  if (merge_counters.has_value()) {
    const int64_t rows = max_nodes * (q.size(2) / kv_heads);
    const int64_t counters =
        batch_size * kv_heads * ((rows + kTreeAttentionMinTileRows - 1) / kTreeAttentionMinTileRows);
    TORCH_CHECK_VALUE(merge_counters->dim() == 1 && merge_counters->is_contiguous() &&
                          merge_counters->numel() >= counters,
                      "specdec_C::tree_attention: `merge_counters` must be a contiguous [M] tensor with M >= "
                      "B * Hkv * ceil(N * Hq / Hkv / ", kTreeAttentionMinTileRows, ") = ", counters, ", got ",
                      merge_counters->sizes());
  }
}

AttentionDtype attention_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat ? AttentionDtype::kFloat32
                             : dtype == at::kBFloat16 ? AttentionDtype::kBFloat16 : AttentionDtype::kFloat16;
}

StridedValues strided_values(const at::Tensor& tensor) {
  StridedValues view;
  view.data = tensor.data_ptr();
  for (int dim = 0; dim < 4; ++dim) view.stride[dim] = tensor.stride(dim);
  return view;
}

// The output [B, N, Hq, D] (contiguous), then the partial states when the
// launch splits; `device`: planned for the GPU or the host program.
at::Tensor run_tree_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& prefix_lens,
                              const at::Tensor& tree_mask, const std::optional<at::Tensor>& num_nodes,
                              std::optional<double> scale, int64_t num_splits,
                              const std::optional<at::Tensor>& merge_counters, bool device) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  TreeAttentionArgs args;
  args.q = strided_values(q);
  args.k_cache = strided_values(k_cache);
  args.v_cache = strided_values(v_cache);
  args.block_tables = index_tensor(block_tables);
  args.tables_stride_b = block_tables.stride(0);
  args.tables_stride_m = block_tables.stride(1);
  args.prefix_lens = index_tensor(prefix_lens);
  args.prefix_stride = prefix_lens.stride(0);
  args.tree_mask = tree_mask.data_ptr<int32_t>();
  args.mask_stride_b = tree_mask.stride(0);
  args.mask_stride_n = tree_mask.stride(1);
  args.mask_stride_w = tree_mask.stride(2);
  if (num_nodes.has_value()) {
    args.num_nodes = index_tensor(*num_nodes);
    args.num_nodes_stride = num_nodes->stride(0);
  }
  args.out = out.data_ptr();
  args.dtype = attention_dtype(q.scalar_type());
  args.batch_size = q.size(0);
  args.max_nodes = q.size(1);
  args.num_q_heads = q.size(2);
  args.head_dim = q.size(3);
  args.num_blocks = k_cache.size(0);
  args.block_size = k_cache.size(1);
  args.num_kv_heads = k_cache.size(2);
  args.max_blocks = block_tables.size(1);
  while ((int64_t{1} << args.block_size_log2) < args.block_size) ++args.block_size_log2;
  const double softmax_scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(args.head_dim));
  args.scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);  // log2(e)
  args.num_splits = tree_attention_num_splits(args, num_splits, device);
  at::Tensor partial_acc, partial_max, partial_sum;
  if (args.num_splits > 1) {
    const int64_t partial_rows = out.numel() / args.head_dim * args.num_splits;
    const auto options = q.options().dtype(at::kFloat);
    partial_acc = at::empty({partial_rows, args.head_dim}, options);
    partial_max = at::empty({partial_rows}, options);
    partial_sum = at::empty({partial_rows}, options);
    args.partial_acc = partial_acc.data_ptr<float>();
    args.partial_max = partial_max.data_ptr<float>();
    args.partial_sum = partial_sum.data_ptr<float>();
    if (merge_counters.has_value()) args.merge_counters = merge_counters->data_ptr<int32_t>();
  }
  if (device) {
    check_launch(launch_tree_attention(args, current_cuda_stream(q.device())), "tree_attention");
  } else {
    tree_attention_host(args);
  }
  // The partial states go back to the caching allocator in stream order.
  return out;
}

template <Backend backend>
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& prefix_lens, const at::Tensor& tree_mask,
                          const std::optional<at::Tensor>& num_nodes, std::optional<double> scale, int64_t num_splits,
                          const std::optional<at::Tensor>& merge_counters) {
  check_tree_attention_args(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, num_splits,
                            merge_counters);
  if constexpr (backend == Backend::kMeta) {
    return at::empty_symint(q.sym_sizes(), q.options());
  } else {
    const c10::OptionalDeviceGuard device_guard(guarded_device(backend, q.device()));
    return run_tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, scale,
                              num_splits, merge_counters, backend == Backend::kCuda);
  }
}

}  // namespace
}  // namespace specdec::bindings

TORCH_LIBRARY_FRAGMENT(specdec_C, m) {
  // Attention of tree nodes over a paged KV cache
  // (include/specdec/tree_attention.cuh): q [B, N, Hq, D] with D in (64,
  // 128, 256), caches [num_blocks, block_size, Hkv, D] of q's dtype (Float,
  // BFloat16 or Half; any strides; block_size a power of two), block_tables
  // [B, max_blocks], prefix_lens and num_nodes [B] (int32 or int64),
  // tree_mask int32 [B, N, ceil(N/32)]. scale None: D ** -0.5.
  // `num_splits`: KV splits per block, 0 for the launcher's choice (tests
  // force other counts). `merge_counters` int32 [>= B * Hkv * ceil(N * Hq /
  // Hkv / 32)] or None: with a split, the tensor-core program's last split
  // of each block merges the block's rows (one launch), the counters zero
  // before the call and left zero; None (and the SIMT program): a second
  // launch merges. Returns out [B, N, Hq, D], contiguous.
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor prefix_lens, "
        "Tensor tree_mask, Tensor? num_nodes=None, float? scale=None, int num_splits=0, "
        "Tensor(a!)? merge_counters=None) -> Tensor");
}

SPECDEC_REGISTER_BACKENDS("tree_attention", specdec::bindings::tree_attention)
