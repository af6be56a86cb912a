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
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "odc/device_cuda.h"
#include "odc/ffi.h"

namespace jaxodc::odc {

namespace {

// The element conversions are common/dtype.h's, the CPU handlers' own.
__global__ void cast_f32_to_bf16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = f32_to_bf16(in[i]);
}

__global__ void cast_bf16_to_f32(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = bf16_to_f32(in[i]);
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
      cast_f32_to_bf16<<<cast_blocks(n), 256, 0, stream>>>(scratch, static_cast<uint16_t*>(out), n);
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
    cast_bf16_to_f32<<<cast_blocks(n), 256, 0, stream>>>(static_cast<const uint16_t*>(grad), scratch, n);
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
      cast_f32_to_bf16<<<cast_blocks(n), 256, 0, stream>>>(scratch, static_cast<uint16_t*>(out->untyped_data()), n);
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

// gather_pieces: each output gets its piece of the unit.
//  - No device block: the host transports write the pieces, already in the outputs' dtype (the
//    runtime's conversion), one after another into pinned staging; one H2D copy per piece.
//  - A device block: the unit is gathered whole into an fp32 device scratch (gather_with_device's
//    route), then each piece is copied (fp32) or cast (bf16) out of it: a unit's worth of
//    transient device memory, freed in stream order.
void gather_pieces_cuda(Runtime* rt, int unit, int64_t v, const Pieces& pieces, ElemType type, cudaStream_t stream) {
  const size_t esize = elem_size(type);
  if (rt->device() < 0) {
    int64_t total = 0;
    for (int64_t c : pieces.counts) total += c;
    char* host = static_cast<char*>(t_staging.get(static_cast<size_t>(std::max<int64_t>(total, 1)) * esize));
    std::vector<void*> staged;
    for (size_t i = 0, at = 0; i < pieces.counts.size(); at += static_cast<size_t>(pieces.counts[i]) * esize, ++i)
      staged.push_back(host + at);
    rt->gather_pieces(unit, v, pieces.offsets, pieces.counts, staged, type);
    for (size_t i = 0; i < staged.size(); ++i)
      if (pieces.counts[i] > 0)
        check(cudaMemcpyAsync(pieces.ptrs[i], staged[i], static_cast<size_t>(pieces.counts[i]) * esize,
                              cudaMemcpyHostToDevice, stream),
              "gather_pieces H2D");
    check(cudaStreamSynchronize(stream), "gather_pieces");  // the staging buffer is reused by the next call
    return;
  }
  const int64_t n = rt->numel(unit);
  for (size_t i = 0; i < pieces.ptrs.size(); ++i) {  // the host route checks in Runtime::gather_pieces
    if (pieces.offsets[i] < 0 || pieces.offsets[i] + pieces.counts[i] > n)
      throw Error("odc.gather_pieces: rank " + std::to_string(rt->rank()) + ": piece [" +
                  std::to_string(pieces.offsets[i]) + ", " + std::to_string(pieces.offsets[i] + pieces.counts[i]) +
                  ") of unit " + std::to_string(unit) + " lies outside its " + std::to_string(n) + " elements");
    check_on_device(rt, pieces.ptrs[i], "odc.gather_pieces", unit);
  }
  float* full = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&full), static_cast<size_t>(n) * 4, stream), "gather_pieces scratch");
  bool staged = false;
  try {
    rt->gather_device(unit, v, full, stream);
    staged = gather_host_owners(rt, unit, v, full, n, stream);
    for (size_t i = 0; i < pieces.ptrs.size(); ++i) {
      const int64_t m = pieces.counts[i];
      if (m == 0) continue;
      const float* src = full + pieces.offsets[i];
      if (type == ElemType::kF32) {
        check(cudaMemcpyAsync(pieces.ptrs[i], src, static_cast<size_t>(m) * 4, cudaMemcpyDeviceToDevice, stream),
              "gather_pieces copy");
      } else {
        cast_f32_to_bf16<<<cast_blocks(m), 256, 0, stream>>>(src, static_cast<uint16_t*>(pieces.ptrs[i]), m);
        check(cudaGetLastError(), "bf16 cast kernel");
      }
    }
  } catch (...) {
    cudaFreeAsync(full, stream);
    throw;
  }
  check(cudaFreeAsync(full, stream), "gather_pieces scratch free");
  if (staged) check(cudaStreamSynchronize(stream), "gather_pieces");
}

ffi::Error GatherPiecesCudaImpl(cudaStream_t stream, ffi::AnyBuffer local_shard, ffi::Buffer<ffi::S32> version,
                                ffi::RemainingRets outs, int64_t runtime, int64_t unit,
                                ffi::Span<const int64_t> offsets) {
  Pieces pieces;
  Runtime* rt;
  ElemType type;
  if (auto err = check_pieces(runtime, unit, local_shard, outs, offsets, &pieces, &rt, &type); err.failure()) return err;
  return run_guarded([&] {
    gather_pieces_cuda(rt, static_cast<int>(unit), read_version(version.typed_data(), stream), pieces, type, stream);
  });
}

