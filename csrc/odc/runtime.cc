#include "odc/runtime.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "odc/segment.h"
#include "transport/socket_util.h"

namespace jaxodc::odc {

namespace {

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

std::atomic<Runtime*> g_runtime{nullptr};

}  // namespace

// A process on this host is alive unless it is gone or a zombie (dead, not yet reaped).
bool pid_alive(int pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  if (!std::getline(stat, content)) return false;
  size_t paren = content.rfind(')');
  if (paren == std::string::npos || paren + 2 >= content.size()) return true;
  char state = content[paren + 2];
  return state != 'Z' && state != 'X';
}

// Wire format of the TCP transport.
// kNv*: the control half of the nvshmem transport (the data moves through NVSHMEM): wait for a
// publication (reply), wait for the client's slot to be free (reply), mark it full (no reply).
enum Op : uint32_t {
  kHello = 1, kGather = 2, kPush = 3, kDone = 4, kScalar = 5, kClaim = 6, kBye = 7,
  kNvWaitPublished = 8, kNvWaitSlot = 9, kNvCommit = 10
};
struct WireHeader {
  uint32_t op;
  int32_t rank;
  int32_t unit;
  int32_t status;  // replies: 0 ok, 1 error (message of `count` bytes follows)
  int64_t version;
  int64_t count;
  uint64_t aux;
  double value;
};

namespace {

// Client side of the tcp transport; the caller holds the peer connection's lock.
void send_request(int fd, const std::string& peer, double timeout_s, uint32_t op, int rank, int32_t unit = 0,
                  int64_t version = 0, int64_t count = 0, uint64_t aux = 0) {
  WireHeader h{};
  h.op = op;
  h.rank = rank;
  h.unit = unit;
  h.version = version;
  h.count = count;
  h.aux = aux;
  net::send_all(fd, &h, sizeof(h), timeout_s, peer);
}

// A reply header; an error reply is followed by its message, thrown as PeerError(what: message).
WireHeader recv_reply(int fd, const std::string& peer, double timeout_s, const std::string& what) {
  WireHeader r{};
  net::recv_all(fd, &r, sizeof(r), timeout_s, peer);
  if (r.status != 0) {
    std::string msg(static_cast<size_t>(r.count), '\0');
    net::recv_all(fd, msg.data(), msg.size(), timeout_s, peer);
    throw PeerError(what + ": " + msg);
  }
  return r;
}

}  // namespace

Runtime* current_runtime() { return g_runtime.load(std::memory_order_acquire); }
void set_current_runtime(Runtime* rt) { g_runtime.store(rt, std::memory_order_release); }

Runtime::Runtime(int rank, int world, const std::string& job_id, const std::vector<int64_t>& unit_numels,
                 double timeout_s, const std::string& listen_host, int64_t slot_elems)
    : rank_(rank), world_(world), job_id_(job_id), numels_(unit_numels), timeout_s_(timeout_s) {
  if (world < 1) throw Error("world size must be >= 1, got " + std::to_string(world));
  if (rank < 0 || rank >= world)
    throw Error("rank " + std::to_string(rank) + " outside [0, " + std::to_string(world) + ")");
  if (unit_numels.empty()) throw Error("rank " + std::to_string(rank) + ": no units registered");
  for (char c : job_id)
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '_'))
      throw Error("job id '" + job_id + "' may hold only letters, digits and '_'");
  layout_hash_ = fnv1a(0xcbf29ce484222325ULL, &world, sizeof(world));
  for (size_t u = 0; u < numels_.size(); ++u) {
    if (numels_[u] <= 0)
      throw Error("rank " + std::to_string(rank) + ": unit " + std::to_string(u) + " has " +
                  std::to_string(numels_[u]) + " elements; units must be non-empty");
    int64_t shard = (numels_[u] + world - 1) / world;
    shards_.push_back(shard);
    max_shard_ = std::max(max_shard_, shard);
    layout_hash_ = fnv1a(layout_hash_, &numels_[u], sizeof(int64_t));
  }
  if (slot_elems < 0)
    throw Error("rank " + std::to_string(rank) + ": slot_elems must be >= 0 (0: one shard of the largest unit), got " +
                std::to_string(slot_elems));
  slot_elems_ = slot_elems == 0 ? max_shard_ : std::min(slot_elems, max_shard_);
  layout_hash_ = fnv1a(layout_hash_, &slot_elems_, sizeof(int64_t));  // clients write in slot-sized chunks

  // Segment layout.
  const int nu = num_units();
  size_t off = align_up(sizeof(SegmentHeader), 64);
  size_t units_off = off;
  off = align_up(off + sizeof(UnitEntry) * nu, 64);
  size_t masters_off = off;
  std::vector<uint64_t> master_offsets;
  for (int u = 0; u < nu; ++u) {
    master_offsets.push_back(off);
    off = align_up(off + static_cast<size_t>(shards_[u]) * 4, 64);
  }
  size_t slot_stride = align_up(64 + static_cast<size_t>(slot_elems_) * 4, 64);
  size_t slots_off = off;
  off += slot_stride * world;
  size_t done_off = off;
  off = align_up(off + sizeof(int64_t) * world, 64);
  size_t scalars_off = off;
  off = align_up(off + sizeof(ScalarEntry) * kRing, 4096);
  seg_bytes_ = off;

  reclaim_stale_segments();
  shm_name_ = "/jaxodc_" + job_id + "_" + std::to_string(rank);
  int fd = shm_open(shm_name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {
    throw Error("rank " + std::to_string(rank) + ": shared memory segment " + shm_name_ +
                " already exists and its owner is alive: is job id '" + job_id + "' in use twice?");
  }
  if (fd < 0) throw Error("shm_open(" + shm_name_ + "): " + strerror(errno));
  linked_ = true;
  if (ftruncate(fd, static_cast<off_t>(seg_bytes_)) != 0) {
    std::string msg = strerror(errno);
    ::close(fd);
    shm_unlink(shm_name_.c_str());
    throw Error("rank " + std::to_string(rank) + ": cannot size shared memory segment " + shm_name_ +
                " to " + std::to_string(seg_bytes_) + " bytes: " + msg);
  }
  void* p = mmap(nullptr, seg_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(shm_name_.c_str());
    throw Error("mmap of " + shm_name_ + " failed: " + strerror(errno));
  }
  seg_ = static_cast<SegmentHeader*>(p);
  // ftruncate zero-fills; atomics with all-zero bytes are valid zero values.
  seg_->rank = rank;
  seg_->world = world;
  seg_->pid = static_cast<int32_t>(getpid());
  seg_->num_units = nu;
  seg_->layout_hash = layout_hash_;
  seg_->max_shard = max_shard_;
  seg_->total_bytes = seg_bytes_;
  seg_->units_off = units_off;
  seg_->masters_off = masters_off;
  seg_->slots_off = slots_off;
  seg_->slot_stride = slot_stride;
  seg_->done_off = done_off;
  seg_->scalars_off = scalars_off;
  for (int u = 0; u < nu; ++u) {
    UnitEntry* e = seg_->unit(u);
    e->numel = numels_[u];
    e->shard = shards_[u];
    e->master_offset = master_offsets[u];
    e->version.store(-1, std::memory_order_relaxed);
  }
  for (int c = 0; c < world; ++c) seg_->done(c)->store(-1, std::memory_order_relaxed);
  for (int i = 0; i < kRing; ++i) seg_->scalar(i)->version.store(-1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  seg_->magic = kMagic;

  for (int u = 0; u < nu; ++u) {
    const size_t bytes = align_up(static_cast<size_t>(std::max<int64_t>(shards_[u], 1)) * 4, 64);
    float* acc = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (acc == nullptr) throw Error("rank " + std::to_string(rank) + ": cannot allocate the accumulator of unit " +
                                    std::to_string(u) + " (" + std::to_string(bytes) + " bytes)");
    std::memset(acc, 0, bytes);
    accum_.emplace_back(acc);
    accum_mu_.push_back(std::make_unique<std::mutex>());
  }
  last_fetched_.assign(nu, -1);
  grad_lent_.assign(nu, 0);
  client_failure_.assign(world, "");

  for (int r = 0; r < world; ++r) peers_.push_back(std::make_unique<Peer>());
  Peer& self = *peers_[rank];
  self.rank = rank;
  self.transport = Transport::kSelf;
  self.seg = seg_;
  self.pid = getpid();

  if (world > 1) {
    listen_fd_ = net::listen_tcp(listen_host, 0, &port_);
    server_ = std::thread([this] { serve_loop(); });
  }
  daemon_ = std::thread([this] { daemon_loop(); });
}

Runtime::~Runtime() {
  try {
    close(false);
  } catch (...) {
  }
  if (seg_) munmap(seg_, seg_bytes_);
}

int64_t Runtime::numel(int unit) const {
  check_unit(unit, "numel");
  return numels_[unit];
}

int64_t Runtime::shard_size(int unit) const {
  check_unit(unit, "shard_size");
  return shards_[unit];
}

Stats Runtime::stats() const {
  Stats s;
  s.slot_bytes = static_cast<int64_t>(slot_elems_) * 4 * world_;
  for (int64_t sh : shards_) s.master_bytes += sh * 4;
  s.accum_bytes = s.master_bytes;
  s.segment_bytes = static_cast<int64_t>(seg_bytes_);
  s.pushes_received = pushes_received_.load();
  s.bytes_received = bytes_received_.load();
  s.device_bytes = device_bytes_;
  return s;
}

void Runtime::piece(int unit, int owner, int64_t* lo, int64_t* n) const {
  const int64_t numel = numels_[unit], shard = shards_[unit];
  *lo = std::min<int64_t>(static_cast<int64_t>(owner) * shard, numel);
  *n = std::max<int64_t>(0, std::min<int64_t>(shard, numel - *lo));
}

bool Runtime::device_owner(int owner) const {
  if (dev_ == nullptr) return false;
  const Transport t = peers_[owner]->transport;
  return owner == rank_ || t == Transport::kCudaIpc || (t == Transport::kNvshmem && nv_block_ != nullptr);
}

bool Runtime::has_host_owners() const {
  for (int d = 0; d < world_; ++d)
    if (!device_owner(d)) return true;
  return false;
}

void Runtime::check_unit(int unit, const char* op) const {
  if (unit < 0 || unit >= static_cast<int>(numels_.size()))
    throw Error(std::string(op) + ": rank " + std::to_string(rank_) + " has no unit " + std::to_string(unit) +
                " (" + std::to_string(numels_.size()) + " units registered)");
}

void Runtime::check_open(const char* op) const {
  if (closed_) throw Error(std::string(op) + ": the ODC runtime of rank " + std::to_string(rank_) + " is closed");
}

void Runtime::connect(const std::vector<PeerConfig>& configs) {
  check_open("connect");
  if (static_cast<int>(configs.size()) != world_)
    throw Error("connect: expected " + std::to_string(world_) + " peer configs, got " +
                std::to_string(configs.size()));
  connected_ = true;
  for (const PeerConfig& cfg : configs) {
    if (cfg.rank < 0 || cfg.rank >= world_) throw Error("connect: bad peer rank " + std::to_string(cfg.rank));
    if (cfg.rank == rank_) continue;
    Peer& peer = *peers_[cfg.rank];
    peer.rank = cfg.rank;
    peer.transport = cfg.transport;
    peer.pid = cfg.pid;
    peer.host = cfg.host;
    peer.port = cfg.port;
    if (is_mapped(cfg.transport)) {
      int fd = shm_open(cfg.shm_name.c_str(), O_RDWR, 0);
      if (fd < 0)
        throw PeerError("rank " + std::to_string(rank_) + ": cannot open the segment " + cfg.shm_name + " of rank " +
                        std::to_string(cfg.rank) + ": " + strerror(errno) +
                        " (is it on another host? use the tcp transport)");
      struct stat st;
      fstat(fd, &st);
      void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      ::close(fd);
      if (p == MAP_FAILED) throw PeerError("mmap of " + cfg.shm_name + " failed: " + strerror(errno));
      peer.seg = static_cast<SegmentHeader*>(p);
      peer.seg_bytes = static_cast<size_t>(st.st_size);
      if (peer.seg->magic != kMagic || peer.seg->rank != cfg.rank || peer.seg->world != world_)
        throw PeerError("segment " + cfg.shm_name + " is not the ODC segment of rank " + std::to_string(cfg.rank));
      if (peer.seg->layout_hash != layout_hash_)
        throw Error("unit layout of rank " + std::to_string(cfg.rank) + " differs from rank " + std::to_string(rank_));
      peer.pid = peer.seg->pid;
      if (cfg.transport == Transport::kCudaIpc) dev_open_peer(peer);
    } else if (uses_socket(cfg.transport)) {
      if (cfg.transport == Transport::kNvshmem &&
          (nv_block_ == nullptr || nv_pe_[cfg.rank] < 0 || nv_pe_[rank_] < 0))
        throw Error("rank " + std::to_string(rank_) + ": nvshmem transport to rank " + std::to_string(cfg.rank) +
                    ": " + (nv_block_ ? "that rank is not part of this rank's NVSHMEM job"
                                      : "NVSHMEM is not initialised (init_nvshmem before connect)"));
      peer.fd = net::connect_tcp(cfg.host, cfg.port, timeout_s_, peer.name());
      send_request(peer.fd, peer.name(), timeout_s_, kHello, rank_, 0, 0, world_, layout_hash_);
      WireHeader r{};
      net::recv_all(peer.fd, &r, sizeof(r), timeout_s_, peer.name());
      if (r.status != 0)
        throw Error("unit layout of rank " + std::to_string(cfg.rank) + " differs from rank " + std::to_string(rank_) +
                    " (tcp handshake refused)");
    } else {
      throw Error("connect: peer " + std::to_string(cfg.rank) + " cannot use the 'self' transport");
    }
  }
}

void Runtime::unlink_segment() {
  if (linked_) {
    shm_unlink(shm_name_.c_str());
    linked_ = false;
  }
}

void Runtime::check_peer_alive(const Peer& peer, const std::string& what) const {
  if (closed_ || stop_.load()) throw Error(what + ": the ODC runtime of rank " + std::to_string(rank_) + " was closed");
  if (is_mapped(peer.transport)) {
    if (peer.seg->closing.load(std::memory_order_acquire))
      throw PeerError(what + ": " + peer.name() + " shut down its ODC runtime");
    if (!pid_alive(peer.pid))
      throw PeerError(what + ": " + peer.name() + " (pid " + std::to_string(peer.pid) + ") died");
  }
}

template <class Pred>
void Runtime::wait_for(std::atomic<uint32_t>* word, Pred ready, const Peer* peer, const std::string& what) {
  double start = now_seconds(), deadline = start + timeout_s_;
  int spins = 0;
  while (true) {
    uint32_t seen = word->load(std::memory_order_acquire);
    if (ready()) return;
    // A short spin catches the common case of an event a few microseconds away.
    if (++spins < 64) continue;
    if (peer != nullptr) check_peer_alive(*peer, what);
    if (stop_.load()) throw Error(what + ": the ODC runtime of rank " + std::to_string(rank_) + " was closed");
    double now = now_seconds();
    if (now > deadline)
      throw TimeoutError("rank " + std::to_string(rank_) + " timed out after " + std::to_string(timeout_s_) +
                         " s " + what);
    futex_wait(word, seen, std::min(0.05, deadline - now));
  }
}

void Runtime::wait_until(std::atomic<uint32_t>* word, const std::function<bool()>& ready, const Peer* peer,
                         const std::string& what) {
  wait_for(word, ready, peer, what);
}

// ---------------------------------------------------------------------------------------------
// Worker side

void Runtime::gather(int unit, int64_t version, void* out, ElemType type, int64_t out_numel, Route route) {
  check_open("gather");
  check_unit(unit, "gather");
  const int64_t numel = numels_[unit], shard = shards_[unit];
  if (out_numel != numel)
    throw Error("gather: unit " + std::to_string(unit) + " has " + std::to_string(numel) + " elements, output holds " +
                std::to_string(out_numel));
  char* dst = static_cast<char*>(out);
  const size_t esize = elem_size(type);
  auto piece = [&](int owner, int64_t* lo, int64_t* n) {
    *lo = std::min<int64_t>(static_cast<int64_t>(owner) * shard, numel);
    *n = std::min<int64_t>(shard, numel - *lo);
  };
  // TCP owners first: send every request, then copy the local shards while they travel.
  std::vector<Peer*> remote;
  for (int d = 0; d < world_; ++d) {
    Peer& p = *peers_[d];
    if (!uses_socket(p.transport)) continue;
    if (route == Route::kHostOwners && device_owner(d)) continue;
    p.mu.lock();
    remote.push_back(&p);
    try {
      send_request(p.fd, p.name(), timeout_s_, kGather, rank_, unit, version);
    } catch (...) {
      for (Peer* q : remote) q->mu.unlock();
      throw;
    }
  }
  std::vector<float> staging;
  try {
    for (int d = 0; d < world_; ++d) {
      Peer& p = *peers_[d];
      if (uses_socket(p.transport)) continue;
      if (route == Route::kHostOwners && device_owner(d)) continue;
      int64_t lo, n;
      piece(d, &lo, &n);
      UnitEntry* e = p.seg->unit(unit);
      wait_for(
          &p.seg->pub_seq, [&] { return e->version.load(std::memory_order_acquire) >= version; },
          d == rank_ ? nullptr : &p,
          "waiting for " + p.name() + " to publish unit " + std::to_string(unit) + " version " +
              std::to_string(version) + " (gather)");
      if (n <= 0) continue;
      int64_t seen = e->version.load(std::memory_order_acquire);
      const float* src = p.seg->master(unit);
      store_from_f32(dst + lo * esize, type, src, n);
      if (e->version.load(std::memory_order_acquire) != seen)
        throw Error("gather: " + p.name() + " republished unit " + std::to_string(unit) +
                    " while rank " + std::to_string(rank_) + " was reading version " + std::to_string(seen));
    }
    for (Peer* p : remote) {
      const WireHeader r = recv_reply(p->fd, p->name(), timeout_s_ + 5,
                                      "gather of unit " + std::to_string(unit) + " from " + p->name() + " failed");
      int64_t lo, n;
      piece(p->rank, &lo, &n);
      if (r.count != std::max<int64_t>(n, 0)) throw PeerError("gather: " + p->name() + " sent a wrong shard size");
      if (n <= 0) continue;
      if (type == ElemType::kF32) {
        net::recv_all(p->fd, dst + lo * esize, static_cast<size_t>(n) * 4, timeout_s_, p->name());
      } else {
        staging.resize(static_cast<size_t>(n));
        net::recv_all(p->fd, staging.data(), static_cast<size_t>(n) * 4, timeout_s_, p->name());
        store_from_f32(dst + lo * esize, type, staging.data(), n);
      }
    }
  } catch (...) {
    for (Peer* q : remote) q->mu.unlock();
    throw;
  }
  for (Peer* q : remote) q->mu.unlock();
}

void Runtime::scatter_accumulate(int unit, int64_t version, const void* grad, ElemType type, int64_t grad_numel,
                                 Route route) {
  check_open("scatter_accumulate");
  check_unit(unit, "scatter_accumulate");
  const int64_t numel = numels_[unit], shard = shards_[unit];
  if (grad_numel != numel)
    throw Error("scatter_accumulate: unit " + std::to_string(unit) + " has " + std::to_string(numel) +
                " elements, gradient holds " + std::to_string(grad_numel));
  const char* src = static_cast<const char*>(grad);
  const size_t esize = elem_size(type);
  std::vector<float> staging;
  // Start with the next owner so that ranks do not all queue at owner 0 at once.
  for (int i = 0; i < world_; ++i) {
    int d = (rank_ + 1 + i) % world_;
    if (route == Route::kHostOwners && device_owner(d)) continue;
    int64_t lo = std::min<int64_t>(static_cast<int64_t>(d) * shard, numel);
    int64_t n = std::max<int64_t>(0, std::min<int64_t>(shard, numel - lo));
    push_to_owner(*peers_[d], unit, version, 0, src + lo * esize, type, n, staging);
  }
}

void Runtime::scatter_accumulate_range(int unit, int64_t version, int64_t offset, const void* grad, ElemType type,
                                       int64_t n) {
  check_open("scatter_accumulate");
  check_unit(unit, "scatter_accumulate");
  const int64_t numel = numels_[unit], shard = shards_[unit];
  if (offset < 0 || n < 0 || offset + n > numel)
    throw Error("scatter_accumulate: rank " + std::to_string(rank_) + ": elements [" + std::to_string(offset) + ", " +
                std::to_string(offset + n) + ") are outside unit " + std::to_string(unit) + " of " +
                std::to_string(numel) + " elements");
  const char* src = static_cast<const char*>(grad);
  const size_t esize = elem_size(type);
  std::vector<float> staging;
  for (int i = 0; i < world_; ++i) {
    int d = (rank_ + 1 + i) % world_;
    const int64_t lo = static_cast<int64_t>(d) * shard;
    const int64_t a = std::max(lo, offset), b = std::min(lo + shard, offset + n);
    if (a >= b) continue;  // this owner holds none of the range
    push_to_owner(*peers_[d], unit, version, a - lo, src + (a - offset) * esize, type, b - a, staging);
  }
}

void Runtime::push_to_owner(Peer& p, int unit, int64_t version, int64_t offset, const char* src, ElemType type,
                            int64_t count, std::vector<float>& staging) {
  const size_t esize = elem_size(type);
  if (p.transport == Transport::kSelf) {
    if (type == ElemType::kF32) {
      accumulate(unit, version, rank_, reinterpret_cast<const float*>(src), count, offset);
    } else {
      staging.resize(static_cast<size_t>(count));
      load_to_f32(staging.data(), src, type, count);
      accumulate(unit, version, rank_, staging.data(), count, offset);
    }
  } else if (is_mapped(p.transport)) {
    // In slot-sized chunks (at least one message, so an empty piece still reaches its owner).
    SlotHeader* slot = p.seg->slot(rank_);
    float* data = p.seg->slot_data(rank_);
    const std::string what = "waiting for its receive slot at " + p.name() + " (pushing unit " +
                             std::to_string(unit) + " version " + std::to_string(version) + ")";
    int64_t sent = 0;
    do {
      const int64_t chunk = std::min(slot_elems_, count - sent);
      wait_for(
          &p.seg->slot_seq, [&] { return slot->state.load(std::memory_order_acquire) == kSlotFree; }, &p, what);
      load_to_f32(data, src + sent * esize, type, chunk);
      p.seg->raise_slot(rank_, unit, version, chunk, kSlotHost, offset + sent);
      sent += chunk;
    } while (sent < count);
  } else {
    std::lock_guard<std::mutex> lock(p.mu);
    send_request(p.fd, p.name(), timeout_s_, kPush, rank_, unit, version, count, static_cast<uint64_t>(offset));
    if (type == ElemType::kF32) {
      net::send_all(p.fd, src, static_cast<size_t>(count) * 4, timeout_s_, p.name());
    } else {
      staging.resize(static_cast<size_t>(count));
      load_to_f32(staging.data(), src, type, count);
      net::send_all(p.fd, staging.data(), static_cast<size_t>(count) * 4, timeout_s_, p.name());
    }
  }
}

void Runtime::done(int64_t version) {
  check_open("done");
  // Owners may overwrite their device masters once every done(version) arrived: the device
  // copies this rank enqueued from them must have finished first.
  if (dev_) dev_sync_pending();
  for (int d = 0; d < world_; ++d) {
    Peer& p = *peers_[d];
    if (uses_socket(p.transport)) {
      std::lock_guard<std::mutex> lock(p.mu);
      send_request(p.fd, p.name(), timeout_s_, kDone, rank_, 0, version);
    } else {
      p.seg->done(rank_)->store(version, std::memory_order_release);
      signal_event(&p.seg->doorbell);
    }
  }
}

// Work-stealing deque of one owner's microbatches for one minibatch, one word:
// tag (version + 1, 24 bits) << 40 | front << 20 | back. The owner takes from the front, thieves
// from the back; a word left from an older minibatch restarts as [0, count) for the new one.
static int64_t claim_slot(std::atomic<uint64_t>& word, int64_t version, int64_t count, bool steal, int owner) {
  constexpr uint64_t kField = (1u << 20) - 1, kTag = (1u << 24) - 1;
  if (count < 0 || static_cast<uint64_t>(count) > kField)
    throw Error("claim: rank " + std::to_string(owner) + " has " + std::to_string(count) +
                " microbatches in minibatch " + std::to_string(version) + "; between 0 and " +
                std::to_string(kField) + " fit a deque");
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
    int64_t got;
    if (steal) {
      got = static_cast<int64_t>(--back);
    } else {
      got = static_cast<int64_t>(front++);
    }
    const uint64_t next = (tag << 40) | (front << 20) | back;
    if (word.compare_exchange_weak(cur, next, std::memory_order_acq_rel)) return got;
  }
}

