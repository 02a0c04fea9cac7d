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

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "specdec/build_tree.cuh"
#include "specdec/chain_verify.cuh"
#include "specdec/compact_kv.cuh"
#include "specdec/index.cuh"
#include "specdec/rng.cuh"
#include "specdec/tree_attention.cuh"
#include "specdec/tree_verify.cuh"

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

// Under dynamic shapes (torch.compile tracing with symbolic sizes) a Meta
// implementation knows only dtypes and ranks; sizes are checked by the real
// kernels.
bool symbolic(const at::Tensor& tensor) { return tensor.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); }

bool symbolic(const std::optional<at::Tensor>& tensor) { return tensor.has_value() && symbolic(*tensor); }

// Counts, lengths, parents, block tables and paths: int32 or int64 each
// (include/specdec/index.cuh reads either).
// `shape` names the expected dims, e.g. "[B, N]"; sizes are checked by the op.
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

// An optional per-request vector: `dtype`, shape [B], on the device of `target`.
void check_batch_vector(const std::optional<at::Tensor>& tensor, const char* op, const char* name,
                        at::ScalarType dtype, int64_t batch_size, const at::Tensor& target) {
  if (!tensor.has_value()) return;
  check_dtype(*tensor, op, name, dtype);
  TORCH_CHECK_VALUE(tensor->dim() == 1 && tensor->size(0) == batch_size, "specdec_C::", op, ": `", name,
                    "` must have shape [B] = [", batch_size, "], got ", tensor->sizes());
  check_same_device(*tensor, op, name, target, "target");
}

// seed int64 [B] and offset int64 [] or [B] of a verification op, when given.
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

// The int32 outputs of a verification op: `rows` [B, W] with a contiguous
// last dim (`shape` names it, e.g. "[B, N]") and `counts` [B] contiguous.
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

// RngArgs pointing into `seed` and `offset`, which must be contiguous and
// outlive the args.
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

// ---------------------------------------------------------------------------
// rng_fill: Philox words and uniforms of a block of counters.

using RngFillOutputs = std::tuple<at::Tensor, at::Tensor>;

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
                std::get<1>(outputs).data_ptr<float>());
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
                               std::get<1>(outputs).data_ptr<float>(), current_cuda_stream(positions.device())),
               "rng_fill");
  return outputs;
}

// ---------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------
// chain_verify and chain_verify_packed: fused chain verification
// (csrc/chain_verify.cu), one kernel for both layouts. The caller allocates
// the outputs and lends the workspace and the counters
// (specdec_kernels/launchers/chain_verify.py sizes them with
// cuda_workspace_specs and keeps them across calls).

const std::optional<at::Tensor> kNoTensor;

struct ChainVerifyTensors {
  const at::Tensor& draft_token_ids;
  const std::optional<at::Tensor>& cu_num_draft_tokens;  // given: the packed layout
  const at::Tensor& target;
  const std::optional<at::Tensor>& draft;
  const std::optional<at::Tensor>& num_draft_tokens;  // padded layout only
  const std::optional<at::Tensor>& temperature;
  const std::optional<at::Tensor>& seed;
  const std::optional<at::Tensor>& offset;
  const at::Tensor& workspace;
  const at::Tensor& arrivals;
  const at::Tensor& output_token_ids;
  const at::Tensor& num_accepted;
  int64_t num_splits;
  int64_t max_drafts;  // packed: max_num_draft_tokens (padded: from the shape of `target`)
  SamplingParameterTensors sampling;
  const std::optional<at::Tensor>& stages;  // the staged plan's records, or none (one block per truncated request)
};

// The sizes of one call, read from either layout.
struct ChainShapes {
  int64_t batch_size = 0;
  int64_t max_drafts = 0;
  int64_t vocab_size = 0;
  int64_t num_tokens = 0;  // T (packed)
};

