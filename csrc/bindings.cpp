// The one torch.library namespace of the compiled extension, `specdec_C`
// (the public namespace `specdec` is defined in Python by the package; its
// CUDA backend calls the raw ops registered here).
//
// Compiled by the host C++ compiler against the CPU or CUDA build of torch:
// it includes no CUDA torch header, only cuda_runtime_api.h, and gets the
// current stream through the device-guard interface (TOOLCHAIN.md). The
// launchers it calls live in csrc/*.cu and take raw pointers.
//
// One section per op: argument checks (shared by every dispatch key), then
// the CPU, CUDA and Meta implementations. Registration is at the bottom.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "specdec/rng.cuh"

namespace specdec {
namespace {

// ---------------------------------------------------------------------------
// Shared helpers

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

void check_device(const at::Tensor& tensor, const char* op, const char* name, c10::Device expected) {
  TORCH_CHECK_VALUE(tensor.device() == expected, "specdec_C::", op, ": `", name, "` must be on ", expected,
                    " (the device of `positions`), got ", tensor.device());
}

// ---------------------------------------------------------------------------
// rng_fill: Philox words, uniforms and exponentials of a block of counters.

using RngFillOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

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
          at::empty({batch_size, num_positions, num_indices}, options.dtype(at::kFloat)),
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
  inputs.args.seed_value = seed_value;
  inputs.args.offset_value = offset_value;
  if (seed.has_value()) {
    inputs.seed = seed->contiguous();
    inputs.args.seed_ptr = inputs.seed->data_ptr<int64_t>();
  }
  if (offset.has_value()) {
    inputs.offset = offset->contiguous();
    inputs.args.offset_ptr = inputs.offset->data_ptr<int64_t>();
    inputs.args.offset_per_request = offset->dim() == 1;
  }
  return inputs;
}

RngFillOutputs rng_fill_meta(const std::optional<at::Tensor>& seed, int64_t seed_value,
                             const std::optional<at::Tensor>& offset, int64_t offset_value, int64_t batch_size,
                             int64_t stream, const at::Tensor& positions, int64_t num_indices) {
  check_rng_fill_args(seed, offset, batch_size, stream, positions, num_indices);
  return allocate_rng_fill(positions, batch_size, num_indices);
}

RngFillOutputs rng_fill_cpu(const std::optional<at::Tensor>& seed, int64_t seed_value,
                            const std::optional<at::Tensor>& offset, int64_t offset_value, int64_t batch_size,
                            int64_t stream, const at::Tensor& positions, int64_t num_indices) {
  check_rng_fill_args(seed, offset, batch_size, stream, positions, num_indices);
  auto outputs = allocate_rng_fill(positions, batch_size, num_indices);
  const RngFillInputs inputs = prepare_rng_fill(seed, seed_value, offset, offset_value, positions);
  rng_fill_host(inputs.args, batch_size, static_cast<uint32_t>(stream), inputs.positions.data_ptr<int64_t>(),
                inputs.positions.size(0), num_indices,
                reinterpret_cast<uint32_t*>(std::get<0>(outputs).data_ptr<int32_t>()),
                std::get<1>(outputs).data_ptr<float>(), std::get<2>(outputs).data_ptr<float>());
  return outputs;
}

RngFillOutputs rng_fill_cuda(const std::optional<at::Tensor>& seed, int64_t seed_value,
                             const std::optional<at::Tensor>& offset, int64_t offset_value, int64_t batch_size,
                             int64_t stream, const at::Tensor& positions, int64_t num_indices) {
  check_rng_fill_args(seed, offset, batch_size, stream, positions, num_indices);
  const c10::DeviceGuard device_guard(positions.device());
  auto outputs = allocate_rng_fill(positions, batch_size, num_indices);
  const RngFillInputs inputs = prepare_rng_fill(seed, seed_value, offset, offset_value, positions);
  check_launch(launch_rng_fill(inputs.args, batch_size, static_cast<uint32_t>(stream),
                               inputs.positions.data_ptr<int64_t>(), inputs.positions.size(0), num_indices,
                               reinterpret_cast<uint32_t*>(std::get<0>(outputs).data_ptr<int32_t>()),
                               std::get<1>(outputs).data_ptr<float>(), std::get<2>(outputs).data_ptr<float>(),
                               current_cuda_stream(positions.device())),
               "rng_fill");
  return outputs;
}

// ---------------------------------------------------------------------------
// rng_from_words: the float transforms of given Philox words.

using RngFromWordsOutputs = std::tuple<at::Tensor, at::Tensor>;

void check_rng_from_words_args(const at::Tensor& words) {
  check_dtype(words, "rng_from_words", "words", at::kInt);
  TORCH_CHECK_VALUE(words.dim() >= 1 && words.size(-1) == 4,
                    "specdec_C::rng_from_words: `words` must have shape [..., 4], got ", words.sizes());
}

RngFromWordsOutputs allocate_rng_from_words(const at::Tensor& words) {
  const auto shape = words.sizes().slice(0, words.dim() - 1);
  return {at::empty(shape, words.options().dtype(at::kFloat)), at::empty(shape, words.options().dtype(at::kFloat))};
}

RngFromWordsOutputs rng_from_words_meta(const at::Tensor& words) {
  check_rng_from_words_args(words);
  return allocate_rng_from_words(words);
}

RngFromWordsOutputs rng_from_words_cpu(const at::Tensor& words) {
  check_rng_from_words_args(words);
  auto outputs = allocate_rng_from_words(words);
  const at::Tensor contiguous = words.contiguous();
  rng_from_words_host(reinterpret_cast<const uint32_t*>(contiguous.data_ptr<int32_t>()), contiguous.numel() / 4,
                      std::get<0>(outputs).data_ptr<float>(), std::get<1>(outputs).data_ptr<float>());
  return outputs;
}

RngFromWordsOutputs rng_from_words_cuda(const at::Tensor& words) {
  check_rng_from_words_args(words);
  const c10::DeviceGuard device_guard(words.device());
  auto outputs = allocate_rng_from_words(words);
  const at::Tensor contiguous = words.contiguous();
  check_launch(launch_rng_from_words(reinterpret_cast<const uint32_t*>(contiguous.data_ptr<int32_t>()),
                                     contiguous.numel() / 4, std::get<0>(outputs).data_ptr<float>(),
                                     std::get<1>(outputs).data_ptr<float>(), current_cuda_stream(words.device())),
               "rng_from_words");
  return outputs;
}

}  // namespace
}  // namespace specdec

