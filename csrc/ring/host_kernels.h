// Host loops of the piece arithmetic (reduce, quantise, dequantise) used by the host memory
// backends of the ring engine.
//
// The op and "apply the average" are compile-time constants inside every loop (no per-element
// branch), and f32 -- the hot path of quantised transfer -- has SSE2 loops that also fuse the
// passes the ring needs back to back: reduce + range of the result (the next hop quantises it),
// codes + dequantised values (the owner keeps exactly what everyone else will decode). Every
// vector step is the same IEEE operation, in the same order, as the scalar code in reduce.h (no
// FMA contraction, no reassociation), so all paths -- scalar, SSE, CUDA -- give the same bits.
// Ranges ignore NaN and are exact (min/max do not round), so their evaluation order is free.
#pragma once

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ring/reduce.h"

namespace jaxodc::ring {

// combine(op, a, b) with op fixed at compile time.
template <Op O, typename A> inline A combine_t(A a, A b) {
  if constexpr (O == Op::kSum || O == Op::kAvg) return wrap_add(a, b);
  else if constexpr (O == Op::kMin) return b < a ? b : a;
  else if constexpr (O == Op::kMax) return b > a ? b : a;
  else return wrap_mul(a, b);
}

// Calls f(op constant, last constant); "last" (divide by the world) only matters for the average.
template <typename F> inline void dispatch_op(Op op, bool last, F&& f) {
  using std::integral_constant;
  switch (op) {
    case Op::kSum: f(integral_constant<Op, Op::kSum>{}, std::false_type{}); break;
    case Op::kAvg:
      if (last) f(integral_constant<Op, Op::kAvg>{}, std::true_type{});
      else f(integral_constant<Op, Op::kAvg>{}, std::false_type{});
      break;
    case Op::kMin: f(integral_constant<Op, Op::kMin>{}, std::false_type{}); break;
    case Op::kMax: f(integral_constant<Op, Op::kMax>{}, std::false_type{}); break;
    default: f(integral_constant<Op, Op::kProd>{}, std::false_type{}); break;
  }
}

// Running range of a piece's values (NaN ignored; empty = [+inf, -inf]).
struct Range {
  float lo = INFINITY, hi = -INFINITY;
  void add(float f) {
    lo = f < lo ? f : lo;
    hi = f > hi ? f : hi;
  }
  void merge(const Range& o) {
    add_lo(o.lo);
    add_hi(o.hi);
  }
  void add_lo(float f) { lo = f < lo ? f : lo; }
  void add_hi(float f) { hi = f > hi ? f : hi; }
};

// Quantisation parameters of a range: value = lo + q * scale, code = (v - lo) * inv + 0.5.
inline QMeta meta_of(Range r, float levels, float* inv) {
  if (!(r.lo <= r.hi)) r.lo = r.hi = NAN;  // all-NaN piece: decodes to NaN, as it should
  *inv = r.hi > r.lo ? levels / (r.hi - r.lo) : 0.0f;
  return QMeta{r.lo, (r.hi - r.lo) / levels};
}

#if defined(__SSE2__)
namespace sse {

template <Op O> inline __m128 combine(__m128 a, __m128 b) {
  if constexpr (O == Op::kSum || O == Op::kAvg) return _mm_add_ps(a, b);
  else if constexpr (O == Op::kMin) return _mm_min_ps(b, a);  // b < a ? b : a
  else if constexpr (O == Op::kMax) return _mm_max_ps(b, a);  // b > a ? b : a
  else return _mm_mul_ps(a, b);
}

// 16 codes -> 4 x 4 floats (exact).
inline void load_codes(const uint8_t* q, __m128 f[4]) {
  const __m128i z = _mm_setzero_si128();
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  __m128i l = _mm_unpacklo_epi8(b, z), h = _mm_unpackhi_epi8(b, z);
  f[0] = _mm_cvtepi32_ps(_mm_unpacklo_epi16(l, z));
  f[1] = _mm_cvtepi32_ps(_mm_unpackhi_epi16(l, z));
  f[2] = _mm_cvtepi32_ps(_mm_unpacklo_epi16(h, z));
  f[3] = _mm_cvtepi32_ps(_mm_unpackhi_epi16(h, z));
}
inline void load_codes(const uint16_t* q, __m128 f[4]) {
  const __m128i z = _mm_setzero_si128();
  __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 8));
  f[0] = _mm_cvtepi32_ps(_mm_unpacklo_epi16(a, z));
  f[1] = _mm_cvtepi32_ps(_mm_unpackhi_epi16(a, z));
  f[2] = _mm_cvtepi32_ps(_mm_unpacklo_epi16(b, z));
  f[3] = _mm_cvtepi32_ps(_mm_unpackhi_epi16(b, z));
}
// 4 x 4 codes in [0, levels] as int32 -> 16 stored codes.
inline void store_codes(uint8_t* q, const __m128i c[4]) {
  __m128i a = _mm_packs_epi32(c[0], c[1]), b = _mm_packs_epi32(c[2], c[3]);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_packus_epi16(a, b));
}
inline void store_codes(uint16_t* q, const __m128i c[4]) {
  // SSE2 has no unsigned 32->16 pack: shift into int16 range, pack, flip the sign bit back.
  const __m128i bias = _mm_set1_epi32(32768), flip = _mm_set1_epi16(static_cast<int16_t>(0x8000));
  __m128i a = _mm_packs_epi32(_mm_sub_epi32(c[0], bias), _mm_sub_epi32(c[1], bias));
  __m128i b = _mm_packs_epi32(_mm_sub_epi32(c[2], bias), _mm_sub_epi32(c[3], bias));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_xor_si128(a, flip));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 8), _mm_xor_si128(b, flip));
}

