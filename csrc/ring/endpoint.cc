// A ring endpoint's connections: listening and authenticating (jaxodc-auth-v2), building
// the ring of one epoch (connect_ring), routing each incoming operation to its all-reduce by tag
// (the dispatcher), bandwidth probes, link emulation settings, abort and close.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "common/handles.h"
#include "transport/link_shaper.h"
#include "ring/ring.h"
#include "ring/ring_state.h"
#include "transport/tcp_socket.h"

namespace jaxodc::ring {

using tcp::ErrKind;
using tcp::TcpError;

namespace {

Handles<Endpoint>& live_endpoints() {
  static Handles<Endpoint> handles;
  return handles;
}

constexpr int kMaxHandshakes = 32;
constexpr uint64_t kMaxProbeBytes = uint64_t(1) << 32;

// Client side: authenticates as ring index `rank` (jaxodc-auth-v2), then says hello.
void client_handshake(int fd, const std::string& peer, const auth::Identity& id, uint32_t rank, double timeout_s,
                      const Hello& hello, const std::string& my_addr, const std::atomic<bool>* abort_flag) {
  const double dl = now_seconds() + timeout_s;
  const std::string what = "authenticating to " + peer;
  auth::client_handshake(fd, id, rank, dl, abort_flag, what);
  Hello h = hello;
  h.addr_len = static_cast<uint32_t>(my_addr.size());
  tcp::send_all(fd, &h, sizeof(h), dl, abort_flag, what);
  tcp::send_all(fd, my_addr.data(), my_addr.size(), dl, abort_flag, what);
}

}  // namespace


Endpoint::Endpoint(const std::string& host, int port, int pool_size, std::string secret, double timeout_s,
                   std::string group_id)
    : host_(host), identity_{std::move(secret), "ring", std::move(group_id)}, pool_size_(pool_size),
      timeout_s_(timeout_s) {
  if (pool_size < 1) throw std::invalid_argument("pool_size must be >= 1");
  if (!(timeout_s > 0)) throw std::invalid_argument("timeout_s must be > 0");
  auth::check_bind(identity_.secret, host, "ring endpoint");
  if (identity_.job_id.find('|') != std::string::npos)
    throw std::invalid_argument("ring endpoint: group id '" + identity_.job_id + "' may not contain '|'");
  int bound = 0;
  listen_fd_ = tcp::listen_on(host, port, &bound);
  address_ = host + ":" + std::to_string(bound);
  refusals_.rename("ring endpoint " + address_);
  acceptor_ = std::thread([this] { accept_loop(); });
  handle_ = live_endpoints().add(this);
}

Endpoint::~Endpoint() { close(); }

void Endpoint::close() {
  if (closing_.exchange(true)) return;
  live_endpoints().remove(handle_);  // jitted calls started from now on fail with a clear error
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
  refusals_.closing();
}

void Endpoint::accept_loop() {
  while (!closing_) {
    int fd = tcp::accept_ready(listen_fd_, 100);
    if (closing_) {
      if (fd >= 0) ::close(fd);
      break;
    }
    if (fd < 0) continue;
    std::vector<std::thread> finished;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (closing_) { ::close(fd); break; }
      if (handshakes_.load() >= kMaxHandshakes) {
        refusals_.refused(auth::peer_address(fd), "too many connections in their handshake");
        ::close(fd);
        continue;
      }
      handshakes_++;
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
  const std::string from = auth::peer_address(fd);
  std::string what = "incoming connection from " + from + " on " + address_;
  try {
    const double dl = now_seconds() + std::min(timeout_s_, auth::kHandshakeSeconds);
    uint32_t rank;
    try {
      rank = auth::server_handshake(fd, identity_, auth::kMaxRank, dl, &closing_, what);
    } catch (const std::exception& e) {
      handshakes_--;
      if (closing_) throw;
      refusals_.refused(from, e.what());
      throw auth::Rejected("refused");
    }
    handshakes_--;
    Hello h;
    tcp::recv_all(fd, &h, sizeof(h), dl, &closing_, what);
    if (h.magic != kHelloMagic || h.addr_len > 256 || (h.kind == kKindProbe && h.probe_bytes > kMaxProbeBytes))
      throw TcpError(ErrKind::kProtocol, "bad hello from ring index " + std::to_string(rank));
    std::string src(h.addr_len, '\0');
    tcp::recv_all(fd, src.data(), src.size(), dl, &closing_, what);
    if (h.kind == kKindProbe) {
      std::vector<char> sink(1 << 20);
      uint64_t left = h.probe_bytes;
      double pdl = now_seconds() + timeout_s_ + 60.0;
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
        pending_[h.epoch].push_back({fd, h.slot, rank, src});
        keep = true;
        cv_.notify_all();
      }
    }
  } catch (const std::exception& e) {
    if (!closing_ && !dynamic_cast<const auth::Rejected*>(&e))
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
  my_index_.store(my_index);
  if (W > 1) {
    rs->next = ring[(my_index + 1) % W];
    rs->prev = ring[(my_index + W - 1) % W];
    if (pipe2(rs->wake, O_CLOEXEC | O_NONBLOCK) != 0)
      throw TcpError(ErrKind::kConnection, "pipe2 failed");
    const std::string where = "connect_ring epoch " + std::to_string(epoch) + " on " + address_;
    double dl = now_seconds() + timeout_s_;
    try {
      for (int s = 0; s < pool_size_; ++s) {
        try {
          int fd = tcp::connect_to(rs->next, std::max(0.01, dl - now_seconds()), &stop);
          rs->out_fds.push_back(fd);
          Hello h{kHelloMagic, kKindRing, epoch, 0, static_cast<uint32_t>(s), 0};
          client_handshake(fd, rs->next, identity_, static_cast<uint32_t>(my_index), std::max(0.01, dl - now_seconds()), h,
                           ring[my_index], &stop);
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
        if (now_seconds() > dl)
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
      const uint32_t prev_index = static_cast<uint32_t>((my_index + W - 1) % W);
      for (auto& p : conns) {
        if ((p.src != rs->prev || p.rank != prev_index) && bad.empty())
          bad = p.src + " (authenticated as ring index " + std::to_string(p.rank) + ")";
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
        tcp::recv_all(fds[k].fd, &h, sizeof(h), now_seconds() + timeout_s_, nullptr,
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
  link_for(peer)->set(bw, latency_s);
}

double Endpoint::measure_bandwidth(const std::string& peer, size_t nbytes) {
  if (nbytes == 0) throw std::invalid_argument("measure_bandwidth: nbytes must be > 0");
  auto link = link_for(peer);
  int fd = tcp::connect_to(peer, timeout_s_, &closing_);
  struct Closer { int fd; ~Closer() { ::close(fd); } } closer{fd};
  Hello h{kHelloMagic, kKindProbe, 0, nbytes, 0, 0};
  client_handshake(fd, peer, identity_, static_cast<uint32_t>(my_index_.load()), timeout_s_, h, address_, &closing_);
  tcp::set_nonblocking(fd, true);
  std::vector<char> buf(std::min<size_t>(nbytes, 1 << 20), 0);
  double t0 = now_seconds();
  double lat = link->lat();
  if (lat > 0) std::this_thread::sleep_for(std::chrono::duration<double>(lat));
  size_t left = nbytes;
  double dl = now_seconds() + timeout_s_ + 60.0;
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
  double t = now_seconds() - t0;
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

Endpoint* endpoint_by_handle(int64_t handle) { return live_endpoints().find(handle); }

}  // namespace jaxodc::ring
