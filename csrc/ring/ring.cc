#include "ring/ring.h"

#include <fcntl.h>
#include <poll.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "hash/sha256.h"
#include "ring/host_kernels.h"
#include "ring/staged_ops.h"
#include "transport/tcp_socket.h"

namespace jaxodc::ring {

using tcp::ErrKind;
using tcp::now_s;
using tcp::TcpError;

namespace {

constexpr uint32_t kAuthMagic = 0x3152584a;   // "JXR1"
constexpr uint32_t kHelloMagic = 0x4c454831;  // hello after authentication
constexpr uint32_t kStartMagic = 0x54525331;  // start of one all-reduce on a connection
constexpr uint32_t kFrameMagic = 0x4d524631;  // one piece
constexpr uint32_t kKindRing = 1, kKindProbe = 2;

struct Hello {
  uint32_t magic, kind;
  uint64_t epoch, probe_bytes;
  uint32_t slot, addr_len;
};
struct StartHdr {
  uint32_t magic, tag;
  uint64_t epoch, count;
  uint32_t dtype, op, quant, piece_elems;
};
struct FrameHdr {
  uint32_t magic, tag, seq, nbytes;
  float qlo, qscale;
  uint64_t epoch;
};
static_assert(sizeof(FrameHdr) == 32, "frame header layout");

std::mutex g_registry_mu;
std::map<int64_t, std::shared_ptr<Endpoint>> g_registry;  // non-owning aliases (see bindings)
std::atomic<int64_t> g_next_handle{1};

void shut(int fd) {
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
}

crypto::Digest mac(const std::string& secret, const char* label, const uint8_t* a, const uint8_t* b) {
  uint8_t msg[6 + 64];
  std::memcpy(msg, label, 6);
  std::memcpy(msg + 6, a, 32);
  std::memcpy(msg + 38, b, 32);
  return crypto::hmac_sha256(secret.data(), secret.size(), msg, sizeof(msg));
}

// Client side of the challenge-response: proves knowledge of the secret and checks the server's
// proof; the secret itself never crosses the wire.
void client_handshake(int fd, const std::string& peer, const std::string& secret, double timeout_s,
                      const Hello& hello, const std::string& my_addr, const std::atomic<bool>* abort_flag) {
  double dl = now_s() + timeout_s;
  std::string what = "authenticating to " + peer;
  uint8_t chal[36];
  tcp::recv_all(fd, chal, sizeof(chal), dl, abort_flag, what);
  uint32_t magic;
  std::memcpy(&magic, chal, 4);
  if (magic != kAuthMagic) throw TcpError(ErrKind::kProtocol, what + ": not a jaxodc ring endpoint");
  uint8_t reply[64];
  tcp::fill_random(reply, 32);
  crypto::Digest m = mac(secret, "client", chal + 4, reply);
  std::memcpy(reply + 32, m.data(), 32);
  tcp::send_all(fd, reply, sizeof(reply), dl, abort_flag, what);
  crypto::Digest server_proof;
  try {
    tcp::recv_all(fd, server_proof.data(), 32, dl, abort_flag, what);
  } catch (const TcpError& e) {
    if (e.kind == ErrKind::kConnection)
      throw TcpError(ErrKind::kConnection, what + ": authentication rejected (wrong secret?)");
    throw;
  }
  if (!crypto::digest_equal(server_proof, mac(secret, "server", reply, chal + 4)))
    throw TcpError(ErrKind::kConnection, what + ": peer failed authentication (wrong secret?)");
  Hello h = hello;
  h.addr_len = static_cast<uint32_t>(my_addr.size());
  tcp::send_all(fd, &h, sizeof(h), dl, abort_flag, what);
  tcp::send_all(fd, my_addr.data(), my_addr.size(), dl, abort_flag, what);
}

}  // namespace

// Per-link emulation: a token bucket caps the bytes/s sent to one peer over all connections, and
// every piece is held back `latency` seconds after it became ready to send.
struct Link {
  std::mutex mu;
  double rate = 0;  // bytes/s; 0 = unlimited
  double latency = 0;
  double tokens = 0, last = 0;

  double burst() const { return std::max(65536.0, rate * 0.005); }
  // Grants up to `want` bytes now (0 and a wait in seconds when the bucket is too low). Grants
  // come in steps of >= 2 ms of traffic (64 KiB at least), so a capped sender wakes a few hundred
  // times a second instead of once per 16 KiB; the 5 ms burst absorbs a late wake-up, so the cap
  // is still reached.
  size_t take(size_t want, double* wait) {
    std::lock_guard<std::mutex> g(mu);
    if (rate <= 0) return want;
    double t = now_s();
    tokens = std::min(burst(), tokens + rate * (t - last));
    last = t;
    double need = std::min<double>(want, std::max(65536.0, rate * 0.002));
    if (tokens < need) {
      *wait = (need - tokens) / rate;
      return 0;
    }
    size_t grant = std::min<size_t>(want, static_cast<size_t>(tokens));
    tokens -= static_cast<double>(grant);
    return grant;
  }
  void refund(size_t n) {
    std::lock_guard<std::mutex> g(mu);
    if (rate > 0) tokens += static_cast<double>(n);
  }
  double lat() {
    std::lock_guard<std::mutex> g(mu);
    return latency;
  }
};

struct RingState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t epoch = 0;
  int world = 1, rank = 0;
  std::string next, prev;
  std::vector<int> out_fds, in_fds;
  std::vector<bool> out_busy;
  std::vector<int> in_state;  // 0 idle (dispatcher reads its next start header), 1 routed/owned, 2 dead
  struct Routed { int idx; StartHdr hdr; };
  std::map<uint32_t, std::deque<Routed>> routed;
  std::string broken;  // set once the ring is unusable (peer lost, timeout, protocol error)
  bool aborted = false, stop = false;
  uint64_t next_ticket = 0, serving = 0;
  std::set<uint64_t> cancelled;
  int wake[2] = {-1, -1};
  std::thread dispatcher;

