// XLA FFI handlers of the ring all-reduce: the CPU one in ffi_cpu.cc, the CUDA one in ffi_cuda.cu
// (CUDA builds), registered by bindings.cc; and what both share.
#pragma once

#include <string>
#include <utility>

#include "ffi/token.h"
#include "ring/ring.h"
#include "xla/ffi/api/ffi.h"

namespace jaxodc::ring {

// (x, token) -> (y, token + 1); attrs handle, op, quant, tag (all int64).
XLA_FFI_DECLARE_HANDLER_SYMBOL(RingAllReduceCpu);
#ifdef JAXODC_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(RingAllReduceCuda);
#endif

// The all-reduce signature of the CPU and CUDA handlers (pass ffi::Ffi::Bind(), with the stream
// bound first for CUDA): (x, ordering token) -> (result, token), matching jaxodc/ops/ring.py.
template <typename Binding>
auto bind_all_reduce(Binding&& b) {
  return std::move(b).template Arg<xla::ffi::AnyBuffer>().template Arg<xla::ffi::AnyBuffer>()
      .template Ret<xla::ffi::AnyBuffer>().template Ret<xla::ffi::AnyBuffer>()
      .template Attr<int64_t>("handle").template Attr<int64_t>("op").template Attr<int64_t>("quant")
      .template Attr<int64_t>("tag");
}

inline bool ffi_dtype(xla::ffi::DataType t, DType* out) {
  using xla::ffi::DataType;
  switch (t) {
    case DataType::F32: *out = DType::kF32; return true;
    case DataType::F64: *out = DType::kF64; return true;
    case DataType::F16: *out = DType::kF16; return true;
    case DataType::BF16: *out = DType::kBF16; return true;
    case DataType::S32: *out = DType::kI32; return true;
    case DataType::S64: *out = DType::kI64; return true;
    default: return false;
  }
}

// Operand checks of both handlers: sets the element type and the live endpoint of `handle`.
inline xla::ffi::Error check_all_reduce(const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& tok, int64_t handle,
                                        DType* dt, Endpoint** ep) {
  using xla::ffi::Error;
  if (!ffi_dtype(x.element_type(), dt)) return Error::InvalidArgument("ring all_reduce: unsupported dtype");
  if (auto err = check_token(tok, "ring all_reduce"); err.failure()) return err;
  *ep = endpoint_by_handle(handle);
  if (!*ep)
    return Error::InvalidArgument("ring all_reduce: no live endpoint with handle " + std::to_string(handle) +
                                  " (closed, or never created in this process)");
  return Error::Success();
}

inline xla::ffi::Error ffi_status(const OpResult& r) {
  using xla::ffi::ErrorCode;
  switch (r.status) {
    case Status::kOk: return xla::ffi::Error::Success();
    case Status::kAborted: return xla::ffi::Error(ErrorCode::kAborted, "RingAborted: " + r.message);
    case Status::kTimeout: return xla::ffi::Error(ErrorCode::kDeadlineExceeded, "TimeoutError: " + r.message);
    case Status::kConnection: return xla::ffi::Error(ErrorCode::kUnavailable, "ConnectionError: " + r.message);
    default: return xla::ffi::Error(ErrorCode::kInvalidArgument, r.message);
  }
}

}  // namespace jaxodc::ring
