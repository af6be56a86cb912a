// XLA FFI handlers of the gradient sketch: CPU ones in ffi_cpu.cc, CUDA ones in ffi_cuda.cu (CUDA
// builds), registered by bindings.cc; and what both share: the signatures and argument checks.
// sparsify: (grad f32|bf16 [n], residual f32 [n]) -> (kept f32 [n], residual f32 [n], bitmap u32 [words]),
//           attribute fraction (f64);
// build:    (values f32 [n], bitmap u32 [words]) -> sketch f32 [3, width], attribute seed (i64);
// peel:     (sketch f32 [3, width], bitmap u32 [words]) -> (values f32 [n], counts i32 [2]), attribute seed.
#pragma once

#include <string>
#include <utility>

#include "sketch/sketch.h"
#include "xla/ffi/api/ffi.h"

namespace jaxodc::sketch {

namespace ffi = xla::ffi;

XLA_FFI_DECLARE_HANDLER_SYMBOL(SparsifyCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BuildCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PeelCpu);
#ifdef JAXODC_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparsifyCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BuildCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PeelCuda);
#endif

// One signature per op for the CPU and CUDA handlers (pass ffi::Ffi::Bind(), with the stream bound
// first for CUDA); they must match the ffi_call sites in jaxodc/ops/sketch.py.
template <typename Binding>
auto bind_sparsify(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>().template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::U32>>().template Attr<double>("fraction");
}
// build and peel both take (float32 values or sketch, uint32 bitmap) and return float32 first.
template <typename Binding>
auto bind_over_bitmap(Binding&& b) {
  return std::move(b).template Arg<ffi::Buffer<ffi::F32>>().template Arg<ffi::Buffer<ffi::U32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}
template <typename Binding>
auto bind_build(Binding&& b) {
  return bind_over_bitmap(std::move(b)).template Attr<int64_t>("seed");
}
template <typename Binding>
auto bind_peel(Binding&& b) {
  return bind_over_bitmap(std::move(b)).template Ret<ffi::Buffer<ffi::S32>>().template Attr<int64_t>("seed");
}

inline ffi::Error invalid(const char* op, const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(op) + ": " + msg);
}

// The bitmap over n elements must hold exactly bitmap_words(n) words.
inline ffi::Error check_bitmap(const char* op, int64_t words, int64_t n) {
  if (words != bitmap_words(n))
    return invalid(op, "the bitmap holds " + std::to_string(words) + " words; " + std::to_string(n) +
                           " elements need " + std::to_string(bitmap_words(n)));
  return ffi::Error::Success();
}

inline ffi::Error check_sparsify(ffi::AnyBuffer grad, int64_t residual_numel, int64_t bitmap_numel, double fraction) {
  constexpr const char* op = "sketch_sparsify";
  const int64_t n = static_cast<int64_t>(grad.element_count());
  if (grad.element_type() != ffi::DataType::F32 && grad.element_type() != ffi::DataType::BF16)
    return invalid(op, "the gradient must be float32 or bfloat16");
  if (residual_numel != n)
    return invalid(op, "the residual has " + std::to_string(residual_numel) + " elements, the gradient " +
                           std::to_string(n));
  if (!(fraction > 0.0 && fraction <= 1.0))
    return invalid(op, "fraction must be in (0, 1], got " + std::to_string(fraction));
  if (n > 0xffffffffLL) return invalid(op, "more than 2^32 - 1 elements");
  return check_bitmap(op, bitmap_numel, n);
}

// A sketch is float32 [3, width >= 1]; returns the width through `width`.
inline ffi::Error check_sketch(const char* op, ffi::Span<const int64_t> dims, int64_t* width) {
  if (dims.size() != 2 || dims[0] != kRows || dims[1] < 1) return invalid(op, "the sketch must be float32 [3, width >= 1]");
  *width = dims[1];
  return ffi::Error::Success();
}

// build's arguments; gives the element count and the sketch width.
inline ffi::Error check_build(ffi::Buffer<ffi::F32>& values, ffi::Buffer<ffi::U32>& bitmap,
                              ffi::ResultBuffer<ffi::F32>& sketch, int64_t* n, int64_t* width) {
  *n = static_cast<int64_t>(values.element_count());
  if (auto err = check_bitmap("sketch_build", static_cast<int64_t>(bitmap.element_count()), *n); err.failure()) return err;
  return check_sketch("sketch_build", sketch->dimensions(), width);
}

// peel's arguments; gives the element count and the sketch width.
inline ffi::Error check_peel(ffi::Buffer<ffi::F32>& sketch, ffi::Buffer<ffi::U32>& bitmap,
                             ffi::ResultBuffer<ffi::F32>& values, ffi::ResultBuffer<ffi::S32>& counts, int64_t* n,
                             int64_t* width) {
  constexpr const char* op = "sketch_peel";
  *n = static_cast<int64_t>(values->element_count());
  if (auto err = check_sketch(op, sketch.dimensions(), width); err.failure()) return err;
  if (counts->element_count() != 2) return invalid(op, "counts must be int32 [2]");
  if (*n > 0x7fffffffLL) return invalid(op, "more than 2^31 - 1 elements");
  return check_bitmap(op, static_cast<int64_t>(bitmap.element_count()), *n);
}

}  // namespace jaxodc::sketch
