// CUDA FFI handler of the ring all-reduce. The ring engine (ring.cc) moves the bytes over TCP
// through pinned host buffers; every reduction, quantisation and dequantisation of a piece runs as
// a kernel on the call's stream (GpuOps below), so the arithmetic is the same code as the host path
// (reduce.h) and the dequantised bytes are bit-identical to a CPU peer's.
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "ring/engine.h"
#include "ring/ffi_ring.h"

namespace ffi = xla::ffi;

namespace jaxodc::ring {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("ring all_reduce (CUDA): ") + what + ": " + cudaGetErrorString(e));
}

struct Pinned {
  char* p = nullptr;
  size_t n = 0;
  ~Pinned() { if (p) cudaFreeHost(p); }
  char* get(size_t want) {
    if (want > n) {
      if (p) cudaFreeHost(p);
      p = nullptr;
      n = 0;
      check(cudaHostAlloc(reinterpret_cast<void**>(&p), want, cudaHostAllocDefault), "cudaHostAlloc");
      n = want;
    }
    return p;
  }
};

struct DeviceBuf {
  char* p = nullptr;
  size_t n = 0;
  ~DeviceBuf() { if (p) cudaFree(p); }
  char* get(size_t want) {
    if (want > n) {
      if (p) cudaFree(p);
      p = nullptr;
      n = 0;
      check(cudaMalloc(reinterpret_cast<void**>(&p), want), "cudaMalloc");
      n = want;
    }
    return p;
  }
};

// Per XLA thread; each call synchronises its stream before returning, so they are free again
// when the thread runs the next call.
struct Scratch {
  Pinned send_h, recv_h, agq_h, meta_h;
  DeviceBuf recv_d, q_d, meta_d;
};
thread_local Scratch t_scratch;

constexpr int kThreads = 256;
unsigned grid_for(size_t n) { return static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 65535)); }

struct DevMeta {  // device-side quantisation parameters of one piece
  QMeta m;
  float inv;
};

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
  float lo = static_cast<float>(Tr::load(v[0])), hi = lo;
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

__global__ void k_token(const int32_t* in, int32_t* out) { out[0] = in[0] + 1; }

template <DType D, typename Q>
class GpuOps final : public PieceOps {
  using T = typename Traits<D>::T;

 public:
  GpuOps(const OpLayout& L, cudaStream_t s, const char* x_d, char* out_d)
      : L_(L), s_(s), x_d_(x_d), out_d_(out_d), sc_(t_scratch) {
    size_t piece = L.piece_elems * L.elem_size;
    send_h_ = sc_.send_h.get(piece);
    recv_h_ = sc_.recv_h.get(piece);
    recv_d_ = sc_.recv_d.get(piece);
    meta_h_ = reinterpret_cast<DevMeta*>(sc_.meta_h.get(sizeof(DevMeta)));
    meta_d_ = reinterpret_cast<DevMeta*>(sc_.meta_d.get(sizeof(DevMeta)));
    if (quantized()) {
      q_d_ = reinterpret_cast<Q*>(sc_.q_d.get(L.piece_elems * sizeof(Q)));
      agq_h_ = sc_.agq_h.get(std::max<size_t>(1, L.count * sizeof(Q)));
      agmeta_.resize(L.num_qpieces);
    }
  }

