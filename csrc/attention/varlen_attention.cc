// The varlen attention kernel (varlen_attention.h) for every instruction set: the kernel body
// (varlen_attention_kernel.inc) is compiled once per instruction set (portable scalar, SSE2,
// AVX2+FMA, AVX-512) with target pragmas, so the default -O3 build without -march=native still
// runs wide vectors; the widest one the CPU supports is picked at run time.
#include "attention/varlen_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace jaxodc::attention {

namespace {

namespace isa_scalar {
using vf = float;
using vi = int32_t;
constexpr int W = 1, NVMAX = 4;
inline vf vzero() { return 0.f; }
inline vf vset1(float x) { return x; }
inline vf vload(const float* p) { return *p; }
inline void vstore(float* p, vf x) { *p = x; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vmin(vf a, vf b) { return std::min(a, b); }
inline vf vmax(vf a, vf b) { return std::max(a, b); }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vi vround(vf x) { return static_cast<vi>(std::nearbyint(x)); }
inline vf vtof(vi n) { return static_cast<float>(n); }
inline vf vpow2(vi n) {
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float hsum(vf x) { return x; }
inline float hmax(vf x) { return x; }
#include "attention/varlen_attention_kernel.inc"
}  // namespace isa_scalar

#ifdef JAXODC_ATTENTION_X86

namespace isa_sse2 {
using vf = __m128;
using vi = __m128i;
constexpr int W = 4, NVMAX = 2;
inline vf vzero() { return _mm_setzero_ps(); }
inline vf vset1(float x) { return _mm_set1_ps(x); }
inline vf vload(const float* p) { return _mm_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm_storeu_ps(p, x); }
inline vf vadd(vf a, vf b) { return _mm_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm_mul_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm_add_ps(_mm_mul_ps(a, b), c); }
inline vi vround(vf x) { return _mm_cvtps_epi32(x); }
inline vf vtof(vi n) { return _mm_cvtepi32_ps(n); }
inline vf vpow2(vi n) { return _mm_castsi128_ps(_mm_slli_epi32(_mm_add_epi32(n, _mm_set1_epi32(127)), 23)); }
inline float hsum(vf x) {
  alignas(16) float t[4];
  _mm_store_ps(t, x);
  return (t[0] + t[1]) + (t[2] + t[3]);
}
inline float hmax(vf x) {
  alignas(16) float t[4];
  _mm_store_ps(t, x);
  return std::max(std::max(t[0], t[1]), std::max(t[2], t[3]));
}
#include "attention/varlen_attention_kernel.inc"
}  // namespace isa_sse2

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace isa_avx2 {
using vf = __m256;
using vi = __m256i;
constexpr int W = 8, NVMAX = 2;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vi vround(vf x) { return _mm256_cvtps_epi32(x); }
inline vf vtof(vi n) { return _mm256_cvtepi32_ps(n); }
inline vf vpow2(vi n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
inline float hsum(vf x) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  alignas(16) float t[4];
  _mm_store_ps(t, s);
  return (t[0] + t[1]) + (t[2] + t[3]);
}
inline float hmax(vf x) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  alignas(16) float t[4];
  _mm_store_ps(t, s);
  return std::max(std::max(t[0], t[1]), std::max(t[2], t[3]));
}
#include "attention/varlen_attention_kernel.inc"
}  // namespace isa_avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
// GCC 12's own avx512fintrin.h (`__m512 __Y = __Y;`) trips this warning at every intrinsic.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace isa_avx512 {
using vf = __m512;
using vi = __m512i;
constexpr int W = 16, NVMAX = 4;  // 32 vector registers: 4 x 4 accumulators fit
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vi vround(vf x) { return _mm512_cvtps_epi32(x); }
inline vf vtof(vi n) { return _mm512_cvtepi32_ps(n); }
inline vf vpow2(vi n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
}
inline float hsum(vf x) { return _mm512_reduce_add_ps(x); }
inline float hmax(vf x) { return _mm512_reduce_max_ps(x); }
#include "attention/varlen_attention_kernel.inc"
}  // namespace isa_avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
#endif  // x86-64

}  // namespace

const Isa kIsas[] = {
    {"scalar", isa_scalar::forward_run, isa_scalar::backward_run, [] { return true; }},
#ifdef JAXODC_ATTENTION_X86
    {"sse2", isa_sse2::forward_run, isa_sse2::backward_run, [] { return true; }},
    {"avx2", isa_avx2::forward_run, isa_avx2::backward_run,
     [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }},
    {"avx512", isa_avx512::forward_run, isa_avx512::backward_run,
     [] { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }},
#endif
};
const int kNumIsas = sizeof(kIsas) / sizeof(kIsas[0]);

}  // namespace jaxodc::attention
