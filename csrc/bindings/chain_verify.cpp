// chain_verify and chain_verify_packed: fused chain verification
// (csrc/chain_verify.cu), one kernel for both layouts. The caller allocates
// the outputs and lends the workspace and the counters
// (specdec_kernels/launchers/chain_verify.py sizes them with
// cuda_workspace_specs and keeps them across calls).
#include <tuple>
#include <utility>

#include "common.h"
#include "specdec/chain_verify.cuh"

namespace specdec::bindings {
namespace {

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
  const std::optional<at::Tensor>& errors;  // the device's fault counters, or none: not counted
  int64_t fault_role;                       // tests: the block of this role gives up its waits
  const std::optional<at::Tensor>& claims;  // per request the launch's claim of its words, or none: no claims
  int64_t stamp;                            // this launch's number (faults.cuh, claim_ready)
};

// The sizes of one call, read from either layout.
struct ChainShapes {
  int64_t batch_size = 0;
  int64_t max_drafts = 0;
  int64_t vocab_size = 0;
  int64_t num_tokens = 0;  // T (packed)
  bool bonus_rows = true;  // packed: target [T+B, V]; false: [T, V], bonus_token_ids given
};

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
    // With bonus ids the bonus rows may be left out (vLLM's target_logits): [T, V].
    const bool has_bonus = t.sampling.bonus_token_ids.has_value();
    TORCH_CHECK_VALUE(t.target.dim() == 2 && (t.target.size(0) == shapes.num_tokens + shapes.batch_size ||
                                              (has_bonus && t.target.size(0) == shapes.num_tokens)),
                      "specdec_C::", op, ": `target` must have shape [T+B, V] with T + B = ", shapes.num_tokens,
                      " + ", shapes.batch_size, has_bonus ? " (or [T, V] with bonus_token_ids)" : "", ", got ",
                      t.target.sizes());
    shapes.bonus_rows = t.target.size(0) == shapes.num_tokens + shapes.batch_size;
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
  TORCH_CHECK_VALUE(t.arrivals.dim() == 1 && t.arrivals.is_contiguous() &&
                        t.arrivals.numel() >= chain_counter_words(batch_size),
                    "specdec_C::", op, ": `arrivals` must be a contiguous [N] tensor with N >= 2 * B = ",
                    chain_counter_words(batch_size), ", got ", t.arrivals.sizes());
  check_fault_counters(t.errors, op, t.target);
  check_same_device(t.arrivals, op, "arrivals", t.target, "target");
  if (t.claims.has_value()) {
    check_dtype(*t.claims, op, "claims", at::kLong);
    TORCH_CHECK_VALUE(t.claims->dim() == 1 && t.claims->is_contiguous() && t.claims->numel() >= batch_size,
                      "specdec_C::", op, ": `claims` must be a contiguous [N] tensor with N >= B = ", batch_size,
                      ", got ", t.claims->sizes());
    check_same_device(*t.claims, op, "claims", t.target, "target");
    check_launch_stamp(t.stamp, op);
  }
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
  args.bonus_rows = shapes.bonus_rows;
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
  args.errors = fault_counters(t.errors);
  args.fault_role = t.fault_role;
  if (t.claims.has_value()) args.claims = t.claims->data_ptr<int64_t>();
  args.stamp = t.stamp;
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
         symbolic(t.workspace) || symbolic(t.arrivals) || symbolic(t.output_token_ids) || symbolic(t.num_accepted) ||
         symbolic(t.stages) || symbolic(t.errors);
}

