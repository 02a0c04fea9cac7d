// Tensor-core matrix multiply-accumulate as a warp collective, written so
// that one program runs on the GPU and, for tests, on the host.
//
// The unit is mma.sync.m16n8k16 (sm_80 and later): D[16x8] += A[16x16] *
// B[16x8], A and B 16-bit (bfloat16 or float16), D float32, each matrix
// spread over the 32 lanes of a warp in the PTX ISA's fragment layout. With
// g = lane / 4 and t = lane % 4 (a 32-bit register holds two 16-bit
// elements, the lower column or row in the low half):
//   A: a[0] = A[g][2t..2t+1]    a[1] = A[g+8][2t..2t+1]
//      a[2] = A[g][2t+8..2t+9]  a[3] = A[g+8][2t+8..2t+9]
//   B: b[0] = B[2t..2t+1][g]    b[1] = B[2t+8..2t+9][g]
//   D: d[0..1] = D[g][2t..2t+1] d[2..3] = D[g+8][2t..2t+1]
//
// Lane-holding blocks. A program written against these holds its values
// per *held lane*: arrays of kHeldLanes fragments, indexed by h, for lane
// held_lane(h). On the GPU (DeviceWarpBlock) each thread holds its own lane
// (kHeldLanes = 1); on the host (HostWarpBlock) one std::thread runs a whole
// warp and holds its 32 lanes, so the mma and the quad reductions below are
// plain loops there, with no barrier per instruction. Such a block provides
//   kWarps, kHeldLanes (static), warp(), held_lane(h), thread(h) (the
//   lane's thread id, warp * 32 + lane), sync() (a block barrier).
//
// This header includes no torch header.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "specdec/common.cuh"
#include "specdec/host_block.cuh"

namespace specdec {

constexpr int kMmaWarpSize = 32;

#if defined(__CUDACC__)
struct DeviceWarpBlock {
  static constexpr int kWarps = 8;
  static constexpr int kHeldLanes = 1;
  __device__ __forceinline__ int warp() const { return static_cast<int>(threadIdx.x) / kMmaWarpSize; }
  __device__ __forceinline__ int held_lane(int) const { return static_cast<int>(threadIdx.x) % kMmaWarpSize; }
  __device__ __forceinline__ int thread(int) const { return static_cast<int>(threadIdx.x); }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
};
#endif

// The host twin: kWarps std::threads, one per warp (2: tiles of 32 rows, so
// CPU tests cross row tiles with small trees).
struct HostWarpState {
  static constexpr int kWarps = 2;
  SpinBarrier<kWarps> block_barrier;
};

struct HostWarpBlock {
  static constexpr int kWarps = HostWarpState::kWarps;
  static constexpr int kHeldLanes = kMmaWarpSize;
  HostWarpState* state;
  int warp_index;

  SPECDEC_HOST_DEVICE int warp() const { return warp_index; }
  SPECDEC_HOST_DEVICE int held_lane(int h) const { return h; }
  SPECDEC_HOST_DEVICE int thread(int h) const { return warp_index * kMmaWarpSize + h; }
  SPECDEC_HOST_DEVICE void sync() const {
#if !defined(__CUDA_ARCH__)
    state->block_barrier.wait();
#endif
  }
};

// Runs program(block, index) for index in [0, num_blocks), blocks one after
// another, each on HostWarpState::kWarps std::threads.
template <class Program>
void run_host_warp_blocks(int64_t num_blocks, Program&& program) {
  run_emulated_blocks<HostWarpBlock, HostWarpState, HostWarpState::kWarps>(num_blocks, program);
}

// Two 16-bit values in one register, `low` in the low half.
template <class Value>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint32_t pack_pair(Value low, Value high) {
  return static_cast<uint32_t>(low.bits) | (static_cast<uint32_t>(high.bits) << 16);
}

template <class Value>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float pair_element(uint32_t pair, int index) {
  return to_float(Value{static_cast<uint16_t>(index == 0 ? pair : pair >> 16)});
}

namespace mma_detail {

template <class Value>
struct Instruction;

// The element of A (row r, column k) and of B (row k, column n) among the
// warp's fragments, by the layout above.
template <class Value>
SPECDEC_HOST_DEVICE float a_element(const uint32_t (&a)[kMmaWarpSize][4], int r, int k) {
  const int lane = (r % 8) * 4 + (k % 8) / 2;
  return pair_element<Value>(a[lane][(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k % 2);
}

template <class Value>
SPECDEC_HOST_DEVICE float b_element(const uint32_t (&b)[kMmaWarpSize][2], int k, int n) {
  return pair_element<Value>(b[n * 4 + (k % 8) / 2][k >= 8 ? 1 : 0], k % 2);
}

}  // namespace mma_detail

// d += a * b for the warp (every lane of the warp calls it; Value is
// BFloat16 or Float16). The host sums each product in order of k, in
// float32 without fused multiply-adds; the tensor cores' order and internal
// precision are their own, so results agree within float32 rounding.
template <class Block, class Value>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void warp_mma(const Block&, float (&d)[Block::kHeldLanes][4],
                                                      const uint32_t (&a)[Block::kHeldLanes][4],
                                                      const uint32_t (&b)[Block::kHeldLanes][2]) {
  if constexpr (Block::kHeldLanes == 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (std::is_same_v<Value, BFloat16>) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};"
          : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
          : "r"(a[0][0]), "r"(a[0][1]), "r"(a[0][2]), "r"(a[0][3]), "r"(b[0][0]), "r"(b[0][1]));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};"
          : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
          : "r"(a[0][0]), "r"(a[0][1]), "r"(a[0][2]), "r"(a[0][3]), "r"(b[0][0]), "r"(b[0][1]));
    }