bool is_probability_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// Padded: target [B, K+1, V], draft_token_ids [B, K], draft [B, K, V],
// num_draft_tokens [B]. Packed: target [T+B, V], draft_token_ids [T],
// draft [T, V], cu_num_draft_tokens [B+1] (int32 or int64).
ChainShapes check_chain_layout(const ChainVerifyTensors& t, const char* op) {
  const auto same_device = [&](const at::Tensor& tensor, const char* name) {
    check_same_device(tensor, op, name, t.target, "target");
  };
  TORCH_CHECK_TYPE(is_probability_dtype(t.target.scalar_type()), "specdec_C::", op,
                   ": `target` must be Float, BFloat16 or Half, got ", t.target.scalar_type());
  TORCH_CHECK_TYPE(t.draft_token_ids.scalar_type() == at::kInt || t.draft_token_ids.scalar_type() == at::kLong,
                   "specdec_C::", op, ": `draft_token_ids` must be Int or Long, got ", t.draft_token_ids.scalar_type());
  if (t.draft.has_value()) {
    TORCH_CHECK_TYPE(is_probability_dtype(t.draft->scalar_type()), "specdec_C::", op,
                     ": `draft` must be Float, BFloat16 or Half, got ", t.draft->scalar_type());
  }
  ChainShapes shapes;
  if (!t.cu_num_draft_tokens.has_value()) {
    TORCH_CHECK_VALUE(t.target.dim() == 3 && t.target.size(1) >= 1, "specdec_C::", op,
                      ": `target` must have shape [B, K+1, V] with K+1 >= 1, got ", t.target.sizes());
    shapes.batch_size = t.target.size(0);
    shapes.max_drafts = t.target.size(1) - 1;
    shapes.vocab_size = t.target.size(2);
    TORCH_CHECK_VALUE(t.draft_token_ids.dim() == 2 && t.draft_token_ids.size(0) == shapes.batch_size &&
                          t.draft_token_ids.size(1) == shapes.max_drafts,
                      "specdec_C::", op, ": `draft_token_ids` must have shape [B, K] = [", shapes.batch_size, ", ",
                      shapes.max_drafts, "], got ", t.draft_token_ids.sizes());
    if (t.draft.has_value()) {
      TORCH_CHECK_VALUE(t.draft->dim() == 3 && t.draft->size(0) == shapes.batch_size &&
                            t.draft->size(1) == shapes.max_drafts && t.draft->size(2) == shapes.vocab_size,
                        "specdec_C::", op, ": `draft` must have shape [B, K, V] = [", shapes.batch_size, ", ",
                        shapes.max_drafts, ", ", shapes.vocab_size, "], got ", t.draft->sizes());
    }
    check_batch_vector(t.num_draft_tokens, op, "num_draft_tokens", at::kInt, shapes.batch_size, t.target);
  } else {
    const at::Tensor& cu = *t.cu_num_draft_tokens;
    check_index_tensor(cu, op, "cu_num_draft_tokens", 1, "[B+1]");
    TORCH_CHECK_VALUE(cu.size(0) >= 1, "specdec_C::", op, ": `cu_num_draft_tokens` must have shape [B+1] with B+1 >= 1, got ",
                      cu.sizes());
    same_device(cu, "cu_num_draft_tokens");
    TORCH_CHECK_VALUE(t.draft_token_ids.dim() == 1, "specdec_C::", op, ": `draft_token_ids` must have shape [T], got ",
                      t.draft_token_ids.sizes());
    shapes.batch_size = cu.size(0) - 1;
    shapes.num_tokens = t.draft_token_ids.size(0);
    shapes.max_drafts = t.max_drafts;
    TORCH_CHECK_VALUE(t.max_drafts >= 0, "specdec_C::", op, ": `max_num_draft_tokens` must be >= 0, got ",
                      t.max_drafts);
    TORCH_CHECK_VALUE(t.target.dim() == 2 && t.target.size(0) == shapes.num_tokens + shapes.batch_size, "specdec_C::",
                      op, ": `target` must have shape [T+B, V] with T + B = ", shapes.num_tokens, " + ",
                      shapes.batch_size, ", got ", t.target.sizes());
    shapes.vocab_size = t.target.size(1);
    if (t.draft.has_value()) {
      TORCH_CHECK_VALUE(t.draft->dim() == 2 && t.draft->size(0) == shapes.num_tokens &&
                            t.draft->size(1) == shapes.vocab_size,
                        "specdec_C::", op, ": `draft` must have shape [T, V] = [", shapes.num_tokens, ", ",
                        shapes.vocab_size, "], got ", t.draft->sizes());
    }
  }
  // Slices are int32 and rounded up to whole tiles: V <= 2**30 leaves room.
  TORCH_CHECK_VALUE(shapes.vocab_size >= 1 && shapes.vocab_size <= (int64_t{1} << 30), "specdec_C::", op,
                    ": the vocabulary size V must be in [1, 2**30], got ", shapes.vocab_size);
  TORCH_CHECK_VALUE(shapes.max_drafts < (int64_t{1} << 24) - 1, "specdec_C::", op,
                    ": K must be below 2**24 - 1 (the RNG position word), got ", shapes.max_drafts);
  same_device(t.draft_token_ids, "draft_token_ids");
  if (t.draft.has_value()) same_device(*t.draft, "draft");
  return shapes;
}

ChainShapes check_chain_verify_args(const ChainVerifyTensors& t, const char* op) {
  const ChainShapes shapes = check_chain_layout(t, op);
  const int64_t batch_size = shapes.batch_size;
  check_batch_vector(t.temperature, op, "temperature", at::kFloat, batch_size, t.target);
  check_random_state(t.seed, t.offset, op, batch_size, t.target);
  check_sampling_parameters(t.sampling, op, batch_size, t.target);

  const int64_t chunk_words = chain_verify_chunk_words(batch_size, shapes.vocab_size);
  check_dtype(t.workspace, op, "workspace", at::kLong);
  TORCH_CHECK_VALUE(t.workspace.dim() == 1 && t.workspace.is_contiguous() && t.workspace.numel() >= chunk_words,
                    "specdec_C::", op, ": `workspace` must be a contiguous [N] tensor with N >= "
                    "3 * B * ceil(V / 1024) = ",
                    chunk_words, ", got ", t.workspace.sizes());
  check_same_device(t.workspace, op, "workspace", t.target, "target");
  check_dtype(t.arrivals, op, "arrivals", at::kInt);
  TORCH_CHECK_VALUE(t.arrivals.dim() == 1 && t.arrivals.is_contiguous() && t.arrivals.numel() >= batch_size + 2,
                    "specdec_C::", op, ": `arrivals` must be a contiguous [N] tensor with N >= B + 2 = ",
                    batch_size + 2, ", got ", t.arrivals.sizes());
  check_same_device(t.arrivals, op, "arrivals", t.target, "target");
  if (t.stages.has_value()) {
    check_dtype(*t.stages, op, "stages", at::kLong);
    TORCH_CHECK_VALUE(t.stages->dim() == 1 && t.stages->is_contiguous(), "specdec_C::", op,
                      ": `stages` must be a contiguous [N] tensor, got ", t.stages->sizes());
    check_same_device(*t.stages, op, "stages", t.target, "target");
  }
  TORCH_CHECK_VALUE(t.num_splits >= 0, "specdec_C::", op, ": `num_splits` must be >= 0, got ", t.num_splits);
  check_token_rows(t.output_token_ids, op, "output_token_ids", "[B, K+1]", batch_size, shapes.max_drafts + 1,
                   t.target);
  check_counts_output(t.num_accepted, op, "num_accepted", batch_size, t.target);
  return shapes;
}

