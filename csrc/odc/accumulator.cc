// One unit's gradient accumulator on its owner: exact fixed-point or fp32 (accumulator.h).
#include "odc/accumulator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "common/sync.h"

namespace jaxodc::odc {

namespace {

using Fixed = __int128;
using UFixed = unsigned __int128;
constexpr uint32_t kAbs = 0x7fffffffu;
// The fp32 bits of 2^kMaxExp: finite values below it have smaller absolute bit patterns.
constexpr uint32_t kLimitBits = static_cast<uint32_t>(127 + Accumulator::kMaxExp) << 23;
constexpr int kLoBits = 52;
constexpr int64_t kLoMask = (int64_t{1} << kLoBits) - 1;
// |x| < 2^kMaxExp keeps floor(x * 2^80 / 2^52) below 2^51, where the magic-number conversions hold.
static_assert(Accumulator::kMaxExp + Accumulator::kFracBits - kLoBits <= 51, "hi limb of one value too wide");
static_assert(Accumulator::kBoundExp + Accumulator::kFracBits - kLoBits <= 62, "hi limbs' sum may overflow");
// After a carry lo is in [0, 2^52); each push adds at most 2^51 in magnitude.
static_assert(Accumulator::kCarryEvery <= (1 << 11), "lo limbs may overflow between carries");

constexpr double kMagic = 0x1.8p52;  // 1.5 * 2^52: (z + kMagic) - kMagic rounds |z| < 2^51 to an integer

inline int64_t bits_of(double x) {
  int64_t b;
  std::memcpy(&b, &x, 8);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// The exact sum's two hot loops are compiled twice, for AVX2 and for baseline x86-64, the one the
// CPU runs picked when the library loads: baseline SSE2 vectorises neither (it has no vector
// int64 <-> double conversions), AVX2 does. Same arithmetic, so the same bits, on either.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__CUDACC__)
#define JAXODC_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define JAXODC_VECTOR_CLONES
#endif

// Adds x[i] * 2^80 (rounded to an integer, ties to even, below 2^-57) to hi[i] * 2^52 + lo[i];
// every |x[i]| < 2^kMaxExp. Straight-line double arithmetic (every step exact but the one rounding
// of a sub-grid value), so the loop vectorises.
JAXODC_VECTOR_CLONES void add_fixed(const float* x, int64_t count, int64_t* lo, int64_t* hi) {
  const int64_t magic_bits = bits_of(kMagic);
  for (int64_t i = 0; i < count; ++i) {
    const double y = static_cast<double>(x[i]) * 0x1p80;  // exact; |y| < 2^103
    const double h = (y * 0x1p-52 + kMagic) - kMagic;      // y / 2^52 rounded to an integer, |h| <= 2^51
    const double l = y - h * 0x1p52;                       // exact: y's bits below 2^52, |l| <= 2^51
    hi[i] += bits_of(h + kMagic) - magic_bits;
    lo[i] += bits_of(l + kMagic) - magic_bits;  // rounds l to an integer (only a sub-grid y has a fraction)
  }
}

// s * 2^-80 rounded to the nearest fp32, ties to even: the 62 leading bits of |s| with a sticky
// bit below them, converted by the hardware (one rounding), then scaled by a power of two (exact:
// the result is >= 2^-80, a normal fp32).
inline float to_float(Fixed s) {
  const bool neg = s < 0;
  const UFixed u = neg ? -static_cast<UFixed>(s) : static_cast<UFixed>(s);
  const uint64_t hi = static_cast<uint64_t>(u >> 64), lo = static_cast<uint64_t>(u);
  const int msb = hi ? 127 - __builtin_clzll(hi) : (lo ? 63 - __builtin_clzll(lo) : 0);
  const int k = msb > 61 ? msb - 61 : 0;
  const uint64_t t = static_cast<uint64_t>(u >> k) | ((u & ((UFixed{1} << k) - 1)) != 0 ? 1 : 0);
  const float r = static_cast<float>(static_cast<int64_t>(t)) *
                  float_of(static_cast<uint32_t>(127 + k - Accumulator::kFracBits) << 23);
  return neg ? -r : r;
}

inline Fixed value_of(int64_t lo, int64_t hi) { return (static_cast<Fixed>(hi) << kLoBits) + lo; }

inline double double_of(int64_t b) {
  double x;
  std::memcpy(&x, &b, 8);
  return x;
}

// to_float of hi * 2^52 + lo for lo in [0, 2^52) and |hi| < 2^53 (sums below 2^25: the common
// case) in double arithmetic: s + e is the value exactly (Fast2Sum: |a| >= |b| or a = 0); s
// rounded to odd when e != 0, then to fp32, is the correctly rounded value (53 >= 24 + 2 bits).
inline float to_float_small(int64_t lo, int64_t hi) {
  const double a = static_cast<double>(hi) * 0x1p-28, b = static_cast<double>(lo) * 0x1p-80;
  const double s = a + b, e = b - (s - a);
  int64_t bs = bits_of(s);
  if (e != 0 && !(bs & 1)) bs += (e > 0) == (s > 0) ? 1 : -1;  // the odd neighbour toward the value
  return static_cast<float>(double_of(bs));
}

// to_float_small for |hi| < 2^51, with the integer-to-double conversions done by magic numbers
// (integer adds and bit casts, which vectorise on any x86-64; SSE2 has no int64 -> double) and the
// rounding to odd without a branch. The same arithmetic, so the same bits.
inline float to_float_narrow(int64_t lo, int64_t hi) {
  const double a = (double_of(hi + bits_of(kMagic)) - kMagic) * 0x1p-28;                // hi exactly
  const double b = (double_of(lo | bits_of(0x1p52)) - 0x1p52) * 0x1p-80;                 // lo exactly
  const double s = a + b, e = b - (s - a);
  const int64_t bs = bits_of(s);
  const int64_t odd = static_cast<int64_t>(e != 0) & ~bs & 1;                             // round to odd
  const int64_t toward = 2 * static_cast<int64_t>((e > 0) == (s > 0)) - 1;
  return static_cast<float>(double_of(bs + odd * toward));
}

// finish()'s branch-free path over one block: out[j] for every element with |hi| < 2^51 (sums
// below 2^23); returns nonzero when some element is wider, and the caller redoes the block.
JAXODC_VECTOR_CLONES uint64_t finish_narrow(const int64_t* lo, const int64_t* hi, int64_t m, float* out) {
  uint64_t wide = 0;
  for (int64_t j = 0; j < m; ++j) {
    const int64_t l = lo[j] & kLoMask, h = hi[j] + (lo[j] >> kLoBits);  // carried: l in [0, 2^52)
    wide |= static_cast<uint64_t>(h + (int64_t{1} << 51)) >> 52;        // nonzero unless |h| < 2^51
    out[j] = to_float_narrow(l, h);
  }
  return wide;
}

}  // namespace

Accumulator::Accumulator(int64_t n, bool exact, const std::string& what) : n_(n), exact_(exact) {
  const size_t elem = exact ? 16 : sizeof(float);
  bytes_ = static_cast<int64_t>((static_cast<size_t>(std::max<int64_t>(n, 1)) * elem + 63) / 64 * 64);
  buf_.reset(static_cast<char*>(std::aligned_alloc(64, static_cast<size_t>(bytes_))));
  if (!buf_)
    throw Error(what + ": cannot allocate the " + (exact ? "exact" : "fp32") + " gradient accumulator (" +
                std::to_string(bytes_) + " bytes)");
  std::memset(buf_.get(), 0, static_cast<size_t>(bytes_));
}

void Accumulator::add(const float* x, int64_t offset, int64_t count) {
  settle();
  if (!exact_) {
    float* acc = reinterpret_cast<float*>(buf_.get()) + offset;
    for (int64_t i = 0; i < count; ++i) acc[i] += x[i];
    return;
  }
  // The largest in-range |x| (by its bits, which order like the magnitudes) and whether any value
  // is outside the range.
  uint32_t top = 0, out = 0;
  const auto* xb = reinterpret_cast<const uint32_t*>(x);
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t a = xb[i] & kAbs;
    const bool in = a < kLimitBits;
    top = std::max(top, in ? a : 0u);
    out |= in ? 0u : 1u;
  }
  // Every in-range value of the push is < 2^(exponent of top + 1).
  const double step = top ? std::ldexp(2.0, static_cast<int>(top >> 23) - 127) : 0.0;
  if (bound_ + step >= std::ldexp(1.0, kBoundExp)) {
    add_spill(x, offset, count, /*all=*/true);
    return;
  }
  bound_ += step;
  if (++pushes_ > kCarryEvery) carry();
  int64_t* lo = reinterpret_cast<int64_t*>(buf_.get());
  int64_t* hi = lo + n_;
  if (!out) {
    add_fixed(x, count, lo + offset, hi + offset);
    return;
  }
  for (int64_t i = 0; i < count; ++i)  // rare: only pushes holding inf, NaN or huge values
    if ((xb[i] & kAbs) < kLimitBits) add_fixed(x + i, 1, lo + offset + i, hi + offset + i);
  add_spill(x, offset, count, /*all=*/false);
}

void Accumulator::carry() {
  int64_t* lo = reinterpret_cast<int64_t*>(buf_.get());
  int64_t* hi = lo + n_;
  for (int64_t i = 0; i < n_; ++i) {
    hi[i] += lo[i] >> kLoBits;  // floor: the value hi * 2^52 + lo is unchanged
    lo[i] &= kLoMask;
  }
  pushes_ = 1;
}

void Accumulator::add_spill(const float* x, int64_t offset, int64_t count, bool all) {
  if (!spill_) {
    spill_.reset(new double[static_cast<size_t>(n_)]);
    std::fill(spill_.get(), spill_.get() + n_, 0.0);
  }
  double* sp = spill_.get() + offset;
  const auto* xb = reinterpret_cast<const uint32_t*>(x);
  for (int64_t i = 0; i < count; ++i)
    if (all || (xb[i] & kAbs) >= kLimitBits) sp[i] += static_cast<double>(x[i]);
}

float* Accumulator::finish() {
  settle();
  char* base = buf_.get();
  if (exact_ && !finished_) {
    const int64_t* lo = reinterpret_cast<const int64_t*>(base);
    const int64_t* hi = lo + n_;
    // Block by block through a local buffer: block k's floats land in the lo limbs of elements
    // before its start (k >= 1) or of its own elements (k = 0), read by then. Each block first
    // takes the branch-free path (finish_narrow); a block with a sum of 2^23 or more or with
    // spilled values is redone element by element.
    alignas(64) float out[kFinishBlock];
    for (int64_t i0 = 0; i0 < n_; i0 += kFinishBlock) {
      const int64_t m = std::min<int64_t>(kFinishBlock, n_ - i0);
      if (finish_narrow(lo + i0, hi + i0, m, out) != 0 || spill_) {
        for (int64_t j = 0; j < m; ++j) {
          const int64_t i = i0 + j, l = lo[i] & kLoMask, h = hi[i] + (lo[i] >> kLoBits);  // carried: l in [0, 2^52)
          if (spill_ && spill_[i] != 0.0)
            out[j] = static_cast<float>(std::ldexp(static_cast<double>(value_of(l, h)), -kFracBits) + spill_[i]);
          else if (h > -(int64_t{1} << 53) && h < (int64_t{1} << 53))
            out[j] = to_float_small(l, h);
          else
            out[j] = to_float(value_of(l, h));
        }
      }
      std::memcpy(base + 4 * i0, out, static_cast<size_t>(m) * 4);
    }
  }
  finished_ = true;
  return reinterpret_cast<float*>(base);
}

void Accumulator::clear() {
  std::memset(buf_.get(), 0, static_cast<size_t>(bytes_));
  spill_.reset();
  bound_ = 0;
  pushes_ = 0;
  finished_ = false;
  released_ = false;
}

}  // namespace jaxodc::odc
