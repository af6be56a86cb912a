// The single nanobind extension of jaxodc: control APIs of every subsystem plus one
// registrations() dict of XLA FFI handlers.
#include <nanobind/nanobind.h>

#include "ffi/registry.h"

namespace nb = nanobind;

NB_MODULE(_C, m) {
  m.doc() = "jaxodc native extension: ODC runtime, ring all-reduce, hashing, gradient sketch, lock-step collectives, FFI handlers";
  // A process that dies of a Python exception may still hold native objects (in daemon threads,
  // in the traceback): nanobind would bury the exception under "leaked instance" lines.
  nb::set_leak_warnings(false);
  nb::dict targets;
  jaxodc::bind_odc(m, targets);
  jaxodc::bind_ring(m, targets);
  jaxodc::bind_hash(m, targets);
  jaxodc::bind_attention(m, targets);
  jaxodc::bind_sketch(m, targets);
  jaxodc::bind_lockstep(m, targets);
  jaxodc::bind_transport(m, targets);
#ifdef JAXODC_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def("registrations", [targets]() { return targets; },
        "{target_name: {platform: capsule}} for jax.ffi.register_ffi_target");
}