// Keeps the converted / contiguous inputs alive as long as the args point into them.
struct ChainVerifyInputs {
  at::Tensor draft_token_ids, target;
  std::optional<at::Tensor> draft, num_draft_tokens, cu_num_draft_tokens, temperature, seed, offset;
  SamplingParameterInputs sampling;
  ChainVerifyArgs args;

  explicit ChainVerifyInputs(const SamplingParameterTensors& parameters) : sampling(parameters) {}
};

ProbDtype probability_dtype(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? ProbDtype::kBFloat16 : (dtype == at::kHalf ? ProbDtype::kFloat16 : ProbDtype::kFloat32);
}

// target and draft as the kernels read them: unit stride along V and one
// storage type (mixed dtypes, rare, are widened to float32, which is exact).
void prepare_distributions(const at::Tensor& target, const std::optional<at::Tensor>& draft, at::Tensor& target_out,
                           std::optional<at::Tensor>& draft_out) {
  target_out = target.stride(-1) == 1 ? target : target.contiguous();
  if (draft.has_value()) draft_out = draft->stride(-1) == 1 ? *draft : draft->contiguous();
  if (draft_out.has_value() && draft_out->scalar_type() != target_out.scalar_type()) {
    target_out = target_out.to(at::kFloat);
    draft_out = draft_out->to(at::kFloat);
  }
}

ChainVerifyInputs prepare_chain_verify(const ChainVerifyTensors& t, const ChainShapes& shapes, bool logits,
                                       int64_t seed_value, int64_t offset_value) {
  ChainVerifyInputs inputs(t.sampling);
  inputs.draft_token_ids = t.draft_token_ids;
  prepare_distributions(t.target, t.draft, inputs.target, inputs.draft);
  inputs.num_draft_tokens = contiguous_or_none(t.num_draft_tokens);
  inputs.cu_num_draft_tokens = contiguous_or_none(t.cu_num_draft_tokens);
  inputs.temperature = contiguous_or_none(t.temperature);
  inputs.seed = contiguous_or_none(t.seed);
  inputs.offset = contiguous_or_none(t.offset);
  const bool packed = inputs.cu_num_draft_tokens.has_value();
  // (stride to a request's row 0, stride between its rows): packed rows are
  // addressed by row index, so both are the row stride.
  const auto row_strides = [packed](const at::Tensor& rows) {
    return std::make_pair(rows.stride(0), rows.stride(packed ? 0 : 1));
  };

  ChainVerifyArgs& args = inputs.args;
  args.draft_token_ids = inputs.draft_token_ids.data_ptr();
  std::tie(args.ids_stride_b, args.ids_stride_k) = row_strides(inputs.draft_token_ids);
  args.token_dtype = inputs.draft_token_ids.scalar_type() == at::kLong ? TokenDtype::kInt64 : TokenDtype::kInt32;
  args.target = inputs.target.data_ptr();
  std::tie(args.target_stride_b, args.target_stride_k) = row_strides(inputs.target);
  args.prob_dtype = probability_dtype(inputs.target.scalar_type());
  if (inputs.draft.has_value()) {
    args.draft = inputs.draft->data_ptr();
    std::tie(args.draft_stride_b, args.draft_stride_k) = row_strides(*inputs.draft);
  }
  if (inputs.num_draft_tokens.has_value()) args.num_draft_tokens = inputs.num_draft_tokens->data_ptr<int32_t>();
  if (packed) args.cu_num_draft_tokens = index_tensor(*inputs.cu_num_draft_tokens);
  args.num_tokens = shapes.num_tokens;
  if (inputs.temperature.has_value()) args.temperature = inputs.temperature->data_ptr<float>();
  args.logits = logits;
  args.rng = rng_args_of(inputs.seed, seed_value, inputs.offset, offset_value);
  inputs.sampling.set(args);
  args.output_token_ids = t.output_token_ids.data_ptr<int32_t>();
  args.output_stride_b = t.output_token_ids.stride(0);
  args.num_accepted = t.num_accepted.data_ptr<int32_t>();
  args.workspace = t.workspace.data_ptr<int64_t>();
  args.workspace_words = t.workspace.numel();
  args.counters = t.arrivals.data_ptr<int32_t>();
  if (t.stages.has_value()) {
    args.stages = t.stages->data_ptr<int64_t>();
    args.stage_words = t.stages->numel();
  }
  args.requested_splits = t.num_splits;
  args.batch_size = shapes.batch_size;
  args.max_drafts = static_cast<int32_t>(shapes.max_drafts);
  args.vocab_size = static_cast<int32_t>(shapes.vocab_size);
  return inputs;
}