// Meta: dtypes and ranks under symbolic shapes, else every check.
void check_chain_verify_meta(const ChainVerifyTensors& t, const char* op) {
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

template <Backend backend>
void verify_chain(const ChainVerifyTensors& t, const char* op, bool logits, int64_t seed_value, int64_t offset_value) {
  if constexpr (backend == Backend::kMeta) {
    check_chain_verify_meta(t, op);
  } else {
    const ChainShapes shapes = check_chain_verify_args(t, op);
    const c10::OptionalDeviceGuard device_guard(guarded_device(backend, t.target.device()));
    const ChainVerifyInputs inputs = prepare_chain_verify(t, shapes, logits, seed_value, offset_value);
    if constexpr (backend == Backend::kHost) {
      chain_verify_host(inputs.args);
    } else {
      check_launch(launch_chain_verify(inputs.args, current_cuda_stream(t.target.device())), op);
    }
  }
}

template <Backend backend>
void chain_verify(const at::Tensor& draft_token_ids, const at::Tensor& target, const std::optional<at::Tensor>& draft,
                  const std::optional<at::Tensor>& num_draft_tokens, const std::optional<at::Tensor>& temperature,
                  bool logits, const std::optional<at::Tensor>& seed, int64_t seed_value,
                  const std::optional<at::Tensor>& offset, int64_t offset_value, const at::Tensor& workspace,
                  const at::Tensor& arrivals, const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                  int64_t num_splits, const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                  const std::optional<at::Tensor>& min_p, const std::optional<at::Tensor>& bonus_token_ids,
                  const std::optional<at::Tensor>& stages, const std::optional<at::Tensor>& errors,
                  int64_t fault_role, const std::optional<at::Tensor>& claims, int64_t stamp) {
  verify_chain<backend>({draft_token_ids, kNoTensor, target, draft, num_draft_tokens, temperature, seed, offset,
                         workspace, arrivals, output_token_ids, num_accepted, num_splits, 0,
                         {top_k, top_p, min_p, bonus_token_ids}, stages, errors, fault_role, claims, stamp},
                        "chain_verify", logits, seed_value, offset_value);
}

template <Backend backend>
void chain_verify_packed(const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
                         const at::Tensor& target, const std::optional<at::Tensor>& draft,
                         int64_t max_num_draft_tokens, const std::optional<at::Tensor>& temperature, bool logits,
                         const std::optional<at::Tensor>& seed, int64_t seed_value,
                         const std::optional<at::Tensor>& offset, int64_t offset_value, const at::Tensor& workspace,
                         const at::Tensor& arrivals, const at::Tensor& output_token_ids,
                         const at::Tensor& num_accepted, int64_t num_splits, const std::optional<at::Tensor>& top_k,
                         const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
                         const std::optional<at::Tensor>& bonus_token_ids, const std::optional<at::Tensor>& stages,
                         const std::optional<at::Tensor>& errors, int64_t fault_role,
                         const std::optional<at::Tensor>& claims, int64_t stamp) {
  const std::optional<at::Tensor> cu = cu_num_draft_tokens;
  verify_chain<backend>({draft_token_ids, cu, target, draft, kNoTensor, temperature, seed, offset, workspace,
                         arrivals, output_token_ids, num_accepted, num_splits, max_num_draft_tokens,
                         {top_k, top_p, min_p, bonus_token_ids}, stages, errors, fault_role, claims, stamp},
                        "chain_verify_packed", logits, seed_value, offset_value);
}

}  // namespace
}  // namespace specdec::bindings

TORCH_LIBRARY_FRAGMENT(specdec_C, m) {
  // Fused chain verification (include/specdec/chain_verify.cuh): writes
  // output_token_ids int32 [B, K+1] and num_accepted int32 [B]. Arguments as
  // specdec::chain_verify, with seed/offset as in rng_fill; `workspace`
  // int64 [N], N >= 3 * B * ceil(V / 1024), contents need not be
  // initialised (2 * B * (K + 1) more words per extra split let the
  // vocabulary split over more blocks); `arrivals` int32 [>= 2 * B], the
  // counters (per request its arrivals and failure flag): zero before the
  // call and left zero after it. `num_splits`: blocks per
  // request, 0 for the launcher's choice (tests force other counts).
  // `stages` int64 [>= B * chain_stage_request_words(K + 1)] or None: the
  // staged plan's records with logits or top_k/top_p/min_p
  // (chain_verify_stages.cuh; with logits only, 16 words a request), zero
  // before the call and left zero; without it (or too small) such a call has
  // one block per request. `errors` int32 [>= 2] or
  // None: the device's fault counters (faults.cuh) a wait that gives up
  // counts into; the request then gets tokens -1 and num_accepted 0.
  // `fault_role` (tests): the block of that role gives up its waits at once.
  // `claims` int64 [>= B] or None: per request the launch's claim of its
  // words (faults.cuh), left zero; `stamp` a number the caller draws for
  // each launch, in [2**40, 2**61): the first block of a split request resets
  // its words whatever they held, the others wait for it.
  m.def(
      "chain_verify(Tensor draft_token_ids, Tensor target, Tensor? draft, Tensor? num_draft_tokens, "
      "Tensor? temperature, bool logits, Tensor? seed, int seed_value, Tensor? offset, int offset_value, "
      "Tensor(a!) workspace, Tensor(b!) arrivals, Tensor(c!) output_token_ids, Tensor(d!) num_accepted, "
      "int num_splits=0, Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, "
      "Tensor? bonus_token_ids=None, Tensor(e!)? stages=None, Tensor(f!)? errors=None, int fault_role=-1, "
      "Tensor(g!)? claims=None, int stamp=0) -> ()");
  // The same on the packed layout (sk.chain_verify_packed): draft_token_ids
  // [T], cu_num_draft_tokens [B+1] (int32 or int64, read on the device),
  // target [T+B, V], draft [T, V] or None; the workspace and counters as for
  // chain_verify with K = max_num_draft_tokens.
  m.def(
      "chain_verify_packed(Tensor draft_token_ids, Tensor cu_num_draft_tokens, Tensor target, Tensor? draft, "
      "int max_num_draft_tokens, Tensor? temperature, bool logits, Tensor? seed, int seed_value, Tensor? offset, "
      "int offset_value, Tensor(a!) workspace, Tensor(b!) arrivals, Tensor(c!) output_token_ids, "
      "Tensor(d!) num_accepted, int num_splits=0, Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, "
      "Tensor? bonus_token_ids=None, Tensor(e!)? stages=None, Tensor(f!)? errors=None, int fault_role=-1, "
      "Tensor(g!)? claims=None, int stamp=0) -> ()");
}

SPECDEC_REGISTER_BACKENDS("chain_verify", specdec::bindings::chain_verify)
SPECDEC_REGISTER_BACKENDS("chain_verify_packed", specdec::bindings::chain_verify_packed)
