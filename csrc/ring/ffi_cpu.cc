// CPU FFI handler of the ring all-reduce: runs the native ring directly on XLA's host buffers.
#include "ring/ffi.h"

namespace ffi = xla::ffi;

namespace jaxodc::ring {

namespace {

ffi::Error AllReduceCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer tok, ffi::Result<ffi::AnyBuffer> y,
                               ffi::Result<ffi::AnyBuffer> tok_out, int64_t handle, int64_t op,
                               int64_t quant, int64_t tag) {
  DType dt;
  Endpoint* ep;
  if (auto err = check_all_reduce(x, tok, handle, &dt, &ep); err.failure()) return err;
  OpResult r = ep->all_reduce(x.untyped_data(), y->untyped_data(), x.element_count(), dt, static_cast<Op>(op),
                              static_cast<Quant>(quant), static_cast<uint32_t>(tag));
  advance_token(tok, tok_out);
  return ffi_status(r);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RingAllReduceCpu, AllReduceCpuImpl, bind_all_reduce(ffi::Ffi::Bind()));

}  // namespace jaxodc::ring
