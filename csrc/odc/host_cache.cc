// The per-host gather cache (host_cache.h).
#include "odc/host_cache.h"

#include <algorithm>
#include <cstring>

#include "odc/core.h"

namespace jaxodc::odc {

namespace {

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace

std::unique_ptr<HostCache> HostCache::create(const std::string& name, const Layout& layout,
                                             const std::vector<int>& remote, const std::string& who) {
  const int nu = layout.num_units(), w = layout.world;
  std::vector<char> is_remote(static_cast<size_t>(w), 0);
  for (int r : remote) {
    if (r < 0 || r >= w) throw Error(who + ": host cache: rank " + std::to_string(r) + " is outside the world");
    is_remote[static_cast<size_t>(r)] = 1;
  }
  const size_t entries_off = align_up(sizeof(HostCacheHeader), 64);
  size_t off = align_up(entries_off + sizeof(CacheEntry) * static_cast<size_t>(nu) * static_cast<size_t>(w), 64);
  const size_t data_start = off;
  std::vector<uint64_t> offsets(static_cast<size_t>(nu) * static_cast<size_t>(w), 0);
  std::vector<int64_t> counts(offsets.size(), 0);
  for (int u = 0; u < nu; ++u)
    for (int o = 0; o < w; ++o) {
      int64_t lo, n;
      layout.piece(u, o, &lo, &n);
      const size_t i = static_cast<size_t>(u) * static_cast<size_t>(w) + static_cast<size_t>(o);
      counts[i] = n;
      if (!is_remote[static_cast<size_t>(o)]) continue;
      offsets[i] = off;
      off = align_up(off + static_cast<size_t>(n) * 4, 64);  // room for fp32, the widest gathered type
    }
  std::unique_ptr<HostCache> c(new HostCache(name, w));
  shm::create(name, align_up(std::max<size_t>(off, 4096), 4096), who + " (host gather cache)", &c->map_);
  c->linked_ = true;
  HostCacheHeader* h = c->header();
  h->layout_hash = layout.hash;
  h->world = w;
  h->num_units = nu;
  h->total_bytes = c->map_.bytes;
  h->entries_off = entries_off;
  h->data_bytes = off - data_start;
  for (size_t i = 0; i < offsets.size(); ++i) {
    CacheEntry* e = reinterpret_cast<CacheEntry*>(c->base() + entries_off) + i;
    e->version.store(-1);
    e->state.store(kEntryIdle);
    e->filler.store(-1);
    e->cached = is_remote[i % static_cast<size_t>(w)];
    e->data_offset = offsets[i];
    e->count = counts[i];
  }
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->store(kHostCacheMagic, std::memory_order_release);
  return c;
}

std::unique_ptr<HostCache> HostCache::open(const std::string& name, const Layout& layout, const std::string& who) {
  std::unique_ptr<HostCache> c(new HostCache(name, layout.world));
  shm::map_existing(name, who + ": the host gather cache " + name, &c->map_);
  const HostCacheHeader* h = c->header();
  if (c->map_.bytes < sizeof(HostCacheHeader) ||
      reinterpret_cast<const std::atomic<uint64_t>*>(&h->magic)->load(std::memory_order_acquire) != kHostCacheMagic ||
      h->total_bytes != c->map_.bytes)
    throw Error(who + ": " + name + " is not a host gather cache");
  if (h->layout_hash != layout.hash || h->world != layout.world || h->num_units != layout.num_units())
    throw Error(who + ": the host gather cache " + name + " was made for another unit layout");
  const size_t end = h->entries_off + sizeof(CacheEntry) * static_cast<size_t>(h->num_units) * static_cast<size_t>(h->world);
  if (end > c->map_.bytes) throw Error(who + ": the host gather cache " + name + " is truncated");
  return c;
}

void HostCache::unlink() {
  if (linked_) {
    shm::unlink(name_);
    linked_ = false;
  }
}

void CachedPeer::fetch(int unit, int64_t version, const std::vector<Segment>& out, ElemType type,
                       std::vector<float>& staging) {
  Pending held = inner_->request_piece(unit, version, type);
  inner_->read_piece(unit, version, out, type, staging);
}

void CachedPeer::done(int64_t version) {
  inner_->done(version);
  int64_t seen = last_done_.load();
  while (seen < version && !last_done_.compare_exchange_weak(seen, version)) {
  }
}

void CachedPeer::read_piece(int unit, int64_t version, const std::vector<Segment>& out, ElemType type,
                            std::vector<float>& staging) {
  // A minibatch this rank finished: the owner may have published since; ask it.
  if (version <= last_done_.load()) return fetch(unit, version, out, type, staging);
  CacheEntry* e = cache_.entry(unit, rank_);
  const double deadline = now_seconds() + core_.timeout_s;
  bool fetched = false;
  for (;;) {
    const int64_t held = e->version.load(std::memory_order_acquire);
    if (held == version) {
      if (e->elem_type != static_cast<int32_t>(type)) return fetch(unit, version, out, type, staging);
      break;
    }
    if (held > version) return fetch(unit, version, out, type, staging);  // cannot happen (host_cache.h); safe anyway
    uint32_t idle = kEntryIdle;
    if (e->state.compare_exchange_strong(idle, kEntryFilling, std::memory_order_acq_rel)) {
      if (e->version.load(std::memory_order_acquire) == version) {  // filled between the two loads
        e->state.store(kEntryIdle, std::memory_order_release);
        futex_wake_all(&e->state);
        continue;
      }
      e->filler.store(core_.rank);
      try {
        e->elem_type = static_cast<int32_t>(type);
        fetch(unit, version, {Segment{cache_.data(e), e->count}}, type, staging);
      } catch (...) {
        e->filler.store(-1);
        e->state.store(kEntryIdle, std::memory_order_release);
        futex_wake_all(&e->state);
        throw;
      }
      e->version.store(version, std::memory_order_release);
      e->filler.store(-1);
      e->state.store(kEntryIdle, std::memory_order_release);
      futex_wake_all(&e->state);
      fetched = true;
      break;
    }
    // Another rank of this host is fetching the piece: wait for it.
    const double left = deadline - now_seconds();
    if (left <= 0)
      throw TimeoutError(core_.who() + " timed out after " + seconds_text(core_.timeout_s) + " waiting for rank " +
                         std::to_string(e->filler.load()) + " of this host to fetch " + name() + "'s piece of unit " +
                         std::to_string(unit) + " (version " + std::to_string(version) +
                         ") into the host gather cache");
    if (core_.stop.load()) throw Error(core_.closed("gather"));
    inner_->check_alive("gather of unit " + std::to_string(unit) + " from " + name());
    futex_wait(&e->state, kEntryFilling, std::min(left, 0.1));
  }
  const size_t esize = elem_size(type);
  const char* src = cache_.data(e);
  for (const Segment& s : out) {
    const size_t part = static_cast<size_t>(s.count) * esize;
    if (s.dst != nullptr) std::memcpy(s.dst, src, part);
    src += part;
  }
  if (!fetched) hits_.fetch_add(1);
}

}  // namespace jaxodc::odc