bool any_symbolic(const ChainVerifyTensors& t) {
  return symbolic(t.draft_token_ids) || symbolic(t.cu_num_draft_tokens) || symbolic(t.target) || symbolic(t.draft) ||
         symbolic(t.num_draft_tokens) || symbolic(t.temperature) || symbolic(t.seed) || symbolic(t.offset) ||
         symbolic(t.workspace) || symbolic(t.arrivals) || symbolic(t.output_token_ids) || symbolic(t.num_accepted) || symbolic(t.stages);
}

void chain_verify_meta_impl(const ChainVerifyTensors& t, const char* op) {
  if (any_symbolic(t)) {
    const bool packed = t.cu_num_draft_tokens.has_value();
    TORCH_CHECK_TYPE(is_probability_dtype(t.target.scalar_type()), "specdec_C::", op,
                     ": `target` must be Float, BFloat16 or Half, got ", t.target.scalar_type());
    TORCH_CHECK_VALUE(t.target.dim() == (packed ? 2 : 3) && t.draft_token_ids.dim() == (packed ? 1 : 2) &&
                          t.output_token_ids.dim() == 2,
                      "specdec_C::", op, packed ? ": `target` must be [T+B, V], `draft_token_ids` [T] and "
                                                  "`output_token_ids` [B, K+1]"
                                                : ": `target` must be [B, K+1, V], `draft_token_ids` [B, K] and "
                                                  "`output_token_ids` [B, K+1]");
    return;
  }
  check_chain_verify_args(t, op);
}

void chain_verify_cpu_impl(const ChainVerifyTensors& t, const char* op, bool logits, int64_t seed_value,
                           int64_t offset_value) {
  const ChainShapes shapes = check_chain_verify_args(t, op);
  const ChainVerifyInputs inputs = prepare_chain_verify(t, shapes, logits, seed_value, offset_value);
  const char* failure = chain_verify_host(inputs.args);
  TORCH_CHECK(failure == nullptr, "specdec_C::", op, " (host): ", failure);
}

void chain_verify_cuda_impl(const ChainVerifyTensors& t, const char* op, bool logits, int64_t seed_value,
                            int64_t offset_value) {
  const ChainShapes shapes = check_chain_verify_args(t, op);
  const c10::DeviceGuard device_guard(t.target.device());
  const ChainVerifyInputs inputs = prepare_chain_verify(t, shapes, logits, seed_value, offset_value);
  check_launch(launch_chain_verify(inputs.args, current_cuda_stream(t.target.device())), op);
}

void chain_verify_meta(const at::Tensor& draft_token_ids, const at::Tensor& target,
                       const std::optional<at::Tensor>& draft, const std::optional<at::Tensor>& num_draft_tokens,
                       const std::optional<at::Tensor>& temperature, bool logits, const std::optional<at::Tensor>& seed,
                       int64_t seed_value, const std::optional<at::Tensor>& offset, int64_t offset_value,
                       const at::Tensor& workspace, const at::Tensor& arrivals, const at::Tensor& output_token_ids,
                       const at::Tensor& num_accepted, int64_t num_splits,
                       const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                       const std::optional<at::Tensor>& min_p, const std::optional<at::Tensor>& bonus_token_ids,
                       const std::optional<at::Tensor>& stages) {
  chain_verify_meta_impl({draft_token_ids, kNoTensor, target, draft, num_draft_tokens, temperature, seed, offset,
                          workspace, arrivals, output_token_ids, num_accepted, num_splits, 0,
                          {top_k, top_p, min_p, bonus_token_ids}, stages},
                         "chain_verify");
}

void chain_verify_cpu(const at::Tensor& draft_token_ids, const at::Tensor& target,
                      const std::optional<at::Tensor>& draft, const std::optional<at::Tensor>& num_draft_tokens,
                      const std::optional<at::Tensor>& temperature, bool logits, const std::optional<at::Tensor>& seed,
                      int64_t seed_value, const std::optional<at::Tensor>& offset, int64_t offset_value,
                      const at::Tensor& workspace, const at::Tensor& arrivals, const at::Tensor& output_token_ids,
                      const at::Tensor& num_accepted, int64_t num_splits,
                      const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                      const std::optional<at::Tensor>& min_p, const std::optional<at::Tensor>& bonus_token_ids,
                       const std::optional<at::Tensor>& stages) {
  chain_verify_cpu_impl({draft_token_ids, kNoTensor, target, draft, num_draft_tokens, temperature, seed, offset,
                         workspace, arrivals, output_token_ids, num_accepted, num_splits, 0,
                         {top_k, top_p, min_p, bonus_token_ids}, stages},
                        "chain_verify", logits, seed_value, offset_value);
}

