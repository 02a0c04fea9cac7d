// Tree metadata (sk.build_tree): ancestor bit masks, depths and rotary
// positions in one launch. The CUDA twin of kernels/build_tree.py;
// specdec_kernels/reference/build_tree.py is the definition of correct, and
// every output equals it bit for bit on every input.
//
// Design
// ------
// One thread per (request, node), over a 1-D grid of B * N threads: a node
// walks up its parent chain on its own, so the work spreads over nodes, no
// node waits for another and blocks need no barrier; small trees share a
// block (B = 64, N = 8 is four blocks of 128). A walk takes at most
// depth + 1 steps (<= N: a step must go to a parent below the current node,
// so it also stops on every cycle). The ancestors come in decreasing index
// order, so the mask row is written word by word as the walk leaves a word,
// each word once, from registers; only a walk that does not reach the root
// (a malformed tree: rare) writes its row a second time, all zeros. For
// N <= 64 a row is two words and a warp's rows are contiguous, so its stores
// coalesce.
//
// Defined outcomes (the reference's): node i is reachable iff
// i < num_nodes[b] and every parent on its chain lies in [0, child);
// unreachable nodes get a zero mask row and depth -1, and
// positions = prefix_lens[b] + depth (wrapping as torch's int64 add).
// parents[b, 0] is never read, a parent is read only for 0 < node < N, so
// no value causes an out-of-bounds access. Counts compare as int64, so a
// count <= 0 leaves every node padding and one >= N keeps every node.
//
// The node program is SPECDEC_HOST_DEVICE: the kernel runs it once per
// thread, csrc/build_tree.cu runs it on the host as the CPU implementation of
// torch.ops.specdec_C.build_tree. This header includes no torch header.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "specdec/common.cuh"
#include "specdec/index.cuh"

namespace specdec {

constexpr int kMaskWordBits = 32;

struct BuildTreeArgs {
  IndexTensor parents;  // [B, N]
  int64_t parents_stride_b = 0, parents_stride_n = 0;
  IndexTensor num_nodes;  // [B], or data == nullptr: N for every request
  int64_t num_nodes_stride = 0;
  IndexTensor prefix_lens;  // [B], or data == nullptr: 0
  int64_t prefix_lens_stride = 0;
  int32_t* mask = nullptr;       // [B, N, num_words], contiguous
  int32_t* depth = nullptr;      // [B, N], contiguous
  int64_t* positions = nullptr;  // [B, N], contiguous
  int64_t batch_size = 0;
  int64_t max_nodes = 0;  // N
  int64_t num_words = 0;  // ceil(N / 32)
};

// Launchers (csrc/build_tree.cu). Neither synchronises.
// One launch on `stream`; returns the launch status (cudaGetLastError).
cudaError_t launch_build_tree(const BuildTreeArgs& args, cudaStream_t stream);
// The same node program on the host (host pointers), node after node.
void build_tree_host(const BuildTreeArgs& args);

// Mask row, depth and position of node `flat` = b * N + i.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void build_tree_node(const BuildTreeArgs& args, int64_t flat) {
  const int64_t request = flat / args.max_nodes;
  const int64_t node = flat - request * args.max_nodes;
  const int64_t limit =
      args.num_nodes.data != nullptr ? args.num_nodes[request * args.num_nodes_stride] : args.max_nodes;
  int32_t* row = args.mask + flat * args.num_words;
  int32_t depth = -1;
  if (node < limit) {
    const int64_t parents_row = request * args.parents_stride_b;
    int64_t current = node;
    int64_t word = current / kMaskWordBits;
    uint32_t bits = 0;
    int32_t steps = 0;
    // Words above the node's own hold no ancestor.
    for (int64_t w = args.num_words - 1; w > word; --w) row[w] = 0;
    while (true) {
      bits |= 1u << (current % kMaskWordBits);
      if (current == 0) {
        depth = steps;
        break;
      }
      const int64_t parent = args.parents[parents_row + current * args.parents_stride_n];
      if (parent < 0 || parent >= current) break;
      ++steps;
      const int64_t parent_word = parent / kMaskWordBits;
      if (parent_word != word) {
        // The walk leaves `word` for good: store it, and zeros for the words
        // it skips. Bit 31 makes a negative word, as the reference packs it.
        row[word] = static_cast<int32_t>(bits);
        for (int64_t w = word - 1; w > parent_word; --w) row[w] = 0;
        word = parent_word;
        bits = 0;
      }
      current = parent;
    }
    if (depth >= 0) {
      row[word] = static_cast<int32_t>(bits);
      for (int64_t w = word - 1; w >= 0; --w) row[w] = 0;
    }
  }
  if (depth < 0) {
    for (int64_t w = 0; w < args.num_words; ++w) row[w] = 0;
  }
  args.depth[flat] = depth;
  const int64_t prefix = args.prefix_lens.data != nullptr ? args.prefix_lens[request * args.prefix_lens_stride] : 0;
  args.positions[flat] = wrapping_add(prefix, depth);
}

#if defined(__CUDACC__)
namespace build_tree_detail {

constexpr int kThreadsPerBlock = 128;

__global__ void __launch_bounds__(kThreadsPerBlock) build_tree_kernel(const BuildTreeArgs args) {
  const int64_t flat = static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
  if (flat < args.batch_size * args.max_nodes) build_tree_node(args, flat);
}

}  // namespace build_tree_detail
#endif  // __CUDACC__

}  // namespace specdec
