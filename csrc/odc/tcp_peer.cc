// The client side of the tcp transport: every operation is a request to the owner's TCP server
// (tcp_server.cc), one at a time per connection.
#include "odc/peer.h"
#include "odc/runtime.h"
#include "transport/auth.h"
#include "transport/link_shaper.h"
#include "transport/tcp_socket.h"

namespace jaxodc::odc {

TcpPeer::TcpPeer(const Core& core, const PeerConfig& cfg)
    : Peer(core, cfg.rank, cfg.host + ":" + std::to_string(cfg.port)) {
  link_.set(core.link_rate, core.link_latency);
  fd_ = tcp::connect_within(cfg.host, cfg.port, core.timeout_s, name());
  try {
    auth::client_handshake(fd_, core.identity, static_cast<uint32_t>(core.rank), now_seconds() + core.timeout_s,
                           nullptr, name() + "'s odc tcp listener");
  } catch (const tcp::TcpError& e) {
    tcp::close_fd(fd_);
    throw PeerError(core.who() + " could not authenticate to " + name() + ": " + e.what());
  }
  send(request(kHello, core.rank, 0, 0, core.layout.world, core.layout.hash));
  WireHeader r{};
  tcp::recv_within(fd_, &r, sizeof(r), core.timeout_s, name());
  if (r.status != 0)
    throw Error("unit layout of " + name() + " differs from " + core.who() + " (tcp handshake refused)");
}

void TcpPeer::send(WireHeader h) {
  h.sent_at = now_seconds();
  send_data(&h, sizeof(h));
}

void TcpPeer::send_data(const void* data, size_t bytes) {
  tcp::send_shaped(fd_, data, bytes, link_, core_.timeout_s, name());
}

WireHeader TcpPeer::call(const WireHeader& h, double reply_timeout_s, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  send(h);
  return recv_reply(fd_, name(), reply_timeout_s, what, core_.link_latency);
}

Peer::Pending TcpPeer::request_piece(int unit, int64_t version, ElemType type) {
  Pending held(mu_);
  WireHeader h = request(kGather, core_.rank, unit, version);
  h.elem_type = static_cast<int32_t>(type);  // the owner sends the piece in the type it is wanted in
  send(h);
  return held;
}

void TcpPeer::read_piece(int unit, int64_t, const std::vector<Segment>& out, ElemType type, std::vector<float>&) {
  // The owner waits for the version; the reply may take up to its timeout.
  // The reply's latency is applied once its data is in (below).
  const WireHeader r = recv_reply(fd_, name(), core_.timeout_s + 5,
                                  "gather of unit " + std::to_string(unit) + " from " + name() + " failed");
  int64_t lo, n;
  core_.layout.piece(unit, rank_, &lo, &n);
  if (r.count != n) throw PeerError("gather: " + name() + " sent a wrong shard size");
  if (n == 0) return tcp::arrive_after(r.sent_at, sizeof(r), core_.link_rate, core_.link_latency);
  const size_t bytes = static_cast<size_t>(n) * elem_size(type);
  std::vector<char> skipped;
  for (const Segment& s : out) {
    const size_t part = static_cast<size_t>(s.count) * elem_size(type);
    char* to = s.dst;
    if (to == nullptr) {  // still read off the stream
      skipped.resize(part);
      to = skipped.data();
    }
    tcp::recv_within(fd_, to, part, core_.timeout_s, name());
  }
  gather_bytes_.fetch_add(static_cast<int64_t>(bytes));
  tcp::arrive_after(r.sent_at, static_cast<double>(sizeof(r) + bytes), core_.link_rate, core_.link_latency);
}

void TcpPeer::push(int unit, int64_t version, int64_t offset, const char* src, ElemType type, int64_t count,
                   std::vector<float>&) {
  std::lock_guard<std::mutex> lock(mu_);
  WireHeader h = request(kPush, core_.rank, unit, version, count, static_cast<uint64_t>(offset));
  h.elem_type = static_cast<int32_t>(type);  // sent as computed (bf16: half the bytes); the owner sums in fp32
  send(h);
  send_data(src, static_cast<size_t>(count) * elem_size(type));
}

void TcpPeer::push_sketch(int unit, int64_t version, int64_t offset, const SketchChunk& chunk) {
  std::lock_guard<std::mutex> lock(mu_);
  WireHeader h = request(kPushSketch, core_.rank, unit, version, chunk.count, static_cast<uint64_t>(offset));
  h.sketch_width = chunk.width;
  h.sketch_seed = chunk.seed;
  send(h);
  send_data(chunk.payload.data(), chunk.payload.size());
}

void TcpPeer::done(int64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  send(request(kDone, core_.rank, 0, version));
}

int64_t TcpPeer::claim(int64_t version, int64_t count, bool steal) {
  return call(request(kClaim, core_.rank, 0, version, count, steal ? 1 : 0), core_.timeout_s,
              "claim at " + name() + " failed for minibatch " + std::to_string(version))
      .count;
}

void TcpPeer::scalars(int64_t seq, int64_t n, double* out, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  send(request(kScalar, core_.rank, 0, seq, n));
  const WireHeader r = recv_reply(fd_, name(), core_.timeout_s + 5, what, core_.link_latency);
  check_scalar_count(r.count, n, what);  // the owner sends its post's values only when the counts agree
  tcp::recv_within(fd_, out, static_cast<size_t>(n) * sizeof(double), core_.timeout_s, name());
}

void TcpPeer::say_goodbye() {
  if (fd_ < 0) return;
  const WireHeader bye = request(kBye, core_.rank);
  try {
    std::lock_guard<std::mutex> lock(mu_);
    tcp::send_within(fd_, &bye, sizeof(bye), 1.0, name());
  } catch (...) {
    // The owner is gone already: nothing to tell it.
  }
}

void TcpPeer::close() { tcp::close_fd(fd_); }

}  // namespace jaxodc::odc