// Two lo/hi accumulator pairs: enough to hide the min/max latency without spilling registers.
inline void fold(const __m128 lo[2], const __m128 hi[2], Range* rg) {
  float l[8], h[8];
  for (int k = 0; k < 2; ++k) {
    _mm_storeu_ps(l + 4 * k, lo[k]);
    _mm_storeu_ps(h + 4 * k, hi[k]);
  }
  for (int k = 0; k < 8; ++k) {
    rg->add_lo(l[k]);
    rg->add_hi(h[k]);
  }
}

// out = finalize(combine(dequant(in), x)) [and its range]; returns the elements done (multiple of 16).
template <Op O, bool LAST, bool RANGE, typename Q>
inline size_t reduce_q(const Q* __restrict in, QMeta m, const float* __restrict x, float* __restrict out, size_t n,
                       int world, Range* rg) {
  const __m128 vlo = _mm_set1_ps(m.lo), vs = _mm_set1_ps(m.scale), vw = _mm_set1_ps(static_cast<float>(world));
  __m128 lo[2], hi[2];
  for (int k = 0; k < 2; ++k) {
    lo[k] = _mm_set1_ps(INFINITY);
    hi[k] = _mm_set1_ps(-INFINITY);
  }
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128 f[4];
    load_codes(in + i, f);
    for (int k = 0; k < 4; ++k) {
      __m128 r = combine<O>(_mm_add_ps(vlo, _mm_mul_ps(f[k], vs)), _mm_loadu_ps(x + i + 4 * k));
      if constexpr (LAST) r = _mm_div_ps(r, vw);
      _mm_storeu_ps(out + i + 4 * k, r);
      if constexpr (RANGE) {
        lo[k & 1] = _mm_min_ps(r, lo[k & 1]);  // r < lo ? r : lo (NaN r ignored)
        hi[k & 1] = _mm_max_ps(r, hi[k & 1]);
      }
    }
  }
  if constexpr (RANGE) fold(lo, hi, rg);
  return i;
}

