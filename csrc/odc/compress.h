// Internal to csrc/odc: TAGC's compressed push (compress.cc). Ranges of a unit's flat vector are
// registered with a setting (kept fraction, sketch ratio, hash seed); a push to a remote owner
// sends each registered range's part as an index bitmap + count sketch instead of dense fp32:
//
//   acc = grad + residual; keep the top `fraction` of |acc| exactly (sketch::sparsify);
//   payload = bitmap (bit i: element i kept) ++ 3 x width sketch of the kept values;
//   residual = acc - what the owner will decode (the sender peels its own payload: the decoder is
//   deterministic, so error feedback covers the sketch's estimates too, not only the dropped values).
//
// The owner's daemon peels each push as it drains the slot and adds the result into its
// accumulator, like a dense push (accumulator.h) (decode per push: sums of several pushes'
// sketches would hold the union of their supports, which outgrows the sketch after a few
// microbatches; bench/sketch.py --owner measures it). A chunk's payload fits one receive slot, so slots and server memory stay as they are.
// Ranges registered with compress = false are only counted (wire bytes of what a setting would
// compress, in dense runs).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace jaxodc::odc {

struct CompressedRange {
  int unit = 0;
  int64_t offset = 0, size = 0;
  double fraction = 1.0, ratio = 2.0;
  uint64_t seed = 0;
  bool compress = true;
  std::vector<float> residual;  // error feedback, one per element of the range (zero at first)
};

// Per-unit traffic of this rank as a worker (pushes to other owners) and as an owner (decoding).
struct UnitTraffic {
  int64_t wire_bytes = 0;         // gradient bytes pushed to other ranks (all of the unit, as pushed: fp32 or bf16)
  int64_t range_bytes = 0;        // of those, the registered ranges' bytes
  int64_t range_elems = 0;        // elements of registered ranges pushed to other ranks
  int64_t kept_elems = 0;         // of those, the ones kept by sparsification
  int64_t peeled = 0, estimated = 0;  // as an owner: decoded exactly / by the median estimate
};

// A compressed chunk: its element count, sketch width and seed travel in the slot header / wire
// header; the payload is the bitmap then the sketch.
struct SketchChunk {
  int64_t count = 0, width = 0;
  uint64_t seed = 0;
  std::vector<char> payload;
};

int64_t sketch_payload_bytes(int64_t count, int64_t width);

class Compressor {
 public:
  // Registers [offset, offset + size) of `unit` (numel elements); throws naming the unit and range
  // on a bad setting or an overlap with a registered range.
  void add(int unit, int64_t numel, int64_t offset, int64_t size, double fraction, double ratio, uint64_t seed,
           bool compress);
  bool empty() const { return ranges_.empty(); }
  // Called at the first push: the ranges are read without a lock from then on.
  void freeze() { frozen_.store(true); }

  // Calls f(lo, hi, range) for consecutive pieces covering [a, b) of `unit`, each inside one
  // registered range (range non-null) or outside all of them (null).
  template <class F>
  void split(int unit, int64_t a, int64_t b, F&& f) {
    auto it = ranges_.upper_bound({unit, a});
    if (it != ranges_.begin() && std::prev(it)->first.first == unit) --it;
    int64_t at = a;
    for (; it != ranges_.end() && it->first.first == unit && at < b; ++it) {
      CompressedRange& r = *it->second;
      if (r.offset + r.size <= at) continue;
      if (r.offset >= b) break;
      if (r.offset > at) f(at, r.offset, static_cast<CompressedRange*>(nullptr));
      const int64_t hi = std::min(b, r.offset + r.size);
      f(std::max(at, r.offset), hi, &r);
      at = hi;
    }
    if (at < b) f(at, b, static_cast<CompressedRange*>(nullptr));
  }

  // The largest chunk of a range's elements whose payload fits `slot_bytes`.
  static int64_t chunk_elems(const CompressedRange& r, int64_t slot_bytes);

  // Encodes elements [lo, lo + count) of the unit (inside range r; `src` holds them in `type`),
  // updating r's residual there. Returns the kept count.
  static int64_t encode(CompressedRange& r, int64_t lo, const char* src, ElemType type, int64_t count,
                        SketchChunk& out);

  // A copy of the error-feedback residual of the range registered at (unit, offset).
  std::vector<float> residual(int unit, int64_t offset) const;
  // Replaces that residual (a restored checkpoint's); throws unless `n` is the range's size. Only
  // between pushes: the pushes of this rank rewrite it without a lock.
  void set_residual(int unit, int64_t offset, const float* values, int64_t n);

  UnitTraffic traffic(int unit);
  void count_push(int unit, int64_t bytes, const CompressedRange* r, int64_t elems, int64_t kept);
  void count_decoded(int unit, int64_t peeled, int64_t estimated);

 private:
  std::map<std::pair<int, int64_t>, std::unique_ptr<CompressedRange>> ranges_;  // by (unit, offset)
  std::atomic<bool> frozen_{false};
  std::mutex traffic_mu_;
  std::map<int, UnitTraffic> traffic_;
};

// Owner side: the decoded values of a chunk's payload into out[0, count) (0 off its support);
// they depend on the payload alone.
void decode(const char* payload, int64_t count, int64_t width, uint64_t seed, float* out, int64_t* peeled,
            int64_t* estimated);

}  // namespace jaxodc::odc
