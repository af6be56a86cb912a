// Python control API of the ring all-reduce (jaxodc/comm/ring.py wraps it) and its FFI targets.
// Arrays arrive as flat uint8 views with the element type passed separately, which also covers
// dtypes DLPack/numpy cannot describe (bfloat16).
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <condition_variable>
#include <thread>

#include "ffi/registry.h"
#include "ring/ffi.h"
#include "transport/tcp_socket.h"

namespace jaxodc {

using ring::Endpoint;
using ByteIn = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using ByteOut = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

namespace {

// One all-reduce running on its own thread; keeps the arrays alive until Python drops it.
struct NativeOp {
  ByteIn x;
  ByteOut out;
  std::thread th;
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  ring::OpResult res;

  ~NativeOp() {
    if (th.joinable()) {
      nb::gil_scoped_release nogil;
      th.join();
    }
  }
  bool wait(double timeout_s) {
    nb::gil_scoped_release nogil;
    std::unique_lock<std::mutex> g(mu);
    if (timeout_s < 0) cv.wait(g, [&] { return finished; });
    else cv.wait_for(g, std::chrono::duration<double>(timeout_s), [&] { return finished; });
    return finished;
  }
  bool done() {
    std::lock_guard<std::mutex> g(mu);
    return finished;
  }
};

void check_sizes(const ByteIn& x, const ByteOut& out, size_t count, int dtype) {
  size_t es = ring::dtype_size(static_cast<ring::DType>(dtype));
  if (dtype < 0 || dtype > 5) throw nb::value_error("unknown dtype code");
  if (x.size() != count * es || out.size() != count * es)
    throw nb::value_error("all_reduce: byte sizes of x and out do not match count * itemsize");
}

}  // namespace

void bind_ring(nb::module_& m, nb::dict& targets) {
  nb::class_<Endpoint>(m, "RingEndpoint")
      .def("__init__",
           [](Endpoint* self, const std::string& host, int port, int pool_size, nb::bytes secret, double timeout_s,
              const std::string& group_id) {
             new (self) Endpoint(host, port, pool_size, std::string(secret.c_str(), secret.size()), timeout_s, group_id);
           },
           nb::arg("host"), nb::arg("port"), nb::arg("pool_size"), nb::arg("secret"), nb::arg("timeout_s"), nb::arg("group_id") = "")
      .def_prop_ro("address", &Endpoint::address)
      .def_prop_ro("handle", &Endpoint::handle)
      .def_prop_ro("world", &Endpoint::world)
      // (status, message) with the all_reduce status codes, so Python raises RingAborted /
      // TimeoutError / ConnectionError by kind rather than by parsing text; bad arguments raise.
      .def("connect_ring",
           [](Endpoint& ep, std::vector<std::string> ring, int my_index, uint64_t epoch) {
             nb::gil_scoped_release nogil;
             try {
               ep.connect_ring(ring, my_index, epoch);
             } catch (const tcp::TcpError& e) {
               ring::Status st = e.kind == tcp::ErrKind::kAborted   ? ring::Status::kAborted
                                 : e.kind == tcp::ErrKind::kTimeout ? ring::Status::kTimeout
                                                                    : ring::Status::kConnection;
               return std::make_pair(static_cast<int>(st), std::string(e.what()));
             }
             return std::make_pair(0, std::string());
           })
      .def("all_reduce",
           [](Endpoint& ep, ByteIn x, ByteOut out, size_t count, int dtype, int op, int quant, uint32_t tag) {
             check_sizes(x, out, count, dtype);
             ring::OpResult r;
             {
               nb::gil_scoped_release nogil;
               r = ep.all_reduce(x.data(), out.data(), count, static_cast<ring::DType>(dtype),
                                 static_cast<ring::Op>(op), static_cast<ring::Quant>(quant), tag);
             }
             return std::make_pair(static_cast<int>(r.status), r.message);
           })
      .def("all_reduce_staged",
           [](Endpoint& ep, ByteIn x, ByteOut out, size_t count, int dtype, int op, int quant, uint32_t tag) {
             check_sizes(x, out, count, dtype);
             if (x.size() && x.data() < out.data() + out.size() && out.data() < x.data() + x.size())
               throw nb::value_error("all_reduce_staged: out must not alias x");
             ring::OpResult r;
             {
               nb::gil_scoped_release nogil;
               r = ep.all_reduce_staged(x.data(), out.data(), count, static_cast<ring::DType>(dtype),
                                        static_cast<ring::Op>(op), static_cast<ring::Quant>(quant), tag);
             }
             return std::make_pair(static_cast<int>(r.status), r.message);
           })
      .def("abort", &Endpoint::abort, nb::call_guard<nb::gil_scoped_release>())
      .def("set_link", &Endpoint::set_link)
      .def("measure_bandwidth", &Endpoint::measure_bandwidth, nb::call_guard<nb::gil_scoped_release>())
      .def("set_piece_bytes", &Endpoint::set_piece_bytes)
      .def("stats",
           [](Endpoint& ep) {
             nb::dict d;
             d["bytes_sent"] = ep.bytes_sent.load();
             d["bytes_received"] = ep.bytes_received.load();
             d["ops_ok"] = ep.ops_ok.load();
             d["ops_failed"] = ep.ops_failed.load();
             d["auth_rejected"] = ep.auth_rejected();
             return d;
           })
      .def("close", &Endpoint::close, nb::call_guard<nb::gil_scoped_release>());

  nb::class_<NativeOp>(m, "RingOp")
      .def("wait", &NativeOp::wait, nb::arg("timeout_s") = -1.0)
      .def("done", &NativeOp::done)
      .def("result", [](NativeOp& op) {
        std::lock_guard<std::mutex> g(op.mu);
        return std::make_pair(static_cast<int>(op.res.status), op.res.message);
      });

  m.def("ring_start",
        [](nb::object ep_obj, ByteIn x, ByteOut out, size_t count, int dtype, int op, int quant, uint32_t tag) {
          check_sizes(x, out, count, dtype);
          Endpoint* ep = nb::inst_ptr<Endpoint>(ep_obj);
          auto* o = new NativeOp();
          o->x = x;
          o->out = out;
          const void* xp = x.data();
          void* op_ptr = out.data();
          o->th = std::thread([o, ep, xp, op_ptr, count, dtype, op, quant, tag] {
            auto r = ep->all_reduce(xp, op_ptr, count, static_cast<ring::DType>(dtype), static_cast<ring::Op>(op),
                                    static_cast<ring::Quant>(quant), tag);
            std::lock_guard<std::mutex> g(o->mu);
            o->res = r;
            o->finished = true;
            o->cv.notify_all();
          });
          return o;
        },
        nb::rv_policy::take_ownership);

  add_target(targets, "jaxodc_ring_all_reduce", "cpu", ring::RingAllReduceCpu);
#ifdef JAXODC_WITH_CUDA
  add_target(targets, "jaxodc_ring_all_reduce", "CUDA", ring::RingAllReduceCuda);
#endif
}

}  // namespace jaxodc