  ~RingState() {
    for (int fd : out_fds) ::close(fd);
    for (int fd : in_fds) ::close(fd);
    if (wake[0] >= 0) { ::close(wake[0]); ::close(wake[1]); }
  }
  void poke() {
    char c = 1;
    if (wake[1] >= 0) (void)!::write(wake[1], &c, 1);
  }
  void shut_all() {
    for (int fd : out_fds) shut(fd);
    for (int fd : in_fds) shut(fd);
  }
  void advance_serving() {  // skip tickets of ops that gave up waiting
    while (cancelled.count(serving)) cancelled.erase(serving++);
  }
};

// ---------------------------------------------------------------------------------------------
// Endpoint lifecycle

Endpoint::Endpoint(const std::string& host, int port, int pool_size, std::string secret, double timeout_s)
    : host_(host), secret_(std::move(secret)), pool_size_(pool_size), timeout_s_(timeout_s) {
  if (pool_size < 1) throw std::invalid_argument("pool_size must be >= 1");
  if (!(timeout_s > 0)) throw std::invalid_argument("timeout_s must be > 0");
  int bound = 0;
  listen_fd_ = tcp::listen_on(host, port, &bound);
  address_ = host + ":" + std::to_string(bound);
  handle_ = g_next_handle++;
  acceptor_ = std::thread([this] { accept_loop(); });
}

Endpoint::~Endpoint() { close(); }

void Endpoint::close() {
  if (closing_.exchange(true)) return;
  shut(listen_fd_);
  if (acceptor_.joinable()) acceptor_.join();
  ::close(listen_fd_);
  std::shared_ptr<RingState> rs;
  std::vector<Handler> handlers;
  {
    std::lock_guard<std::mutex> g(mu_);
    rs = std::move(ring_);
    for (auto* f : connecting_) f->store(true);
    for (int fd : handler_fds_) shut(fd);
    handlers.swap(handlers_);
    for (auto& [ep, v] : pending_)
      for (auto& p : v) ::close(p.fd);
    pending_.clear();
  }
  if (rs) teardown_ring(rs);
  for (auto& h : handlers) h.th.join();
  cv_.notify_all();
}

void Endpoint::accept_loop() {
  while (!closing_) {
    pollfd p{listen_fd_, POLLIN, 0};
    int rc = poll(&p, 1, 100);
    if (closing_) break;
    if (rc <= 0) continue;
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    tcp::tune_socket(fd);
    std::vector<std::thread> finished;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (closing_) { ::close(fd); break; }
      for (size_t i = 0; i < handlers_.size();) {
        if (handlers_[i].done->load()) {
          finished.push_back(std::move(handlers_[i].th));
          handlers_.erase(handlers_.begin() + i);
        } else {
          ++i;
        }
      }
      handler_fds_.insert(fd);
      auto done = std::make_shared<std::atomic<bool>>(false);
      handlers_.push_back({std::thread([this, fd, done] { handle_incoming(fd, done); }), done});
    }
    for (auto& t : finished) t.join();
  }
}

// Server side of the handshake, then either parks a ring connection for connect_ring() or answers
// a bandwidth probe. Bad peers are logged and dropped; nothing they send can crash the endpoint.
void Endpoint::handle_incoming(int fd, std::shared_ptr<std::atomic<bool>> done) {
  bool keep = false;
  std::string what = "incoming connection on " + address_;
  try {
    double dl = now_s() + std::min(timeout_s_, 30.0);
    uint8_t chal[36];
    std::memcpy(chal, &kAuthMagic, 4);
    tcp::fill_random(chal + 4, 32);
    tcp::send_all(fd, chal, sizeof(chal), dl, &closing_, what);
    uint8_t reply[64];
    tcp::recv_all(fd, reply, sizeof(reply), dl, &closing_, what);
    crypto::Digest got;
    std::memcpy(got.data(), reply + 32, 32);
    if (!crypto::digest_equal(got, mac(secret_, "client", chal + 4, reply))) {
      auth_rejected++;
      std::fprintf(stderr, "jaxodc ring %s: rejected a connection: bad authentication\n", address_.c_str());
      throw TcpError(ErrKind::kProtocol, "bad authentication");
    }
    crypto::Digest proof = mac(secret_, "server", reply, chal + 4);
    tcp::send_all(fd, proof.data(), 32, dl, &closing_, what);
    Hello h;
    tcp::recv_all(fd, &h, sizeof(h), dl, &closing_, what);
    if (h.magic != kHelloMagic || h.addr_len > 256) throw TcpError(ErrKind::kProtocol, "bad hello");
    std::string src(h.addr_len, '\0');
    tcp::recv_all(fd, src.data(), src.size(), dl, &closing_, what);
    if (h.kind == kKindProbe) {
      std::vector<char> sink(1 << 20);
      uint64_t left = h.probe_bytes;
      double pdl = now_s() + timeout_s_ + 60.0;
      while (left > 0) {
        size_t n = std::min<uint64_t>(left, sink.size());
        tcp::recv_all(fd, sink.data(), n, pdl, &closing_, "bandwidth probe from " + src);
        left -= n;
      }
      uint64_t ack = h.probe_bytes;
      tcp::send_all(fd, &ack, sizeof(ack), pdl, &closing_, "bandwidth probe ack to " + src);
    } else if (h.kind == kKindRing) {
      std::lock_guard<std::mutex> g(mu_);
      uint64_t cur = ring_ ? ring_->epoch : 0;
      if (!closing_ && (!ring_ || h.epoch > cur || (h.epoch == cur && ring_->in_fds.empty()))) {
        pending_[h.epoch].push_back({fd, h.slot, src});
        keep = true;
        cv_.notify_all();
      }
    }
  } catch (const std::exception& e) {
    if (!closing_ && std::string(e.what()) != "bad authentication")
      std::fprintf(stderr, "jaxodc ring %s: dropped %s: %s\n", address_.c_str(), what.c_str(), e.what());
  }
  std::lock_guard<std::mutex> g(mu_);
  handler_fds_.erase(fd);
  if (!keep) ::close(fd);
  done->store(true);
}

