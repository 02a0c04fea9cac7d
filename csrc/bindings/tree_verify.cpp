// tree_verify: fused tree verification (csrc/tree_verify.cu), one block per
// request. The caller allocates the outputs and lends the workspace
// (specdec_kernels/launchers/tree_verify.py sizes it with
// cuda_workspace_specs and keeps it across calls).
#include <string>

#include "common.h"
#include "specdec/tree_verify.cuh"

namespace specdec::bindings {
namespace {

struct TreeVerifyTensors {
  const at::Tensor& tree_token_ids;
  const at::Tensor& parents;
  const at::Tensor& target;
  const std::optional<at::Tensor>& draft;
  const std::optional<at::Tensor>& num_nodes;
  const std::optional<at::Tensor>& temperature;
  c10::string_view draft_sampling;
  const std::optional<at::Tensor>& seed;
  const std::optional<at::Tensor>& offset;
  const at::Tensor& workspace;
  const at::Tensor& accepted_nodes;
  const at::Tensor& output_token_ids;
  const at::Tensor& num_accepted;
  SamplingParameterTensors sampling;
  const std::optional<at::Tensor>& stages;
  int64_t num_splits;
  const std::optional<at::Tensor>& errors;  // the device's fault counters, or none: not counted
  int64_t fault_role;                       // tests: the block of this role gives up its waits
  int64_t stamp;                            // split plan: this launch's number (faults.cuh, claims), 0: none
};

void check_tree_verify_args(const TreeVerifyTensors& t) {
  constexpr const char* op = "tree_verify";
  TORCH_CHECK_TYPE(is_probability_dtype(t.target.scalar_type()),
                   "specdec_C::tree_verify: `target` must be Float, BFloat16 or Half, got ", t.target.scalar_type());
  TORCH_CHECK_VALUE(t.target.dim() == 3, "specdec_C::tree_verify: `target` must have shape [B, N, V], got ",
                    t.target.sizes());
  const int64_t batch_size = t.target.size(0);
  const int64_t max_nodes = t.target.size(1);
  const int64_t vocab_size = t.target.size(2);
  TORCH_CHECK_VALUE(max_nodes >= 1 && max_nodes < (int64_t{1} << 24),
                    "specdec_C::tree_verify: the tree size N must be in [1, 2**24) (the RNG position word), got ",
                    max_nodes);
  TORCH_CHECK_VALUE(vocab_size >= 1 && vocab_size <= (int64_t{1} << 30),
                    "specdec_C::tree_verify: the vocabulary size V must be in [1, 2**30], got ", vocab_size);
  TORCH_CHECK_VALUE(t.draft_sampling == "with_replacement" || t.draft_sampling == "without_replacement",
                    "specdec_C::tree_verify: `draft_sampling` must be \"with_replacement\" or "
                    "\"without_replacement\", got \"", std::string(t.draft_sampling), "\"");
  const auto check_nodes = [&](const at::Tensor& tensor, const char* name) {
    TORCH_CHECK_VALUE(tensor.dim() == 2 && tensor.size(0) == batch_size && tensor.size(1) == max_nodes,
                      "specdec_C::tree_verify: `", name, "` must have shape [B, N] = [", batch_size, ", ", max_nodes,
                      "], got ", tensor.sizes());
    check_same_device(tensor, op, name, t.target, "target");
  };
  TORCH_CHECK_TYPE(t.tree_token_ids.scalar_type() == at::kInt || t.tree_token_ids.scalar_type() == at::kLong,
                   "specdec_C::tree_verify: `tree_token_ids` must be Int or Long, got ",
                   t.tree_token_ids.scalar_type());
  check_nodes(t.tree_token_ids, "tree_token_ids");
  check_dtype(t.parents, op, "parents", at::kInt);
  check_nodes(t.parents, "parents");
  if (t.draft.has_value()) {
    TORCH_CHECK_TYPE(is_probability_dtype(t.draft->scalar_type()),
                     "specdec_C::tree_verify: `draft` must be Float, BFloat16 or Half, got ", t.draft->scalar_type());
    TORCH_CHECK_VALUE(t.draft->sizes() == t.target.sizes(), "specdec_C::tree_verify: `draft` must have shape [B, N, V] = ",
                      t.target.sizes(), ", got ", t.draft->sizes());
    check_same_device(*t.draft, op, "draft", t.target, "target");
  }
  check_batch_vector(t.num_nodes, op, "num_nodes", at::kInt, batch_size, t.target);
  check_batch_vector(t.temperature, op, "temperature", at::kFloat, batch_size, t.target);
  check_random_state(t.seed, t.offset, op, batch_size, t.target);
  check_sampling_parameters(t.sampling, op, batch_size, t.target);

  const int64_t words = tree_verify_workspace_words(batch_size, vocab_size);
  check_dtype(t.workspace, op, "workspace", at::kLong);
  TORCH_CHECK_VALUE(t.workspace.dim() == 1 && t.workspace.is_contiguous() && t.workspace.numel() >= words,
                    "specdec_C::tree_verify: `workspace` must be a contiguous [M] tensor with M >= "
                    "B * (2 * ceil(3 * ceil(V / 1024) / 2) + 4 * ceil(V / 4)) = ",
                    words, ", got ", t.workspace.sizes());
  check_same_device(t.workspace, op, "workspace", t.target, "target");
  TORCH_CHECK_VALUE(t.num_splits >= 1 && t.num_splits <= 65536,
                    "specdec_C::tree_verify: `num_splits` must be in [1, 65536], got ", t.num_splits);
  if (t.num_splits > 1) {
    TORCH_CHECK_VALUE(max_nodes <= kMaxSplitNodes, "specdec_C::tree_verify: `num_splits` > 1 needs N <= ",
                      kMaxSplitNodes, " (the replay of a node's rejections), got N = ", max_nodes);
    const int64_t stage_words = tree_verify_stage_words(batch_size, max_nodes);
    TORCH_CHECK_VALUE(t.stages.has_value(), "specdec_C::tree_verify: `num_splits` > 1 needs `stages`");
    check_dtype(*t.stages, op, "stages", at::kLong);
    TORCH_CHECK_VALUE(t.stages->dim() == 1 && t.stages->is_contiguous() && t.stages->numel() >= stage_words,
                      "specdec_C::tree_verify: `stages` must be a contiguous [M] tensor with M >= "
                      "16 * B * (N + 1) = ", stage_words, ", got ", t.stages->sizes());
    check_same_device(*t.stages, op, "stages", t.target, "target");
  }
  if (t.stamp != 0) check_launch_stamp(t.stamp, op);
  check_fault_counters(t.errors, op, t.target);
  check_token_rows(t.accepted_nodes, op, "accepted_nodes", "[B, N]", batch_size, max_nodes, t.target);
  check_token_rows(t.output_token_ids, op, "output_token_ids", "[B, N]", batch_size, max_nodes, t.target);
  check_counts_output(t.num_accepted, op, "num_accepted", batch_size, t.target);
}

// Keeps the converted / contiguous inputs alive as long as the args point into them.
struct TreeVerifyInputs {
  at::Tensor target;
  std::optional<at::Tensor> draft, num_nodes, temperature, seed, offset;
  SamplingParameterInputs sampling;
  TreeVerifyArgs args;

