// Launcher of build_tree (include/specdec/build_tree.cuh holds the design
// and the node program): the grid, and the host implementation, which runs
// the same node program for every node.
#include <cuda_runtime.h>

#include <cstdint>

#include "specdec/build_tree.cuh"

namespace specdec {

cudaError_t launch_build_tree(const BuildTreeArgs& args, cudaStream_t stream) {
  const int64_t threads = args.batch_size * args.max_nodes;
  if (threads == 0) return cudaSuccess;
  const int64_t blocks = (threads + build_tree_detail::kThreadsPerBlock - 1) / build_tree_detail::kThreadsPerBlock;
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  build_tree_detail::build_tree_kernel<<<static_cast<unsigned>(blocks), build_tree_detail::kThreadsPerBlock, 0,
                                         stream>>>(args);
  return cudaGetLastError();
}

void build_tree_host(const BuildTreeArgs& args) {
  const int64_t threads = args.batch_size * args.max_nodes;
  for (int64_t flat = 0; flat < threads; ++flat) build_tree_node(args, flat);
}

}  // namespace specdec
