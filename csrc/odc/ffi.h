// XLA FFI handlers of the ODC ops (CPU here; CUDA ones in ffi_cuda.cu when built with CUDA).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jaxodc::odc {

XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcGatherCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcGatherIntoCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcScatterCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcScatterRangeCpu);
#ifdef JAXODC_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcGatherCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcGatherIntoCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcScatterCuda);
#endif

}  // namespace jaxodc::odc
