#include "ffi/registry.h"

namespace jaxodc {
void bind_odc(nb::module_& m, nb::dict& targets) {}
}  // namespace jaxodc
