// The CPU FFI handler of the lock-step collectives: one target for every channel kind (the channel
// says which). Asynchronous: the handler posts and returns XLA a future that the group completes
// once every peer's data is in, so a rank waiting for a late peer never holds one of XLA's threads.
#include <string>

#include "lockstep/ffi.h"

namespace jaxodc::lockstep {

namespace {

ffi::Future failed(const std::string& msg) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(ffi::Error(ffi::ErrorCode::kInvalidArgument, msg));
  return future;
}

ffi::Future CollectiveCpuImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int64_t group, int64_t channel) {
  Group* g = group_by_handle(group);
  if (g == nullptr)
    return failed("lockstep collective on channel " + std::to_string(channel) + ": no live lockstep group with handle " +
                  std::to_string(group) + " in this process (a closed group's handle is dead)");
  if (channel < 0 || channel >= g->num_channels())
    return failed("lockstep collective: rank " + std::to_string(g->rank()) + " has no channel " +
                  std::to_string(channel) + " (" + std::to_string(g->num_channels()) + " channels)");
  const int c = static_cast<int>(channel);
  const std::string at = "lockstep collective on channel '" + g->channel(c).name + "' of rank " + std::to_string(g->rank());
  const bool bf16 = g->channel(c).dtype == lockstep::DType::kBF16;
  const ffi::DataType want = bf16 ? ffi::DataType::BF16 : ffi::DataType::F32;
  if (x.element_type() != want || out->element_type() != want)
    return failed(at + ": arrays must be " + (bf16 ? "bfloat16" : "float32") + " (the channel's dtype)");
  if (static_cast<int64_t>(x.element_count()) != g->in_elems(c) ||
      static_cast<int64_t>(out->element_count()) != g->out_elems(c))
    return failed(at + ": expected " + std::to_string(g->in_elems(c)) + " elements in and " +
                  std::to_string(g->out_elems(c)) + " out, got " + std::to_string(x.element_count()) + " and " +
                  std::to_string(out->element_count()));
  ffi::Promise promise;
  ffi::Future future(promise);
  g->start(c, x.untyped_data(), out->untyped_data(),
           [promise](const std::string& error) mutable {
             if (error.empty()) promise.SetAvailable();
             else promise.SetError(ffi::Error(ffi::ErrorCode::kInternal, error));
           });
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LockstepCpu, CollectiveCpuImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("group")
                                  .Attr<int64_t>("channel"));

}  // namespace jaxodc::lockstep
