// The ODC tcp transport's view of transport/tcp_socket: relative timeouts and ODC's error types,
// so both transports share one implementation of sockets.
#include "transport/socket_util.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/sync.h"
#include "transport/tcp_socket.h"

namespace jaxodc::net {

int listen_tcp(const std::string& host, int port, int* bound_port) {
  try {
    return tcp::listen_on(host, port, bound_port);
  } catch (const tcp::TcpError& e) {
    throw Error(e.what());
  }
}

int connect_tcp(const std::string& host, int port, double timeout_s, const std::string& what) {
  try {
    // non-blocking connect polled against the deadline: an unreachable host cannot overrun it
    return tcp::connect_to(host + ":" + std::to_string(port), timeout_s, nullptr);
  } catch (const tcp::TcpError& e) {
    throw PeerError("could not connect to " + what + ": " + e.what());
  }
}

void send_all(int fd, const void* data, size_t n, double timeout_s, const std::string& what) {
  try {
    tcp::send_all(fd, data, n, tcp::now_s() + timeout_s, nullptr, what);
  } catch (const tcp::TcpError& e) {
    if (e.kind == tcp::ErrKind::kTimeout)
      throw TimeoutError("timed out after " + std::to_string(timeout_s) + " s sending to " + what);
    throw PeerError("connection to " + std::string(e.what()));
  }
}

void recv_all(int fd, void* data, size_t n, double timeout_s, const std::string& what) {
  try {
    tcp::recv_all(fd, data, n, tcp::now_s() + timeout_s, nullptr, what);
  } catch (const tcp::TcpError& e) {
    if (e.kind == tcp::ErrKind::kTimeout)
      throw TimeoutError("timed out after " + std::to_string(timeout_s) + " s receiving from " + what);
    throw PeerError("connection to " + std::string(e.what()));
  }
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void close_fd(int& fd) {
  if (fd >= 0) {
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
    fd = -1;
  }
}

}  // namespace jaxodc::net
