// The shared checks and conversions of the bindings (common.h says what each does).
#include "common.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace specdec::bindings {

cudaStream_t current_cuda_stream(c10::Device device) {
  return static_cast<cudaStream_t>(
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle());
}

void check_launch(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, "specdec_C::", op, ": kernel launch failed: ", cudaGetErrorString(status));
}

void check_dtype(const at::Tensor& tensor, const char* op, const char* name, at::ScalarType expected) {
  TORCH_CHECK_TYPE(tensor.scalar_type() == expected, "specdec_C::", op, ": `", name, "` must be ", expected,
                   ", got ", tensor.scalar_type());
}

bool symbolic(const at::Tensor& tensor) { return tensor.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); }

bool symbolic(const std::optional<at::Tensor>& tensor) { return tensor.has_value() && symbolic(*tensor); }

void check_index_tensor(const at::Tensor& tensor, const char* op, const char* name, int64_t dim, const char* shape) {
  TORCH_CHECK_TYPE(tensor.scalar_type() == at::kInt || tensor.scalar_type() == at::kLong, "specdec_C::", op, ": `",
                   name, "` must be Int or Long, got ", tensor.scalar_type());
  TORCH_CHECK_VALUE(tensor.dim() == dim, "specdec_C::", op, ": `", name, "` must have shape ", shape, ", got ",
                    tensor.sizes());
}

void check_same_device(const at::Tensor& tensor, const char* op, const char* name, const at::Tensor& first,
                       const char* first_name) {
  TORCH_CHECK_VALUE(tensor.device() == first.device(), "specdec_C::", op, ": `", name, "` must be on ",
                    first.device(), " (the device of `", first_name, "`), got ", tensor.device());
}

IndexTensor index_tensor(const at::Tensor& tensor) {
  IndexTensor index;
  index.data = tensor.data_ptr();
  index.wide = tensor.scalar_type() == at::kLong;
  return index;
}

void check_batch_vector(const std::optional<at::Tensor>& tensor, const char* op, const char* name,
                        at::ScalarType dtype, int64_t batch_size, const at::Tensor& target) {
  if (!tensor.has_value()) return;
  check_dtype(*tensor, op, name, dtype);
  TORCH_CHECK_VALUE(tensor->dim() == 1 && tensor->size(0) == batch_size, "specdec_C::", op, ": `", name,
                    "` must have shape [B] = [", batch_size, "], got ", tensor->sizes());
  check_same_device(*tensor, op, name, target, "target");
}

void check_launch_stamp(int64_t stamp, const char* op) {
  TORCH_CHECK_VALUE(stamp >= (int64_t{1} << 40) && stamp < (int64_t{1} << 61), "specdec_C::", op,
                    ": `stamp` must be in [2**40, 2**61) (a number drawn per launch), got ", stamp);
}

void check_fault_counters(const std::optional<at::Tensor>& errors, const char* op, const at::Tensor& target) {
  if (!errors.has_value()) return;
  check_dtype(*errors, op, "errors", at::kInt);
  TORCH_CHECK_VALUE(errors->dim() == 1 && errors->is_contiguous() && errors->numel() >= kFaultKinds, "specdec_C::",
                    op, ": `errors` must be a contiguous [N] tensor with N >= ", kFaultKinds, ", got ",
                    errors->sizes());
  check_same_device(*errors, op, "errors", target, "target");
}

int32_t* fault_counters(const std::optional<at::Tensor>& errors) {
  return errors.has_value() ? errors->data_ptr<int32_t>() : nullptr;
}

void check_random_state(const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                        const char* op, int64_t batch_size, const at::Tensor& target) {
  check_batch_vector(seed, op, "seed", at::kLong, batch_size, target);
  if (!offset.has_value()) return;
  check_dtype(*offset, op, "offset", at::kLong);
  TORCH_CHECK_VALUE(offset->dim() == 0 || (offset->dim() == 1 && offset->size(0) == batch_size), "specdec_C::", op,
                    ": `offset` must have shape [] or [B] = [", batch_size, "], got ", offset->sizes());
  check_same_device(*offset, op, "offset", target, "target");
}

std::optional<at::Tensor> contiguous_or_none(const std::optional<at::Tensor>& tensor) {
  return tensor.has_value() ? std::optional<at::Tensor>(tensor->contiguous()) : std::nullopt;
}

void check_token_rows(const at::Tensor& rows, const char* op, const char* name, const char* shape, int64_t batch_size,
                      int64_t width, const at::Tensor& target) {
  check_dtype(rows, op, name, at::kInt);
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.size(0) == batch_size && rows.size(1) == width &&
                        (rows.stride(1) == 1 || width == 1),
                    "specdec_C::", op, ": `", name, "` must have shape ", shape, " = [", batch_size, ", ", width,
                    "] with a contiguous last dim, got ", rows.sizes(), " with strides ", rows.strides());
  check_same_device(rows, op, name, target, "target");
}

void check_counts_output(const at::Tensor& counts, const char* op, const char* name, int64_t batch_size,
                         const at::Tensor& target) {
  check_dtype(counts, op, name, at::kInt);
  TORCH_CHECK_VALUE(counts.dim() == 1 && counts.size(0) == batch_size && (counts.stride(0) == 1 || batch_size <= 1),
                    "specdec_C::", op, ": `", name, "` must be a contiguous [B] = [", batch_size, "] tensor, got ",
                    counts.sizes());
  check_same_device(counts, op, name, target, "target");
}

RngArgs rng_args_of(const std::optional<at::Tensor>& seed, int64_t seed_value,
                    const std::optional<at::Tensor>& offset, int64_t offset_value) {
  RngArgs args;
  args.seed_value = seed_value;
  args.offset_value = offset_value;
  if (seed.has_value()) args.seed_ptr = seed->data_ptr<int64_t>();
  if (offset.has_value()) {
    args.offset_ptr = offset->data_ptr<int64_t>();
    args.offset_per_request = offset->dim() == 1;
  }
  return args;
}

bool is_probability_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

ProbDtype probability_dtype(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? ProbDtype::kBFloat16 : (dtype == at::kHalf ? ProbDtype::kFloat16 : ProbDtype::kFloat32);
}

void prepare_distributions(const at::Tensor& target, const std::optional<at::Tensor>& draft, at::Tensor& target_out,
                           std::optional<at::Tensor>& draft_out) {
  target_out = target.stride(-1) == 1 ? target : target.contiguous();
  if (draft.has_value()) draft_out = draft->stride(-1) == 1 ? *draft : draft->contiguous();
  if (draft_out.has_value() && draft_out->scalar_type() != target_out.scalar_type()) {
    target_out = target_out.to(at::kFloat);
    draft_out = draft_out->to(at::kFloat);
  }
}

void check_sampling_parameters(const SamplingParameterTensors& t, const char* op, int64_t batch_size,
                               const at::Tensor& target) {
  for (const auto& [tensor, name] : {std::pair{&t.top_k, "top_k"}, std::pair{&t.bonus_token_ids, "bonus_token_ids"}}) {
    if (!tensor->has_value()) continue;
    check_index_tensor(**tensor, op, name, 1, "[B]");
    TORCH_CHECK_VALUE((*tensor)->size(0) == batch_size, "specdec_C::", op, ": `", name, "` must have shape [B] = [",
                      batch_size, "], got ", (*tensor)->sizes());
    check_same_device(**tensor, op, name, target, "target");
  }
  check_batch_vector(t.top_p, op, "top_p", at::kFloat, batch_size, target);
  check_batch_vector(t.min_p, op, "min_p", at::kFloat, batch_size, target);
}

}  // namespace specdec::bindings
