// Internal to csrc/odc: the wire format of the tcp transport and the server that answers it.
// Every request is one WireHeader (plus data for a push); replies are one WireHeader (plus a
// shard for a gather), or an error reply: status 1 and a message of `count` bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/auth.h"

namespace jaxodc::odc {

struct Core;

// kNv*: the control half of the nvshmem transport (the data moves through NVSHMEM): wait for a
// publication (reply), wait for the client's slot to be free (reply), mark it full (no reply).
// kPushSketch: a compressed chunk (compress.h) of `count` elements; its payload follows.
enum Op : uint32_t {
  kHello = 1, kGather = 2, kPush = 3, kDone = 4, kScalar = 5, kClaim = 6, kBye = 7,
  kNvWaitPublished = 8, kNvWaitSlot = 9, kNvCommit = 10, kPushSketch = 11
};

struct WireHeader {
  uint32_t op;
  int32_t rank;
  int32_t unit;
  int32_t status;  // replies: 0 ok, 1 error (message of `count` bytes follows)
  int64_t version;
  int64_t count;
  uint64_t aux;  // push: offset in the owner's shard; claim: steal; hello: layout hash
  double value;
  int64_t sketch_width;  // kPushSketch
  uint64_t sketch_seed;
  int32_t elem_type;  // kGather / kPush: the element type on the wire (ElemType: fp32, or bf16 under mixed precision)
  int32_t reserved;
  double sent_at;  // now_seconds() at sending: the receiver of an emulated link holds it until sent_at + latency
};

inline WireHeader request(uint32_t op, int rank, int32_t unit = 0, int64_t version = 0, int64_t count = 0,
                          uint64_t aux = 0) {
  WireHeader h{};
  h.op = op;
  h.rank = rank;
  h.unit = unit;
  h.version = version;
  h.count = count;
  h.aux = aux;
  return h;
}

constexpr int64_t kMaxErrorBytes = 1 << 16;  // longest error message a reply may carry

// Receives a reply, held back by the emulated link's `latency` (0: none); an error reply is thrown
// as PeerError(what: message).
WireHeader recv_reply(int fd, const std::string& peer, double timeout_s, const std::string& what,
                      double latency = 0);

// This rank's TCP server: a client is served only once it proved the job secret
// (jaxodc-auth-v2, listener "odc_tcp") as the rank it then says hello as; one thread per client
// connection performs the client's one-sided operations on my segment (its waits bounded by the
// runtime's timeout). Every request is checked against the layout before it touches memory. A
// connection that fails the handshake is dropped and logged with its address; an authenticated one
// that breaks the protocol or ends without a goodbye is recorded as that client's failure
// (Core::record_client_failure), which aborts the minibatch naming it. Every read wakes on stop().
class TcpServer {
 public:
  TcpServer(Core& core, const std::string& host);  // listens on an ephemeral port
  ~TcpServer() { stop(); }
  TcpServer(const TcpServer&) = delete;
  TcpServer& operator=(const TcpServer&) = delete;
  int port() const { return port_; }
  uint64_t refused() const { return refusals_.count(); }
  // Joins every thread and closes every socket; the runtime's stop flag must be set.
  void stop();

 private:
  struct Connection {
    std::thread thread;
    int fd;
    std::shared_ptr<std::atomic<bool>> done;
  };
  void accept_loop();
  void serve(int fd);
  void reap();  // joins finished connections (mu_ held)

  Core& core_;
  int listen_fd_ = -1;
  int port_ = 0;
  auth::RefusalLog refusals_;
  auth::ConnectionBudget budget_;
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<Connection> conns_;
};

}  // namespace jaxodc::odc