int Endpoint::world() const {
  auto* self = const_cast<Endpoint*>(this);
  std::lock_guard<std::mutex> g(self->mu_);
  return ring_ ? ring_->world : 0;
}

void Endpoint::teardown_ring(std::shared_ptr<RingState> rs) {
  {
    std::lock_guard<std::mutex> g(rs->mu);
    rs->stop = true;
    rs->aborted = true;
    if (rs->broken.empty()) rs->broken = "ring of epoch " + std::to_string(rs->epoch) + " was replaced";
    rs->shut_all();
    rs->poke();
  }
  rs->cv.notify_all();
  if (rs->dispatcher.joinable()) rs->dispatcher.join();
}

void Endpoint::connect_ring(const std::vector<std::string>& ring, int my_index, uint64_t epoch) {
  int W = static_cast<int>(ring.size());
  if (W < 1) throw std::invalid_argument("connect_ring: empty ring");
  if (my_index < 0 || my_index >= W)
    throw std::invalid_argument("connect_ring: my_index " + std::to_string(my_index) +
                                " out of range for a ring of " + std::to_string(W));
  for (auto& a : ring) {
    std::string h;
    int p;
    tcp::split_address(a, &h, &p);
  }
  // abort() / close() set this flag; every wait below checks it at least every 50 ms.
  std::atomic<bool> stop{false};
  struct Registration {
    Endpoint* ep;
    std::atomic<bool>* flag;
    ~Registration() {
      std::lock_guard<std::mutex> g(ep->mu_);
      ep->connecting_.erase(flag);
    }
  };
  std::shared_ptr<RingState> old;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closing_) throw std::invalid_argument("connect_ring on a closed endpoint");
    if (ring_ && epoch <= ring_->epoch)
      throw std::invalid_argument("connect_ring: epoch " + std::to_string(epoch) +
                                      " must be greater than the current epoch " + std::to_string(ring_->epoch));
    old = std::move(ring_);
    connecting_.insert(&stop);
  }
  Registration reg{this, &stop};
  if (old) teardown_ring(old);
  auto rs = std::make_shared<RingState>();
  rs->epoch = epoch;
  rs->world = W;
  rs->rank = my_index;
  if (W > 1) {
    rs->next = ring[(my_index + 1) % W];
    rs->prev = ring[(my_index + W - 1) % W];
    if (pipe2(rs->wake, O_CLOEXEC | O_NONBLOCK) != 0)
      throw TcpError(ErrKind::kConnection, "pipe2 failed");
    const std::string where = "connect_ring epoch " + std::to_string(epoch) + " on " + address_;
    double dl = now_s() + timeout_s_;
    try {
      for (int s = 0; s < pool_size_; ++s) {
        try {
          int fd = tcp::connect_to(rs->next, std::max(0.01, dl - now_s()), &stop);
          rs->out_fds.push_back(fd);
          Hello h{kHelloMagic, kKindRing, epoch, 0, static_cast<uint32_t>(s), 0};
          client_handshake(fd, rs->next, secret_, std::max(0.01, dl - now_s()), h, ring[my_index], &stop);
        } catch (const TcpError& e) {
          std::string what = e.kind == ErrKind::kAborted ? " aborted while connecting to next peer "
                                                         : " could not connect to next peer ";
          throw TcpError(e.kind, where + what + rs->next + " (connection " + std::to_string(s + 1) + " of " +
                                     std::to_string(pool_size_) + "): " + e.what());
        }
        tcp::set_nonblocking(rs->out_fds.back(), true);
        rs->out_busy.push_back(false);
      }
      std::unique_lock<std::mutex> g(mu_);
      auto got = [&] { return pending_.count(epoch) ? pending_[epoch].size() : size_t(0); };
      while (got() < static_cast<size_t>(pool_size_)) {
        auto waiting = [&] {
          return " waiting for " + std::to_string(pool_size_) + " connections from previous peer " + rs->prev +
                 " (got " + std::to_string(got()) + ")";
        };
        if (closing_) throw TcpError(ErrKind::kAborted, where + ": endpoint closed while" + waiting());
        if (stop) throw TcpError(ErrKind::kAborted, where + " aborted while" + waiting());
        if (now_s() > dl)
          throw TcpError(ErrKind::kTimeout, where + " timed out after " + std::to_string(timeout_s_) + " s" + waiting());
        cv_.wait_for(g, std::chrono::milliseconds(50));
      }
      auto conns = std::move(pending_[epoch]);
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (it->first <= epoch) {
          if (it->first != epoch)
            for (auto& p : it->second) ::close(p.fd);
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
      std::sort(conns.begin(), conns.end(), [](auto& a, auto& b) { return a.slot < b.slot; });
      std::string bad;
      for (auto& p : conns) {
        if (p.src != rs->prev && bad.empty()) bad = p.src;
        tcp::set_nonblocking(p.fd, true);
        rs->in_fds.push_back(p.fd);
        rs->in_state.push_back(0);
      }
      if (!bad.empty())
        throw TcpError(ErrKind::kConnection, where + ": expected connections from previous peer " + rs->prev +
                                                 ", got one from " + bad);
      if (stop) throw TcpError(ErrKind::kAborted, where + " aborted");
      ring_ = rs;
    } catch (...) {
      rs->shut_all();
      throw;
    }
    rs->dispatcher = std::thread([this, rs] { dispatcher_loop(rs); });
  } else {
    std::lock_guard<std::mutex> g(mu_);
    ring_ = rs;
  }
}

