// The unit layout and the life of ODC segments: creation, mapping a peer's, the LB-Steal deque
// word, and reclaiming the segments of dead processes.
#include "odc/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "odc/runtime.h"

namespace jaxodc::odc {

namespace {

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

}  // namespace

Layout::Layout(int rank, int world, const std::vector<int64_t>& unit_numels, int64_t slot_elems_arg)
    : world(world), numels(unit_numels) {
  const std::string who = "rank " + std::to_string(rank);
  if (world < 1) throw Error("world size must be >= 1, got " + std::to_string(world));
  if (rank < 0 || rank >= world) throw Error(who + " outside [0, " + std::to_string(world) + ")");
  if (numels.empty()) throw Error(who + ": no units registered");
  hash = fnv1a(0xcbf29ce484222325ULL, &world, sizeof(world));
  for (size_t u = 0; u < numels.size(); ++u) {
    if (numels[u] <= 0)
      throw Error(who + ": unit " + std::to_string(u) + " has " + std::to_string(numels[u]) +
                  " elements; units must be non-empty");
    const int64_t shard = (numels[u] + world - 1) / world;
    shards.push_back(shard);
    max_shard = std::max(max_shard, shard);
    hash = fnv1a(hash, &numels[u], sizeof(int64_t));
  }
  if (slot_elems_arg < 0)
    throw Error(who + ": slot_elems must be >= 0 (0: one shard of the largest unit), got " +
                std::to_string(slot_elems_arg));
  slot_elems = slot_elems_arg == 0 ? max_shard : std::min(slot_elems_arg, max_shard);
  hash = fnv1a(hash, &slot_elems, sizeof(int64_t));  // clients write in slot-sized chunks
}

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    reset();
    seg = o.seg;
    bytes = o.bytes;
    o.seg = nullptr;
  }
  return *this;
}

void Mapping::reset() {
  if (seg) munmap(seg, bytes);
  seg = nullptr;
}

Mapping create_segment(const std::string& name, const std::string& job_id, int rank, const Layout& layout) {
  const int nu = layout.num_units();
  size_t off = align_up(sizeof(SegmentHeader), 64);
  const size_t units_off = off;
  off = align_up(off + sizeof(UnitEntry) * nu, 64);
  const size_t masters_off = off;
  std::vector<uint64_t> master_offsets;
  for (int u = 0; u < nu; ++u) {
    master_offsets.push_back(off);
    off = align_up(off + static_cast<size_t>(layout.shards[u]) * 4, 64);
  }
  const size_t slot_stride = align_up(64 + static_cast<size_t>(layout.slot_elems) * 4, 64);
  const size_t slots_off = off;
  off += slot_stride * layout.world;
  const size_t done_off = off;
  off = align_up(off + sizeof(int64_t) * layout.world, 64);
  const size_t scalars_off = off;
  const size_t bytes = align_up(off + sizeof(ScalarEntry) * kRing, 4096);

  // A segment of the same name left by a crashed process would block O_EXCL.
  reclaim_stale_segments();
  const std::string who = "rank " + std::to_string(rank);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST)
    throw Error(who + ": shared memory segment " + name + " already exists and its owner is alive: is job id '" +
                job_id + "' in use twice?");
  if (fd < 0) throw Error("shm_open(" + name + "): " + strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    std::string msg = strerror(errno);
    ::close(fd);
    shm_unlink(name.c_str());
    throw Error(who + ": cannot size shared memory segment " + name + " to " + std::to_string(bytes) +
                " bytes: " + msg);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    throw Error("mmap of " + name + " failed: " + strerror(errno));
  }
  auto* seg = static_cast<SegmentHeader*>(p);
  // ftruncate zero-fills; atomics with all-zero bytes are valid zero values.
  seg->rank = rank;
  seg->world = layout.world;
  seg->pid = static_cast<int32_t>(getpid());
  seg->num_units = nu;
  seg->layout_hash = layout.hash;
  seg->max_shard = layout.max_shard;
  seg->total_bytes = bytes;
  seg->units_off = units_off;
  seg->masters_off = masters_off;
  seg->slots_off = slots_off;
  seg->slot_stride = slot_stride;
  seg->done_off = done_off;
  seg->scalars_off = scalars_off;
  for (int u = 0; u < nu; ++u) {
    UnitEntry* e = seg->unit(u);
    e->numel = layout.numels[u];
    e->shard = layout.shards[u];
    e->master_offset = master_offsets[u];
    e->version.store(-1, std::memory_order_relaxed);
  }
  for (int c = 0; c < layout.world; ++c) seg->done(c)->store(-1, std::memory_order_relaxed);
  for (int i = 0; i < kRing; ++i) seg->scalar(i)->version.store(-1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  seg->magic = kMagic;
  return Mapping(seg, bytes);
}

