#include "transport/auth.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace jaxodc::auth {

namespace {

constexpr char kMagic[4] = {'J', 'X', 'A', '2'};

void check_identity(const Identity& id, uint32_t rank) {
  if (rank >= kMaxRank) throw std::invalid_argument("rank " + std::to_string(rank) + " out of range");
  if (id.job_id.find('|') != std::string::npos)
    throw std::invalid_argument("job id '" + id.job_id + "' may not contain '|'");
}

}  // namespace

crypto::Digest tag(const Identity& id, const std::string& role, uint32_t rank, const uint8_t* nonce_s,
                   const uint8_t* nonce_c) {
  if (role != "client" && role != "server") throw std::invalid_argument("role '" + role + "'");
  check_identity(id, rank);
  std::string msg = "jaxodc-auth-v2|" + role + "|" + id.listener + "|" + id.job_id + "|" + std::to_string(rank) + "|";
  msg.append(reinterpret_cast<const char*>(nonce_s), kNonceBytes);
  msg.append(reinterpret_cast<const char*>(nonce_c), kNonceBytes);
  return crypto::hmac_sha256(id.secret.data(), id.secret.size(), msg.data(), msg.size());
}

void client_handshake(int fd, const Identity& id, uint32_t rank, double deadline, const std::atomic<bool>* stop,
                      const std::string& what) {
  check_identity(id, rank);
  uint8_t hello[4 + kNonceBytes];
  tcp::recv_all(fd, hello, sizeof(hello), deadline, stop, what + " (handshake)");
  if (std::memcmp(hello, kMagic, 4) != 0) throw Rejected(what + ": peer is not a jaxodc-auth-v2 listener");
  const uint8_t* nonce_s = hello + 4;
  uint8_t reply[kNonceBytes + 4 + kTagBytes];
  tcp::fill_random(reply, kNonceBytes);
  const uint8_t le[4] = {static_cast<uint8_t>(rank), static_cast<uint8_t>(rank >> 8), static_cast<uint8_t>(rank >> 16),
                         static_cast<uint8_t>(rank >> 24)};
  std::memcpy(reply + kNonceBytes, le, 4);
  const crypto::Digest mine = tag(id, "client", rank, nonce_s, reply);
  std::memcpy(reply + kNonceBytes + 4, mine.data(), kTagBytes);
  tcp::send_all(fd, reply, sizeof(reply), deadline, stop, what + " (handshake)");
  crypto::Digest proof;
  try {
    tcp::recv_all(fd, proof.data(), proof.size(), deadline, stop, what + " (handshake)");
  } catch (const tcp::TcpError& e) {
    if (e.kind != tcp::ErrKind::kConnection) throw;
    throw Rejected(what + ": authentication refused by the listener (wrong job secret or job id?): " + e.what());
  }
  if (!crypto::digest_equal(proof, tag(id, "server", rank, nonce_s, reply)))
    throw Rejected(what + ": the listener failed authentication (it could not prove the job secret)");
}

uint32_t server_handshake(int fd, const Identity& id, uint32_t world, double deadline, const std::atomic<bool>* stop,
                          const std::string& what) {
  uint8_t hello[4 + kNonceBytes];
  std::memcpy(hello, kMagic, 4);
  tcp::fill_random(hello + 4, kNonceBytes);
  tcp::send_all(fd, hello, sizeof(hello), deadline, stop, what + " (handshake)");
  uint8_t reply[kNonceBytes + 4 + kTagBytes];
  tcp::recv_all(fd, reply, sizeof(reply), deadline, stop, what + " (handshake)");
  const uint8_t* r = reply + kNonceBytes;
  const uint32_t rank = uint32_t(r[0]) | uint32_t(r[1]) << 8 | uint32_t(r[2]) << 16 | uint32_t(r[3]) << 24;
  if (rank >= world || rank >= kMaxRank)
    throw Rejected("claimed rank " + std::to_string(rank) + " outside a world of " + std::to_string(world));
  crypto::Digest got;
  std::memcpy(got.data(), reply + kNonceBytes + 4, kTagBytes);
  if (!crypto::digest_equal(got, tag(id, "client", rank, hello + 4, reply)))
    throw Rejected("wrong secret for claimed rank " + std::to_string(rank));
  const crypto::Digest proof = tag(id, "server", rank, hello + 4, reply);
  tcp::send_all(fd, proof.data(), proof.size(), deadline, stop, what + " (handshake)");
  return rank;
}

bool is_loopback(const std::string& host) {
  if (host == "localhost") return true;
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) == 1) return (ntohl(a.s_addr) >> 24) == 127;
  in6_addr a6{};
  if (inet_pton(AF_INET6, host.c_str(), &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
  return false;
}

void check_bind(const std::string& secret, const std::string& host, const std::string& what) {
  if (secret.empty() && !is_loopback(host))
    throw std::invalid_argument(what + ": refusing to listen on " + (host.empty() ? "every interface" : host) +
                                " without a job secret; give one (--secret-file, or $JAXODC_JOB_SECRET) or bind "
                                "127.0.0.1");
}

std::string peer_address(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0 || sa.sin_family != AF_INET) return "unknown peer";
  char ip[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
  return std::string(ip) + ":" + std::to_string(ntohs(sa.sin_port));
}

void RefusalLog::refused(const std::string& peer, const std::string& why) {
  const uint64_t n = count_.fetch_add(1) + 1;
  if (n <= 4 || (n & (n - 1)) == 0)
    std::fprintf(stderr, "jaxodc %s: refused a connection from %s: %s (%llu refused so far)\n", listener_.c_str(),
                 peer.c_str(), why.c_str(), static_cast<unsigned long long>(n));
}

void RefusalLog::closing() const {
  const uint64_t n = count_.load();
  if (n > 0)
    std::fprintf(stderr, "jaxodc %s: closed; refused %llu connections in all\n", listener_.c_str(),
                 static_cast<unsigned long long>(n));
}

bool ConnectionBudget::start_handshake() {
  if (pending_.fetch_add(1) < max_pending_) return true;
  pending_.fetch_sub(1);
  return false;
}

bool ConnectionBudget::admit() {
  if (peers_.fetch_add(1) < max_peers_) return true;
  peers_.fetch_sub(1);
  return false;
}

}  // namespace jaxodc::auth
