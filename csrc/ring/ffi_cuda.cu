// CUDA FFI handler of the ring all-reduce. The ring engine (all_reduce.cc) moves the bytes over TCP
// through pinned host buffers; every reduction, quantisation and dequantisation of a piece runs as
// a kernel on the call's stream (StagedOps in staged_ops.h with the CudaDev below). The kernels use
// the host path's arithmetic (reduce.h), so dequantised values are bit-identical to a CPU peer's.
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "ring/engine.h"
#include "ring/staged_ops.h"
#include "ring/ffi.h"

namespace ffi = xla::ffi;

namespace jaxodc::ring {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("ring all_reduce (CUDA): ") + what + ": " + cudaGetErrorString(e));
}

cudaError_t alloc_pinned(void** p, size_t n) { return cudaHostAlloc(p, n, cudaHostAllocDefault); }
cudaError_t alloc_device(void** p, size_t n) { return cudaMalloc(p, n); }

// A buffer that only grows, kept across calls: pinned host memory or device memory.
template <cudaError_t (*Alloc)(void**, size_t), cudaError_t (*Free)(void*)>
struct GrowingBuffer {
  char* p = nullptr;
  size_t n = 0;
  ~GrowingBuffer() { if (p) Free(p); }
  char* get(size_t want) {
    if (want > n) {
      if (p) Free(p);
      p = nullptr;
      n = 0;
      check(Alloc(reinterpret_cast<void**>(&p), want), Alloc == alloc_pinned ? "cudaHostAlloc" : "cudaMalloc");
      n = want;
    }
    return p;
  }
};

constexpr int kThreads = 256;
unsigned grid_for(size_t n) { return static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 65535)); }

template <DType D>
__global__ void k_reduce(const typename Traits<D>::T* in, const typename Traits<D>::T* x, typename Traits<D>::T* out,
                         size_t n, Op op, bool last, int world) {
  using Tr = Traits<D>;
  using A = typename Tr::A;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    A r = combine<A>(op, Tr::load(in[i]), Tr::load(x[i]));
    out[i] = Tr::store(last ? finalize<A>(op, r, world) : r);
  }
}

template <DType D, typename Q>
__global__ void k_reduce_q(const Q* in, QMeta m, const typename Traits<D>::T* x, typename Traits<D>::T* out, size_t n,
                           Op op, bool last, int world) {
  using Tr = Traits<D>;
  using A = typename Tr::A;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    A r = combine<A>(op, static_cast<A>(dequant_value(in[i], m)), Tr::load(x[i]));
    out[i] = Tr::store(last ? finalize<A>(op, r, world) : r);
  }
}

// One block: range of the piece, then the metadata exactly as the host computes it.
template <DType D>
__global__ void k_minmax(const typename Traits<D>::T* v, size_t n, float levels, DevMeta* meta) {
  using Tr = Traits<D>;
  __shared__ float slo[1024], shi[1024];
  float lo = INFINITY, hi = -INFINITY;  // NaN ignored, as on the host (host_kernels.h Range)
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    float f = static_cast<float>(Tr::load(v[i]));
    lo = f < lo ? f : lo;
    hi = f > hi ? f : hi;
  }
  slo[threadIdx.x] = lo;
  shi[threadIdx.x] = hi;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      slo[threadIdx.x] = slo[threadIdx.x + s] < slo[threadIdx.x] ? slo[threadIdx.x + s] : slo[threadIdx.x];
      shi[threadIdx.x] = shi[threadIdx.x + s] > shi[threadIdx.x] ? shi[threadIdx.x + s] : shi[threadIdx.x];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float l = slo[0], h = shi[0];
    if (!(l <= h)) l = h = NAN;  // all-NaN piece
    meta->m = QMeta{l, __fdiv_rn(__fsub_rn(h, l), levels)};
    meta->inv = h > l ? __fdiv_rn(levels, __fsub_rn(h, l)) : 0.0f;
  }
}

template <DType D, typename Q>
__global__ void k_quant(const typename Traits<D>::T* v, Q* q, size_t n, const DevMeta* meta, float levels) {
  using Tr = Traits<D>;
  QMeta m = meta->m;
  float inv = meta->inv;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    q[i] = static_cast<Q>(quant_value(static_cast<float>(Tr::load(v[i])), m, inv, levels));
}

