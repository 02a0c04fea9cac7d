// Exact 64-bit integer bins in shared memory, added to with 32-bit atomics
// only.
//
// Why: sm_80 and sm_90a have no 64-bit add for shared memory. ptxas lowers a
// 64-bit shared atomicAdd to a compare-and-swap loop (LDS.64, add,
// ATOMS.CAST.SPIN.64, retry while another lane changed the word), and lanes
// that hit the same bin retry one after another. truncation.cuh's radix
// histograms had 864 such sites in the extension, and a search's first pass
// puts a whole row into a few tens of exponent bins, where the loops
// serialise. A 32-bit add is one native ATOMS.ADD.
//
// How: a bin is two 32-bit words, bits 0-31 (`low`) and 32-63 (`high`), kept
// in separate arrays (a warp's distinct bins fall in distinct banks). add()
// adds a 32-bit value to the low word and, when that add wraps (the value
// the atomic returns plus the value exceeds 2**32 - 1), adds the carry to the
// high word. Each add wraps at most once (value < 2**32), and whether it
// wraps is decided by the old value it replaced, so in any order of the adds
// the number of carries is floor(sum / 2**32) and the low word ends at
// sum mod 2**32: after a barrier, bin(i) is the exact sum, the same bits a
// 64-bit atomicAdd gives. Each sum must stay below 2**64; the callers state
// their bounds where they add.
//
// On the host (SimtHostBlock's threads share plain memory) the same words
// take __atomic_fetch_add, so the host twin runs the same carries.
//
// This header includes no torch header.
#pragma once

#include <cstdint>

#include "specdec/common.cuh"

namespace specdec {

// *word += value (relaxed, as a shared-memory atomicAdd); the old value.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint32_t atomic_add_u32(uint32_t* word, uint32_t value) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(reinterpret_cast<unsigned int*>(word), static_cast<unsigned int>(value));
#else
  return __atomic_fetch_add(word, value, __ATOMIC_RELAXED);
#endif
}

template <int kBins>
struct SplitWordBins {
  uint32_t low[kBins];   // bits 0-31 of each bin's sum
  uint32_t high[kBins];  // bits 32-63

  // Plain accesses, between barriers.
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint64_t operator[](int bin) const {
    return (static_cast<uint64_t>(high[bin]) << 32) | low[bin];
  }
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void set(int bin, uint64_t value) {
    low[bin] = static_cast<uint32_t>(value);
    high[bin] = static_cast<uint32_t>(value >> 32);
  }

  // bin += value, atomically: one 32-bit add, and a second for the carry.
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void add(int bin, uint32_t value) {
    const uint32_t before = atomic_add_u32(&low[bin], value);
    if (static_cast<uint32_t>(before + value) < before) atomic_add_u32(&high[bin], 1u);
  }

  // bin += value for a bin whose whole sum stays below 2**32 (the caller's
  // bound): the low word never wraps, so there is no carry to look for and
  // the atomic's result is not waited on.
  SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE void add_below_2_32(int bin, uint32_t value) {
    atomic_add_u32(&low[bin], value);
  }
};

}  // namespace specdec
