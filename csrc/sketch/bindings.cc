// FFI targets of the gradient sketch (jaxodc/ops/sketch.py wraps them).
#include "ffi/registry.h"
#include "sketch/ffi.h"

namespace jaxodc {

void bind_sketch(nb::module_&, nb::dict& targets) {
  add_target(targets, "jaxodc_sketch_sparsify", "cpu", sketch::SparsifyCpu);
  add_target(targets, "jaxodc_sketch_build", "cpu", sketch::BuildCpu);
  add_target(targets, "jaxodc_sketch_peel", "cpu", sketch::PeelCpu);
#ifdef JAXODC_WITH_CUDA
  add_target(targets, "jaxodc_sketch_sparsify", "CUDA", sketch::SparsifyCuda);
  add_target(targets, "jaxodc_sketch_build", "CUDA", sketch::BuildCuda);
  add_target(targets, "jaxodc_sketch_peel", "CUDA", sketch::PeelCuda);
#endif
}

}  // namespace jaxodc
