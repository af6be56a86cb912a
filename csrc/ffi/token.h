// The ordering token of every communicating FFI op (ODC scatter-accumulate, ring all-reduce): an
// int32[1] operand returned advanced by one. Threading it from call to call makes each call depend
// on the previous one, which fixes their order (has_side_effect alone only prevents removal).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

namespace jaxodc {

inline xla::ffi::Error check_token(const xla::ffi::AnyBuffer& token, const std::string& op) {
  if (token.element_type() != xla::ffi::DataType::S32 || token.element_count() != 1)
    return xla::ffi::Error::InvalidArgument(op + ": the ordering token must be int32[1] (jaxodc.ops.new_token())");
  return xla::ffi::Error::Success();
}

// Host buffers (CPU handlers).
inline void advance_token(const xla::ffi::AnyBuffer& in, xla::ffi::Result<xla::ffi::AnyBuffer>& out) {
  int32_t t;
  std::memcpy(&t, in.untyped_data(), 4);
  t += 1;
  std::memcpy(out->untyped_data(), &t, 4);
}

#if defined(__CUDACC__)
namespace {
__global__ void advance_token_kernel(const int32_t* in, int32_t* out) { out[0] = in[0] + 1; }
}  // namespace

// Device buffers (CUDA handlers): ordered on `stream` after the op's work.
inline cudaError_t advance_token(cudaStream_t stream, const xla::ffi::AnyBuffer& in,
                                 xla::ffi::Result<xla::ffi::AnyBuffer>& out) {
  advance_token_kernel<<<1, 1, 0, stream>>>(static_cast<const int32_t*>(in.untyped_data()),
                                            static_cast<int32_t*>(out->untyped_data()));
  return cudaGetLastError();
}
#endif

}  // namespace jaxodc
