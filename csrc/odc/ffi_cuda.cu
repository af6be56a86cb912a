// CUDA handlers of the ODC ops.
//
// Without a device in the runtime, the shards travel through the host transports (shm / tcp) into
// a pinned staging buffer; the device sees one H2D (gather) or D2H (scatter) copy on the call's
// stream, and the bf16 cast runs as a kernel on that stream.
//
// With a device (Runtime.enable_device), owners reached through device memory -- this rank and its
// cuda_ipc peers -- are served GPU to GPU by Runtime::gather_device / scatter_device (cuda_ipc.cu);
// only the remaining owners (tcp, or shm peers without a device) are staged as above. The device
// paths work in fp32: bf16 units are cast on this GPU before a push and after a gather.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>

#include "odc/device_cuda.h"
#include "odc/ffi.h"

namespace jaxodc::odc {

namespace {

__global__ void cast_f32_to_bf16(const float* in, __nv_bfloat16* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void cast_bf16_to_f32(const __nv_bfloat16* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

int cast_blocks(int64_t n) { return static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096)); }

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

int32_t read_version(const int32_t* device_version, cudaStream_t stream) {
  auto* host = static_cast<int32_t*>(t_version.get(sizeof(int32_t)));
  check(cudaMemcpyAsync(host, device_version, sizeof(int32_t), cudaMemcpyDeviceToHost, stream), "version copy");
  check(cudaStreamSynchronize(stream), "version copy");
  return *host;
}

// The runtime's device must be the one XLA placed the buffer on (one rank per GPU).
void check_on_device(const Runtime* rt, const void* ptr, const char* op, int64_t unit) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // allocators the query does not know: leave the check to the copies
    return;
  }
  if (attr.type == cudaMemoryTypeDevice && attr.device != rt->device())
    throw Error(std::string(op) + ": unit " + std::to_string(unit) + " on rank " + std::to_string(rt->rank()) +
                ": the array lives on CUDA device " + std::to_string(attr.device) + " but the ODC runtime uses device " +
                std::to_string(rt->device()) + " (Runtime(device=...))");
}

// Owners outside device memory: the host transports into pinned staging, then one H2D copy per
// owner's piece into `f32` (device, the whole unit). Returns whether anything was staged.
bool gather_host_owners(Runtime* rt, int unit, int64_t v, float* f32, int64_t n, cudaStream_t stream) {
  if (!rt->has_host_owners()) return false;
  auto* host = static_cast<float*>(t_staging.get(static_cast<size_t>(n) * 4));
  rt->gather(unit, v, host, ElemType::kF32, n, Route::kHostOwners);
  for (int d = 0; d < rt->world(); ++d) {
    if (rt->device_owner(d)) continue;
    int64_t lo, m;
    rt->piece(unit, d, &lo, &m);
    if (m > 0)
      check(cudaMemcpyAsync(f32 + lo, host + lo, static_cast<size_t>(m) * 4, cudaMemcpyHostToDevice, stream),
                 "gather H2D");
  }
  return true;
}

void gather_with_device(Runtime* rt, int unit, int64_t v, void* out, ElemType type, int64_t n, cudaStream_t stream) {
  check_on_device(rt, out, "odc.gather", unit);
  float* scratch = nullptr;
  if (type != ElemType::kF32)
    check(cudaMallocAsync(reinterpret_cast<void**>(&scratch), static_cast<size_t>(n) * 4, stream),
               "gather scratch");
  float* f32 = scratch ? scratch : static_cast<float*>(out);
  bool staged = false;
  try {
    // Device owners first: their copies run while the host transports work.
    rt->gather_device(unit, v, f32, stream);
    staged = gather_host_owners(rt, unit, v, f32, n, stream);
    if (scratch) {
      cast_f32_to_bf16<<<cast_blocks(n), 256, 0, stream>>>(scratch, static_cast<__nv_bfloat16*>(out), n);
      check(cudaGetLastError(), "bf16 cast kernel");
    }
  } catch (...) {
    if (scratch) cudaFreeAsync(scratch, stream);
    throw;
  }
  if (scratch) check(cudaFreeAsync(scratch, stream), "gather scratch free");
  // The staging buffer is reused by the next call on this thread. Device copies need no wait here:
  // done() waits for them before the owners may overwrite their masters.
  if (staged) check(cudaStreamSynchronize(stream), "gather");
}