// Reads the start header of the next operation on every idle incoming connection and routes the
// connection to the operation with that tag.
void Endpoint::dispatcher_loop(std::shared_ptr<RingState> rs) {
  std::vector<pollfd> fds;
  std::vector<int> idx;
  while (true) {
    fds.clear();
    idx.clear();
    {
      std::lock_guard<std::mutex> g(rs->mu);
      if (rs->stop) return;
      fds.push_back({rs->wake[0], POLLIN, 0});
      idx.push_back(-1);
      for (size_t i = 0; i < rs->in_fds.size(); ++i)
        if (rs->in_state[i] == 0) {
          fds.push_back({rs->in_fds[i], POLLIN, 0});
          idx.push_back(static_cast<int>(i));
        }
    }
    int rc = poll(fds.data(), fds.size(), 100);
    if (rc <= 0) continue;
    if (fds[0].revents) {
      char buf[64];
      while (::read(rs->wake[0], buf, sizeof(buf)) > 0) {
      }
    }
    for (size_t k = 1; k < fds.size(); ++k) {
      if (!fds[k].revents) continue;
      int i = idx[k];
      StartHdr h;
      std::string err;
      try {
        tcp::recv_all(fds[k].fd, &h, sizeof(h), now_s() + timeout_s_, nullptr,
                      "reading the next operation header from previous peer " + rs->prev);
        if (h.magic != kStartMagic || h.epoch != rs->epoch)
          err = "protocol error from previous peer " + rs->prev + ": bad operation header";
      } catch (const std::exception& e) {
        err = std::string("connection from previous peer ") + rs->prev + " lost: " + e.what();
      }
      {
        std::lock_guard<std::mutex> g(rs->mu);
        if (!err.empty()) {
          rs->in_state[i] = 2;
          if (rs->broken.empty()) rs->broken = err;
        } else {
          rs->in_state[i] = 1;
          rs->routed[h.tag].push_back({i, h});
        }
      }
      rs->cv.notify_all();
    }
  }
}

std::shared_ptr<Link> Endpoint::link_for(const std::string& peer) {
  std::lock_guard<std::mutex> g(mu_);
  auto& l = links_[peer];
  if (!l) l = std::make_shared<Link>();
  return l;
}

void Endpoint::set_link(const std::string& peer, double bw, double latency_s) {
  auto l = link_for(peer);
  std::lock_guard<std::mutex> g(l->mu);
  l->rate = bw > 0 ? bw : 0;
  l->latency = latency_s > 0 ? latency_s : 0;
  l->tokens = l->rate > 0 ? l->burst() : 0;
  l->last = now_s();
}

double Endpoint::measure_bandwidth(const std::string& peer, size_t nbytes) {
  if (nbytes == 0) throw std::invalid_argument("measure_bandwidth: nbytes must be > 0");
  auto link = link_for(peer);
  int fd = tcp::connect_to(peer, timeout_s_, &closing_);
  struct Closer { int fd; ~Closer() { ::close(fd); } } closer{fd};
  Hello h{kHelloMagic, kKindProbe, 0, nbytes, 0, 0};
  client_handshake(fd, peer, secret_, timeout_s_, h, address_, &closing_);
  tcp::set_nonblocking(fd, true);
  std::vector<char> buf(std::min<size_t>(nbytes, 1 << 20), 0);
  double t0 = now_s();
  double lat = link->lat();
  if (lat > 0) std::this_thread::sleep_for(std::chrono::duration<double>(lat));
  size_t left = nbytes;
  double dl = now_s() + timeout_s_ + 60.0;
  std::string what = "bandwidth probe to " + peer;
  while (left > 0) {
    double wait = 0;
    size_t g = link->take(std::min(left, buf.size()), &wait);
    if (g == 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(std::min(wait, 0.05)));
      continue;
    }
    tcp::send_all(fd, buf.data(), g, dl, &closing_, what);
    bytes_sent += g;
    left -= g;
  }
  uint64_t ack = 0;
  tcp::recv_all(fd, &ack, sizeof(ack), dl, &closing_, what);
  double t = now_s() - t0;
  if (ack != nbytes) throw TcpError(ErrKind::kProtocol, what + ": bad acknowledgement");
  return static_cast<double>(nbytes) / std::max(t, 1e-9);
}

std::vector<char>* Endpoint::take_work(size_t n) {
  std::lock_guard<std::mutex> g(mu_);
  size_t best = work_free_.size();  // smallest cached buffer that fits, so small scratch never takes a big one
  for (size_t i = 0; i < work_free_.size(); ++i)
    if (work_free_[i]->size() >= n && (best == work_free_.size() || work_free_[i]->size() < work_free_[best]->size()))
      best = i;
  if (best < work_free_.size()) {
    auto* w = work_free_[best].release();
    work_free_.erase(work_free_.begin() + best);
    return w;
  }
  return new std::vector<char>(n);
}

void Endpoint::give_work(std::vector<char>* w) {
  std::lock_guard<std::mutex> g(mu_);
  work_free_.emplace_back(w);
  if (work_free_.size() > 4) work_free_.erase(work_free_.begin());
}

void Endpoint::abort() {
  std::shared_ptr<RingState> rs;
  {
    std::lock_guard<std::mutex> g(mu_);
    rs = ring_;
    for (auto* f : connecting_) f->store(true);
  }
  cv_.notify_all();  // connect_ring waiting for incoming connections
  if (!rs) return;
  {
    std::lock_guard<std::mutex> g(rs->mu);
    rs->aborted = true;
    rs->shut_all();
  }
  rs->cv.notify_all();
}

// ---------------------------------------------------------------------------------------------
// One all-reduce

// Host arrays: sends point straight into x / out, all-gather pieces are received in place, partial
// results live in out (x is only read).
template <DType D>
class CpuOps final : public PieceOps {
  using T = typename Traits<D>::T;
  using K = Kernels<D>;

 public:
  // Scratch the op needs (codes of the whole array, one send and one receive piece); the caller
  // keeps it cached across ops so no op pays for allocating and zero-filling megabytes.
  static size_t scratch_bytes(const OpLayout& L) {
    if (L.quant == Quant::kNone) return L.piece_elems * L.elem_size;
    return (L.count + 2 * L.piece_elems) * L.quant_size;
  }
  CpuOps(const OpLayout& L, const char* x, char* out, char* scratch) : L_(L), x_(x), out_(out) {
    if (L.quant != Quant::kNone) {
      agq_ = scratch;
      sendq_ = agq_ + L.count * L.quant_size;
      recvbuf_ = sendq_ + L.piece_elems * L.quant_size;
      agmeta_.resize(L.num_qpieces);
      range_.resize(L.num_qpieces);
    } else {
      recvbuf_ = scratch;
    }
  }

