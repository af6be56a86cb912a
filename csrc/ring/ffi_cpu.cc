// CPU FFI handler of the ring all-reduce: runs the native ring directly on XLA's host buffers.
#include <cstring>

#include "ring/ffi_ring.h"

namespace ffi = xla::ffi;

namespace jaxodc::ring {

static ffi::Error AllReduceCpu(ffi::AnyBuffer x, ffi::AnyBuffer tok, ffi::Result<ffi::AnyBuffer> y,
                               ffi::Result<ffi::AnyBuffer> tok_out, int64_t handle, int64_t op,
                               int64_t quant, int64_t tag) {
  DType dt;
  if (!ffi_dtype(x.element_type(), &dt))
    return ffi::Error::InvalidArgument("ring all_reduce: unsupported dtype");
  if (tok.element_type() != ffi::DataType::S32 || tok.element_count() != 1)
    return ffi::Error::InvalidArgument("ring all_reduce: token must be int32[1]");
  auto ep = endpoint_by_handle(handle);
  if (!ep) return ffi::Error::InvalidArgument("ring all_reduce: no live endpoint with handle " + std::to_string(handle));
  OpResult r = ep->all_reduce(x.untyped_data(), y->untyped_data(), x.element_count(), dt, static_cast<Op>(op),
                              static_cast<Quant>(quant), static_cast<uint32_t>(tag));
  int32_t t;
  std::memcpy(&t, tok.untyped_data(), 4);
  t += 1;
  std::memcpy(tok_out->untyped_data(), &t, 4);
  return ffi_status(r);
}

}  // namespace jaxodc::ring

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxodc_ring_all_reduce_cpu, jaxodc::ring::AllReduceCpu,
                              jaxodc::ring::bind_all_reduce(ffi::Ffi::Bind()));
