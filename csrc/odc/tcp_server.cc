// The server side of the tcp transport: performs one-sided operations on this rank's segment for
// peers that reach it over TCP (tcp and nvshmem transports).
#include <poll.h>
#include <sys/socket.h>

#include "odc/compress.h"
#include "odc/core.h"
#include "odc/runtime.h"
#include "odc/wire.h"
#include "transport/link_shaper.h"
#include "transport/tcp_socket.h"

namespace jaxodc::odc {

WireHeader recv_reply(int fd, const std::string& peer, double timeout_s, const std::string& what,
                      double latency) {
  WireHeader r{};
  tcp::recv_within(fd, &r, sizeof(r), timeout_s, peer);
  tcp::arrive_after(r.sent_at, 0, 0, latency);
  if (r.status != 0) {
    if (r.count < 0 || r.count > kMaxErrorBytes)
      throw PeerError(what + ": " + peer + " sent an error reply of " + std::to_string(r.count) + " bytes");
    std::string msg(static_cast<size_t>(r.count), '\0');
    tcp::recv_within(fd, msg.data(), msg.size(), timeout_s, peer);
    throw PeerError(what + ": " + msg);
  }
  return r;
}

namespace {

// Reads `n` bytes of an authenticated client's request: gives up after the runtime's timeout and
// wakes on stop (a connection held half-open never stalls close()).
void read_request(int fd, void* buf, size_t n, const Core& core, const std::string& peer) {
  try {
    tcp::recv_all(fd, buf, n, now_seconds() + core.timeout_s, &core.stop, peer);
  } catch (const tcp::TcpError& e) {
    if (e.kind == tcp::ErrKind::kTimeout)
      throw TimeoutError("timed out after " + seconds_text(core.timeout_s) + " receiving from " + peer);
    throw PeerError("connection to " + std::string(e.what()));
  }
}

// A request of an authenticated client that breaks the protocol: a fault of that rank, which aborts
// the minibatch (Core::record_push_error) -- unlike a lost connection, which matters only if the
// owner still waits for that client.
struct Violation : PeerError {
  using PeerError::PeerError;
};

// [offset, offset + count) lies inside [0, size), checked without arithmetic that can wrap.
bool inside(int64_t offset, int64_t count, int64_t size) {
  return count >= 0 && offset >= 0 && count <= size && offset <= size - count;
}

// The wire element types a push or gather may name.
bool known_type(int32_t t) {
  return t == static_cast<int32_t>(ElemType::kF32) || t == static_cast<int32_t>(ElemType::kBF16);
}

}  // namespace

// Handshakes in flight are few (the ranks connect once, at start); every rank may hold one
// authenticated connection (the nvshmem transport's control link included).
TcpServer::TcpServer(Core& core, const std::string& host)
    : core_(core), refusals_("odc_tcp listener of " + core.who()), budget_(32, core.layout.world) {
  try {
    auth::check_bind(core.identity.secret, host, core.who() + "'s odc tcp listener");
    listen_fd_ = tcp::listen_on(host, 0, &port_);
  } catch (const std::exception& e) {
    throw Error(core.who() + ": " + e.what());
  }
  acceptor_ = std::thread([this] { accept_loop(); });
}

void TcpServer::reap() {
  for (size_t i = 0; i < conns_.size();) {
    if (conns_[i].done->load()) {
      conns_[i].thread.join();
      tcp::close_fd(conns_[i].fd);
      conns_.erase(conns_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
}

void TcpServer::accept_loop() {
  while (!core_.stop.load()) {
    int fd = tcp::accept_ready(listen_fd_, 100);
    if (fd < 0) continue;
    std::lock_guard<std::mutex> lock(mu_);
    reap();
    if (!budget_.start_handshake()) {
      refusals_.refused(auth::peer_address(fd), "too many connections in their handshake");
      tcp::close_fd(fd);
      continue;
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    conns_.push_back({std::thread([this, fd, done] {
                        serve(fd);
                        done->store(true);
                      }),
                      fd, done});
  }
}

void TcpServer::stop() {
  if (acceptor_.joinable()) acceptor_.join();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& c : conns_) {
    if (c.thread.joinable()) c.thread.join();
    tcp::close_fd(c.fd);
  }
  conns_.clear();
  if (listen_fd_ >= 0) refusals_.closing();
  tcp::close_fd(listen_fd_);
}

namespace {

// One client connection's replies, through the emulated link back to the client; `client` is -1
// until its hello.
struct Replier {
  int fd;
  double timeout_s;
  tcp::Link& link;
  int client = -1;

  std::string peer() const { return "rank " + std::to_string(client); }
  void send(WireHeader r, const void* data = nullptr, size_t bytes = 0) const {
    r.sent_at = now_seconds();
    tcp::send_shaped(fd, &r, sizeof(r), link, timeout_s, peer());
    if (bytes) tcp::send_shaped(fd, data, bytes, link, timeout_s, peer());
  }
  void error(const std::string& msg) const {
    WireHeader r{};
    r.status = 1;
    r.count = static_cast<int64_t>(msg.size());
    send(r, msg.data(), msg.size());
  }
  // Runs a wait for the client: an Error it throws is the client's error reply (false).
  template <class Wait>
  bool waited(Wait&& wait) const {
    try {
      wait();
    } catch (const Error& e) {
      error(e.what());
      return false;
    }
    return true;
  }
};

}  // namespace

void TcpServer::serve(int fd) {
  const std::string from = auth::peer_address(fd);
  uint32_t authenticated = 0;
  try {
    authenticated = auth::server_handshake(fd, core_.identity, static_cast<uint32_t>(core_.layout.world),
                                           now_seconds() + std::min(auth::kHandshakeSeconds, core_.timeout_s),
                                           &core_.stop, "odc tcp connection from " + from);
  } catch (const std::exception& e) {
    budget_.end_handshake();
    if (!core_.stop.load()) refusals_.refused(from, e.what());
    ::shutdown(fd, SHUT_RDWR);
    return;
  }
  budget_.end_handshake();
  if (!budget_.admit()) {
    refusals_.refused(from, "rank " + std::to_string(authenticated) + " authenticated, but " +
                                std::to_string(core_.layout.world) + " connections are served already");
    ::shutdown(fd, SHUT_RDWR);
    return;
  }
  struct Leave {
    auth::ConnectionBudget& b;
    ~Leave() { b.leave(); }
  } leave{budget_};
  tcp::Link link;
  link.set(core_.link_rate, core_.link_latency);
  Replier out{fd, core_.timeout_s, link};
  int& client = out.client;
  SegmentHeader* seg = core_.seg;
  const Layout& layout = core_.layout;
  bool said_bye = false;
  std::vector<uint16_t> narrow;  // bf16 pieces on the wire (mixed precision)
  try {
    while (!core_.stop.load()) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      WireHeader h{};
      read_request(fd, &h, sizeof(h), core_, out.peer());
      // A request arrives `latency` after it was sent; a push once its data has (below).
      const bool carries_data = h.op == kPush || h.op == kPushSketch;
      if (!carries_data) tcp::arrive_after(h.sent_at, 0, 0, core_.link_latency);
      if (h.op == kHello) {
        // The hello's rank is the one the handshake proved; its layout must be mine.
        const bool ok = client < 0 && h.rank == static_cast<int32_t>(authenticated) && h.aux == layout.hash &&
                        h.count == layout.world;
        WireHeader r{};
        r.status = ok ? 0 : 1;
        out.send(r);
        if (!ok) {
          refusals_.refused(from, "rank " + std::to_string(authenticated) + " said hello as rank " +
                                      std::to_string(h.rank) + " with another unit layout");
          break;
        }
        client = h.rank;
        continue;
      }
      if (client < 0) {  // every connection starts with a hello
        refusals_.refused(from, "rank " + std::to_string(authenticated) + " sent request " + std::to_string(h.op) +
                                    " before its hello");
        break;
      }
      // Versions index rings of kRing entries (scalars, LB-Steal deques): never negative.
      if (h.version < 0)
        throw Violation("request " + std::to_string(h.op) + " for negative version " + std::to_string(h.version));
      const bool known_unit = h.unit >= 0 && h.unit < layout.num_units();
      const std::string for_client = " for rank " + std::to_string(client);
      switch (h.op) {
        case kGather:
        case kNvWaitPublished: {
          if (!known_unit || !known_type(h.elem_type)) {
            out.error(core_.who() + " has no unit " + std::to_string(h.unit) + " of element type " +
                      std::to_string(h.elem_type));
            break;
          }
          const char* via = h.op == kGather ? "" : " (gather over nvshmem)";
          if (!out.waited([&] {
                core_.wait_published(seg, h.unit, h.version, nullptr,
                                     "publishing unit " + std::to_string(h.unit) + " version " +
                                         std::to_string(h.version) + for_client + via);
              }))
            break;
          WireHeader r{};
          r.version = seg->unit(h.unit)->version.load();
          if (h.op == kNvWaitPublished) {  // the data travels through NVSHMEM
            out.send(r);
            break;
          }
          int64_t lo, n;
          layout.piece(h.unit, core_.rank, &lo, &n);
          r.count = n;
          if (h.elem_type == static_cast<int32_t>(ElemType::kBF16)) {  // mixed precision: half the bytes
            narrow.resize(static_cast<size_t>(n));
            store_from_f32(narrow.data(), ElemType::kBF16, seg->master(h.unit), n);
            out.send(r, narrow.data(), static_cast<size_t>(n) * 2);
          } else {
            out.send(r, seg->master(h.unit), static_cast<size_t>(n) * 4);
          }
          break;
        }
        case kPush: {
          const int64_t offset = static_cast<int64_t>(h.aux);
          if (!known_unit || !known_type(h.elem_type) || !inside(offset, h.count, layout.shards[h.unit]))
            throw Violation("malformed push (unit " + std::to_string(h.unit) + ", " + std::to_string(h.count) +
                            " elements at " + std::to_string(offset) + ", element type " +
                            std::to_string(h.elem_type) + ")");
          const bool bf16 = h.elem_type == static_cast<int32_t>(ElemType::kBF16);
          const size_t esize = bf16 ? 2 : 4;
          int64_t got = 0;
          do {  // in slot-sized chunks
            const int64_t chunk = std::min(layout.slot_elems, h.count - got);
            core_.wait_slot_free(seg, client, nullptr, "draining the receive slot of " + out.peer());
            // A chunk is marked full only after every byte arrived: a client that dies mid-chunk
            // leaves the accumulator without it. bf16 arrives beside the slot and is widened into it.
            if (bf16) {
              narrow.resize(static_cast<size_t>(chunk));
              read_request(fd, narrow.data(), static_cast<size_t>(chunk) * 2, core_, out.peer());
              load_to_f32(seg->slot_data(client), narrow.data(), ElemType::kBF16, chunk);
            } else {
              read_request(fd, seg->slot_data(client), static_cast<size_t>(chunk) * 4, core_, out.peer());
            }
            tcp::arrive_after(h.sent_at, static_cast<double>(sizeof(h) + (got + chunk) * esize), core_.link_rate,
                              core_.link_latency);
            seg->raise_slot(client, h.unit, h.version, chunk, kSlotHost, offset + got);
            got += chunk;
          } while (got < h.count);
          break;
        }
        case kPushSketch: {
          const int64_t offset = static_cast<int64_t>(h.aux);
          // Sizes bounded by the layout before the payload size is computed from them.
          const bool sane = known_unit && h.count > 0 && inside(offset, h.count, layout.shards[h.unit]) &&
                            h.sketch_width > 0 && h.sketch_width <= layout.slot_elems;
          const int64_t bytes = sane ? sketch_payload_bytes(h.count, h.sketch_width) : -1;
          if (bytes < 0 || bytes > layout.slot_elems * 4)
            throw Violation("malformed compressed push (unit " + std::to_string(h.unit) + ", " +
                            std::to_string(h.count) + " elements at " + std::to_string(offset) + ", sketch width " +
                            std::to_string(h.sketch_width) + ")");
          core_.wait_slot_free(seg, client, nullptr, "draining the receive slot of " + out.peer());
          read_request(fd, seg->slot_data(client), static_cast<size_t>(bytes), core_, out.peer());
          tcp::arrive_after(h.sent_at, static_cast<double>(sizeof(h) + bytes), core_.link_rate, core_.link_latency);
          seg->raise_slot(client, h.unit, h.version, h.count, kSlotSketch, offset, h.sketch_width, h.sketch_seed);
          break;
        }
        case kDone:
          seg->done(client)->store(h.version, std::memory_order_release);
          signal_event(&seg->doorbell);
          break;
        case kScalar: {
          if (!out.waited([&] {
                core_.wait_scalar(seg, h.version, nullptr,
                                  "posting scalar call " + std::to_string(h.version) + for_client);
              }))
            break;
          // The values follow only when the client wants as many as were posted (`count`).
          const ScalarEntry* e = seg->scalar(h.version);
          WireHeader r{};
          r.count = e->count;
          out.send(r, e->values, e->count == h.count ? static_cast<size_t>(e->count) * sizeof(double) : 0);
          break;
        }
        case kClaim: {
          WireHeader r{};
          if (out.waited([&] { r.count = claim_microbatch(seg, h.version, h.count, h.aux != 0, core_.rank); }))
            out.send(r);
          break;
        }
        case kNvWaitSlot:
          if (out.waited([&] {
                core_.wait_slot_free(seg, client, nullptr,
                                     "draining the receive slot of " + out.peer() + " (push over nvshmem)");
              }))
            out.send(WireHeader{});
          break;
        case kNvCommit: {
          // The client put its data into my NVSHMEM block and completed it (quiet) before this.
          if (!known_unit || h.count < 0 || h.count > layout.shards[h.unit])
            throw Violation("malformed nvshmem push (unit " + std::to_string(h.unit) + ", " +
                            std::to_string(h.count) + " elements)");
          if (!core_.dev || !core_.dev->nvshmem_active())
            throw Violation("an nvshmem push, but " + core_.who() + " has no NVSHMEM block");
          if (seg->slot(client)->state.load(std::memory_order_acquire) != kSlotFree)
            throw Violation("an nvshmem push into a receive slot that was not free");
          seg->raise_slot(client, h.unit, h.version, h.count, kSlotNvshmem);
          break;
        }
        case kBye:
          said_bye = true;
          break;
        default:
          throw Violation("unknown request " + std::to_string(h.op));
      }
      if (said_bye) break;
    }
  } catch (const Violation& e) {
    if (!core_.stop.load()) {
      core_.record_push_error(out.peer() + " broke the protocol of " + core_.who() + "'s odc tcp listener (from " +
                              from + "): " + e.what());
      core_.record_client_failure(client, "connection from " + out.peer() + " failed: " + e.what());
      signal_event(&seg->doorbell);
    }
  } catch (const std::exception& e) {
    if (client >= 0 && !core_.stop.load())
      core_.record_client_failure(client, "connection from " + out.peer() + " failed: " + e.what());
  }
  if (client >= 0 && !said_bye && !core_.stop.load()) {
    core_.record_client_failure(client, out.peer() + " closed its connection without saying goodbye");
    signal_event(&seg->doorbell);
  }
  ::shutdown(fd, SHUT_RDWR);  // the client sees the end now; the acceptor closes the descriptor
}

}  // namespace jaxodc::odc