void scatter_with_device(Runtime* rt, int unit, int64_t v, const void* grad, ElemType type, int64_t n,
                         cudaStream_t stream) {
  check_on_device(rt, grad, "odc.scatter_accumulate", unit);
  float* scratch = nullptr;
  if (type != ElemType::kF32) {
    check(cudaMallocAsync(reinterpret_cast<void**>(&scratch), static_cast<size_t>(n) * 4, stream),
               "scatter scratch");
    cast_bf16_to_f32<<<cast_blocks(n), 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(grad), scratch, n);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      cudaFreeAsync(scratch, stream);
      check(err, "bf16 cast kernel");
    }
  }
  try {
    rt->scatter_device(unit, v, scratch ? scratch : static_cast<const float*>(grad), stream);
  } catch (...) {
    if (scratch) cudaFreeAsync(scratch, stream);
    throw;
  }
  if (scratch) check(cudaFreeAsync(scratch, stream), "scatter scratch free");
  if (rt->has_host_owners()) {
    const size_t bytes = static_cast<size_t>(n) * elem_size(type);
    void* host = t_staging.get(bytes);
    check(cudaMemcpyAsync(host, grad, bytes, cudaMemcpyDeviceToHost, stream), "scatter D2H");
    check(cudaStreamSynchronize(stream), "scatter D2H");
    rt->scatter_accumulate(unit, v, host, type, n, Route::kHostOwners);
  }
}

ffi::Error GatherCudaImpl(cudaStream_t stream, ffi::AnyBuffer local_shard, ffi::Buffer<ffi::S32> version,
                          ffi::Result<ffi::AnyBuffer> out, int64_t runtime, int64_t unit) {
  Runtime* rt;
  ElemType type;
  if (auto err = check_gather(runtime, unit, local_shard, out, &rt, &type); err.failure()) return err;
  return run_guarded([&] {
    const int64_t n = static_cast<int64_t>(out->element_count());
    const int64_t v = read_version(version.typed_data(), stream);
    if (rt->device() >= 0) {
      gather_with_device(rt, static_cast<int>(unit), v, out->untyped_data(), type, n, stream);
      return;
    }
    auto* host = static_cast<float*>(t_staging.get(static_cast<size_t>(n) * 4));
    rt->gather(static_cast<int>(unit), v, host, ElemType::kF32, n);
    if (type == ElemType::kF32) {
      check(cudaMemcpyAsync(out->untyped_data(), host, n * 4, cudaMemcpyHostToDevice, stream), "gather H2D");
    } else {
      // Stage fp32 on the device in the output's upper half is not possible (bf16 is smaller), so
      // use a scratch allocation from the stream-ordered allocator.
      float* scratch = nullptr;
      check(cudaMallocAsync(reinterpret_cast<void**>(&scratch), n * 4, stream), "gather scratch");
      check(cudaMemcpyAsync(scratch, host, n * 4, cudaMemcpyHostToDevice, stream), "gather H2D");
      cast_f32_to_bf16<<<cast_blocks(n), 256, 0, stream>>>(scratch, static_cast<__nv_bfloat16*>(out->untyped_data()), n);
      check(cudaGetLastError(), "bf16 cast kernel");
      check(cudaFreeAsync(scratch, stream), "gather scratch free");
    }
    // The staging buffer is reused by the next call on this thread.
    check(cudaStreamSynchronize(stream), "gather");
  });
}

ffi::Error GatherIntoCudaImpl(cudaStream_t stream, ffi::AnyBuffer /*aliased_out*/, ffi::AnyBuffer local_shard,
                              ffi::Buffer<ffi::S32> version, ffi::Result<ffi::AnyBuffer> out, int64_t runtime,
                              int64_t unit) {
  return GatherCudaImpl(stream, local_shard, version, out, runtime, unit);
}

ffi::Error ScatterCudaImpl(cudaStream_t stream, ffi::AnyBuffer local_shard, ffi::AnyBuffer grad,
                           ffi::Buffer<ffi::S32> version, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> token_out,
                           int64_t runtime, int64_t unit) {
  Runtime* rt;
  ElemType type;
  if (auto err = check_scatter(runtime, unit, local_shard, grad, token, &rt, &type); err.failure()) return err;
  return run_guarded([&] {
    const int64_t n = static_cast<int64_t>(grad.element_count());
    check(advance_token(stream, token, token_out), "token");
    if (rt->device() >= 0) {
      const int64_t v = read_version(version.typed_data(), stream);
      scatter_with_device(rt, static_cast<int>(unit), v, grad.untyped_data(), type, n, stream);
      return;
    }
    const size_t bytes = static_cast<size_t>(n) * elem_size(type);
    void* host = t_staging.get(bytes);
    check(cudaMemcpyAsync(host, grad.untyped_data(), bytes, cudaMemcpyDeviceToHost, stream), "scatter D2H");
    const int64_t v = read_version(version.typed_data(), stream);  // also waits for the D2H copy
    rt->scatter_accumulate(static_cast<int>(unit), v, host, type, n);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcGatherCuda, GatherCudaImpl,
                              bind_gather(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcGatherIntoCuda, GatherIntoCudaImpl,
                              bind_gather_into(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcScatterCuda, ScatterCudaImpl,
                              bind_scatter(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

}  // namespace jaxodc::odc