  const char* send_payload(const Piece& p, QMeta* meta, size_t* nbytes) override {
    size_t es = L_.elem_size;
    if (L_.reduce_scatter(p)) {
      const T* src = reinterpret_cast<const T*>((p.step == 0 ? x_d_ : out_d_) + p.off * es);
      if (!quantized()) {
        check(cudaMemcpyAsync(send_h_, src, p.n * es, cudaMemcpyDeviceToHost, s_), "copy piece to host");
        sync();
        *nbytes = p.n * es;
        return send_h_;
      }
      quantize(src, p.n);
      check(cudaMemcpyAsync(send_h_, q_d_, p.n * sizeof(Q), cudaMemcpyDeviceToHost, s_), "copy quantised piece");
      check(cudaMemcpyAsync(meta_h_, meta_d_, sizeof(DevMeta), cudaMemcpyDeviceToHost, s_), "copy metadata");
      sync();
      *meta = meta_h_->m;
      *nbytes = p.n * sizeof(Q);
      return send_h_;
    }
    if (!quantized()) {
      check(cudaMemcpyAsync(send_h_, out_d_ + p.off * es, p.n * es, cudaMemcpyDeviceToHost, s_), "copy piece to host");
      sync();
      *nbytes = p.n * es;
      return send_h_;
    }
    *meta = agmeta_[p.qidx];
    *nbytes = p.n * sizeof(Q);
    return agq_h_ + p.off * sizeof(Q);
  }

  char* recv_target(const Piece& p) override {
    if (!L_.reduce_scatter(p) && quantized()) return agq_h_ + p.off * sizeof(Q);
    return recv_h_;
  }

  void on_recv(const Piece& p, QMeta m) override {
    size_t es = L_.elem_size;
    T* os = reinterpret_cast<T*>(out_d_ + p.off * es);
    if (L_.reduce_scatter(p)) {
      bool last = L_.last_reduce(p);
      const T* xs = reinterpret_cast<const T*>(x_d_ + p.off * es);
      size_t wire = p.n * (quantized() ? sizeof(Q) : es);
      check(cudaMemcpyAsync(recv_d_, recv_h_, wire, cudaMemcpyHostToDevice, s_), "copy piece to device");
      if (!quantized())
        k_reduce<D><<<grid_for(p.n), kThreads, 0, s_>>>(reinterpret_cast<const T*>(recv_d_), xs, os, p.n, L_.op, last, L_.world);
      else
        k_reduce_q<D, Q><<<grid_for(p.n), kThreads, 0, s_>>>(reinterpret_cast<const Q*>(recv_d_), m, xs, os, p.n, L_.op,
                                                              last, L_.world);
      check(cudaGetLastError(), "reduce kernel");
      if (last && quantized()) {  // the owner's single quantisation; it keeps the same bytes
        quantize(os, p.n);
        k_dequant<D, Q><<<grid_for(p.n), kThreads, 0, s_>>>(q_d_, meta_d_, QMeta{0, 0}, os, p.n);
        check(cudaGetLastError(), "dequantise kernel");
        check(cudaMemcpyAsync(agq_h_ + p.off * sizeof(Q), q_d_, p.n * sizeof(Q), cudaMemcpyDeviceToHost, s_), "copy owner bytes");
        check(cudaMemcpyAsync(meta_h_, meta_d_, sizeof(DevMeta), cudaMemcpyDeviceToHost, s_), "copy metadata");
        sync();
        agmeta_[p.qidx] = meta_h_->m;
        return;
      }
      sync();
      return;
    }
    if (!quantized()) {
      check(cudaMemcpyAsync(os, recv_h_, p.n * es, cudaMemcpyHostToDevice, s_), "copy piece to device");
    } else {
      agmeta_[p.qidx] = m;
      check(cudaMemcpyAsync(recv_d_, agq_h_ + p.off * sizeof(Q), p.n * sizeof(Q), cudaMemcpyHostToDevice, s_),
            "copy quantised piece to device");
      k_dequant<D, Q><<<grid_for(p.n), kThreads, 0, s_>>>(reinterpret_cast<const Q*>(recv_d_), nullptr, m, os, p.n);
      check(cudaGetLastError(), "dequantise kernel");
    }
    sync();
  }

