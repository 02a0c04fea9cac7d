// build_tree: ancestor masks, depths and positions (csrc/build_tree.cu); the
// outputs are allocated here.
#include <ATen/ops/empty.h>

#include <tuple>

#include "common.h"
#include "specdec/build_tree.cuh"

namespace specdec::bindings {
namespace {

using BuildTreeOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

void check_build_tree_args(const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes,
                           const std::optional<at::Tensor>& prefix_lens) {
  constexpr const char* op = "build_tree";
  check_index_tensor(parents, op, "parents", 2, "[B, N]");
  const bool sized = !symbolic(parents) && !symbolic(num_nodes) && !symbolic(prefix_lens);
  const auto check_vector = [&](const std::optional<at::Tensor>& tensor, const char* name) {
    if (!tensor.has_value()) return;
    check_index_tensor(*tensor, op, name, 1, "[B]");
    TORCH_CHECK_VALUE(!sized || tensor->size(0) == parents.size(0), "specdec_C::build_tree: `", name,
                      "` must have shape [B] = [", parents.size(0), "], got ", tensor->sizes());
    check_same_device(*tensor, op, name, parents, "parents");
  };
  check_vector(num_nodes, "num_nodes");
  check_vector(prefix_lens, "prefix_lens");
}

BuildTreeOutputs allocate_build_tree(const at::Tensor& parents) {
  const c10::SymInt batch_size = parents.sym_size(0);
  const c10::SymInt max_nodes = parents.sym_size(1);
  const c10::SymInt num_words = (max_nodes + (kMaskWordBits - 1)) / kMaskWordBits;
  const auto options = parents.options();
  return {at::empty_symint({batch_size, max_nodes, num_words}, options.dtype(at::kInt)),
          at::empty_symint({batch_size, max_nodes}, options.dtype(at::kInt)),
          at::empty_symint({batch_size, max_nodes}, options.dtype(at::kLong))};
}

BuildTreeArgs build_tree_args(const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes,
                              const std::optional<at::Tensor>& prefix_lens, const BuildTreeOutputs& outputs) {
  BuildTreeArgs args;
  args.parents = index_tensor(parents);
  args.parents_stride_b = parents.stride(0);
  args.parents_stride_n = parents.stride(1);
  if (num_nodes.has_value()) {
    args.num_nodes = index_tensor(*num_nodes);
    args.num_nodes_stride = num_nodes->stride(0);
  }
  if (prefix_lens.has_value()) {
    args.prefix_lens = index_tensor(*prefix_lens);
    args.prefix_lens_stride = prefix_lens->stride(0);
  }
  args.mask = std::get<0>(outputs).data_ptr<int32_t>();
  args.depth = std::get<1>(outputs).data_ptr<int32_t>();
  args.positions = std::get<2>(outputs).data_ptr<int64_t>();
  args.batch_size = parents.size(0);
  args.max_nodes = parents.size(1);
  args.num_words = std::get<0>(outputs).size(2);
  return args;
}

template <Backend backend>
BuildTreeOutputs build_tree(const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes,
                            const std::optional<at::Tensor>& prefix_lens) {
  check_build_tree_args(parents, num_nodes, prefix_lens);
  const c10::OptionalDeviceGuard device_guard(guarded_device(backend, parents.device()));
  BuildTreeOutputs outputs = allocate_build_tree(parents);
  if constexpr (backend == Backend::kHost) {
    build_tree_host(build_tree_args(parents, num_nodes, prefix_lens, outputs));
  } else if constexpr (backend == Backend::kCuda) {
    check_launch(launch_build_tree(build_tree_args(parents, num_nodes, prefix_lens, outputs),
                                   current_cuda_stream(parents.device())),
                 "build_tree");
  }
  return outputs;
}

}  // namespace
}  // namespace specdec::bindings

TORCH_LIBRARY_FRAGMENT(specdec_C, m) {
  // Tree metadata (include/specdec/build_tree.cuh): parents [B, N],
  // num_nodes and prefix_lens [B] or None, each int32 or int64. Returns mask
  // int32 [B, N, ceil(N/32)], depth int32 [B, N], positions int64 [B, N].
  m.def("build_tree(Tensor parents, Tensor? num_nodes, Tensor? prefix_lens) -> (Tensor mask, Tensor depth, "
        "Tensor positions)");
}

SPECDEC_REGISTER_BACKENDS("build_tree", specdec::bindings::build_tree)
