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

TcpLinks::TcpLinks(Group& group, const std::string& host) : group_(group) {
  try {
    listen_fd_ = tcp::listen_on(host, 0, &port_);
  } catch (const tcp::TcpError& e) {
    throw Error("lockstep group of rank " + std::to_string(group.rank()) + ": " + e.what());
  }
  acceptor_ = std::thread([this] { accept_loop(); });
}

void TcpLinks::accept_loop() {
  while (!stop_.load()) {
    const int fd = tcp::accept_ready(listen_fd_, 100);
    if (fd < 0) continue;
    std::lock_guard<std::mutex> lock(mu_);
    fds_.push_back(fd);
    threads_.emplace_back([this, fd] { receive(fd); });
  }
}

void TcpLinks::connect(Peer& peer, const std::string& host, int port) {
  const std::string name = "rank " + std::to_string(peer.rank) + " (lockstep tcp link)";
  peer.send_fd = tcp::connect_within(host, port, group_.timeout_s_, name);
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

void TcpLinks::receive(int fd) {
  Peer* peer = nullptr;
  const double timeout = group_.timeout_s_;
  try {
    Hello hello{};
    tcp::recv_within(fd, &hello, sizeof(hello), timeout, "a connecting lockstep peer");
    const bool ok = hello.magic == kMagic && hello.world == group_.world() && hello.rank >= 0 &&
                    hello.rank < group_.world() && hello.rank != group_.rank() &&
                    hello.layout_hash == group_.layout_hash();
    const int32_t status = ok ? 0 : 1;
    tcp::send_within(fd, &status, sizeof(status), timeout, "a connecting lockstep peer");
    if (!ok) return;
    peer = group_.peers_[hello.rank].get();
    const std::string name = "rank " + std::to_string(hello.rank);
    while (!stop_.load()) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      PostHeader h{};
      tcp::recv_within(fd, &h, sizeof(h), timeout, name);
      if (h.channel < 0 || h.channel >= group_.num_channels() || h.count != group_.channels_[h.channel].n ||
          peer->recv_seq == nullptr)
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
      tcp::recv_within(fd, dst, static_cast<size_t>(bytes), timeout, name);
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
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
  for (int& fd : fds_) tcp::close_fd(fd);
  for (auto& p : group_.peers_) tcp::close_fd(p->send_fd);
  tcp::close_fd(listen_fd_);
}

}  // namespace jaxodc::lockstep
