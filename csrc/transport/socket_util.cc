#include "transport/socket_util.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "common/sync.h"

namespace jaxodc::net {

namespace {

sockaddr_in resolve(const std::string& host, int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1) return addr;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr)
    throw PeerError("cannot resolve host '" + host + "'");
  addr.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return addr;
}

// Waits for `events` on fd until the deadline; false on timeout.
bool wait_fd(int fd, short events, double deadline) {
  while (true) {
    double left = deadline - now_seconds();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    int ms = static_cast<int>(left * 1000) + 1;
    int r = poll(&p, 1, ms > 200 ? 200 : ms);
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return true;  // let the following call report the error
  }
}

}  // namespace

int listen_tcp(const std::string& host, int port, int* bound_port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(std::string("socket(): ") + strerror(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr = resolve(host, port);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    std::string msg = "bind(" + host + ":" + std::to_string(port) + "): " + strerror(errno);
    ::close(fd);
    throw Error(msg);
  }
  if (listen(fd, 128) != 0) {
    ::close(fd);
    throw Error(std::string("listen(): ") + strerror(errno));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *bound_port = ntohs(addr.sin_port);
  return fd;
}

int connect_tcp(const std::string& host, int port, double timeout_s, const std::string& what) {
  double deadline = now_seconds() + timeout_s;
  sockaddr_in addr = resolve(host, port);
  std::string last_error;
  while (now_seconds() < deadline) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw Error(std::string("socket(): ") + strerror(errno));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      set_nodelay(fd);
      return fd;
    }
    last_error = strerror(errno);
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  throw PeerError("could not connect to " + what + " at " + host + ":" + std::to_string(port) +
                  " within " + std::to_string(timeout_s) + " s (" + last_error + ")");
}

void send_all(int fd, const void* data, size_t n, double timeout_s, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  double deadline = now_seconds() + timeout_s;
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!wait_fd(fd, POLLOUT, deadline))
        throw TimeoutError("timed out after " + std::to_string(timeout_s) + " s sending to " + what);
      continue;
    }
    throw PeerError("connection to " + what + " failed while sending: " +
                    (k == 0 ? std::string("closed") : std::string(strerror(errno))));
  }
}

void recv_all(int fd, void* data, size_t n, double timeout_s, const std::string& what) {
  char* p = static_cast<char*>(data);
  double deadline = now_seconds() + timeout_s;
  while (n > 0) {
    ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!wait_fd(fd, POLLIN, deadline))
        throw TimeoutError("timed out after " + std::to_string(timeout_s) + " s receiving from " + what);
      continue;
    }
    throw PeerError("connection to " + what + " " +
                    (k == 0 ? std::string("closed by the peer") : std::string(strerror(errno))));
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