Mapping map_segment(const std::string& name, int peer, int me, const Layout& layout) {
  const std::string of = " of rank " + std::to_string(peer);
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0)
    throw PeerError("rank " + std::to_string(me) + ": cannot open the segment " + name + of + ": " +
                    strerror(errno) + " (is it on another host? use the tcp transport)");
  struct stat st;
  fstat(fd, &st);
  void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw PeerError("mmap of " + name + " failed: " + strerror(errno));
  Mapping m(static_cast<SegmentHeader*>(p), static_cast<size_t>(st.st_size));
  if (m.seg->magic != kMagic || m.seg->rank != peer || m.seg->world != layout.world)
    throw PeerError("segment " + name + " is not the ODC segment" + of);
  if (m.seg->layout_hash != layout.hash)
    throw Error("unit layout of rank " + std::to_string(peer) + " differs from rank " + std::to_string(me));
  return m;
}

// The deque is one word: tag (version + 1, 24 bits) << 40 | front << 20 | back. A word left from
// an older minibatch restarts as [0, count) for the new one.
int64_t claim_microbatch(SegmentHeader* seg, int64_t version, int64_t count, bool steal, int owner) {
  constexpr uint64_t kField = (1u << 20) - 1, kTag = (1u << 24) - 1;
  if (count < 0 || static_cast<uint64_t>(count) > kField)
    throw Error("claim: rank " + std::to_string(owner) + " has " + std::to_string(count) +
                " microbatches in minibatch " + std::to_string(version) + "; between 0 and " +
                std::to_string(kField) + " fit a deque");
  std::atomic<uint64_t>& word = seg->deques[version % kRing];
  const uint64_t tag = (static_cast<uint64_t>(version) + 1) & kTag;
  uint64_t cur = word.load(std::memory_order_acquire);
  while (true) {
    uint64_t cur_tag = cur >> 40, front = (cur >> 20) & kField, back = cur & kField;
    if (cur_tag != tag) {
      // Versions only move forward: a tag ahead of mine (modulo 2^24) is a later minibatch's.
      if (((cur_tag - tag) & kTag) < (1u << 23))
        throw Error("claim: minibatch " + std::to_string(version) + " of rank " + std::to_string(owner) +
                    " is older than its deque's minibatch");
      front = 0;
      back = static_cast<uint64_t>(count);
    }
    if (front >= back) return -1;
    const int64_t got = static_cast<int64_t>(steal ? --back : front++);
    const uint64_t next = (tag << 40) | (front << 20) | back;
    if (word.compare_exchange_weak(cur, next, std::memory_order_acq_rel)) return got;
  }
}

int reclaim_stale_segments() {
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  int removed = 0;
  while (dirent* ent = readdir(dir)) {
    std::string name = ent->d_name;
    if (name.rfind("jaxodc_", 0) != 0) continue;
    std::string path = "/" + name;
    int fd = shm_open(path.c_str(), O_RDONLY, 0);
    if (fd < 0) continue;
    struct stat st;
    bool stale = false;
    if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= sizeof(SegmentHeader)) {
      void* p = mmap(nullptr, sizeof(SegmentHeader), PROT_READ, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) {
        auto* h = static_cast<SegmentHeader*>(p);
        stale = h->magic == kMagic && !pid_alive(h->pid);
        munmap(p, sizeof(SegmentHeader));
      }
    }
    ::close(fd);
    if (stale && shm_unlink(path.c_str()) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

}  // namespace jaxodc::odc
