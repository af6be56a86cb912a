// The lock-step group: its segment, connecting to the peers, calls (post, consume, finish) and the
// progress thread that finishes calls whose peers were late.
#include "lockstep/group.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>

#include "common/handles.h"
#include "lockstep/internal.h"

namespace jaxodc::lockstep {

namespace {

Handles<Group>& live_groups() {
  static Handles<Group> handles;
  return handles;
}

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

// bfloat16 <-> float32 (round to nearest even; NaNs stay NaNs).
inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

const char* kind_name(Kind k) {
  return k == Kind::kGather ? "all_gather" : k == Kind::kScatter ? "reduce_scatter" : "all_reduce";
}

}  // namespace

Group* group_by_handle(int64_t handle) { return live_groups().find(handle); }

Group::Group(int rank, int world, const std::string& shm_name, const std::vector<ChannelSpec>& channels,
             double timeout_s, const std::string& listen_host, const std::string& secret, const std::string& job_id)
    : rank_(rank), world_(world), timeout_s_(timeout_s), channels_(channels), shm_name_(shm_name) {
  const std::string who = "lockstep group of rank " + std::to_string(rank);
  if (world < 1 || rank < 0 || rank >= world)
    throw Error(who + ": rank outside [0, " + std::to_string(world) + ")");
  if (channels.empty()) throw Error(who + ": no channels");
  layout_hash_ = fnv1a(0xcbf29ce484222325ULL, &world, sizeof(world));
  for (const ChannelSpec& ch : channels) {
    if (ch.n <= 0) throw Error(who + ": channel '" + ch.name + "' has " + std::to_string(ch.n) + " elements");
    const int k = static_cast<int>(ch.kind);
    if (k < 0 || k > 2) throw Error(who + ": channel '" + ch.name + "' has an unknown kind");
    layout_hash_ = fnv1a(layout_hash_, &k, sizeof(k));
    layout_hash_ = fnv1a(layout_hash_, &ch.n, sizeof(ch.n));
    const int d = static_cast<int>(ch.dtype);
    if (d < 0 || d > 1) throw Error(who + ": channel '" + ch.name + "' has an unknown dtype");
    layout_hash_ = fnv1a(layout_hash_, &d, sizeof(d));
  }

  // Segment: header, post table (2 entries per channel), the staging areas' headers and read
  // flags, then kSlots staging areas of the largest post (none at world 1: nobody reads them).
  const int nc = num_channels();
  for (int c = 0; c < nc; ++c) slot_bytes_ = std::max(slot_bytes_, post_elems(c) * elem_bytes(c));
  if (world == 1) slot_bytes_ = 0;
  const size_t slots_offset = align_up(kTableOffset + sizeof(PostEntry) * 2 * nc, 64);
  const size_t unread_offset = align_up(slots_offset + sizeof(SlotHeader) * kSlots, 64);
  size_t off = align_up(unread_offset + sizeof(uint32_t) * kSlots * world, 64);
  std::vector<uint64_t> offsets;
  for (int k = 0; k < kSlots; ++k) {
    offsets.push_back(off);
    off = align_up(off + static_cast<size_t>(slot_bytes_), 64);
  }
  const size_t bytes = align_up(off, 4096);
  segment_ = std::make_unique<Segment>();
  shm::create(shm_name, bytes, who, &segment_->map);  // on failure it leaves no segment behind
  linked_ = true;
  segment_->hdr = static_cast<SegmentHeader*>(segment_->map.base);
  segment_->bytes = bytes;
  SegmentHeader* h = segment_->hdr;
  h->rank = rank;
  h->world = world;
  h->pid = static_cast<int32_t>(getpid());
  h->num_channels = nc;
  h->layout_hash = layout_hash_;
  h->bytes = bytes;
  h->num_slots = kSlots;
  h->slot_bytes = static_cast<uint64_t>(slot_bytes_);
  h->slots_offset = slots_offset;
  h->unread_offset = unread_offset;
  for (int c = 0; c < nc; ++c)
    for (int par = 0; par < 2; ++par) {
      PostEntry* e = h->entry(c, par);
      e->seq.store(-1, std::memory_order_relaxed);
      e->slot.store(-1, std::memory_order_relaxed);
    }
  for (int k = 0; k < kSlots; ++k) {
    SlotHeader* sl = h->slot(k);
    sl->left.store(0, std::memory_order_relaxed);
    sl->channel = -1;
    sl->seq = -1;
    sl->offset = offsets[k];
    for (int r = 0; r < world; ++r) h->unread(k, r)->store(0, std::memory_order_relaxed);
  }
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;

  next_seq_.assign(nc, 0);
  in_flight_.assign(nc, 0);
  completed_ = std::make_unique<std::atomic<int64_t>[]>(nc);
  for (int c = 0; c < nc; ++c) completed_[c].store(0);
  peers_.resize(world);
  for (int r = 0; r < world; ++r) {
    peers_[r] = std::make_unique<Peer>();
    peers_[r]->rank = r;
  }
  try {
    if (world > 1) tcp_ = std::make_unique<TcpLinks>(*this, listen_host, auth::Identity{secret, "lockstep_tcp", job_id});
  } catch (...) {
    unlink_segment();
    throw;
  }
  progress_ = std::thread([this] { progress_loop(); });
}

Group::~Group() {
  try {
    close();
  } catch (...) {
  }
}

int Group::port() const { return tcp_ ? tcp_->port() : 0; }

const ChannelSpec& Group::channel(int c) const {
  if (c < 0 || c >= num_channels())
    throw Error("lockstep group of rank " + std::to_string(rank_) + " has no channel " + std::to_string(c) + " (" +
                std::to_string(num_channels()) + " channels)");
  return channels_[c];
}

int64_t Group::in_elems(int c) const {
  const ChannelSpec& ch = channel(c);
  return ch.kind == Kind::kScatter ? ch.n * world_ : ch.n;
}

int64_t Group::out_elems(int c) const {
  const ChannelSpec& ch = channel(c);
  return ch.kind == Kind::kGather ? ch.n * world_ : ch.n;
}

int Group::elem_bytes(int c) const { return channel(c).dtype == DType::kBF16 ? 2 : 4; }

int64_t Group::post_elems(int c) const {
  const ChannelSpec& ch = channel(c);
  return ch.kind == Kind::kScatter ? ch.n * (world_ - 1) : ch.n;
}

int64_t Group::segment_bytes() const { return static_cast<int64_t>(segment_->bytes); }

int64_t Group::tcp_buffer_bytes() const {
  int64_t total = 0;
  for (const auto& p : peers_) total += static_cast<int64_t>(p->recv.size());
  return total;
}

void Group::check_open(const char* op) const {
  if (closed_) throw Error(std::string(op) + ": the lockstep group of rank " + std::to_string(rank_) + " is closed");
}

void Group::connect(const std::vector<PeerConfig>& configs) {
  check_open("connect");
  if (connected_) throw Error("connect: the lockstep group of rank " + std::to_string(rank_) + " is connected");
  if (static_cast<int>(configs.size()) != world_)
    throw Error("connect: expected " + std::to_string(world_) + " peer configs, got " + std::to_string(configs.size()));
  for (const PeerConfig& cfg : configs) {
    if (cfg.rank < 0 || cfg.rank >= world_) throw Error("connect: bad peer rank " + std::to_string(cfg.rank));
    if (cfg.rank == rank_) continue;
    Peer& peer = *peers_[cfg.rank];
    const std::string of = "rank " + std::to_string(rank_) + ": the lockstep segment " + cfg.shm_name + " of rank " +
                           std::to_string(cfg.rank);
    if (cfg.link == Link::kShm) {
      peer.seg = std::make_unique<Segment>();
      shm::map_existing(cfg.shm_name, of, &peer.seg->map);
      peer.seg->hdr = static_cast<SegmentHeader*>(peer.seg->map.base);
      peer.seg->bytes = peer.seg->map.bytes;
      SegmentHeader* h = peer.seg->hdr;
      if (h->magic != kMagic || h->rank != cfg.rank || h->world != world_) throw PeerError(of + " is not one");
      if (h->layout_hash != layout_hash_)
        throw Error(of + " has other channels than rank " + std::to_string(rank_) + "'s (channel layout differs)");
      if (h->num_slots != kSlots || h->slot_bytes != static_cast<uint64_t>(slot_bytes_))
        throw Error(of + " has other staging areas than rank " + std::to_string(rank_) + "'s");
      peer.pid = h->pid;
      peer.link = Link::kShm;
      ++shm_readers_;
    } else if (cfg.link == Link::kTcp) {
      peer.recv_offset.clear();
      size_t total = 0;
      for (int c = 0; c < num_channels(); ++c) {
        peer.recv_offset.push_back(static_cast<int64_t>(total));
        total += 2 * static_cast<size_t>(channels_[c].n * elem_bytes(c));
      }
      peer.recv.assign(total, 0);
      peer.recv_seq = std::make_unique<std::atomic<int64_t>[]>(2 * num_channels());
      for (int i = 0; i < 2 * num_channels(); ++i) peer.recv_seq[i].store(-1);
      peer.link = Link::kTcp;
      tcp_->connect(peer, cfg.host, cfg.port);
    } else {
      throw Error("connect: peer " + std::to_string(cfg.rank) + " cannot use the 'self' link");
    }
  }
  connected_ = true;
  handle_ = live_groups().add(this);
}

void Group::unlink_segment() {
  if (linked_) {
    shm::unlink(shm_name_);
    linked_ = false;
  }
}

std::string Group::describe(const Call& call) const {
  const ChannelSpec& ch = channels_[call.c];
  return std::string("lockstep ") + kind_name(ch.kind) + " on channel " + std::to_string(call.c) + " ('" + ch.name +
         "', call " + std::to_string(call.seq) + ") of rank " + std::to_string(rank_);
}

void Group::ring_doorbell() { signal_event(&segment_->hdr->doorbell); }

int Group::claim_slot() {
  std::lock_guard<std::mutex> lock(post_mu_);
  SegmentHeader* h = segment_->hdr;
  for (int k = 0; k < kSlots; ++k) {
    SlotHeader* sl = h->slot(k);
    // acquire: the readers' copies out of the area happened before their release of it
    if (sl->left.load(std::memory_order_acquire) != 0) continue;
    sl->left.store(shm_readers_, std::memory_order_relaxed);
    return k;
  }
  return -1;
}

void Group::release(int r, int slot) {
  SegmentHeader* h = peers_[r]->seg->hdr;
  h->unread(slot, rank_)->store(0, std::memory_order_relaxed);
  if (h->slot(slot)->left.fetch_sub(1, std::memory_order_acq_rel) == 1) signal_event(&h->doorbell);
}

bool Group::post(Call& call) {
  if (call.posted) return true;
  const ChannelSpec& ch = channels_[call.c];
  if (shm_readers_ > 0) {
    const int k = claim_slot();
    if (k < 0) return false;
    SegmentHeader* h = segment_->hdr;
    SlotHeader* sl = h->slot(k);
    char* dst = h->data(k);
    const int64_t slice = ch.n * call.eb;
    if (ch.kind == Kind::kScatter) {
      // Only the peers' slices travel: slice q at position q (q < me) or q - 1 (q > me).
      for (int q = 0, at = 0; q < world_; ++q)
        if (q != rank_) std::memcpy(dst + (at++) * slice, call.in + q * slice, static_cast<size_t>(slice));
    } else {
      std::memcpy(dst, call.in, static_cast<size_t>(slice));
    }
    sl->channel = call.c;
    sl->seq = call.seq;
    for (auto& p : peers_)
      if (p->link == Link::kShm) h->unread(k, p->rank)->store(1, std::memory_order_relaxed);
    PostEntry* e = h->entry(call.c, call.seq);
    e->slot.store(k, std::memory_order_relaxed);
    e->seq.store(call.seq, std::memory_order_release);
    for (auto& p : peers_)
      if (p->link == Link::kShm) signal_event(&p->seg->hdr->doorbell);
  }
  call.posted = true;  // before the sends: a failed send fails the call, it is never retried
  for (auto& p : peers_) {
    if (p->link != Link::kTcp) continue;
    // A reduce-scatter sends each owner only its slice.
    const char* data = ch.kind == Kind::kScatter ? call.in + p->rank * ch.n * call.eb : call.in;
    tcp_->send(*p, call.c, call.seq, data, ch.n);
  }
  return true;
}

const char* Group::arrived(Call& call, int r, int* slot) {
  const ChannelSpec& ch = channels_[call.c];
  Peer& p = *peers_[r];
  *slot = -1;
  if (r == rank_) return call.in + (ch.kind == Kind::kScatter ? static_cast<int64_t>(rank_) * ch.n * call.eb : 0);
  if (p.link == Link::kShm) {
    SegmentHeader* h = p.seg->hdr;
    PostEntry* e = h->entry(call.c, call.seq);
    const int64_t seen = e->seq.load(std::memory_order_acquire);
    if (seen == call.seq) {
      const int k = e->slot.load(std::memory_order_relaxed);
      if (k < 0 || k >= h->num_slots)
        throw PeerError(describe(call) + ": rank " + std::to_string(r) + " posted it into staging area " +
                        std::to_string(k) + " (it has " + std::to_string(h->num_slots) + ")");
      *slot = k;
      // A reduce-scatter's area holds the writer's peers' slices: mine at rank_ or rank_ - 1.
      const int64_t at = ch.kind == Kind::kScatter ? (rank_ < r ? rank_ : rank_ - 1) : 0;
      return h->data(k) + at * ch.n * call.eb;
    }
    if (seen > call.seq)
      throw PeerError(describe(call) + ": rank " + std::to_string(r) + " already posted call " + std::to_string(seen) +
                      " of this channel (out of step: ranks must make the same calls on every channel)");
    return nullptr;
  }
  const int64_t par = call.seq & 1;
  if (p.recv_seq[2 * call.c + par].load(std::memory_order_acquire) == call.seq)
    return p.recv.data() + p.recv_offset[call.c] + par * ch.n * call.eb;
  if (p.failed.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(p.fail_mu);
    throw PeerError(describe(call) + ": waiting for rank " + std::to_string(r) + ": " + p.failure);
  }
  return nullptr;
}

bool Group::advance(Call& call) {
  const ChannelSpec& ch = channels_[call.c];
  const size_t bytes = static_cast<size_t>(ch.n * call.eb);
  // A shm peer's post must still be this call after the copy (its entry cannot be reposted before
  // every rank finished reading it, unless a rank is out of step); then its area is released.
  auto done_with = [&](int r, int slot) {
    if (slot < 0) return;
    SegmentHeader* h = peers_[r]->seg->hdr;
    const int64_t seen = h->entry(call.c, call.seq)->seq.load(std::memory_order_acquire);
    if (seen != call.seq || h->slot(slot)->seq != call.seq || h->slot(slot)->channel != call.c)
      throw PeerError(describe(call) + ": rank " + std::to_string(r) + " reposted its area while it was read (call " +
                      std::to_string(seen) + "; out of step)");
    release(r, slot);
  };
  int slot = -1;
  if (ch.kind == Kind::kGather) {
    bool all = true;
    for (int r = 0; r < world_; ++r) {
      if (call.got[r]) continue;
      const char* src = arrived(call, r, &slot);
      if (!src) {
        all = false;
        continue;
      }
      std::memcpy(call.out + r * bytes, src, bytes);
      call.got[r] = 1;
      done_with(r, slot);
    }
    return all;
  }
  // Sums in rank order: the same bits on every rank, whatever the arrival order.
  while (call.next < world_) {
    const char* src = arrived(call, call.next, &slot);
    if (!src) return false;
    if (call.next == 0) {
      std::memcpy(call.out, src, bytes);
    } else if (ch.dtype == DType::kBF16) {
      auto* out = reinterpret_cast<uint16_t*>(call.out);
      const auto* in = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < ch.n; ++i) out[i] = f32_to_bf16(bf16_to_f32(out[i]) + bf16_to_f32(in[i]));
    } else {
      auto* out = reinterpret_cast<float*>(call.out);
      const auto* in = reinterpret_cast<const float*>(src);
      for (int64_t i = 0; i < ch.n; ++i) out[i] += in[i];
    }
    ++call.next;
    done_with(call.next - 1, slot);
  }
  return true;
}