int64_t Runtime::local_claim(int64_t version, int64_t count, bool steal) {
  return claim_slot(seg_->deques[version % kRing], version, count, steal, rank_);
}

int64_t Runtime::claim(int64_t version, int owner, int64_t count, bool steal) {
  check_open("claim");
  if (owner < 0 || owner >= world_)
    throw Error("claim: owner rank " + std::to_string(owner) + " outside world size " + std::to_string(world_));
  Peer& p = *peers_[owner];
  if (!uses_socket(p.transport)) return claim_slot(p.seg->deques[version % kRing], version, count, steal, owner);
  std::lock_guard<std::mutex> lock(p.mu);
  send_request(p.fd, p.name(), timeout_s_, kClaim, rank_, 0, version, count, steal ? 1 : 0);
  return recv_reply(p.fd, p.name(), timeout_s_,
                    "claim at rank " + std::to_string(owner) + " failed for minibatch " + std::to_string(version))
      .count;
}

// Control requests of the nvshmem transport; a failure marks NVSHMEM broken, so that close skips
// its collective teardown (which would wait for the peer forever).
void Runtime::nv_wait_published(Peer& p, int unit, int64_t version) {
  const std::string what = "gather over nvshmem: rank " + std::to_string(rank_) + " waiting for " + p.name() +
                           " to publish unit " + std::to_string(unit) + " version " + std::to_string(version);
  std::lock_guard<std::mutex> lock(p.mu);
  try {
    send_request(p.fd, p.name(), timeout_s_, kNvWaitPublished, rank_, unit, version);
    recv_reply(p.fd, p.name(), timeout_s_ + 5, what);
  } catch (...) {
    nv_broken_.store(true);
    throw;
  }
}