void chain_verify_cuda(const at::Tensor& draft_token_ids, const at::Tensor& target,
                       const std::optional<at::Tensor>& draft, const std::optional<at::Tensor>& num_draft_tokens,
                       const std::optional<at::Tensor>& temperature, bool logits, const std::optional<at::Tensor>& seed,
                       int64_t seed_value, const std::optional<at::Tensor>& offset, int64_t offset_value,
                       const at::Tensor& workspace, const at::Tensor& arrivals, const at::Tensor& output_token_ids,
                       const at::Tensor& num_accepted, int64_t num_splits,
                       const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                       const std::optional<at::Tensor>& min_p, const std::optional<at::Tensor>& bonus_token_ids,
                       const std::optional<at::Tensor>& stages) {
  chain_verify_cuda_impl({draft_token_ids, kNoTensor, target, draft, num_draft_tokens, temperature, seed, offset,
                          workspace, arrivals, output_token_ids, num_accepted, num_splits, 0,
                          {top_k, top_p, min_p, bonus_token_ids}, stages},
                         "chain_verify", logits, seed_value, offset_value);
}

void chain_verify_packed_meta(const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
                              const at::Tensor& target, const std::optional<at::Tensor>& draft,
                              int64_t max_num_draft_tokens, const std::optional<at::Tensor>& temperature, bool logits,
                              const std::optional<at::Tensor>& seed, int64_t seed_value,
                              const std::optional<at::Tensor>& offset, int64_t offset_value,
                              const at::Tensor& workspace, const at::Tensor& arrivals,
                              const at::Tensor& output_token_ids, const at::Tensor& num_accepted, int64_t num_splits,
                              const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                              const std::optional<at::Tensor>& min_p,
                              const std::optional<at::Tensor>& bonus_token_ids,
                              const std::optional<at::Tensor>& stages) {
  const std::optional<at::Tensor> cu = cu_num_draft_tokens;
  chain_verify_meta_impl({draft_token_ids, cu, target, draft, kNoTensor, temperature, seed, offset, workspace,
                          arrivals, output_token_ids, num_accepted, num_splits, max_num_draft_tokens,
                          {top_k, top_p, min_p, bonus_token_ids}, stages},
                         "chain_verify_packed");
}

void chain_verify_packed_cpu(const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
                             const at::Tensor& target, const std::optional<at::Tensor>& draft,
                             int64_t max_num_draft_tokens, const std::optional<at::Tensor>& temperature, bool logits,
                             const std::optional<at::Tensor>& seed, int64_t seed_value,
                             const std::optional<at::Tensor>& offset, int64_t offset_value,
                             const at::Tensor& workspace, const at::Tensor& arrivals,
                             const at::Tensor& output_token_ids, const at::Tensor& num_accepted, int64_t num_splits,
                             const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                             const std::optional<at::Tensor>& min_p, const std::optional<at::Tensor>& bonus_token_ids,
                             const std::optional<at::Tensor>& stages) {
  const std::optional<at::Tensor> cu = cu_num_draft_tokens;
  chain_verify_cpu_impl({draft_token_ids, cu, target, draft, kNoTensor, temperature, seed, offset, workspace,
                         arrivals, output_token_ids, num_accepted, num_splits, max_num_draft_tokens,
                         {top_k, top_p, min_p, bonus_token_ids}, stages},
                        "chain_verify_packed", logits, seed_value, offset_value);
}

void chain_verify_packed_cuda(const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
                              const at::Tensor& target, const std::optional<at::Tensor>& draft,
                              int64_t max_num_draft_tokens, const std::optional<at::Tensor>& temperature, bool logits,
                              const std::optional<at::Tensor>& seed, int64_t seed_value,
                              const std::optional<at::Tensor>& offset, int64_t offset_value,
                              const at::Tensor& workspace, const at::Tensor& arrivals,
                              const at::Tensor& output_token_ids, const at::Tensor& num_accepted, int64_t num_splits,
                              const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                              const std::optional<at::Tensor>& min_p,
                              const std::optional<at::Tensor>& bonus_token_ids,
                              const std::optional<at::Tensor>& stages) {
  const std::optional<at::Tensor> cu = cu_num_draft_tokens;
  chain_verify_cuda_impl({draft_token_ids, cu, target, draft, kNoTensor, temperature, seed, offset, workspace,
                          arrivals, output_token_ids, num_accepted, num_splits, max_num_draft_tokens,
                          {top_k, top_p, min_p, bonus_token_ids}, stages},
                         "chain_verify_packed", logits, seed_value, offset_value);
}

// ---------------------------------------------------------------------------
// build_tree: ancestor masks, depths and positions (csrc/build_tree.cu); the
// outputs are allocated here.

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

BuildTreeOutputs build_tree_meta(const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes,
                                 const std::optional<at::Tensor>& prefix_lens) {
  check_build_tree_args(parents, num_nodes, prefix_lens);
  return allocate_build_tree(parents);
}

