// Asynchronous global -> shared copies (cp.async, sm_80 and later), so a
// block can fetch its next tile while it computes on the current one; on
// the host (and before sm_80) a plain copy that is complete at once.
//
// Ordering: a thread's copies are complete after async_copy_wait<n>() leaves
// at most n of its committed groups pending; other threads see them after
// a block barrier that follows the wait.
//
// This header includes no torch header.
#pragma once

#include <cstdint>
#include <cstring>

#include "specdec/common.cuh"

namespace specdec {

// 16 bytes from `source` to `destination` (both 16-byte aligned); zeros,
// with nothing read from `source`, when !valid.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void copy_16_bytes_async(void* destination, const void* source,
                                                                 bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t shared = static_cast<uint32_t>(__cvta_generic_to_shared(destination));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(source),
               "r"(valid ? 16 : 0)
               : "memory");
#else
  if (valid) {
    memcpy(destination, source, 16);
  } else {
    memset(destination, 0, 16);
  }
#endif
}

// Closes the group of this thread's copies issued since the last commit.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void async_copy_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's committed groups are pending.
template <int kPending>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void async_copy_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

}  // namespace specdec
