// Python API of the native jaxodc-auth-v2 (tests check it against jaxodc/auth.py's vectors, and
// the fuzzer uses the client side).
#include <nanobind/stl/string.h>

#include "ffi/registry.h"
#include "transport/auth.h"

namespace jaxodc {

void bind_transport(nb::module_& m, nb::dict& targets) {
  m.def("auth_tag",
        [](nb::bytes secret, const std::string& role, const std::string& listener, const std::string& job_id,
           uint32_t rank, nb::bytes nonce_s, nb::bytes nonce_c) {
          if (nonce_s.size() != auth::kNonceBytes || nonce_c.size() != auth::kNonceBytes)
            throw std::invalid_argument("auth_tag: nonces are 32 bytes");
          const auth::Identity id{std::string(secret.c_str(), secret.size()), listener, job_id};
          const auto t = auth::tag(id, role, rank, reinterpret_cast<const uint8_t*>(nonce_s.c_str()),
                                   reinterpret_cast<const uint8_t*>(nonce_c.c_str()));
          return nb::bytes(reinterpret_cast<const char*>(t.data()), t.size());
        },
        nb::arg("secret"), nb::arg("role"), nb::arg("listener"), nb::arg("job_id"), nb::arg("rank"),
        nb::arg("nonce_s"), nb::arg("nonce_c"), "jaxodc-auth-v2 tag, computed by the C++ listeners' code");
  (void)targets;
}

}  // namespace jaxodc
