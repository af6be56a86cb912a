// Variable-length causal attention over packed rows (CPU XLA FFI): token i attends to token j iff
// j <= i and j lies in the same contiguous run of equal segment ids as i; a padding token
// (segment id 0) attends only to itself. Work follows the runs' lower triangles, so a row costs
// a * sum(s^2) + b * sum(s) in its sample lengths s, not a * T^2.
//
// The kernel body (varlen_attention_kernel.inc) is compiled once per instruction set (portable
// scalar, SSE2, AVX2+FMA, AVX-512) with target pragmas, so the default -O3 build without
// -march=native still runs wide vectors; the widest one the CPU supports is picked at run time.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "ffi/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxodc::attention {

namespace {

// Per-call scratch buffers, grown on demand (one call runs on one thread).
struct Scratch {
  std::vector<float> buf[11];
  float* get(int slot, std::size_t n) {
    if (buf[slot].size() < n) buf[slot].resize(n);
    return buf[slot].data();
  }
};

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

#if defined(__x86_64__) || defined(_M_X64)
#define JAXODC_ATTENTION_X86 1

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

using ForwardFn = void (*)(const float*, const float*, const float*, float*, float*, std::ptrdiff_t, int, int, float,
                           Scratch&);
using BackwardFn = void (*)(const float*, const float*, const float*, const float*, const float*, const float*,
                            float*, float*, float*, std::ptrdiff_t, int, int, float, Scratch&);

struct Isa {
  const char* name;
  ForwardFn fwd;
  BackwardFn bwd;
  bool (*supported)();
};

// Ids (the `isa` attribute) are indices + 1; 0 picks the last supported one.
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
constexpr int kNumIsas = sizeof(kIsas) / sizeof(kIsas[0]);

ffi::Error pick_isa(const char* op, int64_t isa, const Isa** out) {
  if (isa == 0) {
    for (int i = kNumIsas - 1; i >= 0; --i)
      if (kIsas[i].supported()) return *out = &kIsas[i], ffi::Error::Success();
  }
  if (isa < 1 || isa > kNumIsas || !kIsas[isa - 1].supported())
    return ffi::Error::InvalidArgument(std::string(op) + ": instruction set id " + std::to_string(isa) +
                                       " is not available on this CPU");
  *out = &kIsas[isa - 1];
  return ffi::Error::Success();
}

std::string dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    default: return "dtype#" + std::to_string(static_cast<int>(t));
  }
}