// Codes of v (and, when DEQ, v overwritten with the decoded values); returns elements done.
template <bool DEQ, typename Q, typename P>
inline size_t quantize(P v, Q* __restrict q, size_t n, QMeta m, float inv, float levels) {
  const __m128 vlo = _mm_set1_ps(m.lo), vs = _mm_set1_ps(m.scale), vi = _mm_set1_ps(inv);
  const __m128 half = _mm_set1_ps(0.5f), zero = _mm_setzero_ps(), top = _mm_set1_ps(levels);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i c[4];
    for (int k = 0; k < 4; ++k) {
      __m128 t = _mm_add_ps(_mm_mul_ps(_mm_sub_ps(_mm_loadu_ps(v + i + 4 * k), vlo), vi), half);
      t = _mm_min_ps(_mm_max_ps(t, zero), top);  // same selects as quant_value (NaN -> 0)
      c[k] = _mm_cvttps_epi32(t);
    }
    store_codes(q + i, c);
    if constexpr (DEQ)
      for (int k = 0; k < 4; ++k)
        _mm_storeu_ps(v + i + 4 * k, _mm_add_ps(vlo, _mm_mul_ps(_mm_cvtepi32_ps(c[k]), vs)));
  }
  return i;
}

template <typename Q>
inline size_t dequantize(const Q* __restrict q, QMeta m, float* __restrict out, size_t n) {
  const __m128 vlo = _mm_set1_ps(m.lo), vs = _mm_set1_ps(m.scale);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128 f[4];
    load_codes(q + i, f);
    for (int k = 0; k < 4; ++k) _mm_storeu_ps(out + i + 4 * k, _mm_add_ps(vlo, _mm_mul_ps(f[k], vs)));
  }
  return i;
}

inline size_t range(const float* v, size_t n, Range* rg) {
  __m128 lo[2], hi[2];
  for (int k = 0; k < 2; ++k) {
    lo[k] = _mm_set1_ps(INFINITY);
    hi[k] = _mm_set1_ps(-INFINITY);
  }
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 4; ++k) {
      __m128 x = _mm_loadu_ps(v + i + 4 * k);
      lo[k & 1] = _mm_min_ps(x, lo[k & 1]);
      hi[k & 1] = _mm_max_ps(x, hi[k & 1]);
    }
  fold(lo, hi, rg);
  return i;
}

}  // namespace sse
#endif

// Range of a float piece (kept for callers outside the kernels).
inline void minmax_f32(const float* v, size_t n, float* lo_out, float* hi_out) {
  Range rg;
  size_t i = 0;
#if defined(__SSE2__)
  i = sse::range(v, n, &rg);
#endif
  for (; i < n; ++i) rg.add(v[i]);
  *lo_out = rg.lo;
  *hi_out = rg.hi;
}

template <DType D>
struct Kernels {
  using Tr = Traits<D>;
  using T = typename Tr::T;
  using A = typename Tr::A;
  static constexpr bool kSse =
#if defined(__SSE2__)
      D == DType::kF32;
#else
      false;
#endif

  // out[i] = combine(in[i], x[i]) (and finalize when last)
  static void reduce(const T* in, const T* x, T* out, size_t n, Op op, bool last, int world) {
    dispatch_op(op, last, [&](auto o, auto l) {
      constexpr Op O = decltype(o)::value;
      constexpr bool LAST = decltype(l)::value;
      reduce_t<O, LAST>(in, x, out, n, world);
    });
  }

  // out[i] = combine(dequant(in[i]), x[i]) (and finalize when last).
  template <typename Q>
  static void reduce_q(const Q* in, QMeta m, const T* x, T* out, size_t n, Op op, bool last, int world) {
    reduce_q_any<Q, false>(in, m, x, out, n, op, last, world, nullptr);
  }
  // reduce_q that also returns the range of the stored results (what quantising them needs).
  template <typename Q>
  static void reduce_q_range(const Q* in, QMeta m, const T* x, T* out, size_t n, Op op, bool last, int world,
                             float* lo, float* hi) {
    Range rg;
    reduce_q_any<Q, true>(in, m, x, out, n, op, last, world, &rg);
    *lo = rg.lo;
    *hi = rg.hi;
  }

