// Launcher of the fused tree verification (include/specdec/tree_verify.cuh
// holds the design and the kernel): one block per request, dispatch on the
// distribution dtype (float32 / bfloat16 / float16) and the token-id dtype
// (int32 / int64), and the host implementation, which runs the same block
// program on an emulated SIMT block (host_block.cuh).
#include <cuda_runtime.h>

#include <cstdint>

#include "specdec/host_block.cuh"
#include "specdec/tree_verify.cuh"

namespace specdec {

cudaError_t launch_tree_verify(const TreeVerifyArgs& args, cudaStream_t stream) {
  if (args.batch_size == 0) return cudaSuccess;
  if (args.batch_size > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  dispatch_storage_types(args.prob_dtype, args.token_dtype, [&](auto prob, auto token) {
    using Prob = decltype(prob);
    using Token = decltype(token);
    tree_verify_detail::tree_verify_kernel<Prob, Token>
        <<<static_cast<unsigned>(args.batch_size), DeviceBlock::kThreads, 0, stream>>>(args);
  });
  return cudaGetLastError();
}

void tree_verify_host(const TreeVerifyArgs& args) {
  dispatch_storage_types(args.prob_dtype, args.token_dtype, [&](auto prob, auto token) {
    using Prob = decltype(prob);
    using Token = decltype(token);
    // The emulated block's shared memory: blocks run one after another.
    TruncationHistogram histogram;
    run_host_blocks(args.batch_size, [&args, &histogram](const SimtHostBlock& block, int64_t request) {
      tree_verify_detail::tree_verify_block<SimtHostBlock, Prob, Token>(block, args, request, &histogram);
    });
  });
}

}  // namespace specdec