std::string describe(const ffi::AnyBuffer& x) {
  std::string s = dtype_name(x.element_type()) + "[";
  auto dims = x.dimensions();
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Checks `x` is `type` with dimensions `want` (-1: any), naming the argument and its shape.
ffi::Error check_arg(const char* op, const char* name, const ffi::AnyBuffer& x, ffi::DataType type,
                     std::vector<int64_t> want, const char* layout) {
  auto dims = x.dimensions();
  bool ok = x.element_type() == type && dims.size() == want.size();
  for (std::size_t i = 0; ok && i < want.size(); ++i) ok = want[i] < 0 || dims[i] == want[i];
  if (ok) return ffi::Error::Success();
  std::string expect = dtype_name(type) + " " + layout;
  if (want.size() && want[0] >= 0) {
    expect += " = [";
    for (std::size_t i = 0; i < want.size(); ++i) expect += (i ? ", " : "") + std::to_string(want[i]);
    expect += "]";
  }
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must be " + expect + ", got " + describe(x));
}

struct Geometry {
  int64_t B, T, H, Dh;
  float scale;
};

ffi::Error check_common(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::AnyBuffer& seg, Geometry* g) {
  if (auto e = check_arg(op, "q", q, ffi::DataType::F32, {-1, -1, -1, -1}, "[B, T, H, Dh]"); e.failure()) return e;
  auto d = q.dimensions();
  *g = Geometry{d[0], d[1], d[2], d[3], d[3] > 0 ? 1.f / std::sqrt(static_cast<float>(d[3])) : 1.f};
  // Tile offsets inside one run are int: T * (padded Dh) must fit.
  if (g->Dh < 1 || g->T * (g->Dh + 64) > std::numeric_limits<int>::max())
    return ffi::Error::InvalidArgument(std::string(op) + ": q " + describe(q) +
                                       " is outside the kernel's range (Dh >= 1, T * (Dh + 64) < 2^31)");
  const std::vector<int64_t> bthd = {g->B, g->T, g->H, g->Dh};
  if (auto e = check_arg(op, "k", k, ffi::DataType::F32, bthd, "[B, T, H, Dh] like q"); e.failure()) return e;
  if (auto e = check_arg(op, "v", v, ffi::DataType::F32, bthd, "[B, T, H, Dh] like q"); e.failure()) return e;
  return check_arg(op, "segment_ids", seg, ffi::DataType::S32, {g->B, g->T}, "[B, T]");
}

// Calls fn(start, length, padding) for each run of batch row `b` (a padding token is its own run).
template <typename Fn>
void for_each_run(const int32_t* seg, int64_t T, Fn&& fn) {
  int64_t t = 0;
  while (t < T) {
    int64_t e = t + 1;
    if (seg[t] != 0)
      while (e < T && seg[e] == seg[t]) ++e;
    fn(t, e - t, seg[t] == 0);
    t = e;
  }
}

// Denormals flushed to zero while the kernel runs (restored after): probabilities near the exp
// clamp times small values would otherwise hit the slow denormal path.
struct FlushDenormals {
#ifdef JAXODC_ATTENTION_X86
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

template <typename Body>
ffi::Error guarded(const char* op, Body&& body) {
  FlushDenormals ftz;
  try {
    body();
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, std::string(op) + ": out of memory for scratch tiles");
  }
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer seg,
                       ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, int64_t isa) {
  static const char* op = "varlen_attention_fwd";
  Geometry g;
  const Isa* impl;
  if (auto e = check_common(op, q, k, v, seg, &g); e.failure()) return e;
  if (auto e = check_arg(op, "o", *o, ffi::DataType::F32, {g.B, g.T, g.H, g.Dh}, "[B, T, H, Dh]"); e.failure()) return e;
  if (auto e = check_arg(op, "lse", *lse, ffi::DataType::F32, {g.B, g.H, g.T}, "[B, H, T]"); e.failure()) return e;
  if (auto e = pick_isa(op, isa, &impl); e.failure()) return e;
  const float* qp = static_cast<const float*>(q.untyped_data());
  const float* kp = static_cast<const float*>(k.untyped_data());
  const float* vp = static_cast<const float*>(v.untyped_data());
  const int32_t* sp = static_cast<const int32_t*>(seg.untyped_data());
  float* op_ = static_cast<float*>(o->untyped_data());
  float* lp = static_cast<float*>(lse->untyped_data());
  const std::ptrdiff_t ts = g.H * g.Dh;
  return guarded(op, [&] {
    Scratch w;
    for (int64_t b = 0; b < g.B; ++b)
      for_each_run(sp + b * g.T, g.T, [&](int64_t s0, int64_t n, bool pad) {
        for (int64_t h = 0; h < g.H; ++h) {
          const std::ptrdiff_t at = ((b * g.T + s0) * g.H + h) * g.Dh;
          float* l = lp + (b * g.H + h) * g.T + s0;
          if (pad || n == 1) {  // attends only to itself: o = v, lse = its one scaled score
            float s = 0.f;
            for (int64_t d = 0; d < g.Dh; ++d) s += qp[at + d] * kp[at + d];
            std::memcpy(op_ + at, vp + at, sizeof(float) * g.Dh);
            *l = s * g.scale;
          } else {
            impl->fwd(qp + at, kp + at, vp + at, op_ + at, l, ts, static_cast<int>(n), static_cast<int>(g.Dh),
                      g.scale, w);
          }
        }
      });
  });
}

ffi::Error BackwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer seg, ffi::AnyBuffer o,
                        ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, int64_t isa) {
  static const char* op = "varlen_attention_bwd";
  Geometry g;
  const Isa* impl;
  if (auto e = check_common(op, q, k, v, seg, &g); e.failure()) return e;
  const std::vector<int64_t> bthd = {g.B, g.T, g.H, g.Dh};
  if (auto e = check_arg(op, "o", o, ffi::DataType::F32, bthd, "[B, T, H, Dh] like q"); e.failure()) return e;
  if (auto e = check_arg(op, "lse", lse, ffi::DataType::F32, {g.B, g.H, g.T}, "[B, H, T]"); e.failure()) return e;
  if (auto e = check_arg(op, "do", dout, ffi::DataType::F32, bthd, "[B, T, H, Dh] like q"); e.failure()) return e;
  for (auto [name, r] : {std::pair{"dq", &dq}, std::pair{"dk", &dk}, std::pair{"dv", &dv}})
    if (auto e = check_arg(op, name, **r, ffi::DataType::F32, bthd, "[B, T, H, Dh] like q"); e.failure()) return e;
  if (auto e = pick_isa(op, isa, &impl); e.failure()) return e;
  const float* qp = static_cast<const float*>(q.untyped_data());
  const float* kp = static_cast<const float*>(k.untyped_data());
  const float* vp = static_cast<const float*>(v.untyped_data());
  const float* opp = static_cast<const float*>(o.untyped_data());
  const float* dop = static_cast<const float*>(dout.untyped_data());
  const float* lp = static_cast<const float*>(lse.untyped_data());
  const int32_t* sp = static_cast<const int32_t*>(seg.untyped_data());
  float* dqp = static_cast<float*>(dq->untyped_data());
  float* dkp = static_cast<float*>(dk->untyped_data());
  float* dvp = static_cast<float*>(dv->untyped_data());
  const std::ptrdiff_t ts = g.H * g.Dh;
  return guarded(op, [&] {
    Scratch w;
    for (int64_t b = 0; b < g.B; ++b)
      for_each_run(sp + b * g.T, g.T, [&](int64_t s0, int64_t n, bool pad) {
        for (int64_t h = 0; h < g.H; ++h) {
          const std::ptrdiff_t at = ((b * g.T + s0) * g.H + h) * g.Dh;
          if (pad || n == 1) {  // o = v: dv = do, and dS = P (do.v - do.o) = 0 gives dq = dk = 0
            std::memcpy(dvp + at, dop + at, sizeof(float) * g.Dh);
            std::memset(dqp + at, 0, sizeof(float) * g.Dh);
            std::memset(dkp + at, 0, sizeof(float) * g.Dh);
            continue;
          }
          impl->bwd(qp + at, kp + at, vp + at, opp + at, dop + at, lp + (b * g.H + h) * g.T + s0, dqp + at, dkp + at,
                    dvp + at, ts, static_cast<int>(n), static_cast<int>(g.Dh), g.scale, w);
        }
      });
  });
}

}  // namespace

}  // namespace jaxodc::attention

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxodc_varlen_attention_fwd_cpu, jaxodc::attention::ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxodc_varlen_attention_bwd_cpu, jaxodc::attention::BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("isa"));

namespace jaxodc {

void bind_attention(nb::module_& m, nb::dict& targets) {
  m.def(
      "attention_isas",
      [] {
        nb::list out;
        for (const auto& isa : attention::kIsas)
          if (isa.supported()) out.append(nb::str(isa.name));
        return out;
      },
      "Instruction sets of the varlen attention kernel usable on this CPU (their `isa` id is their index + 1 "
      "in ('scalar', 'sse2', 'avx2', 'avx512')), narrowest first.");
  add_target(targets, "jaxodc_varlen_attention_fwd", "cpu", jaxodc_varlen_attention_fwd_cpu);
  add_target(targets, "jaxodc_varlen_attention_bwd", "cpu", jaxodc_varlen_attention_bwd_cpu);
}

}  // namespace jaxodc