// ---------------------------------------------------------------------------
// Registration: every schema here, then one block per dispatch key.

TORCH_LIBRARY(specdec_C, m) {
  // Arguments follow the counter tuple (seed, offset, request, stream,
  // position, index). `seed`: int64 [batch_size], one seed per request
  // (request word 0), or None: `seed_value` shared by the batch (request
  // word b). `offset`: int64 [] or [batch_size], or None: `offset_value`.
  // Outputs: words int32 [B, P, I, 4], uniforms and exponentials float32
  // [B, P, I], with I = num_indices.
  m.def(
      "rng_fill(Tensor? seed, int seed_value, Tensor? offset, int offset_value, int batch_size, int stream, "
      "Tensor positions, int num_indices) -> (Tensor words, Tensor uniforms, Tensor exponentials)");
  // words int32 [..., 4] -> uniforms (of w0) and exponentials, float32 [...].
  m.def("rng_from_words(Tensor words) -> (Tensor uniforms, Tensor exponentials)");
}

TORCH_LIBRARY_IMPL(specdec_C, CPU, m) {
  m.impl("rng_fill", &specdec::rng_fill_cpu);
  m.impl("rng_from_words", &specdec::rng_from_words_cpu);
}

TORCH_LIBRARY_IMPL(specdec_C, CUDA, m) {
  m.impl("rng_fill", &specdec::rng_fill_cuda);
  m.impl("rng_from_words", &specdec::rng_from_words_cuda);
}

TORCH_LIBRARY_IMPL(specdec_C, Meta, m) {
  m.impl("rng_fill", &specdec::rng_fill_meta);
  m.impl("rng_from_words", &specdec::rng_from_words_meta);
}

// `import specdec_kernels._C` loads this library, which runs the
// registrations above; the module itself has no attributes.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