 private:
  bool quantized() const { return L_.quant != Quant::kNone; }
  float levels() const { return sizeof(Q) == 1 ? 255.0f : 65535.0f; }
  void sync() { check(cudaStreamSynchronize(s_), "stream synchronise"); }
  void quantize(const T* src, size_t n) {
    k_minmax<D><<<1, 1024, 0, s_>>>(src, n, levels(), meta_d_);
    k_quant<D, Q><<<grid_for(n), kThreads, 0, s_>>>(src, q_d_, n, meta_d_, levels());
    check(cudaGetLastError(), "quantise kernels");
  }

  OpLayout L_;
  cudaStream_t s_;
  const char* x_d_;
  char* out_d_;
  Scratch& sc_;
  char *send_h_ = nullptr, *recv_h_ = nullptr, *recv_d_ = nullptr, *agq_h_ = nullptr;
  Q* q_d_ = nullptr;
  DevMeta *meta_h_ = nullptr, *meta_d_ = nullptr;
  std::vector<QMeta> agmeta_;
};

template <DType D>
std::unique_ptr<PieceOps> make_for(const OpLayout& L, cudaStream_t s, const char* x, char* y) {
  if (L.quant == Quant::kU16) return std::make_unique<GpuOps<D, uint16_t>>(L, s, x, y);
  return std::make_unique<GpuOps<D, uint8_t>>(L, s, x, y);  // uint8 type unused when not quantised
}

std::unique_ptr<PieceOps> make_gpu_ops(const OpLayout& L, cudaStream_t s, const char* x, char* y) {
  switch (L.dtype) {
    case DType::kF32: return make_for<DType::kF32>(L, s, x, y);
    case DType::kF64: return make_for<DType::kF64>(L, s, x, y);
    case DType::kF16: return make_for<DType::kF16>(L, s, x, y);
    case DType::kBF16: return make_for<DType::kBF16>(L, s, x, y);
    case DType::kI32: return make_for<DType::kI32>(L, s, x, y);
    default: return make_for<DType::kI64>(L, s, x, y);
  }
}

}  // namespace

static ffi::Error AllReduceCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer tok,
                                ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> tok_out,
                                int64_t handle, int64_t op, int64_t quant, int64_t tag) {
  DType dt;
  if (!ffi_dtype(x.element_type(), &dt))
    return ffi::Error::InvalidArgument("ring all_reduce: unsupported dtype");
  if (tok.element_type() != ffi::DataType::S32 || tok.element_count() != 1)
    return ffi::Error::InvalidArgument("ring all_reduce: token must be int32[1]");
  auto ep = endpoint_by_handle(handle);
  if (!ep) return ffi::Error::InvalidArgument("ring all_reduce: no live endpoint with handle " + std::to_string(handle));
  size_t n = x.size_bytes();
  const char* xd = static_cast<const char*>(x.untyped_data());
  char* yd = static_cast<char*>(y->untyped_data());
  OpResult r;
  try {
    // the input must be complete before the engine's first device-to-host copy
    check(cudaStreamSynchronize(stream), "stream synchronise");
    r = ep->run_op(
        x.element_count(), dt, static_cast<Op>(op), static_cast<Quant>(quant), static_cast<uint32_t>(tag),
        [&](const OpLayout& L) { return make_gpu_ops(L, stream, xd, yd); },
        [&] { check(cudaMemcpyAsync(yd, xd, n, cudaMemcpyDeviceToDevice, stream), "copy"); });
    if (r.status != Status::kOk)  // failed: the output is the untouched input, never a partial result
      check(cudaMemcpyAsync(yd, xd, n, cudaMemcpyDeviceToDevice, stream), "restore");
    k_token<<<1, 1, 0, stream>>>(static_cast<const int32_t*>(tok.untyped_data()), static_cast<int32_t*>(tok_out->untyped_data()));
    check(cudaGetLastError(), "token kernel");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  }
  return ffi_status(r);
}

}  // namespace jaxodc::ring

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxodc_ring_all_reduce_cuda, jaxodc::ring::AllReduceCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("handle")
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("quant")
                                  .Attr<int64_t>("tag"));
