// Abortable, pipelined ring all-reduce over TCP (PCCL-style).
//
// One Endpoint per peer: it listens on host:port, authenticates every connection with an
// HMAC-SHA256 challenge-response over a shared secret, and after connect_ring() holds pool_size
// connections to the next peer in the ring and pool_size from the previous one. Each all_reduce
// takes one outgoing connection (granted in call order, so peers that issue operations in the same
// order never deadlock) and finds its incoming connection by the tag in the sender's start header.
//
// Algorithm: reduce-scatter then all-gather, W-1 steps each, every chunk split into pieces that
// stream through the ring; a piece is forwarded as soon as the piece it depends on has arrived, and
// one thread drives both directions of the op with non-blocking sockets (full duplex). Rank r owns
// chunk (r+1) mod W after reduce-scatter; the owner applies the average and (quantised transfer) the
// single quantisation; the all-gather forwards the owner's bytes unchanged, so every peer's result
// is bit-identical by construction.
//
// Restoring the caller's buffer on abort costs nothing when out does not alias x: x is only read and
// all partial results live in out. When out aliases x the op runs into a cached work buffer and
// copies it over x only after the last byte arrived (one memcpy, the least an in-place abortable op
// can cost), so an abort at any point leaves x untouched.
//
// Where the code lives: endpoint.cc (connections, handshake, connect_ring, dispatcher, bandwidth
// probe), all_reduce.cc (one operation: OpRunner, CpuOps), transport/link_shaper.h (link emulation),
// engine.h / staged_ops.h (the memory side of an op), wire.h and ring_state.h (internal).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ring/engine.h"
#include "ring/reduce.h"
#include "transport/auth.h"

namespace jaxodc::tcp {
struct Link;
}  // namespace jaxodc::tcp

namespace jaxodc::ring {

enum class Status : int { kOk = 0, kAborted = 1, kTimeout = 2, kConnection = 3, kInvalid = 4 };

struct OpResult {
  Status status = Status::kOk;
  std::string message;
};

using tcp::Link;
struct RingState;

class Endpoint {
 public:
  // Every connection proves `secret` (jaxodc-auth-v2, listener "ring", job id `group_id`, claimed
  // rank = the connecting peer's ring index); an empty secret only on a loopback host.
  Endpoint(const std::string& host, int port, int pool_size, std::string secret, double timeout_s,
           std::string group_id = "");
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  const std::string& address() const { return address_; }
  // Throws tcp::TcpError (naming the peer it waited for) or std::invalid_argument. Bounded by
  // timeout_s; abort() or close() during the call ends it within ~50 ms with kind kAborted.
  void connect_ring(const std::vector<std::string>& ring, int my_index, uint64_t epoch);
  // Blocking; thread-safe (several may run concurrently). out may alias x.
  OpResult all_reduce(const void* x, void* out, size_t count, DType dtype, Op op, Quant quant,
                      uint32_t tag);
  // Generic form used by device handlers: `make` supplies the memory side of the op (see
  // engine.h); `single` runs instead when the ring has one peer.
  OpResult run_op(size_t count, DType dtype, Op op, Quant quant, uint32_t tag, const OpsFactory& make,
                  const std::function<void()>& single);
  // The device-staged piece logic of the CUDA handler with host memory as the "device" (tests);
  // out must not alias x.
  OpResult all_reduce_staged(const void* x, void* out, size_t count, DType dtype, Op op, Quant quant,
                             uint32_t tag);
  // Ends in-flight all-reduces (caller's buffers restored) and any connect_ring in progress.
  void abort();
  void set_link(const std::string& peer, double bandwidth_bytes_per_s, double latency_s);
  double measure_bandwidth(const std::string& peer, size_t nbytes);
  void close();
  // Pipelining granularity; every peer of a ring must use the same value (checked per op).
  void set_piece_bytes(size_t n) { piece_bytes_ = n < 256 ? 256 : (n > (size_t(1) << 30) ? size_t(1) << 30 : n); }
  int world() const;
  // Names this endpoint in jitted code (the `handle` attribute of the FFI all-reduce) until close.
  int64_t handle() const { return handle_; }

  std::atomic<uint64_t> bytes_sent{0}, bytes_received{0}, ops_ok{0}, ops_failed{0};
  uint64_t auth_rejected() const { return refusals_.count(); }

 private:
  friend struct OpRunner;
  void accept_loop();
  void handle_incoming(int fd, std::shared_ptr<std::atomic<bool>> done);
  void teardown_ring(std::shared_ptr<RingState> rs);
  void dispatcher_loop(std::shared_ptr<RingState> rs);
  std::shared_ptr<Link> link_for(const std::string& peer);
  std::vector<char>* take_work(size_t n);
  void give_work(std::vector<char>* w);

  std::string host_, address_;
  auth::Identity identity_;
  std::atomic<int> handshakes_{0};  // in flight (bounded: idle connections cannot pile up)
  auth::RefusalLog refusals_{"ring"};
  std::atomic<int> my_index_{0};    // my index in the current ring: the rank my connections claim
  int pool_size_;
  double timeout_s_;
  size_t piece_bytes_ = 1 << 20;
  int64_t handle_;
  int listen_fd_ = -1;
  std::atomic<bool> closing_{false};
  std::thread acceptor_;

  std::mutex mu_;  // ring_, pending_, handlers_, links_, work_, connecting_
  std::condition_variable cv_;
  std::shared_ptr<RingState> ring_;
  struct Pending { int fd; uint32_t slot; uint32_t rank; std::string src; };
  std::map<uint64_t, std::vector<Pending>> pending_;  // epoch -> authenticated ring connections
  struct Handler { std::thread th; std::shared_ptr<std::atomic<bool>> done; };
  std::vector<Handler> handlers_;  // finished ones are reaped by the acceptor
  std::set<int> handler_fds_;
  std::map<std::string, std::shared_ptr<Link>> links_;
  std::set<std::atomic<bool>*> connecting_;  // abort flags of connect_ring calls in progress
  std::vector<std::unique_ptr<std::vector<char>>> work_free_;
};

// The endpoint whose handle() is `handle`, or null once it is closed (common/handles.h).
Endpoint* endpoint_by_handle(int64_t handle);

}  // namespace jaxodc::ring