// A range push (one parameter of a unit) leaves through host memory to every owner, device owners
// included (their host accumulators are added to the device ones at fetch): one D2H copy of the
// range, then the CPU handler's path, so registered TAGC ranges are encoded (bitmap + count
// sketch, error-feedback residual kept on the host) by the same code as on CPU.
ffi::Error ScatterRangeCudaImpl(cudaStream_t stream, ffi::AnyBuffer local_shard, ffi::AnyBuffer grad,
                                ffi::Buffer<ffi::S32> version, ffi::AnyBuffer token,
                                ffi::Result<ffi::AnyBuffer> token_out, int64_t runtime, int64_t unit, int64_t offset) {
  Runtime* rt;
  ElemType type;
  if (auto err = check_scatter(runtime, unit, local_shard, grad, token, &rt, &type, /*range=*/true); err.failure())
    return err;
  return run_guarded([&] {
    check(advance_token(stream, token, token_out), "token");
    if (rt->device() >= 0) check_on_device(rt, grad.untyped_data(), "odc.scatter_accumulate_range", unit);
    const int64_t n = static_cast<int64_t>(grad.element_count());
    const size_t bytes = static_cast<size_t>(n) * elem_size(type);
    void* host = t_staging.get(std::max<size_t>(bytes, 1));
    if (bytes > 0) check(cudaMemcpyAsync(host, grad.untyped_data(), bytes, cudaMemcpyDeviceToHost, stream), "scatter D2H");
    const int64_t v = read_version(version.typed_data(), stream);  // also waits for the D2H copy
    rt->scatter_accumulate_range(static_cast<int>(unit), v, offset, host, type, n);
  });
}

// The end of a minibatch's exchange (ffi_cpu.cc's allgather_host) from a device program: the
// inputs come to pinned host memory, the results go back, all on the call's stream; the rank
// blocks on the stream once, as the exchange needs the values.
ffi::Error AllgatherCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::U32> head, ffi::Buffer<ffi::F32> values,
                             ffi::Buffer<ffi::S32> version, ffi::Buffer<ffi::S32> exchange,
                             ffi::Result<ffi::Buffer<ffi::U32>> head_rows, ffi::Result<ffi::Buffer<ffi::F32>> total,
                             int64_t runtime) {
  Runtime* rt;
  if (auto err = check_allgather(runtime, head, values, *head_rows, *total, &rt); err.failure()) return err;
  const int64_t h = static_cast<int64_t>(head.element_count()), n = static_cast<int64_t>(values.element_count());
  return run_guarded([&] {
    const int64_t w = rt->world();
    // one pinned block: head, values, version, exchange | head rows, total
    const size_t in_bytes = static_cast<size_t>(h) * 4 + static_cast<size_t>(n) * 4 + 8;
    const size_t out_bytes = static_cast<size_t>(w * h) * 4 + static_cast<size_t>(n) * 4;
    char* host = static_cast<char*>(t_staging.get(in_bytes + out_bytes));
    uint32_t* h_head = reinterpret_cast<uint32_t*>(host);
    float* h_values = reinterpret_cast<float*>(host + static_cast<size_t>(h) * 4);
    int32_t* h_flags = reinterpret_cast<int32_t*>(host + static_cast<size_t>(h + n) * 4);
    uint32_t* h_rows = reinterpret_cast<uint32_t*>(host + in_bytes);
    float* h_total = reinterpret_cast<float*>(host + in_bytes + static_cast<size_t>(w * h) * 4);
    if (h) check(cudaMemcpyAsync(h_head, head.typed_data(), static_cast<size_t>(h) * 4, cudaMemcpyDeviceToHost, stream),
                 "allgather head D2H");
    if (n) check(cudaMemcpyAsync(h_values, values.typed_data(), static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost,
                                 stream), "allgather values D2H");
    check(cudaMemcpyAsync(h_flags, version.typed_data(), 4, cudaMemcpyDeviceToHost, stream), "allgather version D2H");
    check(cudaMemcpyAsync(h_flags + 1, exchange.typed_data(), 4, cudaMemcpyDeviceToHost, stream),
          "allgather exchange D2H");
    check(cudaStreamSynchronize(stream), "allgather inputs");
    allgather_host(rt, h_head, h, h_values, n, h_flags[0], h_flags[1] != 0, h_rows, h_total);
    if (w * h) check(cudaMemcpyAsync(head_rows->typed_data(), h_rows, static_cast<size_t>(w * h) * 4,
                                     cudaMemcpyHostToDevice, stream), "allgather rows H2D");
    if (n) check(cudaMemcpyAsync(total->typed_data(), h_total, static_cast<size_t>(n) * 4, cudaMemcpyHostToDevice,
                                 stream), "allgather total H2D");
    // the pinned block is this thread's staging buffer: the copies must land before its next use
    check(cudaStreamSynchronize(stream), "allgather results");
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcAllgatherCuda, AllgatherCudaImpl,
                              bind_allgather(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcGatherPiecesCuda, GatherPiecesCudaImpl,
                              bind_gather_pieces(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcScatterRangeCuda, ScatterRangeCudaImpl,
                              bind_scatter_range(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcGatherCuda, GatherCudaImpl,
                              bind_gather(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcGatherIntoCuda, GatherIntoCudaImpl,
                              bind_gather_into(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcScatterCuda, ScatterCudaImpl,
                              bind_scatter(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

}  // namespace jaxodc::odc
