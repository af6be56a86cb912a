// Host loops of the piece arithmetic (reduce, quantise, dequantise) used by the host memory
// backends of the ring engine.
#pragma once

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cstddef>
#include <cstdint>

#include "ring/reduce.h"

namespace jaxodc::ring {

// Range of a float piece; SSE min/max because compilers do not vectorise a float min reduction
// without fast-math (the order does not matter: only the sender computes it and ships the result).
inline void minmax_f32(const float* v, size_t n, float* lo_out, float* hi_out) {
  float lo = v[0], hi = v[0];
  size_t i = 1;
#if defined(__SSE2__)
  if (n >= 8) {
    __m128 l = _mm_loadu_ps(v), h = l;
    for (i = 4; i + 4 <= n; i += 4) {
      __m128 x = _mm_loadu_ps(v + i);
      l = _mm_min_ps(l, x);
      h = _mm_max_ps(h, x);
    }
    float ls[4], hs[4];
    _mm_storeu_ps(ls, l);
    _mm_storeu_ps(hs, h);
    lo = ls[0];
    hi = hs[0];
    for (int k = 1; k < 4; ++k) {
      lo = ls[k] < lo ? ls[k] : lo;
      hi = hs[k] > hi ? hs[k] : hi;
    }
  }
#endif
  for (; i < n; ++i) {
    lo = v[i] < lo ? v[i] : lo;
    hi = v[i] > hi ? v[i] : hi;
  }
  *lo_out = lo;
  *hi_out = hi;
}

template <DType D>
struct Kernels {
  using Tr = Traits<D>;
  using T = typename Tr::T;
  using A = typename Tr::A;

  // out[i] = combine(in[i], x[i]) (and finalize when last)
  static void reduce(const T* in, const T* x, T* out, size_t n, Op op, bool last, int world) {
    for (size_t i = 0; i < n; ++i) {
      A r = combine<A>(op, Tr::load(in[i]), Tr::load(x[i]));
      out[i] = Tr::store(last ? finalize<A>(op, r, world) : r);
    }
  }
  template <typename Q>
  static void reduce_q(const Q* in, QMeta m, const T* x, T* out, size_t n, Op op, bool last, int world) {
    for (size_t i = 0; i < n; ++i) {
      A r = combine<A>(op, static_cast<A>(dequant_value(in[i], m)), Tr::load(x[i]));
      out[i] = Tr::store(last ? finalize<A>(op, r, world) : r);
    }
  }
  template <typename Q>
  static QMeta quantize(const T* v, Q* q, size_t n, float levels) {
    float lo = 0, hi = 0;
    if constexpr (D == DType::kF32) {
      if (n) minmax_f32(v, n, &lo, &hi);
    } else {
      if (n) lo = hi = static_cast<float>(Tr::load(v[0]));
      for (size_t i = 1; i < n; ++i) {
        float f = static_cast<float>(Tr::load(v[i]));
        lo = f < lo ? f : lo;
        hi = f > hi ? f : hi;
      }
    }
    QMeta m{lo, (hi - lo) / levels};
    float inv = hi > lo ? levels / (hi - lo) : 0.0f;
    for (size_t i = 0; i < n; ++i)
      q[i] = static_cast<Q>(quant_value(static_cast<float>(Tr::load(v[i])), m, inv, levels));
    return m;
  }
  template <typename Q>
  static void dequantize(const Q* q, QMeta m, T* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = Tr::store(static_cast<A>(dequant_value(q[i], m)));
  }
};

}  // namespace jaxodc::ring
