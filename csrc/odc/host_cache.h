// Internal to csrc/odc: the per-host gather cache (ZeRO++'s hpZ, hybrid sharding's node-local copy,
// in ODC's terms). Parameters change only at the end of a minibatch, so a host needs each remote
// owner's piece of a unit once per minibatch: the first rank of the host to gather it fetches it
// over the owner's TCP connection into a POSIX shared-memory segment of the host, and the host's
// other ranks copy it from there. Cross-host gather traffic becomes what the host needs, not that
// times (microbatches per rank) x (ranks per host).
//
// The segment (created by the host's first rank, mapped by the others) holds one entry per
// (unit, remote owner): the version it holds, a fill state (the futex word) and the piece's data,
// sized for fp32. Why an entry tagged with version v holds the owner's version v exactly: a rank
// gathering version v has not sent done(v), and an owner publishes v+1 only after every rank's
// done(v); so while any rank of the host may still read version v, no owner has moved past it,
// and no rank of the host can want v+1 yet (no two versions of an entry are wanted at once). A
// gather of a version this rank already finished (e.g. reading parameters after training) may be
// answered with a newer version, so it bypasses the cache.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "odc/peer.h"
#include "odc/segment.h"
#include "transport/shm.h"

namespace jaxodc::odc {

constexpr uint64_t kHostCacheMagic = 0x3130434843584a58ULL;  // "XJXCHC01"
constexpr uint32_t kEntryIdle = 0, kEntryFilling = 1;

struct alignas(64) CacheEntry {
  std::atomic<int64_t> version;  // of the data held; -1: none
  std::atomic<uint32_t> state;   // kEntryIdle / kEntryFilling (the futex word of its waiters)
  std::atomic<int32_t> filler;   // the rank filling it (for errors), -1 when none
  int32_t elem_type;             // of the data held (ElemType)
  int32_t cached;                // 1 when the owner is on another host (the entry has data)
  uint64_t data_offset;          // from the segment's start
  int64_t count;                 // elements of the owner's piece
};
static_assert(sizeof(CacheEntry) == 64, "one cache line per entry");

struct HostCacheHeader {
  uint64_t magic;
  uint64_t layout_hash;
  int32_t world, num_units;
  uint64_t total_bytes, entries_off, data_bytes;
};

class HostCache {
 public:
  // The host's first rank: creates segment `name` with an entry for each unit and each owner in
  // `remote` (the ranks on other hosts).
  static std::unique_ptr<HostCache> create(const std::string& name, const Layout& layout, const std::vector<int>& remote,
                                           const std::string& who);
  // The host's other ranks: maps it and checks it was made for `layout`.
  static std::unique_ptr<HostCache> open(const std::string& name, const Layout& layout, const std::string& who);

  CacheEntry* entry(int unit, int owner) const {
    return reinterpret_cast<CacheEntry*>(base() + header()->entries_off) + (static_cast<int64_t>(unit) * world_ + owner);
  }
  char* data(const CacheEntry* e) const { return base() + e->data_offset; }
  bool caches(int owner) const { return entry(0, owner)->cached != 0; }
  // Bytes of cached data (each remote owner's pieces of every unit, in fp32).
  int64_t data_bytes() const { return static_cast<int64_t>(header()->data_bytes); }
  const std::string& name() const { return name_; }
  void unlink();

 private:
  HostCache(std::string name, int world) : name_(std::move(name)), world_(world) {}
  char* base() const { return static_cast<char*>(map_.base); }
  HostCacheHeader* header() const { return reinterpret_cast<HostCacheHeader*>(map_.base); }

  shm::Mapping map_;
  std::string name_;
  int world_;
  bool linked_ = false;
};

// An owner on another host, reached through `inner` (its TcpPeer) and read through the host cache.
// Everything but gathers goes straight to `inner`.
class CachedPeer final : public Peer {
 public:
  CachedPeer(const Core& core, std::unique_ptr<Peer> inner, HostCache& cache)
      : Peer(core, inner->rank(), inner->where()), inner_(std::move(inner)), cache_(cache) {}

  // Gathers do their own request in read_piece (only the rank filling an entry sends one).
  Pending request_piece(int, int64_t, ElemType) override { return {}; }
  void read_piece(int unit, int64_t version, const std::vector<Segment>& out, ElemType type,
                  std::vector<float>& staging) override;
  void push(int unit, int64_t version, int64_t offset, const char* src, ElemType type, int64_t count,
            std::vector<float>& staging) override {
    inner_->push(unit, version, offset, src, type, count, staging);
  }
  void push_sketch(int unit, int64_t version, int64_t offset, const SketchChunk& chunk) override {
    inner_->push_sketch(unit, version, offset, chunk);
  }
  void done(int64_t version) override;
  int64_t claim(int64_t version, int64_t count, bool steal) override { return inner_->claim(version, count, steal); }
  void scalars(int64_t seq, int64_t n, double* out, const std::string& what) override {
    inner_->scalars(seq, n, out, what);
  }
  void check_alive(const std::string& what) const override { inner_->check_alive(what); }
  void say_goodbye() override { inner_->say_goodbye(); }
  void link_failed() override { inner_->link_failed(); }
  void close() override { inner_->close(); }
  int64_t gather_bytes() const override { return inner_->gather_bytes(); }
  int64_t cache_hits() const override { return hits_.load(); }

 private:
  // inner_'s piece straight into `out` (no cache).
  void fetch(int unit, int64_t version, const std::vector<Segment>& out, ElemType type, std::vector<float>& staging);

  std::unique_ptr<Peer> inner_;
  HostCache& cache_;
  std::atomic<int64_t> last_done_{-1};  // the newest minibatch this rank finished (done)
  std::atomic<int64_t> hits_{0};        // pieces read from the cache that another rank fetched
};

}  // namespace jaxodc::odc
