// The tcp links of a lock-step group: one connection per ordered pair of ranks; the sender writes
// a header and its post, the receiver thread of the other rank stores it in that peer's double
// buffer for the channel and rings the group's doorbell.
#include <poll.h>
#include <sys/socket.h>

#include "lockstep/internal.h"
#include "transport/tcp_socket.h"

namespace jaxodc::lockstep {

namespace {

struct Hello {
  uint64_t magic;
  int32_t rank, world;
  uint64_t layout_hash;
};

struct PostHeader {
  int32_t channel;
  int32_t pad;
  int64_t seq;
  int64_t count;
};

}  // namespace

TcpLinks::TcpLinks(Group& group, const std::string& host, auth::Identity identity)
    : group_(group),
      identity_(std::move(identity)),
      refusals_("lockstep_tcp listener of rank " + std::to_string(group.rank())),
      budget_(32, group.world()),
      linked_(static_cast<size_t>(group.world()), false) {
  try {
    auth::check_bind(identity_.secret, host, "lockstep group of rank " + std::to_string(group.rank()));
    listen_fd_ = tcp::listen_on(host, 0, &port_);
  } catch (const std::exception& e) {
    throw Error("lockstep group of rank " + std::to_string(group.rank()) + ": " + e.what());
  }
  acceptor_ = std::thread([this] { accept_loop(); });
}

void TcpLinks::accept_loop() {
  while (!stop_.load()) {
    int fd = tcp::accept_ready(listen_fd_, 100);
    if (fd < 0) continue;
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < conns_.size();) {  // join finished receivers
      if (conns_[i].done->load()) {
        conns_[i].thread.join();
        tcp::close_fd(conns_[i].fd);
        conns_.erase(conns_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    if (!budget_.start_handshake()) {
      refusals_.refused(auth::peer_address(fd), "too many connections in their handshake");
      tcp::close_fd(fd);
      continue;
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    conns_.push_back({std::thread([this, fd, done] {
                        receive(fd);
                        done->store(true);
                      }),
                      fd, done});
  }
}

void TcpLinks::connect(Peer& peer, const std::string& host, int port) {
  const std::string name = "rank " + std::to_string(peer.rank) + " (lockstep tcp link)";
  peer.send_fd = tcp::connect_within(host, port, group_.timeout_s_, name);
  try {
    auth::client_handshake(peer.send_fd, identity_, static_cast<uint32_t>(group_.rank()),
                           now_seconds() + group_.timeout_s_, nullptr, name);
  } catch (const tcp::TcpError& e) {
    throw PeerError("rank " + std::to_string(group_.rank()) + " could not authenticate to " + name + ": " + e.what());
  }
  const Hello hello{kMagic, group_.rank(), group_.world(), group_.layout_hash()};
  tcp::send_within(peer.send_fd, &hello, sizeof(hello), group_.timeout_s_, name);
  int32_t status = 1;
  tcp::recv_within(peer.send_fd, &status, sizeof(status), group_.timeout_s_, name);
  if (status != 0)
    throw Error("rank " + std::to_string(group_.rank()) + ": " + name +
                " refused the connection: its lockstep channels differ from this rank's");
}

void TcpLinks::send(Peer& peer, int c, int64_t seq, const char* data, int64_t count) {
  const std::string name = "rank " + std::to_string(peer.rank) + " (lockstep post on channel '" +
                           group_.channels_[c].name + "', call " + std::to_string(seq) + ")";
  const PostHeader h{c, 0, seq, count};
  std::lock_guard<std::mutex> lock(peer.send_mu);
  tcp::send_within(peer.send_fd, &h, sizeof(h), group_.timeout_s_, name);
  tcp::send_within(peer.send_fd, data, static_cast<size_t>(count * group_.elem_bytes(c)), group_.timeout_s_, name);
}

void TcpLinks::read(int fd, void* buf, size_t n, const std::string& what) {
  try {
    tcp::recv_all(fd, buf, n, now_seconds() + group_.timeout_s_, &stop_, what);
  } catch (const tcp::TcpError& e) {
    if (e.kind == tcp::ErrKind::kTimeout)
      throw TimeoutError("timed out after " + std::to_string(group_.timeout_s_) + " s receiving from " + what);
    throw PeerError(std::string("connection to ") + e.what());
  }
}

void TcpLinks::receive(int fd) {
  // However it ends, the peer sees the end now; the acceptor closes the descriptor.
  struct Hangup {
    int fd;
    ~Hangup() { ::shutdown(fd, SHUT_RDWR); }
  } hangup{fd};
  const std::string from = auth::peer_address(fd);
  Peer* peer = nullptr;
  uint32_t rank = 0;
  try {
    rank = auth::server_handshake(fd, identity_, static_cast<uint32_t>(group_.world()),
                                  now_seconds() + std::min(auth::kHandshakeSeconds, group_.timeout_s_), &stop_,
                                  "lockstep tcp connection from " + from);
  } catch (const std::exception& e) {
    budget_.end_handshake();
    if (!stop_.load()) refusals_.refused(from, e.what());
    return;
  }
  budget_.end_handshake();
  {
    std::lock_guard<std::mutex> lock(mu_);
    const bool taken = static_cast<int>(rank) == group_.rank() || linked_[rank];
    if (taken || !budget_.admit()) {
      refusals_.refused(from, "rank " + std::to_string(rank) + " authenticated, but " +
                                  (taken ? "it has a link to rank " + std::to_string(group_.rank()) + " already"
                                         : std::string("too many links are up")));
      return;
    }
    linked_[rank] = true;
  }
  struct Leave {
    TcpLinks& links;
    uint32_t rank;
    ~Leave() {
      std::lock_guard<std::mutex> lock(links.mu_);
      links.linked_[rank] = false;
      links.budget_.leave();
    }
  } leave{*this, rank};
  try {
    Hello hello{};
    read(fd, &hello, sizeof(hello), "rank " + std::to_string(rank) + " (its lockstep hello)");
    const bool ok = hello.magic == kMagic && hello.world == group_.world() &&
                    hello.rank == static_cast<int32_t>(rank) && hello.layout_hash == group_.layout_hash();
    const int32_t status = ok ? 0 : 1;
    tcp::send_within(fd, &status, sizeof(status), group_.timeout_s_, "rank " + std::to_string(rank));
    if (!ok) {
      refusals_.refused(from, "rank " + std::to_string(rank) + " said hello as rank " + std::to_string(hello.rank) +
                                  " with other channels");
      return;
    }
    peer = group_.peers_[rank].get();
    const std::string name = "rank " + std::to_string(rank);
    while (!stop_.load()) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      PostHeader h{};
      read(fd, &h, sizeof(h), name);
      if (h.channel < 0 || h.channel >= group_.num_channels() || h.count != group_.channels_[h.channel].n ||
          h.seq < 0 || peer->recv_seq == nullptr)
        throw PeerError("it sent a malformed post (channel " + std::to_string(h.channel) + ", " +
                        std::to_string(h.count) + " elements)");
      // Area seq % 2 held call seq - 2, which this rank must have finished reading (see group.h).
      std::atomic<int64_t>& slot = peer->recv_seq[2 * h.channel + (h.seq & 1)];
      if (slot.load() >= h.seq || group_.completed_[h.channel].load(std::memory_order_acquire) < h.seq - 1)
        throw PeerError("it posted call " + std::to_string(h.seq) + " of channel '" +
                        group_.channels_[h.channel].name + "' before this rank finished call " +
                        std::to_string(h.seq - 2) + " (out of step)");
      const int64_t bytes = h.count * group_.elem_bytes(h.channel);
      char* dst = peer->recv.data() + peer->recv_offset[h.channel] + (h.seq & 1) * bytes;
      read(fd, dst, static_cast<size_t>(bytes), name);
      slot.store(h.seq, std::memory_order_release);
      group_.ring_doorbell();
    }
  } catch (const std::exception& e) {
    if (peer && !stop_.load()) {
      {
        std::lock_guard<std::mutex> lock(peer->fail_mu);
        peer->failure = std::string("its tcp link failed: ") + e.what();
      }
      peer->failed.store(true, std::memory_order_release);
      group_.ring_doorbell();
    }
  }
}

void TcpLinks::stop() {
  stop_.store(true);
  if (acceptor_.joinable()) acceptor_.join();
  std::vector<Connection> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);  // receivers take it when they leave: join without it
    conns.swap(conns_);
  }
  for (auto& c : conns) {
    if (c.thread.joinable()) c.thread.join();
    tcp::close_fd(c.fd);
  }
  for (auto& p : group_.peers_) tcp::close_fd(p->send_fd);
  if (listen_fd_ >= 0) refusals_.closing();
  tcp::close_fd(listen_fd_);
}

}  // namespace jaxodc::lockstep