  const char* send_payload(const Piece& p, QMeta* meta, size_t* nbytes) override {
    size_t es = L_.elem_size, qs = L_.quant_size;
    if (L_.reduce_scatter(p)) {
      const char* src = (p.step == 0 ? x_ : out_) + p.off * es;
      if (L_.quant == Quant::kNone) {
        *nbytes = p.n * es;
        return src;
      }
      // step 0 quantises the input (range pass + codes); later steps reuse the range on_recv took
      *meta = p.step == 0 ? quantize(src, sendq_, p.n) : quantize_range(src, sendq_, p.n, range_[p.qidx]);
      *nbytes = p.n * qs;
      return sendq_;
    }
    if (L_.quant == Quant::kNone) {
      *nbytes = p.n * es;
      return out_ + p.off * es;
    }
    *meta = agmeta_[p.qidx];
    *nbytes = p.n * qs;
    return agq_ + p.off * qs;
  }

  char* recv_target(const Piece& p) override {
    if (L_.reduce_scatter(p)) return recvbuf_;
    return L_.quant == Quant::kNone ? out_ + p.off * L_.elem_size : agq_ + p.off * L_.quant_size;
  }

  void on_recv(const Piece& p, QMeta m) override {
    T* os = reinterpret_cast<T*>(out_) + p.off;
    if (L_.reduce_scatter(p)) {
      bool last = L_.last_reduce(p);
      const T* xs = reinterpret_cast<const T*>(x_) + p.off;
      if (L_.quant == Quant::kNone) {
        K::reduce(reinterpret_cast<const T*>(recvbuf_), xs, os, p.n, L_.op, last, L_.world);
        return;
      }
      // Reduce and take the range of the result in one pass: the next hop (or, on the owner, the
      // single quantisation right below) needs exactly that range.
      Range& rg = range_[p.qidx];
      if (L_.quant == Quant::kU8)
        K::template reduce_q_range<uint8_t>(reinterpret_cast<const uint8_t*>(recvbuf_), m, xs, os, p.n, L_.op,
                                            last, L_.world, &rg.lo, &rg.hi);
      else
        K::template reduce_q_range<uint16_t>(reinterpret_cast<const uint16_t*>(recvbuf_), m, xs, os, p.n,
                                             L_.op, last, L_.world, &rg.lo, &rg.hi);
      if (last) {  // the owner's single quantisation; it keeps the decoded values it sends
        char* q = agq_ + p.off * L_.quant_size;
        if (L_.quant == Quant::kU8)
          agmeta_[p.qidx] = K::template quantize_dequantize<uint8_t>(os, reinterpret_cast<uint8_t*>(q), p.n, 255.0f,
                                                                     rg.lo, rg.hi);
        else
          agmeta_[p.qidx] = K::template quantize_dequantize<uint16_t>(os, reinterpret_cast<uint16_t*>(q), p.n,
                                                                      65535.0f, rg.lo, rg.hi);
      }
    } else if (L_.quant != Quant::kNone) {
      agmeta_[p.qidx] = m;
      dequantize(agq_ + p.off * L_.quant_size, m, os, p.n);
    }
  }

 private:
  QMeta quantize(const char* src, char* dst, size_t n) {
    const T* v = reinterpret_cast<const T*>(src);
    if (L_.quant == Quant::kU8) return K::template quantize<uint8_t>(v, reinterpret_cast<uint8_t*>(dst), n, 255.0f);
    return K::template quantize<uint16_t>(v, reinterpret_cast<uint16_t*>(dst), n, 65535.0f);
  }
  QMeta quantize_range(const char* src, char* dst, size_t n, Range rg) {
    const T* v = reinterpret_cast<const T*>(src);
    if (L_.quant == Quant::kU8)
      return K::template quantize_range<uint8_t>(v, reinterpret_cast<uint8_t*>(dst), n, 255.0f, rg.lo, rg.hi);
    return K::template quantize_range<uint16_t>(v, reinterpret_cast<uint16_t*>(dst), n, 65535.0f, rg.lo, rg.hi);
  }
  void dequantize(const char* q, QMeta m, T* out, size_t n) {
    if (L_.quant == Quant::kU8) K::template dequantize<uint8_t>(reinterpret_cast<const uint8_t*>(q), m, out, n);
    else K::template dequantize<uint16_t>(reinterpret_cast<const uint16_t*>(q), m, out, n);
  }

  OpLayout L_;
  const char* x_;
  char* out_;
  char *sendq_ = nullptr, *recvbuf_ = nullptr, *agq_ = nullptr;
  std::vector<QMeta> agmeta_;
  std::vector<Range> range_;  // per piece: range of the reduced values this peer forwards
};

struct OpRunner {
  Endpoint* ep;
  std::shared_ptr<RingState> rs;
  uint32_t tag;
  OpLayout L;
  int out_slot = -1, in_idx = -1;
  int out_fd = -1, in_fd = -1;
  std::shared_ptr<Link> link;
  std::unique_ptr<PieceOps> ops;

  std::vector<size_t> step_begin_send, step_begin_recv;
  std::vector<Piece> sends, recvs;
  std::vector<double> recv_done_t;

  std::string where() const {
    return " (all_reduce tag " + std::to_string(tag) + ", epoch " + std::to_string(rs->epoch) + ")";
  }

  size_t chunk_start(int c) const { return static_cast<size_t>((unsigned __int128)L.count * c / L.world); }

