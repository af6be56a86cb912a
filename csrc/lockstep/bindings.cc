// Python control API of the lock-step group (`jaxodc._C.LockstepGroup`) and its FFI target.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "ffi/registry.h"
#include "lockstep/ffi.h"
#include "lockstep/group.h"

namespace jaxodc {

void bind_lockstep(nb::module_& m, nb::dict& targets) {
  using lockstep::Group;
  // Host buffers: float32 channels take float32 arrays, bfloat16 channels their bits as uint16.
  using In = nb::ndarray<nb::ndim<1>, nb::c_contig, nb::device::cpu>;
  using Out = nb::ndarray<nb::ndim<1>, nb::c_contig, nb::device::cpu>;
  nb::class_<Group>(m, "LockstepGroup")
      .def(
          "__init__",
          [](Group* self, int rank, int world, const std::string& shm_name,
             const std::vector<std::tuple<int, int64_t, std::string, int>>& channels, double timeout_s,
             const std::string& listen_host, nb::bytes secret, const std::string& job_id) {
            std::vector<lockstep::ChannelSpec> specs;
            for (const auto& [kind, n, name, dtype] : channels)
              specs.push_back({static_cast<lockstep::Kind>(kind), n, name, static_cast<lockstep::DType>(dtype)});
            new (self) Group(rank, world, shm_name, specs, timeout_s, listen_host,
                             std::string(secret.c_str(), secret.size()), job_id);
          },
          nb::arg("rank"), nb::arg("world"), nb::arg("shm_name"), nb::arg("channels"), nb::arg("timeout_s"),
          nb::arg("listen_host") = "127.0.0.1", nb::arg("secret") = nb::bytes(""), nb::arg("job_id") = "")
      .def_prop_ro("rank", &Group::rank)
      .def_prop_ro("world", &Group::world)
      .def_prop_ro("port", &Group::port)
      .def_prop_ro("layout_hash", &Group::layout_hash)
      .def_prop_ro("handle", &Group::handle, "names this group in jitted lockstep ops, from connect on")
      .def_prop_ro("shm_name", &Group::shm_name)
      .def_prop_ro("segment_bytes", &Group::segment_bytes, "this rank's shm segment (header, post table, staging areas)")
      .def_prop_ro("tcp_buffer_bytes", &Group::tcp_buffer_bytes, "this rank's receive buffers for its tcp peers")
      .def("in_elems", &Group::in_elems)
      .def("out_elems", &Group::out_elems)
      .def("elem_bytes", &Group::elem_bytes)
      .def(
          "connect",
          [](Group& g, const std::vector<std::tuple<int, int, std::string, std::string, int>>& peers) {
            std::vector<lockstep::PeerConfig> cfgs;
            for (const auto& [rank, link, shm_name, host, port] : peers)
              cfgs.push_back({rank, static_cast<lockstep::Link>(link), shm_name, host, port});
            nb::gil_scoped_release release;
            g.connect(cfgs);
          },
          nb::arg("peers"))
      .def("unlink_segment", &Group::unlink_segment)
      .def(
          "run",
          [](Group& g, int channel, In in, Out out) {
            const nb::dlpack::dtype want =
                g.elem_bytes(channel) == 2 ? nb::dtype<uint16_t>() : nb::dtype<float>();
            if (in.dtype() != want || out.dtype() != want)
              throw Error("lockstep run: channel " + std::to_string(channel) + " takes " +
                          (g.elem_bytes(channel) == 2 ? "bfloat16 bits as uint16" : "float32") + " arrays");
            if (static_cast<int64_t>(in.shape(0)) != g.in_elems(channel) ||
                static_cast<int64_t>(out.shape(0)) != g.out_elems(channel))
              throw Error("lockstep run: channel " + std::to_string(channel) + " takes " +
                          std::to_string(g.in_elems(channel)) + " elements in and " +
                          std::to_string(g.out_elems(channel)) + " out");
            nb::gil_scoped_release release;
            g.run(channel, in.data(), out.data());
          },
          nb::arg("channel"), nb::arg("x"), nb::arg("out"), "the collective of `channel` outside jit (blocking)")
      .def("close", &Group::close, nb::call_guard<nb::gil_scoped_release>());
  add_target(targets, "jaxodc_lockstep", "cpu", lockstep::LockstepCpu);
}

}  // namespace jaxodc
