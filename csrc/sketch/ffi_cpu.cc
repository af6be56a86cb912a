// CPU handlers of the gradient sketch: the checks of ffi.h, then the kernels of sketch.cc.
#include "sketch/ffi.h"

namespace jaxodc::sketch {

namespace {

ffi::Error SparsifyImpl(ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> residual, ffi::ResultBuffer<ffi::F32> kept,
                        ffi::ResultBuffer<ffi::F32> residual_out, ffi::ResultBuffer<ffi::U32> bitmap, double fraction) {
  if (auto err = check_sparsify(grad, static_cast<int64_t>(residual.element_count()),
                                static_cast<int64_t>(bitmap->element_count()), fraction);
      err.failure())
    return err;
  sparsify(grad.untyped_data(), grad.element_type() == ffi::DataType::BF16, residual.typed_data(),
           static_cast<int64_t>(grad.element_count()), fraction, kept->typed_data(), residual_out->typed_data(),
           bitmap->typed_data());
  return ffi::Error::Success();
}

ffi::Error BuildImpl(ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::U32> bitmap, ffi::ResultBuffer<ffi::F32> sketch,
                     int64_t seed) {
  int64_t n = 0, width = 0;
  if (auto err = check_build(values, bitmap, sketch, &n, &width); err.failure()) return err;
  build(values.typed_data(), bitmap.typed_data(), n, width, static_cast<uint64_t>(seed), sketch->typed_data());
  return ffi::Error::Success();
}

ffi::Error PeelImpl(ffi::Buffer<ffi::F32> sketch, ffi::Buffer<ffi::U32> bitmap, ffi::ResultBuffer<ffi::F32> values,
                    ffi::ResultBuffer<ffi::S32> counts, int64_t seed) {
  int64_t n = 0, width = 0;
  if (auto err = check_peel(sketch, bitmap, values, counts, &n, &width); err.failure()) return err;
  int64_t peeled_estimated[2];
  peel(sketch.typed_data(), bitmap.typed_data(), n, width, static_cast<uint64_t>(seed), values->typed_data(),
       peeled_estimated);
  counts->typed_data()[0] = static_cast<int32_t>(peeled_estimated[0]);
  counts->typed_data()[1] = static_cast<int32_t>(peeled_estimated[1]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsifyCpu, SparsifyImpl, bind_sparsify(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BuildCpu, BuildImpl, bind_build(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PeelCpu, PeelImpl, bind_peel(ffi::Ffi::Bind()));

}  // namespace jaxodc::sketch