BuildTreeOutputs build_tree_cpu(const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes,
                                const std::optional<at::Tensor>& prefix_lens) {
  check_build_tree_args(parents, num_nodes, prefix_lens);
  BuildTreeOutputs outputs = allocate_build_tree(parents);
  build_tree_host(build_tree_args(parents, num_nodes, prefix_lens, outputs));
  return outputs;
}

BuildTreeOutputs build_tree_cuda(const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes,
                                 const std::optional<at::Tensor>& prefix_lens) {
  check_build_tree_args(parents, num_nodes, prefix_lens);
  const c10::DeviceGuard device_guard(parents.device());
  BuildTreeOutputs outputs = allocate_build_tree(parents);
  check_launch(launch_build_tree(build_tree_args(parents, num_nodes, prefix_lens, outputs),
                                 current_cuda_stream(parents.device())),
               "build_tree");
  return outputs;
}

// ---------------------------------------------------------------------------
// compact_kv: the accepted path's K/V moved in place (csrc/compact_kv.cu).

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

void compact_kv_meta(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& prefix_lens, const at::Tensor& accepted_nodes) {
  check_compact_kv_args(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes);
}

void compact_kv_cpu(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                    const at::Tensor& prefix_lens, const at::Tensor& accepted_nodes) {
  check_compact_kv_args(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes);
  compact_kv_host(compact_kv_args(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes));
}

void compact_kv_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& prefix_lens, const at::Tensor& accepted_nodes) {
  check_compact_kv_args(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes);
  const c10::DeviceGuard device_guard(k_cache.device());
  check_launch(launch_compact_kv(compact_kv_args(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes),
                                 current_cuda_stream(k_cache.device())),
               "compact_kv");
}

// ---------------------------------------------------------------------------
// tree_attention: attention of tree nodes over a paged KV cache
// (csrc/tree_attention.cu). The output and, with splits, the partial states
// are allocated here.

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

at::Tensor tree_attention_meta(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& prefix_lens,
                               const at::Tensor& tree_mask, const std::optional<at::Tensor>& num_nodes,
                               std::optional<double> scale, int64_t num_splits,
                               const std::optional<at::Tensor>& merge_counters) {
  check_tree_attention_args(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, num_splits,
                            merge_counters);
  return at::empty_symint(q.sym_sizes(), q.options());
}

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& prefix_lens,
                              const at::Tensor& tree_mask, const std::optional<at::Tensor>& num_nodes,
                              std::optional<double> scale, int64_t num_splits,
                              const std::optional<at::Tensor>& merge_counters) {
  check_tree_attention_args(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, num_splits,
                            merge_counters);
  return run_tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, scale, num_splits,
                            merge_counters, false);
}

at::Tensor tree_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& prefix_lens,
                               const at::Tensor& tree_mask, const std::optional<at::Tensor>& num_nodes,
                               std::optional<double> scale, int64_t num_splits,
                               const std::optional<at::Tensor>& merge_counters) {
  check_tree_attention_args(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, num_splits,
                            merge_counters);
  const c10::DeviceGuard device_guard(q.device());
  return run_tree_attention(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, num_nodes, scale, num_splits,
                            merge_counters, true);
}

// ---------------------------------------------------------------------------
// tree_verify: fused tree verification (csrc/tree_verify.cu), one block per
// request. The caller allocates the outputs and lends the workspace
// (specdec_kernels/launchers/tree_verify.py sizes it with
// cuda_workspace_specs and keeps it across calls).

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
    const int64_t stage_words = tree_verify_stage_words(batch_size, max_nodes);
    TORCH_CHECK_VALUE(t.stages.has_value(), "specdec_C::tree_verify: `num_splits` > 1 needs `stages`");
    check_dtype(*t.stages, op, "stages", at::kLong);
    TORCH_CHECK_VALUE(t.stages->dim() == 1 && t.stages->is_contiguous() && t.stages->numel() >= stage_words,
                      "specdec_C::tree_verify: `stages` must be a contiguous [M] tensor with M >= "
                      "16 * (1 + B * (N + 1)) = ", stage_words, ", got ", t.stages->sizes());
    check_same_device(*t.stages, op, "stages", t.target, "target");
  }
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
  args.batch_size = inputs.target.size(0);
  args.max_nodes = static_cast<int32_t>(inputs.target.size(1));
  args.vocab_size = static_cast<int32_t>(inputs.target.size(2));
  return inputs;
}

void tree_verify_meta(const at::Tensor& tree_token_ids, const at::Tensor& parents, const at::Tensor& target,
                      const std::optional<at::Tensor>& draft, const std::optional<at::Tensor>& num_nodes,
                      const std::optional<at::Tensor>& temperature, bool logits, c10::string_view draft_sampling,
                      const std::optional<at::Tensor>& seed, int64_t seed_value,
                      const std::optional<at::Tensor>& offset, int64_t offset_value, const at::Tensor& workspace,
                      const at::Tensor& accepted_nodes, const at::Tensor& output_token_ids,
                      const at::Tensor& num_accepted, const std::optional<at::Tensor>& top_k,
                      const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
                      const std::optional<at::Tensor>& bonus_token_ids, const std::optional<at::Tensor>& stages,
                      int64_t num_splits) {
  // Under dynamic shapes only dtypes and ranks are known; sizes are checked
  // by the real kernels.
  for (const at::Tensor* tensor : {&tree_token_ids, &parents, &target, &workspace, &accepted_nodes,
                                   &output_token_ids, &num_accepted}) {
    if (tensor->unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
      TORCH_CHECK_VALUE(target.dim() == 3 && tree_token_ids.dim() == 2 && parents.dim() == 2,
                        "specdec_C::tree_verify: `target` must be [B, N, V], `tree_token_ids` and `parents` [B, N]");
      return;
    }
  }
  check_tree_verify_args({tree_token_ids, parents, target, draft, num_nodes, temperature, draft_sampling, seed, offset,
                          workspace, accepted_nodes, output_token_ids, num_accepted, {top_k, top_p, min_p,
                          bonus_token_ids}, stages, num_splits});
}