void Runtime::nv_wait_slot(Peer& p, int unit, int64_t version) {
  const std::string what = "scatter_accumulate over nvshmem: rank " + std::to_string(rank_) +
                           " waiting for its receive slot at " + p.name() + " (pushing unit " + std::to_string(unit) +
                           " version " + std::to_string(version) + ")";
  std::lock_guard<std::mutex> lock(p.mu);
  try {
    send_request(p.fd, p.name(), timeout_s_, kNvWaitSlot, rank_, unit, version);
    recv_reply(p.fd, p.name(), timeout_s_ + 5, what);
  } catch (...) {
    nv_broken_.store(true);
    throw;
  }
}

void Runtime::nv_commit(Peer& p, int unit, int64_t version, int64_t count) {
  std::lock_guard<std::mutex> lock(p.mu);
  try {
    send_request(p.fd, p.name(), timeout_s_, kNvCommit, rank_, unit, version, count);
  } catch (const std::exception& e) {
    nv_broken_.store(true);
    throw PeerError("scatter_accumulate over nvshmem: rank " + std::to_string(rank_) + " raising its slot at " +
                    p.name() + " (unit " + std::to_string(unit) + " version " + std::to_string(version) +
                    "): " + e.what());
  }
}

void Runtime::wait_scalar(SegmentHeader* seg, int64_t version, const Peer* peer, const std::string& what) {
  ScalarEntry* e = seg->scalar(version);
  wait_for(&seg->scalar_seq, [&] { return e->version.load(std::memory_order_acquire) >= version; }, peer, what);
  if (e->version.load(std::memory_order_acquire) != version)
    throw Error(what + ": the peer is out of step (it made more allgather_scalar calls)");
}

