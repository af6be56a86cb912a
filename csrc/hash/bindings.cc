#include "ffi/registry.h"

namespace jaxodc {
void bind_hash(nb::module_& m, nb::dict& targets) {}
}  // namespace jaxodc
