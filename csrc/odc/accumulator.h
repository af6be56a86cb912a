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
// The exact format: per element a two's-complement __int128 fixed-point number with kFracBits = 80
// fraction bits. A pushed fp32 value x is converted exactly when |x| >= 2^-57 (its lowest mantissa
// bit is then >= 2^-80) and rounded to the nearest multiple of 2^-80 (ties to even) below that, so
// each value's conversion depends on the value alone; integer addition is associative, and the
// finished sum is rounded once to fp32 (round to nearest even). The result is the correctly
// rounded sum of the converted values: within half an fp32 ulp of the exact sum plus at most
// pushes x 2^-81 from the sub-2^-57 roundings, at least as accurate as fp32 summation for every
// element whose gradients' magnitudes sum to >= ~2^-60.
//
// Range: a push is added to the fixed-point sums when every value in it is finite with |x| < 2^46
// and the unit's minibatch so far, counting each push by twice its largest |x|, stays below 2^46;
// the sums then cannot leave the int128 range (2^46 x 2^80 < 2^127). Values outside it (inf, NaN,
// |x| >= 2^46) go to a double spill array allocated for the unit on first need and added at the end;
// a push that would break the bound goes there whole. The spill keeps sums correct (IEEE inf / NaN,
// double precision) and reproducible except when one minibatch of a unit pushes magnitudes past
// ~2^45 -- a diverged run.
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
  static constexpr int kMaxExp = 46;  // values and the unit's push bound stay below 2^kMaxExp

  // n: elements of the owner's shard; `exact`: the exact format above, else fp32. Throws Error
  // naming `what` when the memory cannot be had.
  Accumulator(int64_t n, bool exact, const std::string& what);

  // Adds x[0, count) into elements [offset, offset + count); the caller checked the range and holds
  // the unit's lock. Not while the finished sum is lent out (lent()).
  void add(const float* x, int64_t offset, int64_t count);
  // The finished fp32 sum, in place (n floats at the start of the buffer); stays until clear().
  float* finish();
  bool lent() const { return finished_; }
  void clear();

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
  double bound_ = 0;  // sum over this minibatch's fixed-point pushes of 2 x their largest |x|
  std::unique_ptr<char, FreeDeleter> buf_;  // 64-byte aligned: Python wraps the fp32 sum without a copy
  std::unique_ptr<double[]> spill_;         // exact only: values outside the fixed-point range
};

}  // namespace jaxodc::odc