  void build() {
    int W = L.world, r = L.rank;
    size_t P = L.piece_elems;
    std::vector<size_t> qbase(W + 1, 0);
    for (int c = 0; c < W; ++c) {
      size_t len = chunk_start(c + 1) - chunk_start(c);
      qbase[c + 1] = qbase[c] + (len + P - 1) / P;
    }
    L.num_qpieces = qbase[W];
    auto pieces = [&](int step, int c, std::vector<Piece>& v) {
      size_t s = chunk_start(c), e = chunk_start(c + 1);
      size_t k = 0;
      for (size_t o = s; o < e; o += P, ++k) v.push_back({step, c, o, std::min(P, e - o), qbase[c] + k});
    };
    for (int j = 0; j < 2 * W - 2; ++j) {
      int sc, rc;
      if (j < W - 1) {
        sc = ((r - j) % W + W) % W;
        rc = ((r - j - 1) % W + W) % W;
      } else {
        int s = j - (W - 1);
        sc = ((r + 1 - s) % W + W) % W;
        rc = ((r - s) % W + W) % W;
      }
      step_begin_send.push_back(sends.size());
      pieces(j, sc, sends);
      step_begin_recv.push_back(recvs.size());
      pieces(j, rc, recvs);
    }
    step_begin_send.push_back(sends.size());
    step_begin_recv.push_back(recvs.size());
    recv_done_t.assign(recvs.size(), 0.0);
  }

  // Index of the received piece a send item depends on, or -1 (step 0 sends local data). Send
  // step j carries the chunk received at step j-1, so piece p depends on that step's piece p.
  long dep_of(size_t si) const {
    const Piece& it = sends[si];
    if (it.step == 0) return -1;
    size_t p = si - step_begin_send[it.step];
    return static_cast<long>(step_begin_recv[it.step - 1] + p);
  }

  void check_abort() {
    std::lock_guard<std::mutex> g(rs->mu);
    if (rs->aborted) throw TcpError(ErrKind::kAborted, "aborted");
  }

  void acquire() {
    double dl = now_s() + ep->timeout_s_;
    std::unique_lock<std::mutex> g(rs->mu);
    uint64_t ticket = rs->next_ticket++;
    auto fail = [&](ErrKind k, const std::string& msg) {
      rs->cancelled.insert(ticket);
      rs->advance_serving();
      rs->cv.notify_all();
      throw TcpError(k, msg);
    };
    while (true) {
      if (rs->aborted) fail(ErrKind::kAborted, "aborted");
      if (!rs->broken.empty()) fail(ErrKind::kConnection, rs->broken);
      if (rs->serving == ticket) {
        for (size_t s = 0; s < rs->out_busy.size(); ++s)
          if (!rs->out_busy[s]) { out_slot = static_cast<int>(s); break; }
        if (out_slot >= 0) {
          rs->out_busy[out_slot] = true;
          rs->serving++;
          rs->advance_serving();
          rs->cv.notify_all();
          break;
        }
      }
      if (now_s() > dl)
        fail(ErrKind::kTimeout, "timed out waiting for a free connection to next peer " + rs->next);
      rs->cv.wait_for(g, std::chrono::milliseconds(50));
    }
    out_fd = rs->out_fds[out_slot];
  }

  void release(bool ok) {
    std::lock_guard<std::mutex> g(rs->mu);
    if (out_slot >= 0) {
      if (ok) rs->out_busy[out_slot] = false;
      else shut(rs->out_fds[out_slot]);
    }
    if (in_idx >= 0) {
      if (ok) rs->in_state[in_idx] = 0;
      else { rs->in_state[in_idx] = 2; shut(rs->in_fds[in_idx]); }
    }
    rs->poke();
    rs->cv.notify_all();
  }

  StartHdr wait_incoming() {
    double dl = now_s() + ep->timeout_s_;
    std::unique_lock<std::mutex> g(rs->mu);
    while (true) {
      if (rs->aborted) throw TcpError(ErrKind::kAborted, "aborted");
      auto it = rs->routed.find(tag);
      if (it != rs->routed.end() && !it->second.empty()) {
        auto rt = it->second.front();
        it->second.pop_front();
        if (it->second.empty()) rs->routed.erase(it);
        in_idx = rt.idx;
        in_fd = rs->in_fds[in_idx];
        return rt.hdr;
      }
      if (!rs->broken.empty()) throw TcpError(ErrKind::kConnection, rs->broken);
      if (now_s() > dl)
        throw TcpError(ErrKind::kTimeout, "timed out waiting for previous peer " + rs->prev + " to start the operation");
      rs->cv.wait_for(g, std::chrono::milliseconds(50));
    }
  }

