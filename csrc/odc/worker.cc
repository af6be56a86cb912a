// The worker side of the runtime: gather and scatter-accumulate over every owner (each through its
// transport, peer.h), the done markers, LB-Steal claims and the scalar all-gather.
#include <algorithm>
#include <cstring>
#include <utility>

#include "odc/compress.h"
#include "odc/core.h"
#include "odc/peer.h"
#include "odc/runtime.h"

namespace jaxodc::odc {

std::vector<Peer*> Runtime::owners(int first, Route route) const {
  std::vector<Peer*> out;
  for (int i = 0; i < world(); ++i) {
    Peer* p = peers_[(first + i) % world()].get();
    if (route == Route::kHostOwners && p->device_reachable()) continue;
    out.push_back(p);
  }
  return out;
}

bool Runtime::device_owner(int owner) const { return peers_[owner] && peers_[owner]->device_reachable(); }

bool Runtime::has_host_owners() const {
  for (int d = 0; d < world(); ++d)
    if (!device_owner(d)) return true;
  return false;
}

void Runtime::gather(int unit, int64_t version, void* out, ElemType type, int64_t out_numel, Route route) {
  check_buffer("gather", unit, core_->layout.numels[unit], "output", out_numel);
  gather_pieces(unit, version, {0}, {out_numel}, {out}, type, route);
}

void Runtime::gather_pieces(int unit, int64_t version, const std::vector<int64_t>& offsets,
                            const std::vector<int64_t>& counts, const std::vector<void*>& outs, ElemType type,
                            Route route) {
  check_open("gather");
  check_unit(unit, "gather");
  const int64_t numel = core_->layout.numels[unit];
  if (offsets.size() != counts.size() || offsets.size() != outs.size())
    throw Error("gather: " + core_->who() + ": unit " + std::to_string(unit) + ": " + std::to_string(offsets.size()) +
                " offsets, " + std::to_string(counts.size()) + " sizes and " + std::to_string(outs.size()) + " outputs");
  for (size_t i = 0; i < offsets.size(); ++i)
    if (offsets[i] < (i ? offsets[i - 1] + counts[i - 1] : 0) || counts[i] < 0 || offsets[i] + counts[i] > numel)
      throw Error("gather: " + core_->who() + ": piece [" + std::to_string(offsets[i]) + ", " +
                  std::to_string(offsets[i] + counts[i]) + ") of unit " + std::to_string(unit) + " (" +
                  std::to_string(numel) + " elements) is out of order, overlaps the one before or lies outside");
  const size_t esize = elem_size(type);
  // Each owner's piece [lo, lo + n) cut along the outputs: the parts in a piece go there, the rest is skipped.
  auto segments = [&](int owner) {
    int64_t lo, n;
    piece(unit, owner, &lo, &n);
    std::vector<Segment> out;
    int64_t at = lo;
    for (size_t i = 0; i < offsets.size(); ++i) {
      const int64_t a = std::max(at, offsets[i]), b = std::min(lo + n, offsets[i] + counts[i]);
      if (a >= b) continue;
      if (a > at) out.push_back({nullptr, a - at});
      out.push_back({static_cast<char*>(outs[i]) + (a - offsets[i]) * esize, b - a});
      at = b;
    }
    if (at < lo + n) out.push_back({nullptr, lo + n - at});
    return out;
  };
  std::vector<float> staging;
  // Requests to remote owners first; the local pieces are copied while they travel, in rank order
  // on every rank (ranks gathering at once then read the same owner's memory together).
  std::vector<Peer*> local;
  std::vector<std::pair<Peer*, Peer::Pending>> remote;  // releases the connections on any exit
  for (Peer* p : owners(0, route)) {
    Peer::Pending pending = p->request_piece(unit, version, type);
    if (pending.owns_lock()) remote.emplace_back(p, std::move(pending));
    else local.push_back(p);
  }
  for (Peer* p : local) p->read_piece(unit, version, segments(p->rank()), type, staging);
  for (auto& [p, pending] : remote) {
    p->read_piece(unit, version, segments(p->rank()), type, staging);
    pending.unlock();
  }
}

void Runtime::scatter_accumulate(int unit, int64_t version, const void* grad, ElemType type, int64_t grad_numel,
                                 Route route) {
  check_buffer("scatter_accumulate", unit, core_->layout.numels[unit], "gradient", grad_numel);
  const char* src = static_cast<const char*>(grad);
  std::vector<float> staging;
  // Start with the next owner so that ranks do not all queue at owner 0 at once.
  for (Peer* p : owners(rank() + 1, route)) {
    int64_t lo, n;
    piece(unit, p->rank(), &lo, &n);
    push_piece(p, unit, version, lo, lo, src + lo * elem_size(type), type, n, staging);
  }
}

void Runtime::scatter_accumulate_range(int unit, int64_t version, int64_t offset, const void* grad, ElemType type,
                                       int64_t n) {
  check_open("scatter_accumulate");
  check_unit(unit, "scatter_accumulate");
  const int64_t numel = core_->layout.numels[unit];
  if (offset < 0 || n < 0 || offset + n > numel)
    throw Error("scatter_accumulate: " + core_->who() + ": elements [" + std::to_string(offset) + ", " +
                std::to_string(offset + n) + ") are outside unit " + std::to_string(unit) + " of " +
                std::to_string(numel) + " elements");
  const char* src = static_cast<const char*>(grad);
  const size_t esize = elem_size(type);
  std::vector<float> staging;
  for (Peer* p : owners(rank() + 1, Route::kAll)) {
    int64_t lo, len;
    piece(unit, p->rank(), &lo, &len);
    const int64_t a = std::max(lo, offset), b = std::min(lo + len, offset + n);
    if (a >= b) continue;  // this owner holds none of the range
    push_piece(p, unit, version, lo, a, src + (a - offset) * esize, type, b - a, staging);
  }
}

void Runtime::push_piece(Peer* p, int unit, int64_t version, int64_t owner_lo, int64_t a, const char* src,
                         ElemType type, int64_t n, std::vector<float>& staging) {
  Compressor& comp = *compressor_;
  comp.freeze();
  const bool remote = p->rank() != rank();
  if (comp.empty() || n == 0) {
    p->push(unit, version, a - owner_lo, src, type, n, staging);
    if (remote) comp.count_push(unit, n * static_cast<int64_t>(elem_size(type)), nullptr, n, n);
    return;
  }
  const size_t esize = elem_size(type);
  SketchChunk chunk;
  comp.split(unit, a, a + n, [&](int64_t lo, int64_t hi, CompressedRange* r) {
    const char* at = src + (lo - a) * esize;
    // My own slice never travels: it stays dense (and exact).
    if (r == nullptr || !r->compress || !remote) {
      p->push(unit, version, lo - owner_lo, at, type, hi - lo, staging);
      if (remote) comp.count_push(unit, (hi - lo) * static_cast<int64_t>(elem_size(type)), r, hi - lo, hi - lo);
      return;
    }
    const int64_t step = Compressor::chunk_elems(*r, core_->layout.slot_elems * 4);
    for (int64_t c = lo; c < hi; c += step) {
      const int64_t m = std::min(step, hi - c);
      const int64_t kept = Compressor::encode(*r, c, at + (c - lo) * esize, type, m, chunk);
      p->push_sketch(unit, version, c - owner_lo, chunk);
      comp.count_push(unit, static_cast<int64_t>(chunk.payload.size()), r, m, kept);
    }
  });
}

void Runtime::gather_device(int unit, int64_t version, float* out, CUstream_st* stream) {
  check_open("gather");
  check_unit(unit, "gather");
  const std::string tag = "odc.gather over device memory: " + core_->who() + " unit " + std::to_string(unit) +
                          " version " + std::to_string(version);
  if (!core_->dev) throw Error(tag + ": this rank has no device");
  for (Peer* p : owners(rank(), Route::kAll))
    if (p->device_reachable()) p->gather_device(unit, version, out, stream);
  core_->dev->track_gather(stream, tag);
}

void Runtime::scatter_device(int unit, int64_t version, const float* grad, CUstream_st* stream) {
  check_open("scatter_accumulate");
  check_unit(unit, "scatter_accumulate");
  if (!core_->dev)
    throw Error("odc.scatter_accumulate over device memory: " + core_->who() + " unit " + std::to_string(unit) +
                ": this rank has no device");
  // Start with the next owner so that ranks do not all queue at owner 0 at once.
  for (Peer* p : owners(rank() + 1, Route::kAll))
    if (p->device_reachable()) p->push_device(unit, version, grad, stream);
}

void Runtime::done(int64_t version) {
  check_open("done");
  // Owners may overwrite their device masters once every done(version) arrived: the device
  // copies this rank enqueued from them must have finished first.
  if (core_->dev) core_->dev->wait_gathers("done: " + core_->who());
  for (auto& p : peers_) p->done(version);
}

int64_t Runtime::claim(int64_t version, int owner, int64_t count, bool steal) {
  check_open("claim");
  if (owner < 0 || owner >= world())
    throw Error("claim: owner rank " + std::to_string(owner) + " outside world size " + std::to_string(world()));
  return peers_[owner]->claim(version, count, steal);
}

std::vector<double> Runtime::allgather(int64_t version, const std::vector<double>& values) {
  check_open("allgather");
  // Posts are tagged by a per-runtime sequence (every rank makes the same calls in the same order),
  // so several per minibatch never overwrite each other. A rank can run at most one post ahead of
  // the slowest, so a ring of kRing entries is never overrun. A vector longer than one post takes
  // several, in order.
  const int64_t n = static_cast<int64_t>(values.size());
  std::vector<double> out(static_cast<size_t>(world() * n), 0.0);
  SegmentHeader* seg = core_->seg;
  int64_t at = 0;
  do {
    const int64_t chunk = std::min<int64_t>(kScalarWords, n - at);
    const int64_t seq = scalar_calls_++;
    ScalarEntry* mine = seg->scalar(seq);
    mine->count = chunk;
    std::memcpy(mine->values, values.data() + at, static_cast<size_t>(chunk) * sizeof(double));
    mine->version.store(seq, std::memory_order_release);
    signal_event(&seg->scalar_seq);
    for (int d = 0; d < world(); ++d)
      peers_[d]->scalars(seq, chunk, out.data() + d * n + at,
                         "waiting for the values of rank " + std::to_string(d) + " (all-gather post " +
                             std::to_string(seq) + " of " + std::to_string(chunk) + " values, minibatch " +
                             std::to_string(version) + ")");
    at += chunk;
  } while (at < n);
  return out;
}

std::vector<double> Runtime::allgather_scalar(int64_t version, double value) { return allgather(version, {value}); }

}  // namespace jaxodc::odc