void Group::finish(Call& call, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_[call.c] = 0;
    if (error.empty()) completed_[call.c].store(call.seq + 1, std::memory_order_release);
  }
  call.done(error);
}

void Group::start(int c, const void* in, void* out, std::function<void(const std::string&)> done) {
  auto call = std::make_shared<Call>();
  call->c = c;
  call->in = static_cast<const char*>(in);
  call->out = static_cast<char*>(out);
  call->done = std::move(done);
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::string err;
    if (closed_ || stop_.load()) err = "the lockstep group of rank " + std::to_string(rank_) + " is closed";
    else if (!connected_) err = "the lockstep group of rank " + std::to_string(rank_) + " is not connected";
    else if (c < 0 || c >= num_channels()) err = "rank " + std::to_string(rank_) + " has no lockstep channel " + std::to_string(c);
    else if (in_flight_[c])
      err = "rank " + std::to_string(rank_) + ": call " + std::to_string(next_seq_[c]) + " on lockstep channel '" +
            channels_[c].name + "' started while call " + std::to_string(next_seq_[c] - 1) +
            " is still in flight (calls on one channel must be ordered by data dependencies)";
    if (!err.empty()) {
      call->done(err);
      return;
    }
    call->seq = next_seq_[c]++;
    call->eb = channels_[c].dtype == DType::kBF16 ? 2 : 4;
    in_flight_[c] = 1;
  }
  call->got.assign(world_, 0);
  call->started = now_seconds();
  call->deadline = call->started + timeout_s_;
  try {
    const bool posted = post(*call);
    if (advance(*call) && posted) return finish(*call, "");
  } catch (const std::exception& e) {
    return finish(*call, e.what());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(call);
  }
  ring_doorbell();
}