template <DType D, typename Q>
__global__ void k_dequant(const Q* q, const DevMeta* meta, QMeta mv, typename Traits<D>::T* out, size_t n) {
  using Tr = Traits<D>;
  QMeta m = meta ? meta->m : mv;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = Tr::store(static_cast<typename Tr::A>(dequant_value(q[i], m)));
}

// The CUDA device of StagedOps: scratch per XLA thread (each call synchronises its stream before
// returning, so it is free again when the thread runs the next call), copies and kernels on the
// call's stream.
struct CudaScratch {
  GrowingBuffer<alloc_pinned, cudaFreeHost> h[4];
  GrowingBuffer<alloc_device, cudaFree> d[3];
};
thread_local CudaScratch t_scratch;

struct CudaDev {
  cudaStream_t s;
  char* host(int slot, size_t n) { return t_scratch.h[slot].get(n); }
  char* dev(int slot, size_t n) { return t_scratch.d[slot].get(n); }
  void d2h(void* dst, const void* src, size_t n) {
    check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s), "copy to host");
  }
  void h2d(void* dst, const void* src, size_t n) {
    check(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s), "copy to device");
  }
  void sync() { check(cudaStreamSynchronize(s), "stream synchronise"); }
  template <DType D>
  void reduce(const typename Traits<D>::T* in, const typename Traits<D>::T* x, typename Traits<D>::T* out, size_t n,
              Op op, bool last, int world) {
    k_reduce<D><<<grid_for(n), kThreads, 0, s>>>(in, x, out, n, op, last, world);
    check(cudaGetLastError(), "reduce kernel");
  }
  template <DType D, typename Q>
  void reduce_q(const Q* in, QMeta m, const typename Traits<D>::T* x, typename Traits<D>::T* out, size_t n, Op op,
                bool last, int world) {
    k_reduce_q<D, Q><<<grid_for(n), kThreads, 0, s>>>(in, m, x, out, n, op, last, world);
    check(cudaGetLastError(), "reduce kernel");
  }
  template <DType D, typename Q>
  void quantize(const typename Traits<D>::T* src, Q* q, size_t n, float levels, DevMeta* meta) {
    k_minmax<D><<<1, 1024, 0, s>>>(src, n, levels, meta);
    k_quant<D, Q><<<grid_for(n), kThreads, 0, s>>>(src, q, n, meta, levels);
    check(cudaGetLastError(), "quantise kernels");
  }
  template <DType D, typename Q>
  void dequant(const Q* q, const DevMeta* meta, QMeta mv, typename Traits<D>::T* out, size_t n) {
    k_dequant<D, Q><<<grid_for(n), kThreads, 0, s>>>(q, meta, mv, out, n);
    check(cudaGetLastError(), "dequantise kernel");
  }
};

ffi::Error AllReduceCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer tok,
                                ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> tok_out,
                                int64_t handle, int64_t op, int64_t quant, int64_t tag) {
  DType dt;
  Endpoint* ep;
  if (auto err = check_all_reduce(x, tok, handle, &dt, &ep); err.failure()) return err;
  size_t n = x.size_bytes();
  const char* xd = static_cast<const char*>(x.untyped_data());
  char* yd = static_cast<char*>(y->untyped_data());
  OpResult r;
  CudaDev dev{stream};
  try {
    // the input must be complete before the engine's first device-to-host copy
    check(cudaStreamSynchronize(stream), "stream synchronise");
    r = ep->run_op(
        x.element_count(), dt, static_cast<Op>(op), static_cast<Quant>(quant), static_cast<uint32_t>(tag),
        [&](const OpLayout& L) { return make_staged_ops(L, dev, xd, yd); },
        [&] { check(cudaMemcpyAsync(yd, xd, n, cudaMemcpyDeviceToDevice, stream), "copy"); });
    if (r.status != Status::kOk)  // failed: the output is the untouched input, never a partial result
      check(cudaMemcpyAsync(yd, xd, n, cudaMemcpyDeviceToDevice, stream), "restore");
    check(advance_token(stream, tok, tok_out), "token kernel");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  }
  return ffi_status(r);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RingAllReduceCuda, AllReduceCudaImpl,
                              bind_all_reduce(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

}  // namespace jaxodc::ring