void tree_verify_cpu(const at::Tensor& tree_token_ids, const at::Tensor& parents, const at::Tensor& target,
                     const std::optional<at::Tensor>& draft, const std::optional<at::Tensor>& num_nodes,
                     const std::optional<at::Tensor>& temperature, bool logits, c10::string_view draft_sampling,
                     const std::optional<at::Tensor>& seed, int64_t seed_value,
                     const std::optional<at::Tensor>& offset, int64_t offset_value, const at::Tensor& workspace,
                     const at::Tensor& accepted_nodes, const at::Tensor& output_token_ids,
                     const at::Tensor& num_accepted, const std::optional<at::Tensor>& top_k,
                     const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
                     const std::optional<at::Tensor>& bonus_token_ids, const std::optional<at::Tensor>& stages,
                     int64_t num_splits) {
  const TreeVerifyTensors tensors = {tree_token_ids, parents,  target,         draft,          num_nodes,
                                     temperature,    draft_sampling, seed,     offset,         workspace,
                                     accepted_nodes, output_token_ids, num_accepted, {top_k, top_p, min_p,
                                     bonus_token_ids}, stages, num_splits};
  check_tree_verify_args(tensors);
  const char* failure = tree_verify_host(prepare_tree_verify(tensors, logits, seed_value, offset_value).args);
  TORCH_CHECK(failure == nullptr, "specdec_C::tree_verify (host): ", failure);
}