void Group::run(int c, const void* in, void* out) {
  std::promise<std::string> result;
  std::future<std::string> got = result.get_future();
  start(c, in, out, [&result](const std::string& err) { result.set_value(err); });
  const std::string err = got.get();
  if (err.empty()) return;
  if (err.find("timed out") != std::string::npos) throw TimeoutError(err);
  throw PeerError(err);
}

std::string Group::waiting_on(Call& call, bool check_alive) {
  const ChannelSpec& ch = channels_[call.c];
  auto check = [&](int r, const std::string& what) {
    Peer& p = *peers_[r];
    if (!check_alive || p.link != Link::kShm) return;
    if (p.seg->hdr->closing.load(std::memory_order_acquire))
      throw PeerError(describe(call) + ": waiting for " + what + ", which closed its lockstep group");
    if (!shm::pid_alive(p.pid))
      throw PeerError(describe(call) + ": waiting for " + what + " (pid " + std::to_string(p.pid) + "), which died");
  };
  if (!call.posted) {
    // My staging areas are all unread: name the first peer that has not read one.
    SegmentHeader* h = segment_->hdr;
    for (int k = 0; k < kSlots; ++k)
      for (int r = 0; r < world_; ++r)
        if (r != rank_ && h->unread(k, r)->load(std::memory_order_relaxed)) {
          const SlotHeader* sl = h->slot(k);
          const std::string what = "rank " + std::to_string(r);
          check(r, what);
          return "waiting for a free staging area to post it: " + what + " has not read call " +
                 std::to_string(sl->seq) + " on channel '" +
                 (sl->channel >= 0 && sl->channel < num_channels() ? channels_[sl->channel].name : "?") +
                 "' (staging area " + std::to_string(k) + ")";
        }
    return "waiting for a free staging area to post it";
  }
  for (int r = ch.kind == Kind::kGather ? 0 : call.next; r < world_; ++r) {
    if (ch.kind == Kind::kGather && call.got[r]) continue;
    const std::string what = "rank " + std::to_string(r);
    check(r, what);
    return "waiting for " + what + " to post it";
  }
  return "waiting for nobody";
}

