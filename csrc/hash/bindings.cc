// Python API of the deterministic hash (jaxodc/comm/hashing.py wraps it) and of SHA-256 / HMAC.
#include <nanobind/ndarray.h>

#include "ffi/registry.h"
#include "hash/hash.h"
#include "hash/sha256.h"

namespace jaxodc {

void bind_hash(nb::module_& m, nb::dict& targets) {
  m.def("hash_bytes",
        [](nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> x, int threads) {
          const void* p = x.data();
          size_t n = x.size();
          nb::gil_scoped_release nogil;
          return hash::hash_cpu(p, n, threads);
        },
        nb::arg("data"), nb::arg("threads") = 0, "jaxodc hash v1 of a flat uint8 host array");
  m.def("hash_cuda",
        [](nb::ndarray<nb::ro, nb::c_contig, nb::device::cuda> x) -> uint64_t {
#ifdef JAXODC_WITH_CUDA
          size_t n = x.nbytes();
          const void* p = x.data();
          nb::gil_scoped_release nogil;
          return hash::hash_cuda(p, n);
#else
          throw std::runtime_error("jaxodc was built without CUDA");
#endif
        },
        nb::arg("data"), "jaxodc hash v1 of a contiguous CUDA array (any dtype; its raw bytes)");
  m.def("sha256", [](nb::bytes data) {
    auto d = crypto::sha256(data.c_str(), data.size());
    return nb::bytes(reinterpret_cast<const char*>(d.data()), d.size());
  });
  m.def("hmac_sha256", [](nb::bytes key, nb::bytes msg) {
    auto d = crypto::hmac_sha256(key.c_str(), key.size(), msg.c_str(), msg.size());
    return nb::bytes(reinterpret_cast<const char*>(d.data()), d.size());
  });
  (void)targets;
}

}  // namespace jaxodc
