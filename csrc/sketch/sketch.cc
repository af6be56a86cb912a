// CPU kernels of the gradient sketch (sketch.h).
#include "sketch/sketch.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>


namespace jaxodc::sketch {

uint64_t kth_key(std::vector<uint64_t>& candidates, int64_t rank) {
  const auto nth = candidates.begin() + rank;
  std::nth_element(candidates.begin(), nth, candidates.end(), std::greater<uint64_t>());
  return *nth;
}

void find_bin(const int64_t* hist, int64_t k, int64_t* bin, int64_t* above) {
  *above = 0;
  *bin = kHistBins - 1;
  while (*above + hist[*bin] < k) *above += hist[(*bin)--];
}

int64_t sparsify(const void* grad, bool grad_bf16, const float* residual, int64_t n, double fraction, float* kept,
                 float* residual_out, uint32_t* bitmap) {
  std::memset(bitmap, 0, static_cast<size_t>(bitmap_words(n)) * 4);
  if (n == 0) return 0;
  const int64_t k = kept_count(n, fraction);
  std::vector<int64_t> hist(kHistBins, 0);
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad_bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(grad)[i])
                              : static_cast<const float*>(grad)[i];
    const float acc = g + residual[i];
    kept[i] = acc;  // staged here until the threshold is known
    ++hist[hist_bin(rank_key(acc, i))];
  }
  int64_t bin, above;
  find_bin(hist.data(), k, &bin, &above);
  std::vector<uint64_t> candidates;
  candidates.reserve(static_cast<size_t>(hist[bin]));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t key = rank_key(kept[i], i);
    if (hist_bin(key) == bin) candidates.push_back(key);
  }
  const uint64_t threshold = kth_key(candidates, k - above - 1);  // exactly k keys are >= it
  int64_t kept_n = 0;
  for (int64_t i = 0; i < n; ++i)
    if (apply_threshold(kept[i], i, threshold, kept, residual_out)) {
      bitmap[i >> 5] |= 1u << (i & 31);
      ++kept_n;
    }
  return kept_n;
}

void build(const float* values, const uint32_t* bitmap, int64_t n, int64_t width, uint64_t seed, float* sketch) {
  std::fill(sketch, sketch + kRows * width, 0.0f);
  const int64_t words = bitmap_words(n);
  for (int64_t w = 0; w < words; ++w) {
    for (uint32_t bits = bitmap[w]; bits != 0; bits &= bits - 1) {
      const int64_t i = w * 32 + __builtin_ctz(bits);
      if (i >= n) break;
      for (int r = 0; r < kRows; ++r)
        sketch[r * width + bucket_of(i, r, seed, width)] += sign_of(i, r, seed) * values[i];
    }
  }
}

void peel(const float* sketch, const uint32_t* bitmap, int64_t n, int64_t width, uint64_t seed, float* values,
          int64_t* counts, bool add) {
  if (!add) std::fill(values, values + n, 0.0f);
  const int64_t buckets = kRows * width;
  // What is left in each bucket: its value (double: peeling subtracts many times), how many
  // unresolved elements it holds and the XOR of their indices (the index itself once it holds one).
  std::vector<double> left(sketch, sketch + buckets);
  std::vector<int32_t> count(static_cast<size_t>(buckets), 0);
  std::vector<uint64_t> xor_index(static_cast<size_t>(buckets), 0);
  std::vector<int64_t> support;
  const int64_t words = bitmap_words(n);
  for (int64_t w = 0; w < words; ++w) {
    for (uint32_t bits = bitmap[w]; bits != 0; bits &= bits - 1) {
      const int64_t i = w * 32 + __builtin_ctz(bits);
      if (i >= n) break;
      support.push_back(i);
      for (int r = 0; r < kRows; ++r) {
        const int64_t b = r * width + bucket_of(i, r, seed, width);
        ++count[b];
        xor_index[b] ^= static_cast<uint64_t>(i);
      }
    }
  }
  std::vector<uint8_t> resolved(static_cast<size_t>(n), 0);
  std::vector<int64_t> queue;
  for (int64_t b = 0; b < buckets; ++b)
    if (count[b] == 1) queue.push_back(b);
  int64_t peeled = 0;
  for (size_t head = 0; head < queue.size(); ++head) {
    const int64_t q = queue[head];
    if (count[q] != 1) continue;  // emptied since it was queued
    const int64_t i = static_cast<int64_t>(xor_index[q]);
    const double v = sign_of(i, static_cast<int>(q / width), seed) * left[q];
    values[i] = add ? values[i] + static_cast<float>(v) : static_cast<float>(v);
    resolved[i] = 1;
    ++peeled;
    for (int r = 0; r < kRows; ++r) {
      const int64_t b = r * width + bucket_of(i, r, seed, width);
      left[b] -= sign_of(i, r, seed) * v;
      xor_index[b] ^= static_cast<uint64_t>(i);
      if (--count[b] == 1) queue.push_back(b);
    }
  }
  // The rest never stood alone in a bucket: the median of its buckets, net of what was peeled.
  int64_t estimated = 0;
  for (int64_t i : support) {
    if (resolved[i]) continue;
    float est[kRows];
    for (int r = 0; r < kRows; ++r)
      est[r] = sign_of(i, r, seed) * static_cast<float>(left[r * width + bucket_of(i, r, seed, width)]);
    const float m = median3(est[0], est[1], est[2]);
    values[i] = add ? values[i] + m : m;
    ++estimated;
  }
  counts[0] = peeled;
  counts[1] = estimated;
}

}  // namespace jaxodc::sketch
