// XLA FFI handlers of the ODC ops: CPU ones in ffi_cpu.cc, CUDA ones in ffi_cuda.cu (CUDA builds),
// registered by bindings.cc; and what both kinds share: the signatures and the argument checks.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "ffi/token.h"
#include "odc/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jaxodc::odc {

namespace ffi = xla::ffi;

XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcGatherCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcGatherIntoCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcGatherPiecesCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcScatterCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcScatterRangeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcStoreMasterCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcAllgatherCpu);
#ifdef JAXODC_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcGatherCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcGatherIntoCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcScatterCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcGatherPiecesCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcScatterRangeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OdcAllgatherCuda);
#endif

// One signature per op for the CPU and CUDA handlers (pass ffi::Ffi::Bind(), with the stream
// bound first for CUDA); they must match the ffi_call sites in jaxodc/ops/odc.py. Every op names
// its runtime by the `runtime` attribute (Runtime::handle) and its unit by `unit`.
// gather(local shard, version) -> full unit
template <typename Binding>
auto bind_gather(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>().template Attr<int64_t>("runtime").template Attr<int64_t>("unit");
}
// gather_into(persistent buffer, local shard, version) -> the buffer (aliased to the output)
template <typename Binding>
auto bind_gather_into(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>().template Ret<ffi::AnyBuffer>().template Attr<int64_t>("runtime")
      .template Attr<int64_t>("unit");
}
// scatter(local shard, full-unit gradient, version, token) -> token + 1 (ffi/token.h)
template <typename Binding>
auto bind_scatter(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>().template Arg<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("runtime").template Attr<int64_t>("unit");
}

// gather_pieces(local shard, version) -> one output per piece; `offsets`: each piece's first element
template <typename Binding>
auto bind_gather_pieces(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::Buffer<ffi::S32>>().RemainingRets()
      .template Attr<int64_t>("runtime").template Attr<int64_t>("unit")
      .template Attr<ffi::Span<const int64_t>>("offsets");
}
// scatter_range: scatter's signature, plus the first element `offset` of the pushed range
template <typename Binding>
auto bind_scatter_range(Binding&& b) {
  return bind_scatter(std::move(b)).template Attr<int64_t>("offset");
}

// allgather(head, values, version, exchange) -> (every rank's head, values summed over ranks)
template <typename Binding>
auto bind_allgather(Binding&& b) {
  return std::move(b).template Arg<ffi::Buffer<ffi::U32>>().template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>().template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::U32>>().template Ret<ffi::Buffer<ffi::F32>>().template Attr<int64_t>("runtime");
}

// The allgather's exchange and sum on host memory, for the CPU handler and (after its D2H copies)
// the CUDA one (ffi_cpu.cc): `head` h words of float64 bits, `values` n partial sums; fills
// head_rows (world x h words, by rank) and total (n floats: the sum over ranks in rank order in
// double, rounded once, so every rank gets the same bits). `exchange` false skips the peers.
void allgather_host(Runtime* rt, const uint32_t* head, int64_t h, const float* values, int64_t n, int64_t version,
                    bool exchange, uint32_t* head_rows, float* total);
// Resolves the allgather's runtime into *rt and checks its shapes (head of an even count of words;
// the results world x head words and as many floats as values), for both handlers.
ffi::Error check_allgather(int64_t runtime, const ffi::Buffer<ffi::U32>& head, const ffi::Buffer<ffi::F32>& values,
                           const ffi::Buffer<ffi::U32>& head_rows, const ffi::Buffer<ffi::F32>& total, Runtime** rt);

inline ffi::Error invalid(const std::string& msg) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg); }

// Runs a handler body, turning the runtime's exceptions into FFI errors (their message names the
// rank, unit and peer).
inline ffi::Error run_guarded(const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
  return ffi::Error::Success();
}

