// XLA FFI handlers of the gradient sketch (CPU: ffi_cpu.cc), registered by bindings.cc.
// sparsify: (grad f32|bf16 [n], residual f32 [n]) -> (kept f32 [n], residual f32 [n], bitmap u32 [words]),
//           attribute fraction (f64);
// build:    (values f32 [n], bitmap u32 [words]) -> sketch f32 [3, width], attribute seed (i64);
// peel:     (sketch f32 [3, width], bitmap u32 [words]) -> (values f32 [n], counts i32 [2]), attribute seed.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jaxodc::sketch {

namespace ffi = xla::ffi;

XLA_FFI_DECLARE_HANDLER_SYMBOL(SparsifyCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BuildCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PeelCpu);

}  // namespace jaxodc::sketch
