// CUDA handlers of the gradient sketch. The element math is sketch.h's, shared with the CPU
// kernels. sparsify runs the same radix select as the CPU: a histogram kernel, the bin's keys
// gathered on the device and ordered on the host, then a threshold kernel. build adds each kept
// element into its three buckets with atomics (so bucket sums are not bit-identical to the CPU's:
// float addition in another order). peel decodes on the host through staging copies: it is a
// sequential queue walk. Compiled in CI; never run on a GPU yet.
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "sketch/ffi.h"

namespace jaxodc::sketch {

namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("sketch (CUDA): ") + what + ": " + cudaGetErrorString(e));
}

// Device memory of one call, freed on the stream when the call returns.
struct Scratch {
  cudaStream_t stream;
  std::vector<void*> blocks;
  explicit Scratch(cudaStream_t s) : stream(s) {}
  ~Scratch() {
    for (void* p : blocks) cudaFreeAsync(p, stream);
  }
  template <class T>
  T* get(size_t count) {
    void* p = nullptr;
    check(cudaMallocAsync(&p, count * sizeof(T) + 1, stream), "cudaMallocAsync");
    blocks.push_back(p);
    return static_cast<T*>(p);
  }
};

__global__ void accumulate_kernel(const void* grad, bool bf16, const float* residual, int64_t n, float* acc,
                                  unsigned long long* hist) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(grad)[i]) : static_cast<const float*>(grad)[i];
    acc[i] = g + residual[i];
    atomicAdd(&hist[hist_bin(rank_key(acc[i], i))], 1ull);
  }
}

__global__ void gather_bin_kernel(const float* acc, int64_t n, int64_t bin, unsigned long long* count,
                                  unsigned long long* keys) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t key = rank_key(acc[i], i);
    if (hist_bin(key) == bin) keys[atomicAdd(count, 1ull)] = key;
  }
}

__global__ void threshold_kernel(int64_t n, uint64_t threshold, float* kept, float* residual_out, uint32_t* bitmap) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (apply_threshold(kept[i], i, threshold, kept, residual_out)) atomicOr(&bitmap[i >> 5], 1u << (i & 31));
  }
}

__global__ void build_kernel(const float* values, const uint32_t* bitmap, int64_t n, int64_t width, uint64_t seed,
                             float* sketch) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (!bit_set(bitmap, i)) continue;
    for (int r = 0; r < kRows; ++r)
      atomicAdd(&sketch[r * width + bucket_of(i, r, seed, width)], sign_of(i, r, seed) * values[i]);
  }
}

ffi::Error guarded(const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
  return ffi::Error::Success();
}

ffi::Error SparsifyCudaImpl(cudaStream_t stream, ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> residual,
                            ffi::ResultBuffer<ffi::F32> kept, ffi::ResultBuffer<ffi::F32> residual_out,
                            ffi::ResultBuffer<ffi::U32> bitmap, double fraction) {
  if (auto err = check_sparsify(grad, static_cast<int64_t>(residual.element_count()),
                                static_cast<int64_t>(bitmap->element_count()), fraction);
      err.failure())
    return err;
  const int64_t n = static_cast<int64_t>(grad.element_count());
  return guarded([&] {
    check(cudaMemsetAsync(bitmap->typed_data(), 0, static_cast<size_t>(bitmap_words(n)) * 4, stream), "memset");
    if (n == 0) return;
    Scratch scratch(stream);
    auto* hist = scratch.get<unsigned long long>(kHistBins);
    check(cudaMemsetAsync(hist, 0, kHistBins * sizeof(unsigned long long), stream), "memset");
    accumulate_kernel<<<grid_for(n), kThreads, 0, stream>>>(grad.untyped_data(), grad.element_type() == ffi::DataType::BF16,
                                                            residual.typed_data(), n, kept->typed_data(), hist);
    std::vector<unsigned long long> host_hist(kHistBins);
    check(cudaMemcpyAsync(host_hist.data(), hist, kHistBins * sizeof(unsigned long long), cudaMemcpyDeviceToHost,
                          stream), "histogram copy");
    check(cudaStreamSynchronize(stream), "histogram");
    std::vector<int64_t> counts(host_hist.begin(), host_hist.end());
    const int64_t k = kept_count(n, fraction);
    int64_t bin, above;
    find_bin(counts.data(), k, &bin, &above);
    auto* count = scratch.get<unsigned long long>(1);
    auto* keys = scratch.get<unsigned long long>(static_cast<size_t>(counts[bin]));
    check(cudaMemsetAsync(count, 0, sizeof(unsigned long long), stream), "memset");
    gather_bin_kernel<<<grid_for(n), kThreads, 0, stream>>>(kept->typed_data(), n, bin, count, keys);
    std::vector<uint64_t> candidates(static_cast<size_t>(counts[bin]));
    check(cudaMemcpyAsync(candidates.data(), keys, candidates.size() * 8, cudaMemcpyDeviceToHost, stream), "bin copy");
    check(cudaStreamSynchronize(stream), "gathering the bin");
    const uint64_t threshold = kth_key(candidates, k - above - 1);
    threshold_kernel<<<grid_for(n), kThreads, 0, stream>>>(n, threshold, kept->typed_data(), residual_out->typed_data(),
                                                           bitmap->typed_data());
    check(cudaGetLastError(), "sparsify kernels");
  });
}