void tree_verify_cuda(const at::Tensor& tree_token_ids, const at::Tensor& parents, const at::Tensor& target,
                      const std::optional<at::Tensor>& draft, const std::optional<at::Tensor>& num_nodes,
                      const std::optional<at::Tensor>& temperature, bool logits, c10::string_view draft_sampling,
                      const std::optional<at::Tensor>& seed, int64_t seed_value,
                      const std::optional<at::Tensor>& offset, int64_t offset_value, const at::Tensor& workspace,
                      const at::Tensor& accepted_nodes, const at::Tensor& output_token_ids,
                      const at::Tensor& num_accepted, const std::optional<at::Tensor>& top_k,
                      const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
                      const std::optional<at::Tensor>& bonus_token_ids, const std::optional<at::Tensor>& stages,
                      int64_t num_splits) {
  const TreeVerifyTensors tensors = {tree_token_ids, parents,  target,         draft,          num_nodes,
                                     temperature,    draft_sampling, seed,     offset,         workspace,
                                     accepted_nodes, output_token_ids, num_accepted, {top_k, top_p, min_p,
                                     bonus_token_ids}, stages, num_splits};
  check_tree_verify_args(tensors);
  const c10::DeviceGuard device_guard(target.device());
  const TreeVerifyInputs inputs = prepare_tree_verify(tensors, logits, seed_value, offset_value);
  check_launch(launch_tree_verify(inputs.args, current_cuda_stream(target.device())), "tree_verify");
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
  // Outputs: words int32 [B, P, I, 4] and uniforms (of word 0) float32
  // [B, P, I], with I = num_indices.
  m.def(
      "rng_fill(Tensor? seed, int seed_value, Tensor? offset, int offset_value, int batch_size, int stream, "
      "Tensor positions, int num_indices) -> (Tensor words, Tensor uniforms)");
  // Fused chain verification (include/specdec/chain_verify.cuh): writes
  // output_token_ids int32 [B, K+1] and num_accepted int32 [B]. Arguments as
  // specdec::chain_verify, with seed/offset as in rng_fill; `workspace`
  // int64 [N], N >= 3 * B * ceil(V / 1024), contents need not be
  // initialised (2 * B * (K + 1) more words per extra split let the
  // vocabulary split over more blocks); `arrivals` int32 [>= B + 2], the
  // counters: zero before the call and left zero after it, except the last,
  // an error flag set when a bounded wait gave up. `num_splits`: blocks per
  // request, 0 for the launcher's choice (tests force other counts).
  // `stages` int64 [>= B * chain_stage_request_words(K + 1)] or None: the
  // staged plan's records with top_k/top_p/min_p (chain_verify_stages.cuh),
  // zero before the call and left zero; without it (or too small) a
  // truncating call has one block per request.
  m.def(
      "chain_verify(Tensor draft_token_ids, Tensor target, Tensor? draft, Tensor? num_draft_tokens, "
      "Tensor? temperature, bool logits, Tensor? seed, int seed_value, Tensor? offset, int offset_value, "
      "Tensor(a!) workspace, Tensor(b!) arrivals, Tensor(c!) output_token_ids, Tensor(d!) num_accepted, "
      "int num_splits=0, Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, "
      "Tensor? bonus_token_ids=None, Tensor(e!)? stages=None) -> ()");
  // The same on the packed layout (sk.chain_verify_packed): draft_token_ids
  // [T], cu_num_draft_tokens [B+1] (int32 or int64, read on the device),
  // target [T+B, V], draft [T, V] or None; the workspace and counters as for
  // chain_verify with K = max_num_draft_tokens.
  m.def(
      "chain_verify_packed(Tensor draft_token_ids, Tensor cu_num_draft_tokens, Tensor target, Tensor? draft, "
      "int max_num_draft_tokens, Tensor? temperature, bool logits, Tensor? seed, int seed_value, Tensor? offset, "
      "int offset_value, Tensor(a!) workspace, Tensor(b!) arrivals, Tensor(c!) output_token_ids, "
      "Tensor(d!) num_accepted, int num_splits=0, Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, "
      "Tensor? bonus_token_ids=None, Tensor(e!)? stages=None) -> ()");
  // Tree metadata (include/specdec/build_tree.cuh): parents [B, N],
  // num_nodes and prefix_lens [B] or None, each int32 or int64. Returns mask
  // int32 [B, N, ceil(N/32)], depth int32 [B, N], positions int64 [B, N].
  m.def("build_tree(Tensor parents, Tensor? num_nodes, Tensor? prefix_lens) -> (Tensor mask, Tensor depth, "
        "Tensor positions)");
  // The accepted path's K/V moved in place (include/specdec/compact_kv.cuh):
  // caches [num_blocks, block_size, Hkv, D] of one dtype (any strides; bits
  // are copied), block_tables [B, max_blocks], prefix_lens [B],
  // accepted_nodes [B, N] with N <= 1024, each int32 or int64.
  m.def("compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_tables, Tensor prefix_lens, "
        "Tensor accepted_nodes) -> ()");
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
  // Fused tree verification (include/specdec/tree_verify.cuh): writes
  // accepted_nodes and output_token_ids int32 [B, N] and num_accepted int32
  // [B]. Arguments as specdec::tree_verify, with seed/offset as in
  // rng_fill; `workspace` int64 [M], M >= B * (2 * ceil(3 * ceil(V / 1024)
  // / 2) + 4 * ceil(V / 4)), contents need not be initialised. The sampling
  // parameters, each [B] or None: top_k and bonus_token_ids int32/int64,
  // top_p and min_p float32. `num_splits` > 1: that many blocks share each
  // request's vocabulary passes through `stages`, int64 [>= 16 * (1 + B *
  // (N + 1))]: zero before the call and left zero after it (word 0 counts
  // the waits that gave up).
  m.def(
      "tree_verify(Tensor tree_token_ids, Tensor parents, Tensor target, Tensor? draft, Tensor? num_nodes, "
      "Tensor? temperature, bool logits, str draft_sampling, Tensor? seed, int seed_value, Tensor? offset, "
      "int offset_value, Tensor(a!) workspace, Tensor(b!) accepted_nodes, Tensor(c!) output_token_ids, "
      "Tensor(d!) num_accepted, Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, "
      "Tensor? bonus_token_ids=None, Tensor(e!)? stages=None, int num_splits=1) -> ()");
}

TORCH_LIBRARY_IMPL(specdec_C, CPU, m) {
  m.impl("rng_fill", &specdec::rng_fill_cpu);
  m.impl("chain_verify", &specdec::chain_verify_cpu);
  m.impl("chain_verify_packed", &specdec::chain_verify_packed_cpu);
  m.impl("build_tree", &specdec::build_tree_cpu);
  m.impl("compact_kv", &specdec::compact_kv_cpu);
  m.impl("tree_attention", &specdec::tree_attention_cpu);
  m.impl("tree_verify", &specdec::tree_verify_cpu);
}

TORCH_LIBRARY_IMPL(specdec_C, CUDA, m) {
  m.impl("rng_fill", &specdec::rng_fill_cuda);
  m.impl("chain_verify", &specdec::chain_verify_cuda);
  m.impl("chain_verify_packed", &specdec::chain_verify_packed_cuda);
  m.impl("build_tree", &specdec::build_tree_cuda);
  m.impl("compact_kv", &specdec::compact_kv_cuda);
  m.impl("tree_attention", &specdec::tree_attention_cuda);
  m.impl("tree_verify", &specdec::tree_verify_cuda);
}

TORCH_LIBRARY_IMPL(specdec_C, Meta, m) {
  m.impl("rng_fill", &specdec::rng_fill_meta);
  m.impl("chain_verify", &specdec::chain_verify_meta);
  m.impl("chain_verify_packed", &specdec::chain_verify_packed_meta);
  m.impl("build_tree", &specdec::build_tree_meta);
  m.impl("compact_kv", &specdec::compact_kv_meta);
  m.impl("tree_attention", &specdec::tree_attention_meta);
  m.impl("tree_verify", &specdec::tree_verify_meta);
}

// `import specdec_kernels._C` loads this library, which runs the
// registrations above; the module itself has no attributes.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
