// Launcher of the fused tree verification (include/specdec/tree_verify.cuh
// holds the design and the kernel): one block per request (num_splits with
// the split plan), dispatch on the plan, on the
// distribution dtype (float32 / bfloat16 / float16) and the token-id dtype
// (int32 / int64), and the host implementation, which runs the same block
// program on an emulated SIMT block (host_block.cuh).
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "specdec/host_block.cuh"
#include "specdec/tree_verify.cuh"

namespace specdec {

cudaError_t launch_tree_verify(const TreeVerifyArgs& args, cudaStream_t stream) {
  if (args.batch_size == 0) return cudaSuccess;
  const int64_t blocks = args.batch_size * args.num_splits;
  if (args.num_splits < 1 || blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  dispatch_storage_types(args.prob_dtype, args.token_dtype, [&](auto prob, auto token) {
    using Prob = decltype(prob);
    using Token = decltype(token);
    if (args.num_splits > 1) {
      tree_verify_detail::tree_verify_kernel<Prob, Token, true>
          <<<static_cast<unsigned>(blocks), DeviceBlock::kThreads, 0, stream>>>(args);
    } else {
      tree_verify_detail::tree_verify_kernel<Prob, Token, false>
          <<<static_cast<unsigned>(blocks), DeviceBlock::kThreads, 0, stream>>>(args);
    }
  });
  return cudaGetLastError();
}

void tree_verify_host(const TreeVerifyArgs& args) {
  const int64_t splits = args.num_splits;
  dispatch_storage_types(args.prob_dtype, args.token_dtype, [&](auto prob, auto token) {
    using Prob = decltype(prob);
    using Token = decltype(token);
    // The emulated block's shared memory: blocks run one after another. A
    // request's blocks run in decreasing rank, so the first to run (the
    // last rank) takes every slice and the writer (rank 0), last, finds
    // every stage done by another block: its outputs come from the totals,
    // records and chunk results another block published.
    TruncationHistogram histogram;
    std::vector<tree_verify_detail::Pending> replay(splits > 1 ? kMaxSplitRejections : 0);
    run_host_blocks(args.batch_size * splits, [&args, &histogram, &replay, splits](const SimtHostBlock& block,
                                                                                   int64_t index) {
      if (splits > 1) {
        tree_verify_detail::tree_verify_block<SimtHostBlock, Prob, Token, true>(
            block, args, index / splits, splits - 1 - index % splits, &histogram, replay.data());
      } else {
        tree_verify_detail::tree_verify_block<SimtHostBlock, Prob, Token, false>(block, args, index, 0, &histogram,
                                                                                 nullptr);
      }
    });
  });
}

}  // namespace specdec
