#include "ffi/registry.h"

namespace jaxodc {
void bind_ring(nb::module_& m, nb::dict& targets) {}
}  // namespace jaxodc
