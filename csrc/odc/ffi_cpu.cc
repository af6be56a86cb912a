// CPU handlers of the ODC ops: the runtime reads and writes XLA's host buffers directly.
#include <cstring>
#include <vector>

#include "odc/ffi.h"

namespace jaxodc::odc {

namespace {

// Reads the full unit from every owner (waiting for their publication of `version`).
ffi::Error GatherCpuImpl(ffi::AnyBuffer local_shard, ffi::Buffer<ffi::S32> version, ffi::Result<ffi::AnyBuffer> out,
                         int64_t runtime, int64_t unit) {
  Runtime* rt;
  ElemType type;
  if (auto err = check_gather(runtime, unit, local_shard, out, &rt, &type); err.failure()) return err;
  const int64_t v = static_cast<int64_t>(version.typed_data()[0]);
  return run_guarded([&] {
    rt->gather(static_cast<int>(unit), v, out->untyped_data(), type, static_cast<int64_t>(out->element_count()));
  });
}

// Same, into a caller-provided buffer aliased to the result (no fresh output allocation).
ffi::Error GatherIntoCpuImpl(ffi::AnyBuffer /*aliased_out*/, ffi::AnyBuffer local_shard, ffi::Buffer<ffi::S32> version,
                             ffi::Result<ffi::AnyBuffer> out, int64_t runtime, int64_t unit) {
  return GatherCpuImpl(local_shard, version, out, runtime, unit);
}

// Reads the unit from every owner straight into one output per piece (elements [offsets[i],
// offsets[i] + size of output i)): the unit is never whole in XLA's memory, and no slice of it is
// copied out of a whole one.
ffi::Error GatherPiecesCpuImpl(ffi::AnyBuffer local_shard, ffi::Buffer<ffi::S32> version, ffi::RemainingRets outs,
                               int64_t runtime, int64_t unit, ffi::Span<const int64_t> offsets) {
  Pieces pieces;
  Runtime* rt;
  ElemType type;
  if (auto err = check_pieces(runtime, unit, local_shard, outs, offsets, &pieces, &rt, &type); err.failure()) return err;
  const int64_t v = static_cast<int64_t>(version.typed_data()[0]);
  return run_guarded(
      [&] { rt->gather_pieces(static_cast<int>(unit), v, pieces.offsets, pieces.counts, pieces.ptrs, type); });
}

// Pushes each owner's slice of `grad` into its accumulator.
ffi::Error ScatterCpuImpl(ffi::AnyBuffer local_shard, ffi::AnyBuffer grad, ffi::Buffer<ffi::S32> version,
                          ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> token_out, int64_t runtime, int64_t unit) {
  Runtime* rt;
  ElemType type;
  if (auto err = check_scatter(runtime, unit, local_shard, grad, token, &rt, &type); err.failure()) return err;
  const int64_t v = static_cast<int64_t>(version.typed_data()[0]);
  advance_token(token, token_out);
  return run_guarded([&] {
    rt->scatter_accumulate(static_cast<int>(unit), v, grad.untyped_data(), type,
                           static_cast<int64_t>(grad.element_count()));
  });
}

// Pushes elements [offset, offset + numel(grad)) of the unit (one parameter of it, say) to their
// owners, so a unit's gradient never needs concatenating into one buffer.
ffi::Error ScatterRangeCpuImpl(ffi::AnyBuffer local_shard, ffi::AnyBuffer grad, ffi::Buffer<ffi::S32> version,
                               ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> token_out, int64_t runtime,
                               int64_t unit, int64_t offset) {
  Runtime* rt;
  ElemType type;
  if (auto err = check_scatter(runtime, unit, local_shard, grad, token, &rt, &type, /*range=*/true); err.failure())
    return err;
  const int64_t v = static_cast<int64_t>(version.typed_data()[0]);
  advance_token(token, token_out);
  return run_guarded([&] {
    rt->scatter_accumulate_range(static_cast<int>(unit), v, offset, grad.untyped_data(), type,
                                 static_cast<int64_t>(grad.element_count()));
  });
}

// Writes `value` over my master shard of `unit`: the optimizer's new parameters, stored from inside
// its compiled program so that no unit's new shard outlives its store. Only between
// wait_complete(v) and publish_in_place(v + 1) (Runtime::master_data).
ffi::Error StoreMasterCpuImpl(ffi::AnyBuffer value, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> token_out,
                              int64_t runtime, int64_t unit) {
  Runtime* rt;
  ElemType type;
  if (auto err = check_call("odc.store_master", runtime, unit, value.element_type(), value.element_count(),
                            ffi::DataType::F32, -1, &rt, &type);
      err.failure())
    return err;
  if (auto err = check_token(token, "odc.store_master"); err.failure()) return err;
  advance_token(token, token_out);
  return run_guarded([&] {
    std::memcpy(rt->master_data(static_cast<int>(unit)), value.untyped_data(), value.element_count() * 4);
  });
}

// The minibatch's one exchange from inside the optimizer's program (Runtime::allgather): `head`
// carries float64 values as their raw bits (loss, token count: exact, whatever jax's x64 setting)
// and comes back as every rank's, by rank; `values` (the optimizer's partial sums) come back
// summed over ranks (allgather_host). `exchange` 0 skips the peers (a warm-up run): every rank's
// values are taken to be mine.
ffi::Error AllgatherCpuImpl(ffi::Buffer<ffi::U32> head, ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> version,
                            ffi::Buffer<ffi::S32> exchange, ffi::Result<ffi::Buffer<ffi::U32>> head_rows,
                            ffi::Result<ffi::Buffer<ffi::F32>> total, int64_t runtime) {
  Runtime* rt;
  if (auto err = check_allgather(runtime, head, values, *head_rows, *total, &rt); err.failure()) return err;
  const int64_t h = static_cast<int64_t>(head.element_count()), n = static_cast<int64_t>(values.element_count());
  return run_guarded([&] {
    allgather_host(rt, head.typed_data(), h, values.typed_data(), n, version.typed_data()[0],
                   exchange.typed_data()[0] != 0, head_rows->typed_data(), total->typed_data());
  });
}

}  // namespace

ffi::Error check_allgather(int64_t runtime, const ffi::Buffer<ffi::U32>& head, const ffi::Buffer<ffi::F32>& values,
                           const ffi::Buffer<ffi::U32>& head_rows_buf, const ffi::Buffer<ffi::F32>& total_buf, Runtime** rt) {
  *rt = runtime_by_handle(runtime);
  if (*rt == nullptr)
    return invalid("odc.allgather: no live ODC runtime with handle " + std::to_string(runtime) + " in this process");
  const int64_t h = static_cast<int64_t>(head.element_count()), n = static_cast<int64_t>(values.element_count());
  const int64_t head_rows = static_cast<int64_t>(head_rows_buf.element_count());
  const int64_t total = static_cast<int64_t>(total_buf.element_count()), w = (*rt)->world();
  if (h % 2 != 0 || head_rows != w * h || total != n)
    return invalid("odc.allgather: rank " + std::to_string((*rt)->rank()) + ": head of " + std::to_string(h) +
                   " words (even), head rows of " + std::to_string(head_rows) + " (expected " + std::to_string(w * h) +
                   "), total of " + std::to_string(total) + " (expected " + std::to_string(n) + ")");
  return ffi::Error::Success();
}

void allgather_host(Runtime* rt, const uint32_t* head, int64_t h, const float* values, int64_t n, int64_t version,
                    bool exchange, uint32_t* head_rows, float* total) {
  const int64_t w = rt->world(), k = h / 2, m = k + n;  // doubles per rank
  std::vector<double> mine(static_cast<size_t>(m));
  std::memcpy(mine.data(), head, static_cast<size_t>(k) * sizeof(double));
  for (int64_t i = 0; i < n; ++i) mine[k + i] = values[i];
  std::vector<double> rows;
  if (exchange) {
    rows = rt->allgather(version, mine);
  } else {
    rows.reserve(static_cast<size_t>(w * m));
    for (int64_t r = 0; r < w; ++r) rows.insert(rows.end(), mine.begin(), mine.end());
  }
  for (int64_t r = 0; r < w; ++r)
    std::memcpy(head_rows + r * h, rows.data() + r * m, static_cast<size_t>(k) * sizeof(double));
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0.0;
    for (int64_t r = 0; r < w; ++r) sum += rows[r * m + k + i];
    total[i] = static_cast<float>(sum);
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcAllgatherCpu, AllgatherCpuImpl, bind_allgather(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcStoreMasterCpu, StoreMasterCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("runtime")
                                  .Attr<int64_t>("unit"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcGatherCpu, GatherCpuImpl, bind_gather(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcGatherIntoCpu, GatherIntoCpuImpl, bind_gather_into(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcGatherPiecesCpu, GatherPiecesCpuImpl, bind_gather_pieces(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcScatterCpu, ScatterCpuImpl, bind_scatter(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OdcScatterRangeCpu, ScatterRangeCpuImpl, bind_scatter_range(ffi::Ffi::Bind()));

}  // namespace jaxodc::odc
