// XLA FFI handler of the lock-step collectives (ffi_cpu.cc), registered by bindings.cc as
// "jaxodc_lockstep": (x) -> result, attributes `group` (Group::handle) and `channel`.
#pragma once

#include "lockstep/group.h"
#include "xla/ffi/api/ffi.h"

namespace jaxodc::lockstep {

namespace ffi = xla::ffi;

XLA_FFI_DECLARE_HANDLER_SYMBOL(LockstepCpu);

}  // namespace jaxodc::lockstep
