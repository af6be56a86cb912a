// TAGC's compressed push over the ODC runtime (compress.h): the registered ranges, the encoder
// with exact error feedback, the owner's decoder and the traffic counters.
#include "odc/compress.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/sync.h"
#include "sketch/sketch.h"

namespace jaxodc::odc {

int64_t sketch_payload_bytes(int64_t count, int64_t width) {
  return sketch::bitmap_words(count) * 4 + sketch::kRows * width * 4;
}

void Compressor::add(int unit, int64_t numel, int64_t offset, int64_t size, double fraction, double ratio,
                     uint64_t seed, bool compress) {
  const std::string what = "compressed range [" + std::to_string(offset) + ", " + std::to_string(offset + size) +
                           ") of unit " + std::to_string(unit);
  if (frozen_.load()) throw Error(what + ": register compressed ranges before the first push");
  if (offset < 0 || size <= 0 || offset + size > numel)
    throw Error(what + ": outside the unit's " + std::to_string(numel) + " elements (or empty)");
  if (!(fraction > 0.0 && fraction <= 1.0)) throw Error(what + ": fraction must be in (0, 1], got " + std::to_string(fraction));
  // The policy (jaxodc.compress) refuses ratio <= 1 for users; below 1 the sketch outgrows the dense
  // slice but peels everything, which tests use to compare with uncompressed training.
  if (!(ratio > 0.0)) throw Error(what + ": ratio must be > 0 (dense bytes / sketch bytes), got " + std::to_string(ratio));
  auto next = ranges_.lower_bound({unit, offset});
  if (next != ranges_.end() && next->first.first == unit && next->second->offset < offset + size)
    throw Error(what + " overlaps the registered range starting at " + std::to_string(next->second->offset));
  if (next != ranges_.begin()) {
    const CompressedRange& prev = *std::prev(next)->second;
    if (prev.unit == unit && prev.offset + prev.size > offset)
      throw Error(what + " overlaps the registered range starting at " + std::to_string(prev.offset));
  }
  auto r = std::make_unique<CompressedRange>();
  r->unit = unit;
  r->offset = offset;
  r->size = size;
  r->fraction = fraction;
  r->ratio = ratio;
  r->seed = seed;
  r->compress = compress;
  if (compress) r->residual.assign(static_cast<size_t>(size), 0.0f);
  ranges_.emplace(std::make_pair(unit, offset), std::move(r));
}

int64_t Compressor::chunk_elems(const CompressedRange& r, int64_t slot_bytes) {
  // payload(c) ~ c / 8 + 4 c / ratio bytes: start from that estimate and step down until it fits.
  const double per_elem = 1.0 / 8.0 + 4.0 / r.ratio;
  int64_t c = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(slot_bytes) / per_elem));
  while (c > 1 && sketch_payload_bytes(c, sketch::sketch_width(c, r.ratio)) > slot_bytes) c -= std::max<int64_t>(1, c / 64);
  return c;
}

int64_t Compressor::encode(CompressedRange& r, int64_t lo, const char* src, ElemType type, int64_t count,
                           SketchChunk& out) {
  const int64_t width = sketch::sketch_width(count, r.ratio);
  const int64_t words = sketch::bitmap_words(count);
  out.count = count;
  out.width = width;
  out.seed = r.seed;
  out.payload.resize(static_cast<size_t>(sketch_payload_bytes(count, width)));
  auto* bitmap = reinterpret_cast<uint32_t*>(out.payload.data());
  auto* sk = reinterpret_cast<float*>(out.payload.data() + words * 4);
  float* residual = r.residual.data() + (lo - r.offset);
  thread_local std::vector<float> kept, decoded;
  kept.resize(static_cast<size_t>(count));
  // residual is read before it is rewritten, so it may be sparsify's input and output at once.
  const int64_t k = sketch::sparsify(src, type == ElemType::kBF16, residual, count, r.fraction, kept.data(), residual,
                                     bitmap);
  sketch::build(kept.data(), bitmap, count, width, r.seed, sk);
  // What the owner will decode; the difference from what was meant stays in the residual.
  decoded.resize(static_cast<size_t>(count));
  int64_t counts[2];
  sketch::peel(sk, bitmap, count, width, r.seed, decoded.data(), counts);
  for (int64_t w = 0; w < words; ++w)
    for (uint32_t bits = bitmap[w]; bits != 0; bits &= bits - 1) {
      const int64_t i = w * 32 + __builtin_ctz(bits);
      residual[i] += kept[i] - decoded[i];
    }
  return k;
}

std::vector<float> Compressor::residual(int unit, int64_t offset) const {
  auto it = ranges_.find({unit, offset});
  if (it == ranges_.end() || !it->second->compress)
    throw Error("no compressed range of unit " + std::to_string(unit) + " starts at " + std::to_string(offset));
  return it->second->residual;
}

void Compressor::set_residual(int unit, int64_t offset, const float* values, int64_t n) {
  auto it = ranges_.find({unit, offset});
  if (it == ranges_.end() || !it->second->compress)
    throw Error("no compressed range of unit " + std::to_string(unit) + " starts at " + std::to_string(offset));
  std::vector<float>& r = it->second->residual;
  if (n != static_cast<int64_t>(r.size()))
    throw Error("the compressed range of unit " + std::to_string(unit) + " at " + std::to_string(offset) + " has " +
                std::to_string(r.size()) + " elements, the residual given " + std::to_string(n));
  std::copy(values, values + n, r.begin());
}

UnitTraffic Compressor::traffic(int unit) {
  std::lock_guard<std::mutex> lock(traffic_mu_);
  return traffic_[unit];
}

void Compressor::count_push(int unit, int64_t bytes, const CompressedRange* r, int64_t elems, int64_t kept) {
  std::lock_guard<std::mutex> lock(traffic_mu_);
  UnitTraffic& t = traffic_[unit];
  t.wire_bytes += bytes;
  if (r) {
    t.range_bytes += bytes;
    t.range_elems += elems;
    t.kept_elems += kept;
  }
}

void Compressor::count_decoded(int unit, int64_t peeled, int64_t estimated) {
  std::lock_guard<std::mutex> lock(traffic_mu_);
  traffic_[unit].peeled += peeled;
  traffic_[unit].estimated += estimated;
}

void decode(const char* payload, int64_t count, int64_t width, uint64_t seed, float* out, int64_t* peeled,
            int64_t* estimated) {
  const auto* bitmap = reinterpret_cast<const uint32_t*>(payload);
  const auto* sk = reinterpret_cast<const float*>(payload + sketch::bitmap_words(count) * 4);
  int64_t counts[2];
  sketch::peel(sk, bitmap, count, width, seed, out, counts);
  *peeled = counts[0];
  *estimated = counts[1];
}

}  // namespace jaxodc::odc
