// CUDA FFI handler of the ring all-reduce: the bytes travel through pinned host buffers (device ->
// pinned -> ring over TCP -> pinned -> device) on the call's stream.
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>

#include "ring/ffi_ring.h"

namespace ffi = xla::ffi;

namespace jaxodc::ring {

namespace {

struct Pinned {
  void* p = nullptr;
  size_t n = 0;
  ~Pinned() { if (p) cudaFreeHost(p); }
  bool reserve(size_t want) {
    if (want <= n) return true;
    if (p) cudaFreeHost(p);
    p = nullptr;
    n = 0;
    if (cudaHostAlloc(&p, want, cudaHostAllocDefault) != cudaSuccess) return false;
    n = want;
    return true;
  }
};

// Staging buffers per XLA thread: each call synchronises its stream before returning, so a
// thread's buffers are free again when it runs the next call.
thread_local Pinned t_in, t_out, t_tok;

ffi::Error cuda_error(cudaError_t e, const char* what) {
  return ffi::Error::Internal(std::string("ring all_reduce (CUDA): ") + what + ": " + cudaGetErrorString(e));
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
  if (!t_in.reserve(n ? n : 1) || !t_out.reserve(n ? n : 1) || !t_tok.reserve(8))
    return ffi::Error::Internal("ring all_reduce (CUDA): cannot allocate pinned staging buffers");
  cudaError_t e = cudaMemcpyAsync(t_in.p, x.untyped_data(), n, cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaMemcpyAsync(t_tok.p, tok.untyped_data(), 4, cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return cuda_error(e, "device to host");
  OpResult r = ep->all_reduce(t_in.p, t_out.p, x.element_count(), dt, static_cast<Op>(op),
                              static_cast<Quant>(quant), static_cast<uint32_t>(tag));
  static_cast<int32_t*>(t_tok.p)[0] += 1;
  // On failure the output gets the restored input, so the result is well defined.
  const void* src = r.status == Status::kOk ? t_out.p : t_in.p;
  e = cudaMemcpyAsync(y->untyped_data(), src, n, cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) e = cudaMemcpyAsync(tok_out->untyped_data(), t_tok.p, 4, cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return cuda_error(e, "host to device");
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
