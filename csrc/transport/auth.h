// jaxodc-auth-v2 on the native listeners: the challenge-response every jaxodc socket runs before it
// trusts a peer (the exact bytes are specified in jaxodc/auth.py and checked against the shared
// vectors of tests/support/auth_vectors.json):
//
//   server -> client   "JXA2" + nonce_s                           (4 + 32 bytes)
//   client -> server   nonce_c + rank (u32 little endian) + tag_c   (32 + 4 + 32 bytes)
//   server -> client   tag_s                                        (32 bytes), only if tag_c is right
//
//   tag_<role> = HMAC-SHA256(secret, "jaxodc-auth-v2|" role "|" listener "|" job_id "|" rank "|"
//                            nonce_s nonce_c)
//
// Every read of the handshake gives up at a deadline or when the listener's stop flag is set.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "hash/sha256.h"
#include "transport/tcp_socket.h"

namespace jaxodc::auth {

constexpr size_t kNonceBytes = 32, kTagBytes = 32;
constexpr uint32_t kMaxRank = 1u << 20;  // as jaxodc/auth.py: claimed ranks beyond are refused unread
// A handshake has this long (at most) before its connection is dropped: an idle or half-open
// connection holds a listener's handshake slot no longer.
constexpr double kHandshakeSeconds = 10.0;

// Who a socket belongs to: the job secret, the kind of listener (one of jaxodc.auth.LISTENERS) and
// the job (or group) id, all bound into both tags.
struct Identity {
  std::string secret;
  std::string listener;
  std::string job_id;
};

// The tag of `role` ("client" or "server"); throws std::invalid_argument on a bad role, rank or
// a job id holding '|'.
crypto::Digest tag(const Identity& id, const std::string& role, uint32_t rank, const uint8_t* nonce_s,
                   const uint8_t* nonce_c);

// The peer failed the handshake (wrong secret, job, listener, rank or protocol).
struct Rejected : tcp::TcpError {
  explicit Rejected(const std::string& msg) : tcp::TcpError(tcp::ErrKind::kProtocol, msg) {}
};

// Proves the secret as `rank` and checks the server's proof. Throws tcp::TcpError (Rejected when
// the server refused us or failed its proof), naming `what`.
void client_handshake(int fd, const Identity& id, uint32_t rank, double deadline, const std::atomic<bool>* stop,
                      const std::string& what);

// Challenges a connected client; returns its authenticated rank (< world). Throws Rejected (the
// caller closes the socket and logs the peer's address) or tcp::TcpError.
uint32_t server_handshake(int fd, const Identity& id, uint32_t world, double deadline, const std::atomic<bool>* stop,
                          const std::string& what);

// An empty secret only on loopback binds: throws std::invalid_argument naming `what` otherwise.
void check_bind(const std::string& secret, const std::string& host, const std::string& what);
bool is_loopback(const std::string& host);

// "ip:port" of the peer of a connected socket ("unknown peer" when it is gone).
std::string peer_address(int fd);

// Counts a listener's refused connections and logs the first few and then every power of two, so a
// flood of garbage cannot flood the log; the total is logged at close.
class RefusalLog {
 public:
  explicit RefusalLog(std::string listener) : listener_(std::move(listener)) {}
  void rename(std::string listener) { listener_ = std::move(listener); }  // before the listener accepts
  void refused(const std::string& peer, const std::string& why);
  void closing() const;
  uint64_t count() const { return count_.load(); }

 private:
  std::string listener_;
  std::atomic<uint64_t> count_{0};
};

// Bounds the connections a listener serves at once: handshakes in flight and authenticated peers
// separately, so idle unauthenticated connections cannot lock the ranks out.
class ConnectionBudget {
 public:
  ConnectionBudget(int max_pending, int max_peers) : max_pending_(max_pending), max_peers_(max_peers) {}
  bool start_handshake();  // false: too many handshakes in flight (refuse the connection)
  bool admit();            // after a handshake succeeded; false: too many peers
  void end_handshake() { pending_.fetch_sub(1); }
  void leave() { peers_.fetch_sub(1); }

 private:
  const int max_pending_, max_peers_;
  std::atomic<int> pending_{0}, peers_{0};
};

}  // namespace jaxodc::auth
