// What every op's bindings share: the three implementations of an op, the
// argument checks and the conversions from tensors to the kernels' args.
//
// Compiled by the host C++ compiler against the CPU or CUDA build of torch:
// the bindings include no CUDA torch header, only cuda_runtime_api.h, and get
// the current stream through the device-guard interface (TOOLCHAIN.md). The
// launchers they call live in csrc/*.cu and take raw pointers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>

#include "specdec/common.cuh"
#include "specdec/faults.cuh"
#include "specdec/index.cuh"
#include "specdec/rng.cuh"

namespace specdec::bindings {

// The three implementations of an op, one template per op: checks and output
// shapes only (Meta, also under torch.compile's symbolic shapes), the host
// program on CPU tensors, and the CUDA kernels.
enum class Backend { kMeta, kHost, kCuda };

// The device the implementation must guard: `device` for the CUDA kernels,
// none for the host program and Meta.
inline std::optional<c10::Device> guarded_device(Backend backend, c10::Device device) {
  return backend == Backend::kCuda ? std::optional<c10::Device>(device) : std::nullopt;
}

cudaStream_t current_cuda_stream(c10::Device device);

void check_launch(cudaError_t status, const char* op);

void check_dtype(const at::Tensor& tensor, const char* op, const char* name, at::ScalarType expected);

// Under dynamic shapes (torch.compile tracing with symbolic sizes) a Meta
// implementation knows only dtypes and ranks; sizes are checked by the real
// kernels.
bool symbolic(const at::Tensor& tensor);
bool symbolic(const std::optional<at::Tensor>& tensor);

// Counts, lengths, parents, block tables and paths: int32 or int64 each
// (include/specdec/index.cuh reads either).
// `shape` names the expected dims, e.g. "[B, N]"; sizes are checked by the op.
void check_index_tensor(const at::Tensor& tensor, const char* op, const char* name, int64_t dim, const char* shape);

void check_same_device(const at::Tensor& tensor, const char* op, const char* name, const at::Tensor& first,
                       const char* first_name);

IndexTensor index_tensor(const at::Tensor& tensor);

// An optional per-request vector: `dtype`, shape [B], on the device of `target`.
void check_batch_vector(const std::optional<at::Tensor>& tensor, const char* op, const char* name,
                        at::ScalarType dtype, int64_t batch_size, const at::Tensor& target);

// The device's fault counters (include/specdec/faults.cuh), when given:
// a contiguous int32 [>= kFaultKinds] tensor on the device of `target`.
void check_fault_counters(const std::optional<at::Tensor>& errors, const char* op, const at::Tensor& target);
// A launch stamp (faults.cuh, claims) in [2**40, 2**61): a smaller one could read as a count a word holds.
void check_launch_stamp(int64_t stamp, const char* op);
int32_t* fault_counters(const std::optional<at::Tensor>& errors);

// seed int64 [B] and offset int64 [] or [B] of a verification op, when given.
void check_random_state(const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                        const char* op, int64_t batch_size, const at::Tensor& target);

std::optional<at::Tensor> contiguous_or_none(const std::optional<at::Tensor>& tensor);

// The int32 outputs of a verification op: `rows` [B, W] with a contiguous
// last dim (`shape` names it, e.g. "[B, N]") and `counts` [B] contiguous.
void check_token_rows(const at::Tensor& rows, const char* op, const char* name, const char* shape, int64_t batch_size,
                      int64_t width, const at::Tensor& target);
void check_counts_output(const at::Tensor& counts, const char* op, const char* name, int64_t batch_size,
                         const at::Tensor& target);

// RngArgs pointing into `seed` and `offset`, which must be contiguous and
// outlive the args.
RngArgs rng_args_of(const std::optional<at::Tensor>& seed, int64_t seed_value,
                    const std::optional<at::Tensor>& offset, int64_t offset_value);

// Target and draft distributions: Float, BFloat16 or Half.
bool is_probability_dtype(at::ScalarType dtype);
ProbDtype probability_dtype(at::ScalarType dtype);

// target and draft as the kernels read them: unit stride along V and one
// storage type (mixed dtypes, rare, are widened to float32, which is exact).
void prepare_distributions(const at::Tensor& target, const std::optional<at::Tensor>& draft, at::Tensor& target_out,
                           std::optional<at::Tensor>& draft_out);

// top_k / top_p / min_p / bonus_token_ids (each [B] or None), shared by
// chain_verify, chain_verify_packed and tree_verify.
struct SamplingParameterTensors {
  const std::optional<at::Tensor>& top_k;
  const std::optional<at::Tensor>& top_p;
  const std::optional<at::Tensor>& min_p;
  const std::optional<at::Tensor>& bonus_token_ids;
};

// top_k and bonus_token_ids int32/int64, top_p and min_p float32, all [B] on the device of `target`.
void check_sampling_parameters(const SamplingParameterTensors& t, const char* op, int64_t batch_size,
                               const at::Tensor& target);

// The parameters as the kernels read them (contiguous), kept alive with the args.
struct SamplingParameterInputs {
  std::optional<at::Tensor> top_k, top_p, min_p, bonus_token_ids;

  explicit SamplingParameterInputs(const SamplingParameterTensors& t)
      : top_k(contiguous_or_none(t.top_k)),
        top_p(contiguous_or_none(t.top_p)),
        min_p(contiguous_or_none(t.min_p)),
        bonus_token_ids(contiguous_or_none(t.bonus_token_ids)) {}

  // Sets the fields of the same names in ChainVerifyArgs / TreeVerifyArgs.
  template <class Args>
  void set(Args& args) const {
    if (top_k.has_value()) args.top_k = index_tensor(*top_k);
    if (top_p.has_value()) args.top_p = top_p->data_ptr<float>();
    if (min_p.has_value()) args.min_p = min_p->data_ptr<float>();
    if (bonus_token_ids.has_value()) args.bonus_token_ids = index_tensor(*bonus_token_ids);
  }
};

}  // namespace specdec::bindings

// Registers the op `name`'s implementations, the instances of the function
// template `implementation` (qualified): <kHost> for CPU tensors, <kCuda> for
// CUDA tensors and <kMeta> for Meta tensors.
#define SPECDEC_REGISTER_BACKENDS(name, implementation)                             \
  TORCH_LIBRARY_IMPL(specdec_C, CPU, m) {                                            \
    m.impl(name, &implementation<specdec::bindings::Backend::kHost>);              \
  }                                                                                  \
  TORCH_LIBRARY_IMPL(specdec_C, CUDA, m) {                                           \
    m.impl(name, &implementation<specdec::bindings::Backend::kCuda>);              \
  }                                                                                  \
  TORCH_LIBRARY_IMPL(specdec_C, Meta, m) { m.impl(name, &implementation<specdec::bindings::Backend::kMeta>); }
