// One registry for every FFI target of the module: each subsystem adds its handlers with
// add_target(); Python reads them back through `_C.registrations()`.
#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace jaxodc {

namespace nb = nanobind;

// targets[name][platform] = capsule(handler). Platforms: "cpu", "CUDA".
inline void add_target(nb::dict& targets, const char* name, const char* platform,
                       XLA_FFI_Handler* handler) {
  nb::str key(name);
  if (!targets.contains(key)) targets[key] = nb::dict();
  nb::dict per_platform = nb::cast<nb::dict>(targets[key]);
  per_platform[platform] = nb::capsule(reinterpret_cast<void*>(handler));
}

// Each subsystem binds its control API on `m` and its FFI handlers into `targets`.
void bind_odc(nb::module_& m, nb::dict& targets);
void bind_ring(nb::module_& m, nb::dict& targets);
void bind_hash(nb::module_& m, nb::dict& targets);
void bind_attention(nb::module_& m, nb::dict& targets);
void bind_sketch(nb::module_& m, nb::dict& targets);
void bind_lockstep(nb::module_& m, nb::dict& targets);
void bind_transport(nb::module_& m, nb::dict& targets);

}  // namespace jaxodc