std::vector<double> Runtime::allgather_scalar(int64_t version, double value) {
  check_open("allgather_scalar");
  // Entries are tagged by a per-runtime call sequence (every rank makes the same calls in the same
  // order), so several scalars per minibatch never overwrite each other. A rank can run at most
  // one call ahead of the slowest, so a ring of kRing entries is never overrun.
  const int64_t seq = scalar_calls_++;
  ScalarEntry* mine = seg_->scalar(seq);
  mine->value = value;
  mine->version.store(seq, std::memory_order_release);
  signal_event(&seg_->scalar_seq);
  std::vector<double> out(world_, 0.0);
  for (int d = 0; d < world_; ++d) {
    Peer& p = *peers_[d];
    const std::string what = "waiting for the scalar of " + p.name() + " (call " + std::to_string(seq) +
                             ", minibatch " + std::to_string(version) + ")";
    if (uses_socket(p.transport)) {
      std::lock_guard<std::mutex> lock(p.mu);
      send_request(p.fd, p.name(), timeout_s_, kScalar, rank_, 0, seq);
      out[d] = recv_reply(p.fd, p.name(), timeout_s_ + 5, what).value;
    } else {
      wait_scalar(p.seg, seq, d == rank_ ? nullptr : &p, what);
      out[d] = p.seg->scalar(seq)->value;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Owner side

bool Runtime::accept_push(int unit, int64_t version, int client) {
  int64_t expected = accumulating_version_.load(std::memory_order_acquire);
  if (version == expected) return true;
  std::lock_guard<std::mutex> lock(error_mu_);
  if (daemon_error_.empty())
    daemon_error_ = "rank " + std::to_string(client) + " pushed unit " + std::to_string(unit) + " for version " +
                    std::to_string(version) + " while rank " + std::to_string(rank_) + " accumulates version " +
                    std::to_string(expected);
  return false;
}

void Runtime::accumulate(int unit, int64_t version, int client, const float* data, int64_t count, int64_t offset) {
  if (!accept_push(unit, version, client)) return;
  std::lock_guard<std::mutex> lock(*accum_mu_[unit]);
  float* acc = accum_[unit].get() + offset;
  for (int64_t i = 0; i < count; ++i) acc[i] += data[i];
}

bool Runtime::drain_slots() {
  bool drained = false;
  // Every slot, mine included: with a device, my own pushes arrive in my device slot.
  for (int c = 0; c < world_; ++c) {
    SlotHeader* slot = seg_->slot(c);
    if (slot->state.load(std::memory_order_acquire) != kSlotFull) continue;
    int unit = slot->unit;
    int64_t count = slot->count, offset = slot->offset;
    const bool host = slot->where == kSlotHost;
    if (unit < 0 || unit >= num_units() || count < 0 || offset < 0 || offset + count > shards_[unit] ||
        (host && count > slot_elems_) || (!host && offset != 0)) {
      std::lock_guard<std::mutex> lock(error_mu_);
      if (daemon_error_.empty())
        daemon_error_ = "rank " + std::to_string(c) + " pushed a malformed message (unit " + std::to_string(unit) +
                        ", " + std::to_string(count) + " elements at " + std::to_string(offset) + ") to rank " +
                        std::to_string(rank_);
    } else if (slot->where == kSlotDevice || slot->where == kSlotNvshmem) {
      if (dev_ == nullptr) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (daemon_error_.empty())
          daemon_error_ = "rank " + std::to_string(c) + " pushed unit " + std::to_string(unit) +
                          " into device memory of rank " + std::to_string(rank_) + ", which has no device";
      } else if (accept_push(unit, slot->version, c)) {
        try {
          dev_accumulate(unit, c, count, slot->where);
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(error_mu_);
          if (daemon_error_.empty()) daemon_error_ = e.what();
        }
      }
      pushes_received_.fetch_add(1, std::memory_order_relaxed);
      bytes_received_.fetch_add(count * 4, std::memory_order_relaxed);
    } else {
      accumulate(unit, slot->version, c, seg_->slot_data(c), count, offset);
      pushes_received_.fetch_add(1, std::memory_order_relaxed);
      bytes_received_.fetch_add(count * 4, std::memory_order_relaxed);
    }
    slot->state.store(kSlotFree, std::memory_order_release);
    drained = true;
  }
  if (drained) {
    signal_event(&seg_->slot_seq);
    signal_event(&seg_->doorbell);
  }
  return drained;
}

void Runtime::daemon_loop() {
  while (!stop_.load(std::memory_order_acquire)) {
    uint32_t seen = seg_->doorbell.load(std::memory_order_acquire);
    if (drain_slots()) continue;
    futex_wait(&seg_->doorbell, seen, 0.1);
  }
}

void Runtime::wait_complete(int64_t version) {
  check_open("wait_complete");
  if (version != accumulating_version_.load())
    throw Error("wait_complete: rank " + std::to_string(rank_) + " accumulates version " +
                std::to_string(accumulating_version_.load()) + ", not " + std::to_string(version));
  double deadline = now_seconds() + timeout_s_;
  while (true) {
    uint32_t seen = seg_->doorbell.load(std::memory_order_acquire);
    {
      std::lock_guard<std::mutex> lock(error_mu_);
      if (!daemon_error_.empty()) throw PeerError(daemon_error_);
    }
    int missing = -1;
    for (int c = 0; c < world_ && missing < 0; ++c) {
      if (seg_->done(c)->load(std::memory_order_acquire) < version) missing = c;
      else if (seg_->slot(c)->state.load(std::memory_order_acquire) != kSlotFree) missing = c;
    }
    if (missing < 0) break;
    const std::string what = "waiting for done(" + std::to_string(version) + ") and drained pushes from rank " +
                             std::to_string(missing) + " (wait_complete)";
    {
      std::lock_guard<std::mutex> lock(error_mu_);
      if (!client_failure_[missing].empty()) throw PeerError(what + ": " + client_failure_[missing]);
    }
    if (is_mapped(peers_[missing]->transport)) check_peer_alive(*peers_[missing], what);
    double now = now_seconds();
    if (now > deadline)
      throw TimeoutError("rank " + std::to_string(rank_) + " timed out after " + std::to_string(timeout_s_) +
                         " s " + what);
    futex_wait(&seg_->doorbell, seen, std::min(0.05, deadline - now));
  }
  completed_version_.store(version);
  accumulating_version_.store(version + 1);
}

void Runtime::fetch_grad(int unit, float* out, int64_t out_numel) {
  check_open("fetch_grad");
  check_unit(unit, "fetch_grad");
  if (out_numel != shards_[unit])
    throw Error("fetch_grad: unit " + std::to_string(unit) + " shard holds " + std::to_string(shards_[unit]) +
                " elements, output " + std::to_string(out_numel));
  const float* acc = grad_in_place(unit);
  std::memcpy(out, acc, static_cast<size_t>(shards_[unit]) * 4);
  clear_grad(unit);
}

float* Runtime::grad_in_place(int unit) {
  check_open("fetch_grad");
  check_unit(unit, "fetch_grad");
  int64_t completed = completed_version_.load();
  if (completed < 0 || last_fetched_[unit] >= completed)
    throw Error("fetch_grad: rank " + std::to_string(rank_) + " unit " + std::to_string(unit) +
                ": no completed minibatch to fetch (call wait_complete(version) first; last completed " +
                std::to_string(completed) + ")");
  std::lock_guard<std::mutex> lock(*accum_mu_[unit]);
  if (dev_) dev_fetch_add(unit, accum_[unit].get());
  last_fetched_[unit] = completed;
  grad_lent_[unit] = 1;
  return accum_[unit].get();
}

void Runtime::clear_grad(int unit) {
  check_unit(unit, "clear_grad");
  std::lock_guard<std::mutex> lock(*accum_mu_[unit]);
  std::memset(accum_[unit].get(), 0, static_cast<size_t>(shards_[unit]) * 4);
  grad_lent_[unit] = 0;
}

float* Runtime::master_data(int unit) {
  check_open("master_data");
  check_unit(unit, "master_data");
  return seg_->master(unit);
}

void Runtime::publish(int unit, const float* shard, int64_t shard_numel, int64_t version) {
  check_open("publish");
  check_unit(unit, "publish");
  if (shard_numel != shards_[unit])
    throw Error("publish: unit " + std::to_string(unit) + " shard holds " + std::to_string(shards_[unit]) +
                " elements on rank " + std::to_string(rank_) + ", got " + std::to_string(shard_numel));
  check_publish(unit, version);
  std::memcpy(seg_->master(unit), shard, static_cast<size_t>(shard_numel) * 4);
  announce(unit, version);
}

void Runtime::publish_in_place(int unit, int64_t version) {
  check_open("publish");
  check_unit(unit, "publish");
  check_publish(unit, version);
  announce(unit, version);
}

void Runtime::check_publish(int unit, int64_t version) const {
  int64_t cur = seg_->unit(unit)->version.load();
  if (version <= cur)
    throw Error("publish: rank " + std::to_string(rank_) + " unit " + std::to_string(unit) + " is at version " +
                std::to_string(cur) + "; version " + std::to_string(version) + " does not move it forward");
  if (version > completed_version_.load() + 1)
    throw Error("publish: rank " + std::to_string(rank_) + " unit " + std::to_string(unit) + " version " +
                std::to_string(version) + " before minibatch " + std::to_string(version - 1) +
                " completed (wait_complete first)");
  // Peers may push version `version` as soon as it is announced; they must land in a cleared
  // accumulator, not in the gradient the optimizer still reads.
  if (grad_lent_[unit])
    throw Error("publish: rank " + std::to_string(rank_) + " unit " + std::to_string(unit) +
                ": its gradient is still lent out (call clear_grad first)");
}

void Runtime::announce(int unit, int64_t version) {
  if (dev_) dev_publish(unit, seg_->master(unit));  // complete before the version below announces it
  seg_->unit(unit)->version.store(version, std::memory_order_release);
  signal_event(&seg_->pub_seq);
}

int64_t Runtime::published_version(int unit) const {
  check_unit(unit, "published_version");
  return seg_->unit(unit)->version.load();
}

void Runtime::read_shard(int unit, float* out, int64_t out_numel) const {
  check_unit(unit, "read_shard");
  if (out_numel != shards_[unit]) throw Error("read_shard: wrong output size");
  std::memcpy(out, seg_->master(unit), static_cast<size_t>(shards_[unit]) * 4);
}

// ---------------------------------------------------------------------------------------------
// TCP server: performs one-sided operations on this rank's segment for remote peers.

void Runtime::wait_published(int unit, int64_t version, const Peer* via, const std::string& what) {
  UnitEntry* e = seg_->unit(unit);
  wait_for(&seg_->pub_seq, [&] { return e->version.load(std::memory_order_acquire) >= version; }, via, what);
}

void Runtime::serve_loop() {
  while (!stop_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    int r = poll(&p, 1, 100);
    if (r <= 0) continue;
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    net::set_nodelay(fd);
    std::lock_guard<std::mutex> lock(conn_mu_);
    conn_fds_.push_back(fd);
    conn_threads_.emplace_back([this, fd] { serve_connection(fd); });
  }
}

void Runtime::serve_connection(int fd) {
  int client = -1;
  bool said_bye = false;
  auto reply_error = [&](const std::string& msg) {
    WireHeader r{};
    r.status = 1;
    r.count = static_cast<int64_t>(msg.size());
    net::send_all(fd, &r, sizeof(r), timeout_s_, "rank " + std::to_string(client));
    net::send_all(fd, msg.data(), msg.size(), timeout_s_, "rank " + std::to_string(client));
  };
  // Waits until the requested unit is published at the requested version; false = an error
  // reply was sent instead.
  auto await_publication = [&](const WireHeader& h, const char* via) {
    if (h.unit < 0 || h.unit >= num_units()) {
      reply_error("rank " + std::to_string(rank_) + " has no unit " + std::to_string(h.unit));
      return false;
    }
    try {
      wait_published(h.unit, h.version, nullptr,
                     "publishing unit " + std::to_string(h.unit) + " version " + std::to_string(h.version) +
                         " for rank " + std::to_string(client) + via);
    } catch (const Error& e) {
      reply_error(e.what());
      return false;
    }
    return true;
  };
  try {
    while (!stop_.load()) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      WireHeader h{};
      const std::string peer_name = "rank " + std::to_string(client);
      net::recv_all(fd, &h, sizeof(h), timeout_s_, peer_name);
      if (h.op == kHello) {
        client = h.rank;
        WireHeader r{};
        bool ok = client >= 0 && client < world_ && h.aux == layout_hash_ && h.count == world_;
        r.status = ok ? 0 : 1;
        net::send_all(fd, &r, sizeof(r), timeout_s_, peer_name);
        if (!ok) break;
        continue;
      }
      if (client < 0) break;  // every connection starts with a hello
      switch (h.op) {
        case kGather: {
          if (!await_publication(h, "")) break;
          const int64_t numel = numels_[h.unit], shard = shards_[h.unit];
          int64_t lo = std::min<int64_t>(static_cast<int64_t>(rank_) * shard, numel);
          int64_t n = std::max<int64_t>(0, std::min<int64_t>(shard, numel - lo));
          WireHeader r{};
          r.count = n;
          r.version = seg_->unit(h.unit)->version.load();
          net::send_all(fd, &r, sizeof(r), timeout_s_, peer_name);
          net::send_all(fd, seg_->master(h.unit), static_cast<size_t>(n) * 4, timeout_s_, peer_name);
          break;
        }
        case kPush: {
          const int64_t offset = static_cast<int64_t>(h.aux);
          if (h.unit < 0 || h.unit >= num_units() || h.count < 0 || offset < 0 || offset + h.count > shards_[h.unit])
            throw PeerError("malformed push (unit " + std::to_string(h.unit) + ", " + std::to_string(h.count) +
                            " elements at " + std::to_string(offset) + ")");
          SlotHeader* slot = seg_->slot(client);
          int64_t got = 0;
          do {  // in slot-sized chunks
            const int64_t chunk = std::min(slot_elems_, h.count - got);
            wait_for(&seg_->slot_seq, [&] { return slot->state.load(std::memory_order_acquire) == kSlotFree; },
                     nullptr, "draining the receive slot of rank " + std::to_string(client));
            // A chunk is marked full only after every byte arrived: a client that dies mid-chunk
            // leaves the accumulator without it.
            net::recv_all(fd, seg_->slot_data(client), static_cast<size_t>(chunk) * 4, timeout_s_, peer_name);
            seg_->raise_slot(client, h.unit, h.version, chunk, kSlotHost, offset + got);
            got += chunk;
          } while (got < h.count);
          break;
        }
        case kDone:
          seg_->done(client)->store(h.version, std::memory_order_release);
          signal_event(&seg_->doorbell);
          break;
        case kScalar: {
          try {
            wait_scalar(seg_, h.version, nullptr,
                        "posting scalar call " + std::to_string(h.version) + " for rank " +
                            std::to_string(client));
          } catch (const Error& e) {
            reply_error(e.what());
            break;
          }
          WireHeader r{};
          r.value = seg_->scalar(h.version)->value;
          net::send_all(fd, &r, sizeof(r), timeout_s_, peer_name);
          break;
        }
        case kClaim: {
          WireHeader r{};
          try {
            r.count = local_claim(h.version, h.count, h.aux != 0);
          } catch (const Error& e) {
            reply_error(e.what());
            break;
          }
          net::send_all(fd, &r, sizeof(r), timeout_s_, peer_name);
          break;
        }
        case kNvWaitPublished: {
          if (!await_publication(h, " (gather over nvshmem)")) break;
          WireHeader r{};
          r.version = seg_->unit(h.unit)->version.load();
          net::send_all(fd, &r, sizeof(r), timeout_s_, peer_name);
          break;
        }
        case kNvWaitSlot: {
          SlotHeader* slot = seg_->slot(client);
          try {
            wait_for(&seg_->slot_seq, [&] { return slot->state.load(std::memory_order_acquire) == kSlotFree; },
                     nullptr, "draining the receive slot of rank " + std::to_string(client) + " (push over nvshmem)");
          } catch (const Error& e) {
            reply_error(e.what());
            break;
          }
          WireHeader r{};
          net::send_all(fd, &r, sizeof(r), timeout_s_, peer_name);
          break;
        }
        case kNvCommit: {
          // The client put its data into my NVSHMEM block and completed it (quiet) before this.
          if (h.unit < 0 || h.unit >= num_units() || h.count < 0 || h.count > shards_[h.unit])
            throw PeerError("malformed nvshmem push (unit " + std::to_string(h.unit) + ", " +
                            std::to_string(h.count) + " elements)");
          if (nv_block_ == nullptr) throw PeerError("an nvshmem push, but rank " + std::to_string(rank_) + " has no NVSHMEM block");
          SlotHeader* slot = seg_->slot(client);
          if (slot->state.load(std::memory_order_acquire) != kSlotFree)
            throw PeerError("an nvshmem push into a receive slot that was not free");
          seg_->raise_slot(client, h.unit, h.version, h.count, kSlotNvshmem);
          break;
        }
        case kBye:
          said_bye = true;
          break;
        default:
          throw PeerError("unknown request " + std::to_string(h.op));
      }
      if (said_bye) break;
    }
  } catch (const std::exception& e) {
    if (client >= 0 && !stop_.load()) {
      std::lock_guard<std::mutex> lock(error_mu_);
      if (client_failure_[client].empty())
        client_failure_[client] = std::string("connection from rank ") + std::to_string(client) + " failed: " + e.what();
    }
  }
  if (client >= 0 && !said_bye && !stop_.load()) {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (client_failure_[client].empty())
      client_failure_[client] = "rank " + std::to_string(client) + " closed its connection without saying goodbye";
    signal_event(&seg_->doorbell);
  }
}

void Runtime::close(bool collective) {
  if (closed_) return;
  nv_collective_close_ = collective;
  if (current_runtime() == this) set_current_runtime(nullptr);
  for (auto& p : peers_) {
    if (uses_socket(p->transport) && p->fd >= 0) {
      try {
        std::lock_guard<std::mutex> lock(p->mu);
        send_request(p->fd, p->name(), 1.0, kBye, rank_);
      } catch (...) {
      }
    }
  }
  if (seg_) signal_event(&seg_->closing);
  stop_.store(true);
  if (seg_) {
    seg_->closing.store(1);
    futex_wake_all(&seg_->doorbell);
  }
  if (daemon_.joinable()) daemon_.join();
  if (server_.joinable()) server_.join();
  {
    std::lock_guard<std::mutex> lock(conn_mu_);
    for (auto& t : conn_threads_)
      if (t.joinable()) t.join();
    for (int& fd : conn_fds_) net::close_fd(fd);
  }
  net::close_fd(listen_fd_);
  // After the daemon stopped (it uses the device block), before the segments are unmapped (the
  // release clears my mapper marks in the owners' segments and reads the marks in mine).
  if (dev_) dev_release();
  for (auto& p : peers_) {
    net::close_fd(p->fd);
    if (is_mapped(p->transport) && p->seg) munmap(p->seg, p->seg_bytes);
    p->seg = nullptr;
  }
  unlink_segment();
  // My own segment stays mapped until destruction: arrays lent by master_view may outlive
  // close() (they keep this object alive), and must not point at unmapped memory.
  closed_ = true;
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

#ifndef JAXODC_WITH_CUDA
// Built without CUDA: no device can be enabled, so the other device members are never reached.
namespace jaxodc::odc {

bool cuda_built() { return false; }
std::vector<std::string> cuda_device_uuids() { return {}; }

void Runtime::enable_device(int ordinal) {
  throw Error("rank " + std::to_string(rank_) + ": cannot use CUDA device " + std::to_string(ordinal) +
              ": jaxodc was built without CUDA (no nvcc at build time)");
}
void Runtime::dev_open_peer(Peer& peer) {
  throw Error("rank " + std::to_string(rank_) + ": the cuda_ipc transport to " + peer.name() +
              " needs a CUDA build of jaxodc");
}
void Runtime::gather_device(int, int64_t, float*, CUstream_st*) {
  throw Error("gather_device: jaxodc was built without CUDA");
}
void Runtime::scatter_device(int, int64_t, const float*, CUstream_st*) {
  throw Error("scatter_device: jaxodc was built without CUDA");
}
void Runtime::dev_publish(int, const float*) {}
void Runtime::dev_fetch_add(int, float*) {}
void Runtime::dev_accumulate(int, int, int64_t, int32_t) {}
std::string Runtime::nvshmem_uniqueid() {
  throw Error("rank " + std::to_string(rank_) + ": the nvshmem transport needs a CUDA build of jaxodc");
}
void Runtime::init_nvshmem(const std::string&, const std::vector<int>&) {
  throw Error("rank " + std::to_string(rank_) + ": the nvshmem transport needs a CUDA build of jaxodc");
}
void Runtime::nv_gather_owner(Peer&, int, int64_t, float*, CUstream_st*) {
  throw Error("gather over nvshmem: jaxodc was built without CUDA");
}
void Runtime::nv_push_owner(Peer&, int, int64_t, const float*, CUstream_st*) {
  throw Error("scatter_accumulate over nvshmem: jaxodc was built without CUDA");
}
void Runtime::nv_release() {}
void Runtime::dev_sync_pending() {}
void Runtime::dev_release() {}

}  // namespace jaxodc::odc
#endif
