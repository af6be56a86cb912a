// Python API of the varlen attention kernel (jaxodc/ops/attention.py wraps it) and its FFI targets.
#include "attention/ffi.h"
#include "attention/varlen_attention.h"
#include "ffi/registry.h"

namespace jaxodc {

void bind_attention(nb::module_& m, nb::dict& targets) {
  m.def(
      "attention_isas",
      [] {
        nb::list out;
        for (int i = 0; i < attention::kNumIsas; ++i)
          if (attention::kIsas[i].supported()) out.append(nb::str(attention::kIsas[i].name));
        return out;
      },
      "Instruction sets of the varlen attention kernel usable on this CPU (their `isa` id is their index + 1 "
      "in ('scalar', 'sse2', 'avx2', 'avx512')), narrowest first.");
  add_target(targets, "jaxodc_varlen_attention_fwd", "cpu", attention::VarlenAttentionFwdCpu);
  add_target(targets, "jaxodc_varlen_attention_bwd", "cpu", attention::VarlenAttentionBwdCpu);
}

}  // namespace jaxodc
