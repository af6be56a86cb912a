// The transports over mapped segments: this rank itself and same-host peers (shm). Reads and
// writes go straight to the owner's memory; futexes in its segment wake the waiters.
#include <cstring>

#include "odc/peer.h"
#include "odc/runtime.h"

namespace jaxodc::odc {

void MappedPeer::read_piece(int unit, int64_t version, const std::vector<Segment>& out, ElemType type,
                            std::vector<float>&) {
  core_.wait_published(seg_, unit, version, this,
                       "waiting for " + name() + " to publish unit " + std::to_string(unit) + " version " +
                           std::to_string(version) + " (gather)");
  int64_t lo, n;
  core_.layout.piece(unit, rank_, &lo, &n);
  if (n == 0) return;
  UnitEntry* e = seg_->unit(unit);
  const int64_t seen = e->version.load(std::memory_order_acquire);
  const float* src = seg_->master(unit);
  for (const Segment& s : out) {
    if (s.dst != nullptr) store_from_f32(s.dst, type, src, s.count);
    src += s.count;
  }
  if (e->version.load(std::memory_order_acquire) != seen)
    throw Error("gather: " + name() + " republished unit " + std::to_string(unit) + " while " + core_.who() +
                " was reading version " + std::to_string(seen));
}

void MappedPeer::done(int64_t version) {
  seg_->done(core_.rank)->store(version, std::memory_order_release);
  signal_event(&seg_->doorbell);
}

int64_t MappedPeer::claim(int64_t version, int64_t count, bool steal) {
  return claim_microbatch(seg_, version, count, steal, rank_);
}

void MappedPeer::scalars(int64_t seq, int64_t n, double* out, const std::string& what) {
  core_.wait_scalar(seg_, seq, this, what);
  const ScalarEntry* e = seg_->scalar(seq);
  check_scalar_count(e->count, n, what);
  std::memcpy(out, e->values, static_cast<size_t>(n) * sizeof(double));
}

SelfPeer::SelfPeer(const Core& core, Runtime& rt) : MappedPeer(core, core.rank, core.seg), rt_(rt) {}

void SelfPeer::push(int unit, int64_t version, int64_t offset, const char* src, ElemType type, int64_t count,
                    std::vector<float>& staging) {
  if (type == ElemType::kF32) {
    rt_.accumulate(unit, version, rank_, reinterpret_cast<const float*>(src), count, offset);
    return;
  }
  // Converted in slot-sized chunks, as a push to a peer travels: the staging stays a slot, not a
  // parameter's slice.
  const int64_t step = std::max<int64_t>(core_.layout.slot_elems, 1);
  staging.resize(static_cast<size_t>(std::min(step, count)));
  for (int64_t at = 0; at < count; at += step) {
    const int64_t m = std::min(step, count - at);
    load_to_f32(staging.data(), src + at * elem_size(type), type, m);
    rt_.accumulate(unit, version, rank_, staging.data(), m, offset + at);
  }
}

void SelfPeer::gather_device(int unit, int64_t version, float* out, CUstream_st* stream) {
  core_.dev->gather_own(unit, version, out, stream);
}

void SelfPeer::push_device(int unit, int64_t version, const float* grad, CUstream_st* stream) {
  core_.dev->push_own(unit, version, grad, stream);
}

ShmPeer::ShmPeer(const Core& core, int rank, Mapping seg)
    : MappedPeer(core, rank, seg.seg), mapping_(std::move(seg)), pid_(seg_->pid) {}

void ShmPeer::push(int unit, int64_t version, int64_t offset, const char* src, ElemType type, int64_t count,
                   std::vector<float>&) {
  const size_t esize = elem_size(type);
  float* data = seg_->slot_data(core_.rank);
  const std::string what = "waiting for its receive slot at " + name() + " (pushing unit " + std::to_string(unit) +
                           " version " + std::to_string(version) + ")";
  // In slot-sized chunks (at least one message, so an empty piece still reaches its owner).
  int64_t sent = 0;
  do {
    const int64_t chunk = std::min(core_.layout.slot_elems, count - sent);
    core_.wait_slot_free(seg_, core_.rank, this, what);
    load_to_f32(data, src + sent * esize, type, chunk);
    seg_->raise_slot(core_.rank, unit, version, chunk, kSlotHost, offset + sent);
    sent += chunk;
  } while (sent < count);
}

void ShmPeer::push_sketch(int unit, int64_t version, int64_t offset, const SketchChunk& chunk) {
  if (static_cast<int64_t>(chunk.payload.size()) > core_.layout.slot_elems * 4)
    throw Error(core_.who() + ": a compressed chunk of " + std::to_string(chunk.payload.size()) +
                " bytes does not fit the receive slot at " + name());
  core_.wait_slot_free(seg_, core_.rank, this,
                       "waiting for its receive slot at " + name() + " (pushing unit " + std::to_string(unit) +
                           " version " + std::to_string(version) + ", compressed)");
  std::memcpy(seg_->slot_data(core_.rank), chunk.payload.data(), chunk.payload.size());
  seg_->raise_slot(core_.rank, unit, version, chunk.count, kSlotSketch, offset, chunk.width, chunk.seed);
}

void ShmPeer::check_alive(const std::string& what) const {
  if (seg_->closing.load(std::memory_order_acquire)) throw PeerError(what + ": " + name() + " shut down its ODC runtime");
  if (!pid_alive(pid_)) throw PeerError(what + ": " + name() + " (pid " + std::to_string(pid_) + ") died");
}

}  // namespace jaxodc::odc