void Group::progress_loop() {
  SegmentHeader* h = segment_->hdr;
  double next_check = 0;
  int idle_rounds = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    const uint32_t seen = h->doorbell.load(std::memory_order_acquire);
    std::vector<std::shared_ptr<Call>> calls;
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls = pending_;
    }
    const double now = now_seconds();
    const bool check = now >= next_check;
    if (check) next_check = now + 0.05;
    std::vector<std::pair<std::shared_ptr<Call>, std::string>> finished;
    for (auto& call : calls) {
      try {
        const bool posted = post(*call);
        if (advance(*call) && posted) {
          finished.emplace_back(call, "");
        } else if (check) {
          const std::string who = waiting_on(*call, true);
          if (now > call->deadline)
            finished.emplace_back(call, describe(*call) + " timed out after " + std::to_string(timeout_s_) +
                                            " s " + who);
        }
      } catch (const std::exception& e) {
        finished.emplace_back(call, e.what());
      }
    }
    if (!finished.empty()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& [call, err] : finished)
          pending_.erase(std::find(pending_.begin(), pending_.end(), call));
      }
      // Outside the lock: XLA may run the rest of its program from this callback, and start more calls.
      for (auto& [call, err] : finished) finish(*call, err);
      idle_rounds = 0;
      continue;
    }
    // A short spin catches a peer's post a few microseconds away; then sleep on my doorbell.
    if (!calls.empty() && ++idle_rounds < 64) continue;
    idle_rounds = 0;
    futex_wait(&h->doorbell, seen, calls.empty() ? 0.2 : 0.05);
  }
}

void Group::close() {
  if (closed_) return;
  live_groups().remove(handle_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  stop_.store(true);
  SegmentHeader* h = segment_->hdr;
  h->closing.store(1, std::memory_order_release);
  futex_wake_all(&h->doorbell);
  signal_event(&h->doorbell);
  if (progress_.joinable()) progress_.join();
  std::vector<std::shared_ptr<Call>> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    calls.swap(pending_);
  }
  for (auto& call : calls) finish(*call, describe(*call) + ": the group was closed");
  for (auto& p : peers_)
    if (p->link == Link::kShm) signal_event(&p->seg->hdr->doorbell);  // their waits see `closing`
  if (tcp_) tcp_->stop();
  for (auto& p : peers_) p->seg.reset();
  unlink_segment();
}

}  // namespace jaxodc::lockstep