  explicit TreeVerifyInputs(const SamplingParameterTensors& parameters) : sampling(parameters) {}
};

TreeVerifyInputs prepare_tree_verify(const TreeVerifyTensors& t, bool logits, int64_t seed_value,
                                     int64_t offset_value) {
  TreeVerifyInputs inputs(t.sampling);
  prepare_distributions(t.target, t.draft, inputs.target, inputs.draft);
  inputs.num_nodes = contiguous_or_none(t.num_nodes);
  inputs.temperature = contiguous_or_none(t.temperature);
  inputs.seed = contiguous_or_none(t.seed);
  inputs.offset = contiguous_or_none(t.offset);

  TreeVerifyArgs& args = inputs.args;
  args.tree_token_ids = t.tree_token_ids.data_ptr();
  args.ids_stride_b = t.tree_token_ids.stride(0);
  args.ids_stride_n = t.tree_token_ids.stride(1);
  args.token_dtype = t.tree_token_ids.scalar_type() == at::kLong ? TokenDtype::kInt64 : TokenDtype::kInt32;
  args.parents = t.parents.data_ptr<int32_t>();
  args.parents_stride_b = t.parents.stride(0);
  args.parents_stride_n = t.parents.stride(1);
  args.target = inputs.target.data_ptr();
  args.target_stride_b = inputs.target.stride(0);
  args.target_stride_n = inputs.target.stride(1);
  args.prob_dtype = probability_dtype(inputs.target.scalar_type());
  if (inputs.draft.has_value()) {
    args.draft = inputs.draft->data_ptr();
    args.draft_stride_b = inputs.draft->stride(0);
    args.draft_stride_n = inputs.draft->stride(1);
  }
  if (inputs.num_nodes.has_value()) args.num_nodes = inputs.num_nodes->data_ptr<int32_t>();
  if (inputs.temperature.has_value()) args.temperature = inputs.temperature->data_ptr<float>();
  args.logits = logits;
  args.without_replacement = t.draft_sampling == "without_replacement";
  inputs.sampling.set(args);
  args.rng = rng_args_of(inputs.seed, seed_value, inputs.offset, offset_value);
  args.accepted_nodes = t.accepted_nodes.data_ptr<int32_t>();
  args.accepted_stride_b = t.accepted_nodes.stride(0);
  args.output_token_ids = t.output_token_ids.data_ptr<int32_t>();
  args.output_stride_b = t.output_token_ids.stride(0);
  args.num_accepted = t.num_accepted.data_ptr<int32_t>();
  args.workspace = t.workspace.data_ptr<int64_t>();
  if (t.num_splits > 1) args.stages = t.stages->data_ptr<int64_t>();
  args.num_splits = static_cast<int32_t>(t.num_splits);
  args.errors = fault_counters(t.errors);
  args.fault_role = t.fault_role;
  args.stamp = t.stamp;
  args.batch_size = inputs.target.size(0);
  args.max_nodes = static_cast<int32_t>(inputs.target.size(1));
  args.vocab_size = static_cast<int32_t>(inputs.target.size(2));
  return inputs;
}

// Meta: dtypes and ranks under symbolic shapes, else every check.
void check_tree_verify_meta(const TreeVerifyTensors& t) {
  for (const at::Tensor* tensor : {&t.tree_token_ids, &t.parents, &t.target, &t.workspace, &t.accepted_nodes,
                                   &t.output_token_ids, &t.num_accepted}) {
    if (symbolic(*tensor)) {
      TORCH_CHECK_VALUE(t.target.dim() == 3 && t.tree_token_ids.dim() == 2 && t.parents.dim() == 2,
                        "specdec_C::tree_verify: `target` must be [B, N, V], `tree_token_ids` and `parents` [B, N]");
      return;
    }
  }
  check_tree_verify_args(t);
}

template <Backend backend>
void tree_verify(const at::Tensor& tree_token_ids, const at::Tensor& parents, const at::Tensor& target,
                 const std::optional<at::Tensor>& draft, const std::optional<at::Tensor>& num_nodes,
                 const std::optional<at::Tensor>& temperature, bool logits, c10::string_view draft_sampling,
                 const std::optional<at::Tensor>& seed, int64_t seed_value, const std::optional<at::Tensor>& offset,
                 int64_t offset_value, const at::Tensor& workspace, const at::Tensor& accepted_nodes,
                 const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                 const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                 const std::optional<at::Tensor>& min_p, const std::optional<at::Tensor>& bonus_token_ids,
                 const std::optional<at::Tensor>& stages, int64_t num_splits,
                 const std::optional<at::Tensor>& errors, int64_t fault_role, int64_t stamp) {
  const TreeVerifyTensors tensors = {tree_token_ids, parents, target, draft, num_nodes, temperature, draft_sampling,
                                     seed, offset, workspace, accepted_nodes, output_token_ids, num_accepted,
                                     {top_k, top_p, min_p, bonus_token_ids}, stages, num_splits, errors, fault_role,
                                     stamp};
  if constexpr (backend == Backend::kMeta) {
    check_tree_verify_meta(tensors);
  } else {
    check_tree_verify_args(tensors);
    const c10::OptionalDeviceGuard device_guard(guarded_device(backend, target.device()));
    const TreeVerifyInputs inputs = prepare_tree_verify(tensors, logits, seed_value, offset_value);
    if constexpr (backend == Backend::kHost) {
      tree_verify_host(inputs.args);
    } else {
      check_launch(launch_tree_verify(inputs.args, current_cuda_stream(target.device())), "tree_verify");
    }
  }
}

}  // namespace
}  // namespace specdec::bindings

