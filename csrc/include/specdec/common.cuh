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

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

// High 64 bits of the 128-bit product a * b.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE uint64_t umul64hi(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
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

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float positive_infinity() { return bits_as_float(0x7F800000u); }
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float negative_infinity() { return bits_as_float(0xFF800000u); }

// a / b, correctly rounded (the reference's float32 division).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float fdiv_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float exp_f32(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);  // the accurate expf (no --use_fast_math)
#else
  return std::exp(x);
#endif
}

// 2^x (attention's online softmax works in base 2).
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float exp2_f32(float x) {
#if defined(__CUDA_ARCH__)
  return exp2f(x);
#else
  return std::exp2(x);
#endif
}

// 16-byte unit; 16-byte aligned, so the device moves it with one vector
// load or store (compact_kv's widest unit, tree_attention's cache loads).
struct alignas(16) Bytes16 {
  uint64_t low, high;
};

// 16-bit storage types (bit patterns; no cuda_fp16.h / cuda_bf16.h needed).
struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float to_float(float value) { return value; }

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float to_float(BFloat16 value) {
  return bits_as_float(static_cast<uint32_t>(value.bits) << 16);
}

SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float to_float(Float16 value) {
#if defined(__CUDA_ARCH__)
  float result;
  asm("cvt.f32.f16 %0, %1;" : "=f"(result) : "h"(value.bits));
  return result;
#else
  // Exact: every half is a float.
  const uint32_t sign = static_cast<uint32_t>(value.bits & 0x8000u) << 16;
  const uint32_t exponent = (value.bits >> 10) & 0x1Fu;
  const uint32_t mantissa = value.bits & 0x3FFu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;  // zero or subnormal, exact
    return bits_as_float(float_as_bits(magnitude) | sign);
  }
  if (exponent == 0x1F) return bits_as_float(sign | 0x7F800000u | (mantissa << 13));
  return bits_as_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
#endif
}

// float -> storage type, rounded to nearest even (as torch's .to(dtype)):
// from_float<T>(x).
template <class T>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE T from_float(float value);

template <>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE float from_float<float>(float value) {
  return value;
}

template <>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE BFloat16 from_float<BFloat16>(float value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // cvt to bf16 needs sm_80; older archs use the bit rounding
  uint16_t bits;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return {bits};
#else
  const uint32_t bits = float_as_bits(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return {static_cast<uint16_t>((bits >> 16) | 0x40u)};  // quiet NaN
  return {static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16)};
#endif
}

template <>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE Float16 from_float<Float16>(float value) {
#if defined(__CUDA_ARCH__)
  uint16_t bits;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return {bits};
#else
  const uint32_t bits = float_as_bits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return {static_cast<uint16_t>(sign | 0x7E00u)};  // NaN
  if (magnitude >= 0x477FF000u) return {static_cast<uint16_t>(sign | 0x7C00u)};  // rounds past 65504: inf
  if (magnitude < 0x38800000u) {
    // Below 2^-14: a subnormal half, k * 2^-24 with k = x * 2^24 rounded to
    // nearest even (the product is exact; k = 1024 is the smallest normal).
    const float units = std::nearbyint(bits_as_float(magnitude) * 0x1p24f);
    return {static_cast<uint16_t>(sign | static_cast<uint16_t>(units))};
  }
  const uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
  return {static_cast<uint16_t>(sign | ((rounded >> 13) - (112u << 10)))};
#endif
}

// The storage type of distributions and of token ids, as the launchers
// receive them.
enum class ProbDtype : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum class TokenDtype : int32_t { kInt32 = 0, kInt64 = 1 };

// Calls body(Prob{}, Token{}) with the storage types (host side of a launcher).
template <class Body>
void dispatch_storage_types(ProbDtype prob_dtype, TokenDtype token_dtype, Body&& body) {
  const bool wide_ids = token_dtype == TokenDtype::kInt64;
  switch (prob_dtype) {
    case ProbDtype::kFloat32:
      wide_ids ? body(float{}, int64_t{}) : body(float{}, int32_t{});
      break;
    case ProbDtype::kBFloat16:
      wide_ids ? body(BFloat16{}, int64_t{}) : body(BFloat16{}, int32_t{});
      break;
    case ProbDtype::kFloat16:
      wide_ids ? body(Float16{}, int64_t{}) : body(Float16{}, int32_t{});
      break;
  }
}

// Calls body(std::bool_constant<value>{}) (host side of a launcher): one
// kernel instantiation per value, so neither pays registers for the other.
template <class Body>
void dispatch_bool(bool value, Body&& body) {
  if (value) {
    body(std::true_type{});
  } else {
    body(std::false_type{});
  }
}

}  // namespace specdec