// Resolves the runtime, the unit and the compute dtype; `full_numel` is the full unit's size the
// caller passes (gathered output or gradient), or -1 to skip that check (range pushes).
inline ffi::Error check_call(const char* op, int64_t runtime, int64_t unit, ffi::DataType shard_type,
                             size_t shard_numel, ffi::DataType full_type, int64_t full_numel, Runtime** rt,
                             ElemType* type) {
  *rt = runtime_by_handle(runtime);
  if (*rt == nullptr)
    return invalid(std::string(op) + ": unit " + std::to_string(unit) + ": no live ODC runtime with handle " +
                   std::to_string(runtime) + " in this process (pass runtime=jaxodc.odc.Runtime(...); a closed "
                   "runtime's handle is dead)");
  if (unit < 0 || unit >= (*rt)->num_units())
    return invalid(std::string(op) + ": rank " + std::to_string((*rt)->rank()) + " has no unit " +
                   std::to_string(unit) + " (" + std::to_string((*rt)->num_units()) + " registered)");
  if (shard_type != ffi::DataType::F32)
    return invalid(std::string(op) + ": unit " + std::to_string(unit) + ": the local shard must be float32");
  if (static_cast<int64_t>(shard_numel) != (*rt)->shard_size(static_cast<int>(unit)))
    return invalid(std::string(op) + ": unit " + std::to_string(unit) + " on rank " + std::to_string((*rt)->rank()) +
                   ": local shard has " + std::to_string(shard_numel) + " elements, expected " +
                   std::to_string((*rt)->shard_size(static_cast<int>(unit))));
  if (full_type == ffi::DataType::F32) {
    *type = ElemType::kF32;
  } else if (full_type == ffi::DataType::BF16) {
    *type = ElemType::kBF16;
  } else {
    return invalid(std::string(op) + ": unit " + std::to_string(unit) + ": compute dtype must be float32 or bfloat16");
  }
  if (full_numel >= 0 && full_numel != (*rt)->numel(static_cast<int>(unit)))
    return invalid(std::string(op) + ": unit " + std::to_string(unit) + " has " +
                   std::to_string((*rt)->numel(static_cast<int>(unit))) + " elements, got an array of " +
                   std::to_string(full_numel));
  return ffi::Error::Success();
}

// check_call for a gather into `out` (the whole unit).
inline ffi::Error check_gather(int64_t runtime, int64_t unit, const ffi::AnyBuffer& local_shard,
                               const ffi::Result<ffi::AnyBuffer>& out, Runtime** rt, ElemType* type) {
  return check_call("odc.gather", runtime, unit, local_shard.element_type(), local_shard.element_count(),
                    out->element_type(), static_cast<int64_t>(out->element_count()), rt, type);
}

// check_call for a scatter, plus its token. A whole-unit push's gradient must hold the unit; a
// range push's range is checked by the runtime.
inline ffi::Error check_scatter(int64_t runtime, int64_t unit, const ffi::AnyBuffer& local_shard,
                                const ffi::AnyBuffer& grad, const ffi::AnyBuffer& token, Runtime** rt, ElemType* type,
                                bool range = false) {
  const char* op = range ? "odc.scatter_accumulate_range" : "odc.scatter_accumulate";
  if (auto err = check_call(op, runtime, unit, local_shard.element_type(), local_shard.element_count(),
                            grad.element_type(), range ? -1 : static_cast<int64_t>(grad.element_count()), rt, type);
      err.failure())
    return err;
  return check_token(token, op);
}

// The pieces of a gather_pieces call: each output's first element, size and data; every output of
// one dtype. Also resolves the runtime and the compute dtype (check_call).
struct Pieces {
  std::vector<int64_t> offsets, counts;
  std::vector<void*> ptrs;
};
inline ffi::Error check_pieces(int64_t runtime, int64_t unit, const ffi::AnyBuffer& local_shard, ffi::RemainingRets& outs,
                               ffi::Span<const int64_t> offsets, Pieces* pieces, Runtime** rt, ElemType* type) {
  if (outs.size() != offsets.size() || outs.size() == 0)
    return invalid("odc.gather_pieces: unit " + std::to_string(unit) + ": " + std::to_string(outs.size()) +
                   " outputs for " + std::to_string(offsets.size()) + " offsets");
  pieces->offsets.assign(offsets.begin(), offsets.end());
  ffi::DataType dtype = ffi::DataType::F32;
  for (size_t i = 0; i < outs.size(); ++i) {
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (out.has_error()) return out.error();
    if (i > 0 && (*out)->element_type() != dtype)
      return invalid("odc.gather_pieces: unit " + std::to_string(unit) + ": outputs of different dtypes");
    dtype = (*out)->element_type();
    pieces->counts.push_back(static_cast<int64_t>((*out)->element_count()));
    pieces->ptrs.push_back((*out)->untyped_data());
  }
  return check_call("odc.gather_pieces", runtime, unit, local_shard.element_type(), local_shard.element_count(), dtype,
                    -1, rt, type);
}

}  // namespace jaxodc::odc