TORCH_LIBRARY_FRAGMENT(specdec_C, m) {
  // Fused tree verification (include/specdec/tree_verify.cuh): writes
  // accepted_nodes and output_token_ids int32 [B, N] and num_accepted int32
  // [B]. Arguments as specdec::tree_verify, with seed/offset as in
  // rng_fill; `workspace` int64 [M], M >= B * (2 * ceil(3 * ceil(V / 1024)
  // / 2) + 4 * ceil(V / 4)), contents need not be initialised. The sampling
  // parameters, each [B] or None: top_k and bonus_token_ids int32/int64,
  // top_p and min_p float32. `num_splits` > 1: that many blocks share each
  // request's vocabulary passes through `stages`, int64 [>= 16 * B * (N + 1)]:
  // zero before the call and left zero after it. `errors` int32 [>= 2] or
  // None: the device's fault counters (faults.cuh) a wait that gives up
  // counts into; the request then gets tokens -1, accepted_nodes [0, -1, ...]
  // and num_accepted 0. `fault_role` (tests): the block of that role
  // (b * num_splits + rank) gives up its waits at once. `stamp`: a number
  // the caller draws for each launch, in [2**40, 2**61), or 0: with it the
  // first block of a split request claims its records for the launch and
  // zeroes them, whatever they held (faults.cuh), and the others wait for it.
  m.def(
      "tree_verify(Tensor tree_token_ids, Tensor parents, Tensor target, Tensor? draft, Tensor? num_nodes, "
      "Tensor? temperature, bool logits, str draft_sampling, Tensor? seed, int seed_value, Tensor? offset, "
      "int offset_value, Tensor(a!) workspace, Tensor(b!) accepted_nodes, Tensor(c!) output_token_ids, "
      "Tensor(d!) num_accepted, Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, "
      "Tensor? bonus_token_ids=None, Tensor(e!)? stages=None, int num_splits=1, Tensor(f!)? errors=None, "
      "int fault_role=-1, int stamp=0) -> ()");
}

SPECDEC_REGISTER_BACKENDS("tree_verify", specdec::bindings::tree_verify)
