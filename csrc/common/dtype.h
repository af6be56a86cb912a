// Element conversions between the compute dtypes and the fp32 wire/master format.
#pragma once

#include <cstdint>
#include <cstring>

// JAXODC_HD: compiled for host and device by nvcc, so the CUDA handlers' kernels round exactly as
// the CPU handlers do (CPU tests check the same code). Defined as ring/reduce.h defines it.
#if !defined(JAXODC_HD)
#if defined(__CUDACC__)
#define JAXODC_HD __host__ __device__ __forceinline__
#else
#define JAXODC_HD inline
#endif
#endif

namespace jaxodc {

// Round to nearest even; a NaN stays a (quiet) NaN.
JAXODC_HD uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

JAXODC_HD float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

enum class ElemType : int { kF32 = 0, kBF16 = 1 };

inline size_t elem_size(ElemType t) { return t == ElemType::kF32 ? 4 : 2; }

// dst[i] = src[i] (src is fp32), written in dst's type.
inline void store_from_f32(void* dst, ElemType dst_type, const float* src, int64_t n) {
  if (dst_type == ElemType::kF32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  } else {
    auto* out = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(src[i]);
  }
}

// dst[i] = src[i] as fp32.
inline void load_to_f32(float* dst, const void* src, ElemType src_type, int64_t n) {
  if (src_type == ElemType::kF32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  } else {
    auto* in = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(in[i]);
  }
}

// acc[i] += src[i] (src in its type).
inline void accumulate_f32(float* acc, const void* src, ElemType src_type, int64_t n) {
  if (src_type == ElemType::kF32) {
    auto* in = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) acc[i] += in[i];
  } else {
    auto* in = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) acc[i] += bf16_to_f32(in[i]);
  }
}

}  // namespace jaxodc
