// rng_fill: Philox words and uniforms of a block of counters (csrc/rng.cu),
// the test hook that checks every backend's generator against the reference.
#include <ATen/ops/empty.h>

#include <tuple>

#include "common.h"
#include "specdec/rng.cuh"

namespace specdec::bindings {
namespace {

using RngFillOutputs = std::tuple<at::Tensor, at::Tensor>;

void check_device(const at::Tensor& tensor, const char* op, const char* name, c10::Device expected) {
  TORCH_CHECK_VALUE(tensor.device() == expected, "specdec_C::", op, ": `", name, "` must be on ", expected,
                    " (the device of `positions`), got ", tensor.device());
}

void check_rng_fill_args(const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                         int64_t batch_size, int64_t stream, const at::Tensor& positions, int64_t num_indices) {
  constexpr const char* op = "rng_fill";
  TORCH_CHECK_VALUE(batch_size >= 0, "specdec_C::rng_fill: `batch_size` must be >= 0, got ", batch_size);
  TORCH_CHECK_VALUE(stream >= 0 && stream < 256, "specdec_C::rng_fill: `stream` must be in [0, 256), got ",
                    stream);
  TORCH_CHECK_VALUE(num_indices >= 0 && num_indices <= (int64_t{1} << 32),
                    "specdec_C::rng_fill: `num_indices` must be in [0, 2**32] (index is a 32-bit counter word), got ",
                    num_indices);
  check_dtype(positions, op, "positions", at::kLong);
  TORCH_CHECK_VALUE(positions.dim() == 1, "specdec_C::rng_fill: `positions` must have shape [P], got ",
                    positions.sizes());
  if (seed.has_value()) {
    check_dtype(*seed, op, "seed", at::kLong);
    check_device(*seed, op, "seed", positions.device());
    TORCH_CHECK_VALUE(seed->dim() == 1 && seed->size(0) == batch_size,
                      "specdec_C::rng_fill: `seed` must have shape [batch_size] = [", batch_size, "], got ",
                      seed->sizes());
  }
  if (offset.has_value()) {
    check_dtype(*offset, op, "offset", at::kLong);
    check_device(*offset, op, "offset", positions.device());
    TORCH_CHECK_VALUE(offset->dim() == 0 || (offset->dim() == 1 && offset->size(0) == batch_size),
                      "specdec_C::rng_fill: `offset` must have shape [] or [batch_size] = [", batch_size,
                      "], got ", offset->sizes());
  }
}

RngFillOutputs allocate_rng_fill(const at::Tensor& positions, int64_t batch_size, int64_t num_indices) {
  const int64_t num_positions = positions.size(0);
  const auto options = positions.options();
  return {at::empty({batch_size, num_positions, num_indices, 4}, options.dtype(at::kInt)),
          at::empty({batch_size, num_positions, num_indices}, options.dtype(at::kFloat))};
}

// Keeps the contiguous copies alive as long as the RngArgs pointing into them.
struct RngFillInputs {
  std::optional<at::Tensor> seed, offset;
  at::Tensor positions;
  RngArgs args;
};

RngFillInputs prepare_rng_fill(const std::optional<at::Tensor>& seed, int64_t seed_value,
                               const std::optional<at::Tensor>& offset, int64_t offset_value,
                               const at::Tensor& positions) {
  RngFillInputs inputs;
  inputs.positions = positions.contiguous();
  inputs.seed = contiguous_or_none(seed);
  inputs.offset = contiguous_or_none(offset);
  inputs.args = rng_args_of(inputs.seed, seed_value, inputs.offset, offset_value);
  return inputs;
}

template <Backend backend>
RngFillOutputs rng_fill(const std::optional<at::Tensor>& seed, int64_t seed_value,
                        const std::optional<at::Tensor>& offset, int64_t offset_value, int64_t batch_size,
                        int64_t stream, const at::Tensor& positions, int64_t num_indices) {
  check_rng_fill_args(seed, offset, batch_size, stream, positions, num_indices);
  const c10::OptionalDeviceGuard device_guard(guarded_device(backend, positions.device()));
  RngFillOutputs outputs = allocate_rng_fill(positions, batch_size, num_indices);
  if constexpr (backend != Backend::kMeta) {
    const RngFillInputs inputs = prepare_rng_fill(seed, seed_value, offset, offset_value, positions);
    const int64_t* const position_data = inputs.positions.data_ptr<int64_t>();
    const int64_t num_positions = inputs.positions.size(0);
    auto* const words = reinterpret_cast<uint32_t*>(std::get<0>(outputs).data_ptr<int32_t>());
    float* const uniforms = std::get<1>(outputs).data_ptr<float>();
    if constexpr (backend == Backend::kHost) {
      rng_fill_host(inputs.args, batch_size, static_cast<uint32_t>(stream), position_data, num_positions,
                    num_indices, words, uniforms);
    } else {
      check_launch(launch_rng_fill(inputs.args, batch_size, static_cast<uint32_t>(stream), position_data,
                                   num_positions, num_indices, words, uniforms,
                                   current_cuda_stream(positions.device())),
                   "rng_fill");
    }
  }
  return outputs;
}

}  // namespace
}  // namespace specdec::bindings

TORCH_LIBRARY_FRAGMENT(specdec_C, m) {
  // Arguments follow the counter tuple (seed, offset, request, stream,
  // position, index). `seed`: int64 [batch_size], one seed per request
  // (request word 0), or None: `seed_value` shared by the batch (request
  // word b). `offset`: int64 [] or [batch_size], or None: `offset_value`.
  // Outputs: words int32 [B, P, I, 4] and uniforms (of word 0) float32
  // [B, P, I], with I = num_indices.
  m.def(
      "rng_fill(Tensor? seed, int seed_value, Tensor? offset, int offset_value, int batch_size, int stream, "
      "Tensor positions, int num_indices) -> (Tensor words, Tensor uniforms)");
}

SPECDEC_REGISTER_BACKENDS("rng_fill", specdec::bindings::rng_fill)
