// Element types, reduce ops and min-max quantisation of the ring all-reduce. Everything here is
// plain arithmetic shared by the C++ ring and the CUDA kernels (JAXODC_HD), written so that both
// produce the same bits: f16/bf16 are reduced in f32 and rounded back to nearest-even, and
// dequantisation is one rounded multiply then one rounded add (CUDA uses __fmul_rn/__fadd_rn so
// nvcc cannot contract it into an FMA; the x86-64 host build has no FMA contraction).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JAXODC_HD __host__ __device__ __forceinline__
#else
#define JAXODC_HD inline
#endif

namespace jaxodc::ring {

enum class DType : uint32_t { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kI32 = 4, kI64 = 5 };
enum class Op : uint32_t { kSum = 0, kAvg = 1, kMin = 2, kMax = 3, kProd = 4 };
enum class Quant : uint32_t { kNone = 0, kU8 = 1, kU16 = 2 };

inline size_t dtype_size(DType d) {
  switch (d) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF64: case DType::kI64: return 8;
    default: return 2;
  }
}
inline bool dtype_is_float(DType d) { return d != DType::kI32 && d != DType::kI64; }
inline size_t quant_size(Quant q) { return q == Quant::kU8 ? 1 : q == Quant::kU16 ? 2 : 0; }
inline float quant_levels(Quant q) { return q == Quant::kU8 ? 255.0f : 65535.0f; }

JAXODC_HD uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
JAXODC_HD float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

JAXODC_HD float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }
JAXODC_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

JAXODC_HD float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; mant <<= 1; } while ((mant & 0x400u) == 0);
      u = sign | (uint32_t(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  }
  return bits_f32(u);
}

JAXODC_HD uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf (RNE)
  if (a < 0x38800000u) {  // subnormal or zero in f16
    if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // < half of the smallest subnormal
    uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(e);  // 14 + (113 - e) ... gives mantissa bits kept
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);  // RNE on the 13 dropped bits
  r -= 0x38000000u;  // rebias exponent 127 -> 15
  return static_cast<uint16_t>(sign | (r >> 13));
}

// Accumulate type: f32 for 16-bit floats, the type itself otherwise. Integer sums and products
// wrap (computed unsigned) like numpy.
template <DType D> struct Traits;
template <> struct Traits<DType::kF32> { using T = float; using A = float;
  static JAXODC_HD A load(T v) { return v; } static JAXODC_HD T store(A a) { return a; } };
template <> struct Traits<DType::kF64> { using T = double; using A = double;
  static JAXODC_HD A load(T v) { return v; } static JAXODC_HD T store(A a) { return a; } };
template <> struct Traits<DType::kF16> { using T = uint16_t; using A = float;
  static JAXODC_HD A load(T v) { return f16_to_f32(v); } static JAXODC_HD T store(A a) { return f32_to_f16(a); } };
template <> struct Traits<DType::kBF16> { using T = uint16_t; using A = float;
  static JAXODC_HD A load(T v) { return bf16_to_f32(v); } static JAXODC_HD T store(A a) { return f32_to_bf16(a); } };
template <> struct Traits<DType::kI32> { using T = int32_t; using A = int32_t;
  static JAXODC_HD A load(T v) { return v; } static JAXODC_HD T store(A a) { return a; } };
template <> struct Traits<DType::kI64> { using T = int64_t; using A = int64_t;
  static JAXODC_HD A load(T v) { return v; } static JAXODC_HD T store(A a) { return a; } };

template <typename A> JAXODC_HD A wrap_add(A a, A b) { return a + b; }
template <typename A> JAXODC_HD A wrap_mul(A a, A b) { return a * b; }
template <> JAXODC_HD int32_t wrap_add(int32_t a, int32_t b) { return int32_t(uint32_t(a) + uint32_t(b)); }
template <> JAXODC_HD int64_t wrap_add(int64_t a, int64_t b) { return int64_t(uint64_t(a) + uint64_t(b)); }
template <> JAXODC_HD int32_t wrap_mul(int32_t a, int32_t b) { return int32_t(uint32_t(a) * uint32_t(b)); }
template <> JAXODC_HD int64_t wrap_mul(int64_t a, int64_t b) { return int64_t(uint64_t(a) * uint64_t(b)); }

// Combines the incoming partial `a` (everything upstream in the ring) with the local value `b`.
template <typename A> JAXODC_HD A combine(Op op, A a, A b) {
  switch (op) {
    case Op::kSum: case Op::kAvg: return wrap_add(a, b);
    case Op::kMin: return b < a ? b : a;
    case Op::kMax: return b > a ? b : a;
    default: return wrap_mul(a, b);
  }
}

// Average is applied once, by the owner of the fully reduced chunk (integers truncate toward 0).
template <typename A> JAXODC_HD A finalize(Op op, A a, int world) {
  return op == Op::kAvg ? a / static_cast<A>(world) : a;
}

// Min-max quantisation metadata of one piece: value = lo + q * scale.
struct QMeta { float lo; float scale; };

JAXODC_HD float dequant_value(uint32_t q, QMeta m) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(m.lo, __fmul_rn(static_cast<float>(q), m.scale));
#elif defined(__x86_64__) && !defined(__FMA__)
  return m.lo + static_cast<float>(q) * m.scale;  // no FMA instructions: nothing to contract
#else
  volatile float prod = static_cast<float>(q) * m.scale;  // keep the compiler from fusing an FMA
  return m.lo + prod;
#endif
}

// Branch-free so the host loops vectorise (max/min select; NaN maps to 0).
JAXODC_HD uint32_t quant_value(float v, QMeta m, float inv, float levels) {
  float t = (v - m.lo) * inv + 0.5f;
  t = t > 0.0f ? t : 0.0f;
  t = t < levels ? t : levels;
  return static_cast<uint32_t>(static_cast<int32_t>(t));
}

}  // namespace jaxodc::ring
