// CUDA handlers of the ODC ops. The shards travel through the host transports (shm / tcp) into a
// pinned staging buffer; the device sees one H2D (gather) or D2H (scatter) copy on the call's
// stream, and the bf16 cast runs as a kernel on that stream.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <functional>
#include <string>

#include "odc/ffi.h"
#include "odc/ffi_common.h"

namespace jaxodc::odc {

namespace {

__global__ void cast_f32_to_bf16(const float* in, __nv_bfloat16* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

// Pinned host buffer, grown on demand, one per calling thread.
struct PinnedBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  void* get(size_t n) {
    if (n > bytes) {
      if (ptr) cudaFreeHost(ptr);
      ptr = nullptr;
      if (cudaMallocHost(&ptr, n) != cudaSuccess) throw Error("cudaMallocHost of " + std::to_string(n) + " bytes failed");
      bytes = n;
    }
    return ptr;
  }
  ~PinnedBuffer() {
    if (ptr) cudaFreeHost(ptr);
  }
};

thread_local PinnedBuffer t_staging;
thread_local PinnedBuffer t_version;

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(err));
}

int32_t read_version(const int32_t* device_version, cudaStream_t stream) {
  auto* host = static_cast<int32_t*>(t_version.get(sizeof(int32_t)));
  cuda_check(cudaMemcpyAsync(host, device_version, sizeof(int32_t), cudaMemcpyDeviceToHost, stream), "version copy");
  cuda_check(cudaStreamSynchronize(stream), "version copy");
  return *host;
}

ffi::Error guarded(const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
  return ffi::Error::Success();
}

ffi::Error GatherCudaImpl(cudaStream_t stream, ffi::AnyBuffer local_shard, ffi::Buffer<ffi::S32> version,
                          ffi::Result<ffi::AnyBuffer> out, int64_t unit) {
  Runtime* rt;
  ElemType type;
  if (auto err = check_call("odc.gather", unit, local_shard.element_type(), local_shard.element_count(),
                            out->element_type(), out->element_count(), &rt, &type);
      err.failure())
    return err;
  return guarded([&] {
    const int64_t n = static_cast<int64_t>(out->element_count());
    const int64_t v = read_version(version.typed_data(), stream);
    auto* host = static_cast<float*>(t_staging.get(static_cast<size_t>(n) * 4));
    rt->gather(static_cast<int>(unit), v, host, ElemType::kF32, n);
    if (type == ElemType::kF32) {
      cuda_check(cudaMemcpyAsync(out->untyped_data(), host, n * 4, cudaMemcpyHostToDevice, stream), "gather H2D");
    } else {
      // Stage fp32 on the device in the output's upper half is not possible (bf16 is smaller), so
      // use a scratch allocation from the stream-ordered allocator.
      float* scratch = nullptr;
      cuda_check(cudaMallocAsync(reinterpret_cast<void**>(&scratch), n * 4, stream), "gather scratch");
      cuda_check(cudaMemcpyAsync(scratch, host, n * 4, cudaMemcpyHostToDevice, stream), "gather H2D");
      int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
      cast_f32_to_bf16<<<blocks, 256, 0, stream>>>(scratch, static_cast<__nv_bfloat16*>(out->untyped_data()), n);
      cuda_check(cudaGetLastError(), "bf16 cast kernel");
      cuda_check(cudaFreeAsync(scratch, stream), "gather scratch free");
    }
    // The staging buffer is reused by the next call on this thread.
    cuda_check(cudaStreamSynchronize(stream), "gather");
  });
}

ffi::Error GatherIntoCudaImpl(cudaStream_t stream, ffi::AnyBuffer /*aliased_out*/, ffi::AnyBuffer local_shard,
                              ffi::Buffer<ffi::S32> version, ffi::Result<ffi::AnyBuffer> out, int64_t unit) {
  return GatherCudaImpl(stream, local_shard, version, out, unit);
}

ffi::Error ScatterCudaImpl(cudaStream_t stream, ffi::AnyBuffer local_shard, ffi::AnyBuffer grad,
                           ffi::Buffer<ffi::S32> version, ffi::Result<ffi::Buffer<ffi::U32>> token, int64_t unit) {
  Runtime* rt;
  ElemType type;
  if (auto err = check_call("odc.scatter_accumulate", unit, local_shard.element_type(), local_shard.element_count(),
                            grad.element_type(), grad.element_count(), &rt, &type);
      err.failure())
    return err;
  return guarded([&] {
    const int64_t n = static_cast<int64_t>(grad.element_count());
    const size_t bytes = static_cast<size_t>(n) * elem_size(type);
    void* host = t_staging.get(bytes);
    cuda_check(cudaMemcpyAsync(host, grad.untyped_data(), bytes, cudaMemcpyDeviceToHost, stream), "scatter D2H");
    cuda_check(cudaMemsetAsync(token->typed_data(), 0, sizeof(uint32_t), stream), "token");
    const int64_t v = read_version(version.typed_data(), stream);  // also waits for the D2H copy
    rt->scatter_accumulate(static_cast<int>(unit), v, host, type, n);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcGatherCuda, GatherCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("unit"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcGatherIntoCuda, GatherIntoCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("unit"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcScatterCuda, ScatterCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Attr<int64_t>("unit"));

}  // namespace jaxodc::odc
