// Python control API of the ODC runtime (`jaxodc._C.OdcRuntime`) and its FFI targets.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "ffi/registry.h"
#include "odc/ffi.h"
#include "odc/runtime.h"

namespace jaxodc {

namespace {

using odc::Runtime;
using F32In = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using F32Out = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using AnyIn = nb::ndarray<nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A fresh float32 numpy array owning its memory.
nb::ndarray<nb::numpy, float, nb::ndim<1>> new_f32(int64_t n) {
  float* data = new float[static_cast<size_t>(n > 0 ? n : 1)];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  return nb::ndarray<nb::numpy, float, nb::ndim<1>>(data, {static_cast<size_t>(n)}, owner);
}

ElemType elem_type_of(const nb::dlpack::dtype& dt, const char* op) {
  if (dt == nb::dtype<float>()) return ElemType::kF32;
  if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16) return ElemType::kBF16;
  throw Error(std::string(op) + ": arrays must be float32 or bfloat16");
}

}  // namespace

void bind_odc(nb::module_& m, nb::dict& targets) {
  // Base first: nanobind tries translators newest first, so subclasses must come later.
  static nb::exception<Error> odc_error(m, "OdcError", PyExc_RuntimeError);
  static nb::exception<TimeoutError> odc_timeout(m, "OdcTimeoutError", PyExc_TimeoutError);
  static nb::exception<PeerError> odc_peer(m, "PeerError", PyExc_ConnectionError);

  nb::class_<Runtime>(m, "OdcRuntime")
      .def("__init__",
           [](Runtime* self, int rank, int world, const std::string& job_id, const std::vector<int64_t>& numels,
              double timeout_s, const std::string& listen_host, int64_t slot_elems, nb::bytes secret) {
             new (self) Runtime(rank, world, job_id, numels, timeout_s, listen_host, slot_elems,
                                std::string(secret.c_str(), secret.size()));
           },
           nb::arg("rank"), nb::arg("world"), nb::arg("job_id"), nb::arg("unit_numels"), nb::arg("timeout_s"),
           nb::arg("listen_host") = "127.0.0.1", nb::arg("slot_elems") = 0, nb::arg("secret") = nb::bytes(""),
           "secret: the job secret every tcp peer proves (empty only with a loopback listen_host)")
      .def_prop_ro("slot_elems", &Runtime::slot_elems, "fp32 elements per receive slot")
      .def_prop_ro("rank", &Runtime::rank)
      .def_prop_ro("world", &Runtime::world)
      .def_prop_ro("num_units", &Runtime::num_units)
      .def_prop_ro("layout_hash", &Runtime::layout_hash)
      .def_prop_ro("shm_name", &Runtime::shm_name)
      .def_prop_ro("port", &Runtime::port)
      .def_prop_ro("handle", &Runtime::handle, "names this runtime in jitted ODC ops (runtime=), from connect on")
      .def_prop_ro("device", &Runtime::device, "CUDA ordinal of the device block, -1 without one")
      .def_prop_ro("device_uuid", &Runtime::device_uuid)
      .def("enable_device", &Runtime::enable_device, nb::arg("ordinal"), nb::call_guard<nb::gil_scoped_release>(),
           "Puts this rank's server memory (also) in GPU memory, exported for cuda_ipc peers; before connect.")
      .def(
          "nvshmem_uniqueid",
          [](Runtime& rt) {
            std::string uid;
            {
              nb::gil_scoped_release release;
              uid = rt.nvshmem_uniqueid();
            }
            return nb::bytes(uid.data(), uid.size());
          },
          "A fresh NVSHMEM bootstrap id (bytes), made on the rank that becomes PE 0; needs the plugin and a device.")
      .def(
          "init_nvshmem",
          [](Runtime& rt, nb::bytes uid, const std::vector<int>& pe_of_rank) {
            std::string id(uid.c_str(), uid.size());
            nb::gil_scoped_release release;
            rt.init_nvshmem(id, pe_of_rank);
          },
          nb::arg("uid"), nb::arg("pe_of_rank"),
          "Joins the NVSHMEM job of `uid` as PE pe_of_rank[rank] (-1: outside) and allocates the symmetric "
          "block; collective over the job, after enable_device, before connect.")
      .def_prop_ro("nvshmem_active", &Runtime::nvshmem_active)
      .def("numel", &Runtime::numel)
      .def("shard_size", &Runtime::shard_size)
      .def(
          "connect",
          [](Runtime& rt, const std::vector<std::tuple<int, int, std::string, std::string, int>>& peers) {
            std::vector<odc::PeerConfig> cfgs;
            for (const auto& [rank, transport, shm, host, port] : peers) {
              odc::PeerConfig c;
              c.rank = rank;
              c.transport = static_cast<odc::Transport>(transport);
              c.shm_name = shm;
              c.host = host;
              c.port = port;
              cfgs.push_back(c);
            }
            nb::gil_scoped_release release;
            rt.connect(cfgs);
          },
          "peers: [(rank, transport 0=self 1=shm 2=tcp 3=cuda_ipc 4=nvshmem, shm_name, host, port)]")
      .def("unlink_segment", &Runtime::unlink_segment)
      .def("create_host_cache", &Runtime::create_host_cache, nb::arg("name"), nb::arg("remote"),
           "The host's first rank: creates the per-host gather cache with entries for the `remote` owners; before connect.")
      .def("open_host_cache", &Runtime::open_host_cache, nb::arg("name"),
           "The host's other ranks: maps the host's gather cache; before connect.")
      .def("unlink_host_cache", &Runtime::unlink_host_cache)
      .def_prop_ro("host_cache_bytes", &Runtime::host_cache_bytes, "bytes of the host gather cache's data (0: none)")
      .def_prop_ro("gather_wire_bytes", &Runtime::gather_wire_bytes,
                   "bytes of gathered pieces this rank received over the network so far")
      .def_prop_ro("gather_cache_hits", &Runtime::gather_cache_hits,
                   "pieces this rank read from the host gather cache that another rank of its host fetched")
      .def("set_link", &Runtime::set_link, nb::arg("bytes_per_s"), nb::arg("latency_s"),
           "Emulated link of the tcp transport (before connect): bytes/s cap (<= 0: none), added latency.")
      .def("set_exact_sum", &Runtime::set_exact_sum, nb::arg("exact"),
           "How this owner sums pushes (before connect): exactly, whatever their arrival order (True, the "
           "default), or in fp32 in arrival order (False).")
      .def_prop_ro("exact_sum", &Runtime::exact_sum)
      .def("add_range", &Runtime::add_range, nb::arg("unit"), nb::arg("offset"), nb::arg("size"),
           nb::arg("fraction"), nb::arg("ratio"), nb::arg("seed"), nb::arg("compress"),
           "TAGC: pushes of this range to other ranks travel compressed (or, compress=False, are only counted).")
      .def("traffic",
           [](Runtime& rt, int unit) {
             odc::UnitTraffic t = rt.traffic(unit);
             nb::dict d;
             d["wire_bytes"] = t.wire_bytes;
             d["range_bytes"] = t.range_bytes;
             d["range_elems"] = t.range_elems;
             d["kept_elems"] = t.kept_elems;
             d["peeled"] = t.peeled;
             d["estimated"] = t.estimated;
             return d;
           },
           nb::arg("unit"), "This rank's gradient traffic of the unit so far (counters).")
      .def(
          "residual",
          [](const Runtime& rt, int unit, int64_t offset) {
            const std::vector<float> r = rt.residual(unit, offset);
            auto out = new_f32(static_cast<int64_t>(r.size()));
            std::copy(r.begin(), r.end(), out.data());
            return out;
          },
          nb::arg("unit"), nb::arg("offset"), "A copy of the compressed range's error-feedback residual.")
      .def(
          "set_residual",
          [](Runtime& rt, int unit, int64_t offset, F32In values) {
            rt.set_residual(unit, offset, values.data(), static_cast<int64_t>(values.shape(0)));
          },
          nb::arg("unit"), nb::arg("offset"), nb::arg("values"),
          "Replaces the compressed range's error-feedback residual (between minibatches).")
      .def(
          "gather",
          [](Runtime& rt, int unit, int64_t version, AnyIn out) {
            ElemType t = elem_type_of(out.dtype(), "gather");
            nb::gil_scoped_release release;
            rt.gather(unit, version, out.data(), t, static_cast<int64_t>(out.shape(0)));
          },
          nb::arg("unit"), nb::arg("version"), nb::arg("out"))
      .def(
          "scatter_accumulate",
          [](Runtime& rt, int unit, int64_t version, AnyIn grad) {
            ElemType t = elem_type_of(grad.dtype(), "scatter_accumulate");
            nb::gil_scoped_release release;
            rt.scatter_accumulate(unit, version, grad.data(), t, static_cast<int64_t>(grad.shape(0)));
          },
          nb::arg("unit"), nb::arg("version"), nb::arg("grad"))
      .def(
          "scatter_accumulate_range",
          [](Runtime& rt, int unit, int64_t version, int64_t offset, AnyIn grad) {
            ElemType t = elem_type_of(grad.dtype(), "scatter_accumulate_range");
            nb::gil_scoped_release release;
            rt.scatter_accumulate_range(unit, version, offset, grad.data(), t, static_cast<int64_t>(grad.shape(0)));
          },
          nb::arg("unit"), nb::arg("version"), nb::arg("offset"), nb::arg("grad"))
      .def("done", &Runtime::done, nb::arg("version"), nb::call_guard<nb::gil_scoped_release>())
      .def("wait_complete", &Runtime::wait_complete, nb::arg("version"), nb::call_guard<nb::gil_scoped_release>())
      .def("claim", &Runtime::claim, nb::arg("version"), nb::arg("owner"), nb::arg("count"), nb::arg("steal"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("allgather_scalar", &Runtime::allgather_scalar, nb::arg("version"), nb::arg("value"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("allgather", &Runtime::allgather, nb::arg("version"), nb::arg("values"),
           nb::call_guard<nb::gil_scoped_release>())
      .def(
          "fetch_grad",
          [](Runtime& rt, int unit) {
            auto out = new_f32(rt.shard_size(unit));
            nb::gil_scoped_release release;
            rt.fetch_grad(unit, out.data(), static_cast<int64_t>(out.shape(0)));
            return out;
          },
          nb::arg("unit"))
      .def(
          "publish",
          [](Runtime& rt, int unit, F32In shard, int64_t version) {
            nb::gil_scoped_release release;
            rt.publish(unit, shard.data(), static_cast<int64_t>(shard.shape(0)), version);
          },
          nb::arg("unit"), nb::arg("shard"), nb::arg("version"))
      // Views without a copy (see Runtime::grad_in_place / master_data); each keeps the Python
      // runtime object alive, and is valid only for the protocol window described there.
      .def(
          "grad_view",
          [](nb::handle self, int unit) {
            Runtime& rt = nb::cast<Runtime&>(self);
            float* p;
            {
              nb::gil_scoped_release release;
              p = rt.grad_in_place(unit);
            }
            return nb::ndarray<nb::numpy, float, nb::ndim<1>>(p, {static_cast<size_t>(rt.shard_size(unit))}, self);
          },
          nb::arg("unit"))
      .def("clear_grad", &Runtime::clear_grad, nb::arg("unit"))
      .def("lend_grads", &Runtime::lend_grads, nb::arg("units"), nb::call_guard<nb::gil_scoped_release>())
      .def("clear_and_publish_in_place", &Runtime::clear_and_publish_in_place, nb::arg("units"), nb::arg("version"),
           nb::call_guard<nb::gil_scoped_release>())
      .def(
          "master_view",
          [](nb::handle self, int unit) {
            Runtime& rt = nb::cast<Runtime&>(self);
            return nb::ndarray<nb::numpy, float, nb::ndim<1>>(rt.master_data(unit),
                                                             {static_cast<size_t>(rt.shard_size(unit))}, self);
          },
          nb::arg("unit"))
      .def("publish_in_place", &Runtime::publish_in_place, nb::arg("unit"), nb::arg("version"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("published_version", &Runtime::published_version)
      .def("read_shard",
           [](const Runtime& rt, int unit) {
             auto out = new_f32(rt.shard_size(unit));
             rt.read_shard(unit, out.data(), static_cast<int64_t>(out.shape(0)));
             return out;
           })
      .def("stats",
           [](const Runtime& rt) {
             odc::Stats s = rt.stats();
             nb::dict d;
             d["slot_bytes"] = s.slot_bytes;
             d["master_bytes"] = s.master_bytes;
             d["accum_bytes"] = s.accum_bytes;
             d["segment_bytes"] = s.segment_bytes;
             d["pushes_received"] = s.pushes_received;
             d["bytes_received"] = s.bytes_received;
             d["device_bytes"] = s.device_bytes;
             return d;
           })
      .def("close", &Runtime::close, nb::arg("collective") = true, nb::call_guard<nb::gil_scoped_release>(),
           "collective: every rank is closing too, so NVSHMEM's collective teardown may run.");

  m.def("odc_cuda_built", &odc::cuda_built, "Whether the ODC runtime was built with the cuda_ipc transport.");
  m.def("odc_cuda_device_uuids", &odc::cuda_device_uuids,
        "UUIDs of the CUDA devices this process sees (empty without CUDA, a driver or a device).");
  m.def("odc_nvshmem_load", &odc::nvshmem_load, nb::arg("path"), nb::call_guard<nb::gil_scoped_release>(),
        "dlopen()s the NVSHMEM plugin once per process: '' when loaded, else why not.");
  m.def("odc_nvshmem_version", &odc::nvshmem_version, "'NVSHMEM x.y.z' of the loaded plugin, '' when none.");
  m.def("odc_reclaim_stale_segments", &odc::reclaim_stale_segments,
        "Unlinks /dev/shm/jaxodc_* segments whose owner process is gone; returns how many.");

  add_target(targets, "jaxodc_odc_gather", "cpu", odc::OdcGatherCpu);
  add_target(targets, "jaxodc_odc_gather_into", "cpu", odc::OdcGatherIntoCpu);
  add_target(targets, "jaxodc_odc_gather_pieces", "cpu", odc::OdcGatherPiecesCpu);
  add_target(targets, "jaxodc_odc_scatter", "cpu", odc::OdcScatterCpu);
  add_target(targets, "jaxodc_odc_scatter_range", "cpu", odc::OdcScatterRangeCpu);
  add_target(targets, "jaxodc_odc_store_master", "cpu", odc::OdcStoreMasterCpu);
  add_target(targets, "jaxodc_odc_allgather", "cpu", odc::OdcAllgatherCpu);
#ifdef JAXODC_WITH_CUDA
  add_target(targets, "jaxodc_odc_gather", "CUDA", odc::OdcGatherCuda);
  add_target(targets, "jaxodc_odc_gather_into", "CUDA", odc::OdcGatherIntoCuda);
  add_target(targets, "jaxodc_odc_scatter", "CUDA", odc::OdcScatterCuda);
  add_target(targets, "jaxodc_odc_gather_pieces", "CUDA", odc::OdcGatherPiecesCuda);
  add_target(targets, "jaxodc_odc_scatter_range", "CUDA", odc::OdcScatterRangeCuda);
  add_target(targets, "jaxodc_odc_allgather", "CUDA", odc::OdcAllgatherCuda);
#endif
}

}  // namespace jaxodc
