// Test support: host memory standing in for a device, so that StagedOps -- the CUDA handler's piece
// logic (staged_ops.h) -- runs on machines without a GPU (Endpoint::all_reduce_staged, used by
// tests/test_ring.py).
#pragma once

#include <cstring>
#include <vector>

#include "ring/host_kernels.h"
#include "ring/staged_ops.h"

namespace jaxodc::ring {

struct HostDev {
  std::vector<char> h[4], d[3];
  char* host(int slot, size_t n) {
    if (h[slot].size() < n) h[slot].resize(n);
    return h[slot].data();
  }
  char* dev(int slot, size_t n) {
    if (d[slot].size() < n) d[slot].resize(n);
    return d[slot].data();
  }
  void d2h(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
  void h2d(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
  void sync() {}
  template <DType D>
  void reduce(const typename Traits<D>::T* in, const typename Traits<D>::T* x, typename Traits<D>::T* out, size_t n,
              Op op, bool last, int world) {
    Kernels<D>::reduce(in, x, out, n, op, last, world);
  }
  template <DType D, typename Q>
  void reduce_q(const Q* in, QMeta m, const typename Traits<D>::T* x, typename Traits<D>::T* out, size_t n, Op op,
                bool last, int world) {
    Kernels<D>::template reduce_q<Q>(in, m, x, out, n, op, last, world);
  }
  template <DType D, typename Q>
  void quantize(const typename Traits<D>::T* src, Q* q, size_t n, float levels, DevMeta* meta) {
    QMeta m = Kernels<D>::template quantize<Q>(src, q, n, levels);
    float range = m.scale * levels;
    meta->m = m;
    meta->inv = range > 0 ? levels / range : 0.0f;
  }
  template <DType D, typename Q>
  void dequant(const Q* q, const DevMeta* meta, QMeta mv, typename Traits<D>::T* out, size_t n) {
    Kernels<D>::template dequantize<Q>(q, meta ? meta->m : mv, out, n);
  }
};

}  // namespace jaxodc::ring