ffi::Error BuildCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::U32> bitmap,
                         ffi::ResultBuffer<ffi::F32> sketch, int64_t seed) {
  int64_t n = 0, width = 0;
  if (auto err = check_build(values, bitmap, sketch, &n, &width); err.failure()) return err;
  return guarded([&] {
    check(cudaMemsetAsync(sketch->typed_data(), 0, static_cast<size_t>(kRows * width) * 4, stream), "memset");
    if (n > 0)
      build_kernel<<<grid_for(n), kThreads, 0, stream>>>(values.typed_data(), bitmap.typed_data(), n, width,
                                                         static_cast<uint64_t>(seed), sketch->typed_data());
    check(cudaGetLastError(), "build kernel");
  });
}

ffi::Error PeelCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> sketch, ffi::Buffer<ffi::U32> bitmap,
                        ffi::ResultBuffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> counts, int64_t seed) {
  int64_t n = 0, width = 0;
  if (auto err = check_peel(sketch, bitmap, values, counts, &n, &width); err.failure()) return err;
  return guarded([&] {
    std::vector<float> host_sketch(static_cast<size_t>(kRows * width)), host_values(static_cast<size_t>(n));
    std::vector<uint32_t> host_bitmap(static_cast<size_t>(bitmap_words(n)));
    check(cudaMemcpyAsync(host_sketch.data(), sketch.typed_data(), host_sketch.size() * 4, cudaMemcpyDeviceToHost,
                          stream), "sketch copy");
    check(cudaMemcpyAsync(host_bitmap.data(), bitmap.typed_data(), host_bitmap.size() * 4, cudaMemcpyDeviceToHost,
                          stream), "bitmap copy");
    check(cudaStreamSynchronize(stream), "staging the sketch");
    int64_t peeled_estimated[2];
    peel(host_sketch.data(), host_bitmap.data(), n, width, static_cast<uint64_t>(seed), host_values.data(),
         peeled_estimated);
    const int32_t host_counts[2] = {static_cast<int32_t>(peeled_estimated[0]), static_cast<int32_t>(peeled_estimated[1])};
    check(cudaMemcpyAsync(values->typed_data(), host_values.data(), host_values.size() * 4, cudaMemcpyHostToDevice,
                          stream), "values copy");
    check(cudaMemcpyAsync(counts->typed_data(), host_counts, sizeof(host_counts), cudaMemcpyHostToDevice, stream),
          "counts copy");
    check(cudaStreamSynchronize(stream), "returning the values");  // the host buffers die here
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsifyCuda, SparsifyCudaImpl,
                              bind_sparsify(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BuildCuda, BuildCudaImpl,
                              bind_build(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PeelCuda, PeelCudaImpl,
                              bind_peel(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

}  // namespace jaxodc::sketch