#elif defined(__CUDA_ARCH__)
    __trap();  // no tensor-core mma before sm_80: the launcher never runs this there
#endif
  } else {
    static_assert(Block::kHeldLanes == kMmaWarpSize, "a host block holds whole warps");
    float a_matrix[16][16];
    float b_matrix[16][8];
    for (int r = 0; r < 16; ++r) {
      for (int k = 0; k < 16; ++k) a_matrix[r][k] = mma_detail::a_element<Value>(a, r, k);
    }
    for (int k = 0; k < 16; ++k) {
      for (int n = 0; n < 8; ++n) b_matrix[k][n] = mma_detail::b_element<Value>(b, k, n);
    }
    for (int lane = 0; lane < kMmaWarpSize; ++lane) {
      for (int i = 0; i < 4; ++i) {
        const int r = lane / 4 + (i >= 2 ? 8 : 0);
        const int n = (lane % 4) * 2 + i % 2;
        float sum = d[lane][i];
        for (int k = 0; k < 16; ++k) {
          const float product = a_matrix[r][k] * b_matrix[k][n];  // exact: 16-bit inputs
          sum += product;
        }
        d[lane][i] = sum;
      }
    }
  }
}

// Loads four 8x8 matrices of 16-bit elements from shared memory into the
// warp's fragments, as ldmatrix.sync.m8n8.x4 (sm_75 and later): lane 8i + r
// gives row_address(8i + r), the 8 elements (16 bytes, 16-byte aligned) of
// row r of matrix i. Lane (g, t) receives in fragments[..][i], of matrix i:
// row g, columns 2t..2t+1 (kTransposed false), or rows 2t..2t+1 of column g
// (true: ldmatrix .trans). So one load gives the A fragment of a row-major
// 16x16 tile, and two B fragments of a tile stored with n along its rows
// (false) or with k along its rows (true). On the host a loop over the
// warp's lanes builds the same fragments.
template <bool kTransposed, class Block, class RowAddress>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void warp_load_matrices(const Block& block, RowAddress&& row_address,
                                                                uint32_t (&fragments)[Block::kHeldLanes][4]) {
  if constexpr (Block::kHeldLanes == 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    const uint32_t row = static_cast<uint32_t>(__cvta_generic_to_shared(row_address(block.held_lane(0))));
    uint32_t(&f)[4] = fragments[0];
    // volatile: the same address holds new data after the next barrier.
    if constexpr (kTransposed) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(f[0]), "=r"(f[1]), "=r"(f[2]), "=r"(f[3])
                   : "r"(row));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(f[0]), "=r"(f[1]), "=r"(f[2]), "=r"(f[3])
                   : "r"(row));
    }
#elif defined(__CUDA_ARCH__)
    __trap();  // no ldmatrix before sm_75: the launcher never runs this there
#endif
  } else {
    static_assert(Block::kHeldLanes == kMmaWarpSize, "a host block holds whole warps");
    for (int lane = 0; lane < kMmaWarpSize; ++lane) {
      const int g = lane / 4;
      const int t = lane % 4;
      for (int i = 0; i < 4; ++i) {
        uint16_t low, high;
        if constexpr (kTransposed) {
          memcpy(&low, row_address(8 * i + 2 * t) + g, sizeof(low));
          memcpy(&high, row_address(8 * i + 2 * t + 1) + g, sizeof(high));
        } else {
          memcpy(&low, row_address(8 * i + g) + 2 * t, sizeof(low));
          memcpy(&high, row_address(8 * i + g) + 2 * t + 1, sizeof(high));
        }
        fragments[lane][i] = static_cast<uint32_t>(low) | (static_cast<uint32_t>(high) << 16);
      }
    }
  }
}

// Matrices 2n and 2n + 1 of a four-matrix load as one B fragment (b[0],
// b[1]): warp_load_matrices fills two mma B operands per load.
template <int kHeld>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void b_fragment_of(const uint32_t (&loaded)[kHeld][4], int n,
                                                           uint32_t (&b)[kHeld][2]) {
  for (int h = 0; h < kHeld; ++h) {
    b[h][0] = loaded[h][2 * n];
    b[h][1] = loaded[h][2 * n + 1];
  }
}

// Every lane gets combine() of the 4 lanes of its quad (lanes 4g..4g+3,
// which hold the same fragment rows), by the same butterfly (xor 1, then
// xor 2) on both sides, so the bits agree for commutative combines.
template <class Block, class Combine>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void quad_all_reduce(const Block&, float (&values)[Block::kHeldLanes],
                                                             Combine combine) {
  if constexpr (Block::kHeldLanes == 1) {
#if defined(__CUDA_ARCH__)
    values[0] = combine(values[0], __shfl_xor_sync(0xFFFFFFFFu, values[0], 1));
    values[0] = combine(values[0], __shfl_xor_sync(0xFFFFFFFFu, values[0], 2));
#endif
  } else {
    for (int lane_mask = 1; lane_mask <= 2; lane_mask <<= 1) {
      float before[kMmaWarpSize];
      memcpy(before, values, sizeof(before));
      for (int lane = 0; lane < kMmaWarpSize; ++lane) values[lane] = combine(before[lane], before[lane ^ lane_mask]);
    }
  }
}

}  // namespace specdec
