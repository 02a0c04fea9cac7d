// Portable building blocks for code that runs on the GPU and on the host.
//
// Kernel headers in this directory include no torch header (so csrc/ compiles
// without a CUDA build of torch and can be used from any engine). Functions
// marked SPECDEC_HOST_DEVICE compile under nvcc for both sides and under a
// plain C++ compiler for the host.
//
// Floating point: every backend of the package must perform the same IEEE
// operations in the same order, each rounded separately. On the device the
// _rn intrinsics below are never contracted into FMAs by nvcc; on the host
// the plain operators are used, so host code must be compiled with
// -ffp-contract=off (setup.py passes it to both nvcc's host compiler and the
// C++ compiler).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SPECDEC_HOST_DEVICE __host__ __device__
#define SPECDEC_FORCEINLINE __forceinline__
#else
#define SPECDEC_HOST_DEVICE
#define SPECDEC_FORCEINLINE inline
#endif

namespace specdec {

// a * b, rounded to nearest even, never fused with a neighbouring add.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float fmul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// a + b, rounded to nearest even, never fused with a neighbouring multiply.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float fadd_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// a - b, rounded to nearest even, never fused with a neighbouring multiply.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float fsub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// High 32 bits of the 64-bit product a * b.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint32_t umulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * static_cast<uint64_t>(b)) >> 32);
#endif
}

// Leading zero bits of a 32-bit word; 32 for 0.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int count_leading_zeros(uint32_t word) {
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(word));
#elif defined(__GNUC__) || defined(__clang__)
  return word == 0 ? 32 : __builtin_clz(word);
#else
  int zeros = 0;
  for (uint32_t bit = 0x80000000u; bit != 0 && (word & bit) == 0; bit >>= 1) ++zeros;
  return zeros;
#endif
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float bits_as_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint32_t float_as_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

}  // namespace specdec