  void run(const OpsFactory& make) {
    link = ep->link_for(rs->next);
    acquire();
    StartHdr mine{kStartMagic, tag, rs->epoch, L.count, static_cast<uint32_t>(L.dtype), static_cast<uint32_t>(L.op),
                  static_cast<uint32_t>(L.quant), static_cast<uint32_t>(L.piece_elems)};
    tcp::send_all(out_fd, &mine, sizeof(mine), now_s() + ep->timeout_s_, nullptr,
                  "sending operation header to next peer " + rs->next);
    ep->bytes_sent += sizeof(mine);
    StartHdr theirs = wait_incoming();
    if (theirs.count != mine.count || theirs.dtype != mine.dtype || theirs.op != mine.op ||
        theirs.quant != mine.quant || theirs.piece_elems != mine.piece_elems)
      throw TcpError(ErrKind::kProtocol,
                     "previous peer " + rs->prev + " started a different operation with the same tag: count " +
                         std::to_string(theirs.count) + " vs " + std::to_string(L.count) + ", dtype " +
                         std::to_string(theirs.dtype) + " vs " + std::to_string(mine.dtype) + ", op " +
                         std::to_string(theirs.op) + " vs " + std::to_string(mine.op) + ", quantize " +
                         std::to_string(theirs.quant) + " vs " + std::to_string(mine.quant) + ", piece " +
                         std::to_string(theirs.piece_elems) + " vs " + std::to_string(mine.piece_elems));
    build();
    ops = make(L);

    const size_t wire_es = L.quant == Quant::kNone ? L.elem_size : L.quant_size;
    double t_start = now_s();
    double latency = link->lat();
    size_t si = 0, ri = 0;
    // send state: header + payload of sends[si]
    bool prepared = false;
    FrameHdr sh{};
    const char* spay = nullptr;
    size_t snb = 0, ssent = 0;
    double release_t = 0;
    double pace_t = 0;  // emulated link: no tokens before this time
    // receive state: header + payload of recvs[ri]
    FrameHdr rh{};
    size_t rgot = 0;
    char* rdst = nullptr;
    double last_progress = now_s();
    while (si < sends.size() || ri < recvs.size()) {
      check_abort();
      double now = now_s();
      double wait = 0.05;
      bool want_out = false;
      if (si < sends.size()) {
        if (!prepared) {
          long d = dep_of(si);
          if (d < 0 || static_cast<size_t>(d) < ri) {
            QMeta m{0, 0};
            spay = ops->send_payload(sends[si], &m, &snb);
            sh = {kFrameMagic, tag, static_cast<uint32_t>(si), static_cast<uint32_t>(snb), m.lo, m.scale, rs->epoch};
            ssent = 0;
            // emulated latency: a piece leaves `latency` after it became ready
            release_t = (d < 0 ? t_start : recv_done_t[d]) + latency;
            prepared = true;
          }
        }
        if (prepared) {
          double ready = std::max(release_t, pace_t);
          if (now < ready) wait = std::min(wait, ready - now);
          else want_out = true;
        }
      }
      pollfd fds[2] = {{out_fd, static_cast<short>(want_out ? POLLOUT : 0), 0},
                       {in_fd, static_cast<short>(ri < recvs.size() ? POLLIN : 0), 0}};
      // ppoll: microsecond timeouts, so latency / pacing waits do not round up to whole ms
      timespec ts{static_cast<time_t>(wait), static_cast<long>((wait - static_cast<double>(static_cast<time_t>(wait))) * 1e9)};
      int rc = ppoll(fds, 2, &ts, nullptr);
      if (rc < 0 && errno != EINTR) throw TcpError(ErrKind::kConnection, std::string("poll: ") + strerror(errno));
      bool progress = false;
      if (want_out && (fds[0].revents & (POLLOUT | POLLERR | POLLHUP))) {
        size_t total = sizeof(FrameHdr) + snb;
        double tw = 0;
        size_t grant = link->take(total - ssent, &tw);
        if (grant > 0) {
          iovec iov[2];
          int niov = 0;
          size_t budget = grant;
          if (ssent < sizeof(FrameHdr)) {
            size_t h = std::min(budget, sizeof(FrameHdr) - ssent);
            iov[niov++] = {reinterpret_cast<char*>(&sh) + ssent, h};
            budget -= h;
          }
          if (budget > 0) {
            size_t po = ssent > sizeof(FrameHdr) ? ssent - sizeof(FrameHdr) : 0;
            iov[niov++] = {const_cast<char*>(spay) + po, std::min(budget, snb - po)};
          }
          msghdr mh{};
          mh.msg_iov = iov;
          mh.msg_iovlen = niov;
          ssize_t k = sendmsg(out_fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
          if (k < 0) {
            link->refund(grant);
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
              throw TcpError(ErrKind::kConnection, "send to next peer " + rs->next + " failed: " + strerror(errno));
          } else {
            link->refund(grant - static_cast<size_t>(k));
            ssent += static_cast<size_t>(k);
            ep->bytes_sent += static_cast<uint64_t>(k);
            progress = k > 0;
            if (ssent == total) {
              ++si;
              prepared = false;
            }
          }
        } else {
          pace_t = now_s() + tw;  // keep receiving while the emulated link refills
        }
      }
      if (ri < recvs.size() && (fds[1].revents & (POLLIN | POLLERR | POLLHUP))) {
        const Piece& it = recvs[ri];
        char* dst;
        size_t want;
        if (rgot < sizeof(FrameHdr)) {
          dst = reinterpret_cast<char*>(&rh) + rgot;
          want = sizeof(FrameHdr) - rgot;
        } else {
          dst = rdst + (rgot - sizeof(FrameHdr));
          want = sizeof(FrameHdr) + rh.nbytes - rgot;
        }
        ssize_t k = recv(in_fd, dst, want, MSG_DONTWAIT);
        if (k == 0) throw TcpError(ErrKind::kConnection, "connection closed by previous peer " + rs->prev);
        if (k < 0) {
          if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            throw TcpError(ErrKind::kConnection, "receive from previous peer " + rs->prev + " failed: " + strerror(errno));
        } else {
          rgot += static_cast<size_t>(k);
          ep->bytes_received += static_cast<uint64_t>(k);
          progress = true;
          if (rgot == sizeof(FrameHdr) && static_cast<size_t>(k) == want) {
            if (rh.magic != kFrameMagic || rh.tag != tag || rh.seq != ri || rh.nbytes != it.n * wire_es ||
                rh.epoch != rs->epoch)
              throw TcpError(ErrKind::kProtocol, "protocol error from previous peer " + rs->prev + ": unexpected frame");
            rdst = ops->recv_target(it);
          }
          if (rgot > sizeof(FrameHdr) && rgot == sizeof(FrameHdr) + rh.nbytes) {
            ops->on_recv(it, {rh.qlo, rh.qscale});
            recv_done_t[ri] = now_s();
            ++ri;
            rgot = 0;
          }
        }
      }
      if (progress) {
        last_progress = now_s();
      } else if (now_s() - last_progress > ep->timeout_s_) {
        throw TcpError(ErrKind::kTimeout, ri < recvs.size()
                                              ? "timed out receiving from previous peer " + rs->prev
                                              : "timed out sending to next peer " + rs->next);
      }
    }
  }
};

OpResult Endpoint::run_op(size_t count, DType dtype, Op op, Quant quant, uint32_t tag, const OpsFactory& make,
                          const std::function<void()>& single) {
  OpResult res;
  std::shared_ptr<RingState> rs;
  {
    std::lock_guard<std::mutex> g(mu_);
    rs = ring_;
  }
  auto where = " (all_reduce tag " + std::to_string(tag) + ")";
  if (!rs) return {Status::kInvalid, "endpoint " + address_ + " is not connected: call connect_ring first"};
  if (quant != Quant::kNone && !dtype_is_float(dtype))
    return {Status::kInvalid, "quantized all_reduce needs a floating dtype" + where};
  {
    std::lock_guard<std::mutex> g(rs->mu);
    if (rs->aborted) return {Status::kAborted, "endpoint " + address_ + " was aborted; reconnect with a new epoch" + where};
    if (!rs->broken.empty()) return {Status::kConnection, rs->broken + where};
  }
  if (rs->world == 1) {
    try {
      single();
    } catch (const std::exception& e) {
      return {Status::kInvalid, std::string(e.what()) + where};
    }
    ops_ok++;
    return res;
  }
  size_t es = dtype_size(dtype);
  OpLayout L{rs->world, rs->rank, count, std::max<size_t>(1, piece_bytes_ / es), es, quant_size(quant), 0,
             dtype, op, quant};
  OpRunner R{this, rs, tag, L};
  bool ok = false;
  try {
    R.run(make);
    ok = true;
  } catch (const std::exception& e) {
    const auto* te = dynamic_cast<const TcpError*>(&e);
    bool aborted;
    {
      std::lock_guard<std::mutex> g(rs->mu);
      aborted = rs->aborted;
      if (!aborted && rs->broken.empty()) rs->broken = e.what();
    }
    if (aborted || (te && te->kind == ErrKind::kAborted))
      res = {Status::kAborted, "all_reduce aborted on " + address_ + R.where() + "; input buffer restored"};
    else if (te)
      res = {te->kind == ErrKind::kTimeout ? Status::kTimeout : Status::kConnection,
             std::string(e.what()) + R.where() + " on " + address_};
    else
      res = {Status::kInvalid, std::string(e.what()) + R.where() + " on " + address_};
  }
  R.release(ok);
  if (ok) ops_ok++;
  else ops_failed++;
  return res;
}

OpResult Endpoint::all_reduce(const void* x, void* out, size_t count, DType dtype, Op op, Quant quant, uint32_t tag) {
  size_t nbytes = count * dtype_size(dtype);
  const char* xb = static_cast<const char*>(x);
  char* ob = static_cast<char*>(out);
  // Aliased in/out runs into a cached work buffer and commits with one memcpy at the end.
  bool aliased = nbytes > 0 && xb < ob + nbytes && ob < xb + nbytes;
  std::vector<char>* work = nullptr;
  std::vector<char>* scratch = nullptr;
  char* target = ob;
  auto make = [&](const OpLayout& L) -> std::unique_ptr<PieceOps> {
    if (aliased) {
      work = take_work(nbytes);
      target = work->data();
    }
    scratch = take_work(CpuOps<DType::kF32>::scratch_bytes(L));
    char* sc = scratch->data();
    switch (L.dtype) {
      case DType::kF32: return std::make_unique<CpuOps<DType::kF32>>(L, xb, target, sc);
      case DType::kF64: return std::make_unique<CpuOps<DType::kF64>>(L, xb, target, sc);
      case DType::kF16: return std::make_unique<CpuOps<DType::kF16>>(L, xb, target, sc);
      case DType::kBF16: return std::make_unique<CpuOps<DType::kBF16>>(L, xb, target, sc);
      case DType::kI32: return std::make_unique<CpuOps<DType::kI32>>(L, xb, target, sc);
      default: return std::make_unique<CpuOps<DType::kI64>>(L, xb, target, sc);
    }
  };
  OpResult r = run_op(count, dtype, op, quant, tag, make, [&] {
    if (ob != xb) std::memmove(ob, xb, nbytes);
  });
  if (work) {
    if (r.status == Status::kOk) std::memcpy(ob, work->data(), nbytes);  // commit: x overwritten only now
    give_work(work);
  }
  if (scratch) give_work(scratch);
  return r;
}

// Host memory standing in for a device: runs StagedOps (the CUDA handler's piece logic) on
// machines without a GPU, so tests cover it everywhere.
struct HostDev {
  std::vector<char> h[4], d[3];
  char* host(int slot, size_t n) {
    if (h[slot].size() < n) h[slot].resize(n);
    return h[slot].data();
  }
  char* dev(int slot, size_t n) {
    if (d[slot].size() < n) d[slot].resize(n);
    return d[slot].data();
  }
  void d2h(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
  void h2d(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
  void sync() {}
  template <DType D>
  void reduce(const typename Traits<D>::T* in, const typename Traits<D>::T* x, typename Traits<D>::T* out, size_t n,
              Op op, bool last, int world) {
    Kernels<D>::reduce(in, x, out, n, op, last, world);
  }
  template <DType D, typename Q>
  void reduce_q(const Q* in, QMeta m, const typename Traits<D>::T* x, typename Traits<D>::T* out, size_t n, Op op,
                bool last, int world) {
    Kernels<D>::template reduce_q<Q>(in, m, x, out, n, op, last, world);
  }
  template <DType D, typename Q>
  void quantize(const typename Traits<D>::T* src, Q* q, size_t n, float levels, DevMeta* meta) {
    QMeta m = Kernels<D>::template quantize<Q>(src, q, n, levels);
    float range = m.scale * levels;
    meta->m = m;
    meta->inv = range > 0 ? levels / range : 0.0f;
  }
  template <DType D, typename Q>
  void dequant(const Q* q, const DevMeta* meta, QMeta mv, typename Traits<D>::T* out, size_t n) {
    Kernels<D>::template dequantize<Q>(q, meta ? meta->m : mv, out, n);
  }
};

OpResult Endpoint::all_reduce_staged(const void* x, void* out, size_t count, DType dtype, Op op, Quant quant,
                                     uint32_t tag) {
  HostDev dev;
  size_t nbytes = count * dtype_size(dtype);
  return run_op(
      count, dtype, op, quant, tag,
      [&](const OpLayout& L) { return make_staged_ops(L, dev, static_cast<const char*>(x), static_cast<char*>(out)); },
      [&] { std::memmove(out, x, nbytes); });
}

std::shared_ptr<Endpoint> endpoint_by_handle(int64_t handle) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  auto it = g_registry.find(handle);
  return it == g_registry.end() ? nullptr : it->second;
}
void register_endpoint(const std::shared_ptr<Endpoint>& ep) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  g_registry[ep->handle()] = ep;
}
void unregister_endpoint(int64_t handle) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  g_registry.erase(handle);
}

}  // namespace jaxodc::ring
