// XLA FFI handlers of the varlen attention ops (CPU only: ffi_cpu.cc), registered by bindings.cc.
// fwd: (q, k, v, segment_ids) -> (o, lse); bwd: (q, k, v, segment_ids, o, lse, do) -> (dq, dk, dv);
// attribute `isa` (int64).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jaxodc::attention {

namespace ffi = xla::ffi;

XLA_FFI_DECLARE_HANDLER_SYMBOL(VarlenAttentionFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(VarlenAttentionBwdCpu);

}  // namespace jaxodc::attention
