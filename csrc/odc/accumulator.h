// Internal to csrc/odc: one unit's gradient accumulator on its owner (accumulator.cc), summing the
// pushes of a minibatch either exactly, so that the sum cannot depend on the order the pushes
// arrive in (the default), or in plain fp32 in arrival order (the former behaviour).
//
// Why exact: pushes reach an owner in whatever order the network and the ranks' speeds give, and
// fp32 addition is not associative, so two runs of the same seed used to part in the last bits
// from the first few minibatches on. The other ways to a reproducible sum were worse here:
//   - ordered accumulation (hold a push until the one before it in a fixed order has landed)
//     couples the ranks again, which ODC exists to avoid, and with LB-Steal the microbatches a rank
//     pushes vary from run to run, so no fixed per-rank order exists;
//   - per-source partials summed in rank order cost W x shard of memory per unit and still depend
//     on which rank ran which microbatch under LB-Steal.
// An exact sum depends only on the multiset of pushed values: any arrival order and any split of
// the microbatches across ranks give the same bits.
//
// The exact format: per element a fixed-point integer X in units of 2^-kFracBits (kFracBits = 80),
// held as two int64 limbs, X = hi * 2^52 + lo. A pushed fp32 value x becomes x * 2^80 exactly when
// |x| >= 2^-57 (its lowest mantissa bit is then >= 2^-80) and rounded to the nearest integer (ties
// to even) below that, so each value's conversion depends on the value alone; X / 2^52 rounded to
// an integer is added to hi and the rest (|rest| <= 2^51) to lo. Integer addition is associative, so the limbs'
// value does not depend on the order; the finished sum is rounded once to fp32 (nearest, ties to
// even). The result is the correctly rounded sum of the converted values: within half an fp32 ulp
// of the exact sum, plus at most pushes x 2^-81 from the sub-2^-57 roundings -- at least as
// accurate as fp32 summation for every element whose gradients' magnitudes sum to >= ~2^-60.
// The conversion is plain double arithmetic (no branches, no 128-bit shifts), which compilers
// vectorise: the reason for two limbs rather than one __int128.
//
// Range: lo takes <= 2^51 per push, so after kCarryEvery (2^11) pushes of a unit its lo limbs are
// carried into hi (exactly: the value is unchanged). A push is added to the limbs when every value
// in it is finite with |x| < 2^kMaxExp (2^23) and the unit's minibatch so far, counting each push
// by twice its largest |x|, stays below 2^34, so hi cannot overflow (2^34 x 2^80 / 2^52 < 2^63).
// Values outside it (inf, NaN, |x| >= 2^23) go to a double spill array allocated for the unit on
// first need and added at the end; a push that would break the bound goes there whole. The spill
// keeps sums correct (IEEE inf / NaN, double precision) and reproducible except when one minibatch
// of a unit pushes magnitudes past ~2^33 -- a diverged run.
//
// Memory: the exact accumulator holds 16 bytes per element of the owner's shard (the fp32 one 4);
// the finished fp32 sum is written into the first quarter of the same buffer, so the gradient a
// caller reads in place (Runtime::grad_in_place) is a plain fp32 array there.
//
// Not covered: the CUDA owners' device accumulator (cuda_ipc, nvshmem pushes) still sums in fp32
// in arrival order; its part is added onto the exact host sum when the gradient is read.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

namespace jaxodc::odc {

class Accumulator {
 public:
  static constexpr int kFracBits = 80;
  static constexpr int kMaxExp = 23;    // values at or above 2^kMaxExp go to the spill
  static constexpr int kBoundExp = 34;  // the unit's push bound stays below 2^kBoundExp
  static constexpr int kCarryEvery = 1 << 11;  // pushes between carrying lo into hi
  static constexpr int kFinishBlock = 512;     // elements finished per block (finish())

  // n: elements of the owner's shard; `exact`: the exact format above, else fp32. Throws Error
  // naming `what` when the memory cannot be had.
  Accumulator(int64_t n, bool exact, const std::string& what);

  // Adds x[0, count) into elements [offset, offset + count); the caller checked the range and holds
  // the unit's lock. Not while the finished sum is lent out (lent()); a released one is zeroed first.
  void add(const float* x, int64_t offset, int64_t count);
  // The finished fp32 sum, in place (n floats at the start of the buffer); stays until release()
  // or clear().
  float* finish();
  bool lent() const { return finished_ && !released_; }
  void clear();
  // The reader is done with the finished sum: the buffer is zeroed before anything else uses it,
  // by settle() -- the owner's daemon calls it soon after, off the trainer's path -- or by the next
  // add() or finish(), whichever comes first. O(1).
  void release() { released_ = true; }
  void settle() {
    if (released_) clear();
  }

  bool exact() const { return exact_; }
  int64_t bytes() const { return bytes_; }

 private:
  struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
  };

  void add_spill(const float* x, int64_t offset, int64_t count, bool all);

  const int64_t n_;
  const bool exact_;
  int64_t bytes_ = 0;
  bool finished_ = false;
  bool released_ = false;
  void carry();

  double bound_ = 0;    // sum over this minibatch's fixed-point pushes of 2 x their largest |x|
  int64_t pushes_ = 0;  // fixed-point pushes since the last carry
  // Exact: the lo limbs, then the hi limbs; fp32: the sums. 64-byte aligned: Python wraps the
  // fp32 sum without a copy.
  std::unique_ptr<char, FreeDeleter> buf_;
  std::unique_ptr<double[]> spill_;         // exact only: values outside the fixed-point range
};

}  // namespace jaxodc::odc
