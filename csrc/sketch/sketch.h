// TAGC's gradient compression (sparsify -> index bitmap + count sketch -> peel), as kernels.
//
// A sender keeps the top `fraction` of |g + residual| (an exact selection; ties go to the lower
// index), carries the rest over as the next residual, and sends the support as a bitmap (bit i of
// word i / 32) plus a count sketch of the kept values: 3 rows of `width` buckets, element i adding
// sign_r(i) * value into bucket_r(i) of row r. Sketches add and bitmaps OR, so a receiver may sum
// several senders' and decode once. Decoding peels: a bucket holding exactly one unresolved index
// of the bitmap gives that value exactly, which is then removed from its other buckets; whatever
// never becomes alone in a bucket is estimated by the median of its three signed buckets. The
// element math below is `__host__ __device__`, shared by the CPU kernels and the CUDA ones.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __CUDACC__
#define JAXODC_HD __host__ __device__ __forceinline__
#else
#define JAXODC_HD inline
#endif

namespace jaxodc::sketch {

constexpr int kRows = 3;

// splitmix64's finaliser: a bijective 64-bit mix, so distinct (index, row) give independent-looking hashes.
JAXODC_HD uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

JAXODC_HD uint64_t element_hash(int64_t index, int row, uint64_t seed) {
  return mix64(static_cast<uint64_t>(index) * 0x9e3779b97f4a7c15ULL + seed + static_cast<uint64_t>(row) * 0xd1b54a32d192ed03ULL);
}

// Bucket of element `index` in row `row` (rows are separate tables, so an element's three buckets
// are always distinct) and its sign there.
JAXODC_HD int64_t bucket_of(int64_t index, int row, uint64_t seed, int64_t width) {
  // Lemire's multiply-shift on the hash's high 32 bits: uniform over [0, width) without a division.
  return static_cast<int64_t>(((element_hash(index, row, seed) >> 32) * static_cast<uint64_t>(width)) >> 32);
}

JAXODC_HD float sign_of(int64_t index, int row, uint64_t seed) {
  return (element_hash(index, row, seed) & 1u) ? -1.0f : 1.0f;
}

JAXODC_HD bool bit_set(const uint32_t* bitmap, int64_t i) { return (bitmap[i >> 5] >> (i & 31)) & 1u; }

JAXODC_HD uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
#endif
}

JAXODC_HD float bf16_bits_to_float(uint16_t h) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
#else
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Orders elements by |value| descending, then index ascending, as one integer: the magnitude's
// bits (non-negative floats order like their bit patterns) above the complemented index.
JAXODC_HD uint64_t rank_key(float value, int64_t index) {
  return (static_cast<uint64_t>(float_bits(value) & 0x7fffffffu) << 32) | (0xffffffffu - static_cast<uint32_t>(index));
}

// The selection is a radix select: a histogram over the keys' top 16 magnitude bits finds the bin
// holding the k-th largest key, and only that bin's keys are ordered exactly.
constexpr int kHistBins = 1 << 16;
JAXODC_HD int64_t hist_bin(uint64_t key) { return static_cast<int64_t>(key >> 47); }

// Element i once the threshold key is known: kept (true) or carried over in the residual. An exact
// zero is never kept: it carries nothing, and in the bitmap it would only load the sketch (an
// untouched embedding row, say).
JAXODC_HD bool apply_threshold(float acc, int64_t i, uint64_t threshold, float* kept, float* residual_out) {
  const bool keep = acc != 0.0f && rank_key(acc, i) >= threshold;
  kept[i] = keep ? acc : 0.0f;
  residual_out[i] = keep ? 0.0f : acc;
  return keep;
}

JAXODC_HD float median3(float a, float b, float c) {
  const float lo = a < b ? a : b, hi = a < b ? b : a;
  return c < lo ? lo : (c > hi ? hi : c);
}

// Words of a bitmap over n elements.
inline int64_t bitmap_words(int64_t n) { return (n + 31) / 32; }

// k = ceil(fraction * n), at least 1 (n > 0).
inline int64_t kept_count(int64_t n, double fraction) {
  const double k = fraction * static_cast<double>(n);
  const int64_t up = static_cast<int64_t>(k) + (static_cast<double>(static_cast<int64_t>(k)) < k ? 1 : 0);
  return up < 1 ? 1 : (up > n ? n : up);
}

// The radix select's host steps (sketch.cc), shared by the CPU and CUDA sparsify: the bin holding
// the k-th largest key and how many keys lie above it; the key of the given rank among candidates.
void find_bin(const int64_t* hist, int64_t k, int64_t* bin, int64_t* above);
uint64_t kth_key(std::vector<uint64_t>& candidates, int64_t rank);

// CPU kernels (sketch.cc).

// acc = grad + residual; keep the k = ceil(fraction * n) largest |acc| (ties: lower index first;
// exact zeros never): kept = acc there and 0 elsewhere, residual_out = acc - kept, bitmap = the
// kept positions. `grad` is fp32 or bf16 (`grad_bf16`); residual and outputs are fp32 (residual
// may be residual_out). Returns the number kept (k, less any zeros among the k largest).
int64_t sparsify(const void* grad, bool grad_bf16, const float* residual, int64_t n, double fraction, float* kept,
                 float* residual_out, uint32_t* bitmap);

// sketch[r * width + b] = sum over the bitmap's elements i with bucket_of(i, r) == b of sign * values[i].
void build(const float* values, const uint32_t* bitmap, int64_t n, int64_t width, uint64_t seed, float* sketch);

// Decodes a (summed) sketch over the bitmap's support into values (0 off the support; with `add`,
// the decoded values are added to `values` instead, which is otherwise left alone).
// counts[0] = elements recovered exactly by peeling, counts[1] = elements estimated by the median.
void peel(const float* sketch, const uint32_t* bitmap, int64_t n, int64_t width, uint64_t seed, float* values,
          int64_t* counts, bool add = false);

// Buckets per row of a sketch `ratio` times smaller than n fp32 values (n / ratio buckets in all),
// at least 1: TAGC's compression level, as jaxodc.ops.sketch.sketch_width computes it.
inline int64_t sketch_width(int64_t n, double ratio) {
  const double w = static_cast<double>(n) / (kRows * ratio);
  const int64_t up = static_cast<int64_t>(w) + (static_cast<double>(static_cast<int64_t>(w)) < w ? 1 : 0);
  return up < 1 ? 1 : up;
}

}  // namespace jaxodc::sketch
