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
static_assert(Accumulator::kMaxExp + Accumulator::kFracBits + 1 <= 127, "the fixed-point sums must fit an int128");

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// x * 2^kFracBits as an integer, x given by its bits with |x| < 2^kMaxExp: exact when the result
// is an integer (|x| >= 2^-57), else rounded to nearest, ties to even.
inline Fixed to_fixed(uint32_t b) {
  const uint32_t a = b & kAbs;
  const int e = static_cast<int>(a >> 23);
  const uint64_t m = (a & 0x7fffffu) | (e ? 0x800000u : 0u);
  const int sh = (e ? e : 1) - 150 + Accumulator::kFracBits;  // x = m * 2^((e ? e : 1) - 150)
  Fixed v;
  if (sh >= 0) {
    v = static_cast<Fixed>(m) << sh;
  } else if (sh <= -25) {
    v = 0;  // m < 2^24 <= half a grid step
  } else {
    const int r = -sh;
    const uint64_t q = m >> r, rem = m & ((uint64_t{1} << r) - 1), half = uint64_t{1} << (r - 1);
    v = static_cast<Fixed>(q + ((rem > half || (rem == half && (q & 1))) ? 1 : 0));
  }
  return (b >> 31) ? -v : v;
}

// s * 2^-kFracBits rounded to the nearest fp32, ties to even (one rounding: the 25 leading bits
// of |s| and a sticky bit decide it).
inline float to_float(Fixed s) {
  if (s == 0) return 0.0f;
  const bool neg = s < 0;
  const UFixed u = neg ? -static_cast<UFixed>(s) : static_cast<UFixed>(s);
  const uint64_t hi = static_cast<uint64_t>(u >> 64), lo = static_cast<uint64_t>(u);
  const int msb = hi ? 127 - __builtin_clzll(hi) : 63 - __builtin_clzll(lo);
  uint64_t mant;
  int exp2;  // the result is mant * 2^exp2 * 2^-kFracBits
  if (msb < 24) {
    mant = lo;
    exp2 = 0;
  } else {
    const int sh = msb - 24;  // keep 25 bits: 24 of mantissa and the rounding bit
    const uint64_t top = static_cast<uint64_t>(u >> sh);
    const bool sticky = (u & ((UFixed{1} << sh) - 1)) != 0;
    mant = top >> 1;
    if ((top & 1) && (sticky || (mant & 1))) ++mant;  // may carry to 2^24: still exact in fp32
    exp2 = sh + 1;
  }
  // 2^(exp2 - kFracBits) lies in [2^-80, 2^24]: a normal fp32, so the product is exact.
  const float r = static_cast<float>(mant) * float_of(static_cast<uint32_t>(127 + exp2 - Accumulator::kFracBits) << 23);
  return neg ? -r : r;
}

inline double to_double(Fixed s) { return std::ldexp(static_cast<double>(s), -Accumulator::kFracBits); }

}  // namespace

Accumulator::Accumulator(int64_t n, bool exact, const std::string& what) : n_(n), exact_(exact) {
  const size_t elem = exact ? sizeof(Fixed) : sizeof(float);
  bytes_ = static_cast<int64_t>((static_cast<size_t>(std::max<int64_t>(n, 1)) * elem + 63) / 64 * 64);
  buf_.reset(static_cast<char*>(std::aligned_alloc(64, static_cast<size_t>(bytes_))));
  if (!buf_)
    throw Error(what + ": cannot allocate the " + (exact ? "exact" : "fp32") + " gradient accumulator (" +
                std::to_string(bytes_) + " bytes)");
  std::memset(buf_.get(), 0, static_cast<size_t>(bytes_));
}

void Accumulator::add(const float* x, int64_t offset, int64_t count) {
  if (!exact_) {
    float* acc = reinterpret_cast<float*>(buf_.get()) + offset;
    for (int64_t i = 0; i < count; ++i) acc[i] += x[i];
    return;
  }
  // Pass 1: the largest in-range |x| (by its bits, which order like the magnitudes) and whether
  // any value is outside the range.
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
  if (bound_ + step >= std::ldexp(1.0, kMaxExp)) {
    add_spill(x, offset, count, /*all=*/true);
    return;
  }
  bound_ += step;
  Fixed* acc = reinterpret_cast<Fixed*>(buf_.get()) + offset;
  if (!out) {
    for (int64_t i = 0; i < count; ++i) acc[i] += to_fixed(xb[i]);
    return;
  }
  for (int64_t i = 0; i < count; ++i)
    if ((xb[i] & kAbs) < kLimitBits) acc[i] += to_fixed(xb[i]);
  add_spill(x, offset, count, /*all=*/false);
}

void Accumulator::add_spill(const float* x, int64_t offset, int64_t count, bool all) {
  if (!spill_) {
    spill_.reset(new double[static_cast<size_t>(n_)]);
    std::fill(spill_.get(), spill_.get() + n_, 0.0);
  }
  double* sp = spill_.get() + offset;
  for (int64_t i = 0; i < count; ++i)
    if (all || (bits_of(x[i]) & kAbs) >= kLimitBits) sp[i] += static_cast<double>(x[i]);
}

float* Accumulator::finish() {
  char* base = buf_.get();
  if (exact_ && !finished_) {
    // Element i's float lands at byte 4i, inside fixed-point elements <= i, all read already.
    for (int64_t i = 0; i < n_; ++i) {
      Fixed s;
      std::memcpy(&s, base + 16 * i, sizeof(s));
      const float r = spill_ && spill_[i] != 0.0 ? static_cast<float>(to_double(s) + spill_[i]) : to_float(s);
      std::memcpy(base + 4 * i, &r, 4);
    }
  }
  finished_ = true;
  return reinterpret_cast<float*>(base);
}

void Accumulator::clear() {
  std::memset(buf_.get(), 0, static_cast<size_t>(bytes_));
  spill_.reset();
  bound_ = 0;
  finished_ = false;
}

}  // namespace jaxodc::odc
