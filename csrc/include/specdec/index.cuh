// Index inputs of either width: the contract takes counts, lengths, parents,
// block tables and paths as int32 or int64, each on its own. The kernels read
// them through IndexTensor as int64, so one instantiation serves every mix
// of widths and the launcher converts nothing (a conversion would be another
// launch).
#pragma once

#include <cstdint>

#include "specdec/common.cuh"

namespace specdec {

// A read-only int32 or int64 tensor; offsets are in elements.
struct IndexTensor {
  const void* data = nullptr;
  bool wide = false;  // int64, else int32

  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t operator[](int64_t offset) const {
#if defined(__CUDA_ARCH__)
    return wide ? static_cast<int64_t>(__ldg(static_cast<const long long*>(data) + offset))
                : static_cast<int64_t>(__ldg(static_cast<const int32_t*>(data) + offset));
#else
    return wide ? static_cast<const int64_t*>(data)[offset] : static_cast<const int32_t*>(data)[offset];
#endif
  }
};

// a + b modulo 2**64, as torch adds int64 tensors (signed overflow is
// undefined behaviour in C++; garbage prefix lengths must not invoke it).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t wrapping_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}

}  // namespace specdec
