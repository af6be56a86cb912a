// CPU handlers of the gradient sketch: shape and dtype checks, then the kernels of sketch.cc.
#include <string>
#include <utility>

#include "sketch/ffi.h"
#include "sketch/sketch.h"

namespace jaxodc::sketch {

namespace {

ffi::Error invalid(const char* op, const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(op) + ": " + msg);
}

// The bitmap over n elements must hold exactly bitmap_words(n) words.
ffi::Error check_bitmap(const char* op, int64_t words, int64_t n) {
  if (words != bitmap_words(n))
    return invalid(op, "the bitmap holds " + std::to_string(words) + " words; " + std::to_string(n) +
                           " elements need " + std::to_string(bitmap_words(n)));
  return ffi::Error::Success();
}

ffi::Error SparsifyImpl(ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> residual, ffi::ResultBuffer<ffi::F32> kept,
                        ffi::ResultBuffer<ffi::F32> residual_out, ffi::ResultBuffer<ffi::U32> bitmap, double fraction) {
  constexpr const char* op = "sketch_sparsify";
  const int64_t n = static_cast<int64_t>(grad.element_count());
  if (grad.element_type() != ffi::DataType::F32 && grad.element_type() != ffi::DataType::BF16)
    return invalid(op, "the gradient must be float32 or bfloat16");
  if (static_cast<int64_t>(residual.element_count()) != n)
    return invalid(op, "the residual has " + std::to_string(residual.element_count()) + " elements, the gradient " +
                           std::to_string(n));
  if (!(fraction > 0.0 && fraction <= 1.0))
    return invalid(op, "fraction must be in (0, 1], got " + std::to_string(fraction));
  if (n > 0xffffffffLL) return invalid(op, "more than 2^32 - 1 elements");
  if (auto err = check_bitmap(op, static_cast<int64_t>(bitmap->element_count()), n); err.failure()) return err;
  sparsify(grad.untyped_data(), grad.element_type() == ffi::DataType::BF16, residual.typed_data(), n, fraction,
           kept->typed_data(), residual_out->typed_data(), bitmap->typed_data());
  return ffi::Error::Success();
}

ffi::Error BuildImpl(ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::U32> bitmap, ffi::ResultBuffer<ffi::F32> sketch,
                     int64_t seed) {
  constexpr const char* op = "sketch_build";
  const int64_t n = static_cast<int64_t>(values.element_count());
  if (auto err = check_bitmap(op, static_cast<int64_t>(bitmap.element_count()), n); err.failure()) return err;
  const auto dims = sketch->dimensions();
  if (dims.size() != 2 || dims[0] != kRows || dims[1] < 1)
    return invalid(op, "the sketch must be float32 [3, width >= 1]");
  build(values.typed_data(), bitmap.typed_data(), n, dims[1], static_cast<uint64_t>(seed), sketch->typed_data());
  return ffi::Error::Success();
}

ffi::Error PeelImpl(ffi::Buffer<ffi::F32> sketch, ffi::Buffer<ffi::U32> bitmap, ffi::ResultBuffer<ffi::F32> values,
                    ffi::ResultBuffer<ffi::S32> counts, int64_t seed) {
  constexpr const char* op = "sketch_peel";
  const auto dims = sketch.dimensions();
  if (dims.size() != 2 || dims[0] != kRows || dims[1] < 1)
    return invalid(op, "the sketch must be float32 [3, width >= 1]");
  const int64_t n = static_cast<int64_t>(values->element_count());
  if (auto err = check_bitmap(op, static_cast<int64_t>(bitmap.element_count()), n); err.failure()) return err;
  if (counts->element_count() != 2) return invalid(op, "counts must be int32 [2]");
  if (n > 0x7fffffffLL) return invalid(op, "more than 2^31 - 1 elements");
  int64_t peeled_estimated[2];
  peel(sketch.typed_data(), bitmap.typed_data(), n, dims[1], static_cast<uint64_t>(seed), values->typed_data(),
       peeled_estimated);
  counts->typed_data()[0] = static_cast<int32_t>(peeled_estimated[0]);
  counts->typed_data()[1] = static_cast<int32_t>(peeled_estimated[1]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsifyCpu, SparsifyImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Attr<double>("fraction"));

// build and peel both take (float32 values or sketch, uint32 bitmap) and return float32 first.
template <typename Binding>
auto bind_over_bitmap(Binding&& b) {
  return std::move(b).template Arg<ffi::Buffer<ffi::F32>>().template Arg<ffi::Buffer<ffi::U32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(BuildCpu, BuildImpl, bind_over_bitmap(ffi::Ffi::Bind()).Attr<int64_t>("seed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PeelCpu, PeelImpl,
                              bind_over_bitmap(ffi::Ffi::Bind()).Ret<ffi::Buffer<ffi::S32>>().Attr<int64_t>("seed"));

}  // namespace jaxodc::sketch