  static Range range(const T* v, size_t n) {
    Range rg;
    size_t i = 0;
#if defined(__SSE2__)
    if constexpr (kSse) i = sse::range(v, n, &rg);
#endif
    for (; i < n; ++i) rg.add(static_cast<float>(Tr::load(v[i])));
    return rg;
  }

  template <typename Q>
  static QMeta quantize(const T* v, Q* q, size_t n, float levels) {
    Range rg = range(v, n);
    return quantize_range<Q>(v, q, n, levels, rg.lo, rg.hi);
  }
  // Codes of v for a range computed earlier (e.g. by reduce_q_range).
  template <typename Q>
  static QMeta quantize_range(const T* v, Q* q, size_t n, float levels, float lo, float hi) {
    return quant_impl<false, Q>(const_cast<T*>(v), q, n, levels, Range{lo, hi});
  }
  // Codes of v, and v overwritten with their decoded values (the owner's single quantisation).
  template <typename Q>
  static QMeta quantize_dequantize(T* v, Q* q, size_t n, float levels, float lo, float hi) {
    return quant_impl<true, Q>(v, q, n, levels, Range{lo, hi});
  }

  template <typename Q>
  static void dequantize(const Q* q, QMeta m, T* out, size_t n) {
    size_t i = 0;
#if defined(__SSE2__)
    if constexpr (kSse) i = sse::dequantize<Q>(q, m, out, n);
#endif
    for (; i < n; ++i) out[i] = Tr::store(static_cast<A>(dequant_value(q[i], m)));
  }

 private:
  template <Op O, bool LAST>
  static void reduce_t(const T* __restrict in, const T* __restrict x, T* __restrict out, size_t n, int world) {
    for (size_t i = 0; i < n; ++i) {
      A r = combine_t<O, A>(Tr::load(in[i]), Tr::load(x[i]));
      if constexpr (LAST) r = finalize<A>(O, r, world);
      out[i] = Tr::store(r);
    }
  }

  template <typename Q, bool RANGE>
  static void reduce_q_any(const Q* in, QMeta m, const T* x, T* out, size_t n, Op op, bool last, int world,
                           Range* rg) {
    dispatch_op(op, last, [&](auto o, auto l) {
      constexpr Op O = decltype(o)::value;
      constexpr bool LAST = decltype(l)::value;
      size_t i = 0;
#if defined(__SSE2__)
      if constexpr (kSse) i = sse::reduce_q<O, LAST, RANGE, Q>(in, m, x, out, n, world, rg);
#endif
      for (; i < n; ++i) {
        A r = combine_t<O, A>(static_cast<A>(dequant_value(in[i], m)), Tr::load(x[i]));
        if constexpr (LAST) r = finalize<A>(O, r, world);
        T t = Tr::store(r);
        out[i] = t;
        if constexpr (RANGE) rg->add(static_cast<float>(Tr::load(t)));
      }
    });
  }

  template <bool DEQ, typename Q>
  static QMeta quant_impl(T* v, Q* q, size_t n, float levels, Range rg) {
    float inv;
    QMeta m = meta_of(rg, levels, &inv);
    size_t i = 0;
#if defined(__SSE2__)
    if constexpr (kSse) {
      if constexpr (DEQ) i = sse::quantize<true, Q, float*>(v, q, n, m, inv, levels);
      else i = sse::quantize<false, Q, const float*>(v, q, n, m, inv, levels);
    }
#endif
    for (; i < n; ++i) {
      uint32_t c = quant_value(static_cast<float>(Tr::load(v[i])), m, inv, levels);
      q[i] = static_cast<Q>(c);
      if constexpr (DEQ) v[i] = Tr::store(static_cast<A>(dequant_value(c, m)));
    }
    return m;
  }
};

}  // namespace jaxodc::ring
