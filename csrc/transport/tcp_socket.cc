#include "transport/tcp_socket.h"
#include "transport/link_shaper.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "common/sync.h"

namespace jaxodc::tcp {

void split_address(const std::string& addr, std::string* host, int* port) {
  auto pos = addr.rfind(':');
  if (pos == std::string::npos || pos == 0 || pos + 1 >= addr.size())
    throw std::invalid_argument("bad address '" + addr + "': expected host:port");
  *host = addr.substr(0, pos);
  try {
    *port = std::stoi(addr.substr(pos + 1));
  } catch (...) {
    throw std::invalid_argument("bad port in address '" + addr + "'");
  }
  if (*port < 0 || *port > 65535) throw std::invalid_argument("port out of range in '" + addr + "'");
}

static sockaddr_in resolve(const std::string& host, int port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) == 1) return sa;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res)
    throw TcpError(ErrKind::kConnection, "cannot resolve host '" + host + "'");
  sa.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return sa;
}

int listen_on(const std::string& host, int port, int* bound_port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw TcpError(ErrKind::kConnection, std::string("socket(): ") + strerror(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in sa = resolve(host, port);
  if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || listen(fd, 128) != 0) {
    int e = errno;
    close(fd);
    throw TcpError(ErrKind::kConnection,
                   "cannot listen on " + host + ":" + std::to_string(port) + ": " + strerror(e));
  }
  socklen_t len = sizeof(sa);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  *bound_port = ntohs(sa.sin_port);
  return fd;
}

void set_nonblocking(int fd, bool on) {
  int fl = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK));
}

void tune_socket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
}

int connect_to(const std::string& addr, double timeout_s, const std::atomic<bool>* abort_flag) {
  std::string host;
  int port;
  split_address(addr, &host, &port);
  sockaddr_in sa = resolve(host, port);
  double deadline = now_seconds() + timeout_s;
  double backoff = 0.01;
  std::string last = "no attempt";
  auto aborted = [&] { return abort_flag && abort_flag->load(); };
  auto abort_error = [&] { return TcpError(ErrKind::kAborted, "connect to " + addr + " aborted"); };
  while (true) {
    if (aborted()) throw abort_error();
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw TcpError(ErrKind::kConnection, std::string("socket(): ") + strerror(errno));
    tune_socket(fd);
    set_nonblocking(fd, true);
    int err = connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      // non-blocking connect: wait for completion in 50 ms slices that watch the abort flag
      err = ETIMEDOUT;
      while (true) {
        if (aborted()) {
          close(fd);
          throw abort_error();
        }
        double left = deadline - now_seconds();
        if (left <= 0) break;
        pollfd p{fd, POLLOUT, 0};
        int rc = poll(&p, 1, static_cast<int>(std::min(left, 0.05) * 1000) + 1);
        if (rc == 1) {
          socklen_t len = sizeof(err);
          if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
          break;
        }
        if (rc < 0 && errno != EINTR) {
          err = errno;
          break;
        }
      }
    }
    if (err == 0) {
      set_nonblocking(fd, false);
      return fd;
    }
    last = strerror(err);
    close(fd);
    if (now_seconds() >= deadline)
      throw TcpError(ErrKind::kTimeout, "connect to " + addr + " timed out after " +
                                            seconds_text(timeout_s) + " (last error: " + last + ")");
    // refused (peer not listening yet): back off, still watching the abort flag
    double until = std::min(deadline, now_seconds() + backoff);
    for (double t = now_seconds(); t < until; t = now_seconds()) {
      if (aborted()) throw abort_error();
      std::this_thread::sleep_for(std::chrono::duration<double>(std::min(until - t, 0.05)));
    }
    backoff = std::min(backoff * 2, 0.2);
  }
}

static void wait_fd(int fd, short events, double deadline, const std::atomic<bool>* abort_flag,
                    const std::string& what) {
  while (true) {
    if (abort_flag && abort_flag->load()) throw TcpError(ErrKind::kAborted, what + ": aborted");
    double left = deadline - now_seconds();
    if (left <= 0) throw TcpError(ErrKind::kTimeout, what + ": timed out");
    pollfd p{fd, events, 0};
    int rc = poll(&p, 1, static_cast<int>(std::min(left, 0.05) * 1000) + 1);
    if (rc > 0) return;
    if (rc < 0 && errno != EINTR) throw TcpError(ErrKind::kConnection, what + ": poll: " + strerror(errno));
  }
}

void send_all(int fd, const void* buf, size_t n, double deadline, const std::atomic<bool>* abort_flag,
              const std::string& what) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      wait_fd(fd, POLLOUT, deadline, abort_flag, what);
      continue;
    }
    throw TcpError(ErrKind::kConnection, what + ": send failed: " + strerror(errno));
  }
}

void recv_all(int fd, void* buf, size_t n, double deadline, const std::atomic<bool>* abort_flag,
              const std::string& what) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t k = recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k == 0) throw TcpError(ErrKind::kConnection, what + ": connection closed by peer");
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      wait_fd(fd, POLLIN, deadline, abort_flag, what);
      continue;
    }
    throw TcpError(ErrKind::kConnection, what + ": recv failed: " + strerror(errno));
  }
}

void fill_random(void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t k = getrandom(p, n, 0);
    if (k <= 0) {
      std::random_device rd;  // fallback; getrandom is available on every supported kernel
      for (; n > 0; --n) *p++ = static_cast<char>(rd());
      return;
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void close_fd(int& fd) {
  if (fd >= 0) {
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
    fd = -1;
  }
}

int connect_within(const std::string& host, int port, double timeout_s, const std::string& what) {
  try {
    return connect_to(host + ":" + std::to_string(port), timeout_s, nullptr);
  } catch (const TcpError& e) {
    throw PeerError("could not connect to " + what + ": " + e.what());
  }
}

namespace {

// Rethrows the TcpError of a transfer to or from `what` as jaxodc's error type.
[[noreturn]] void rethrow_as_jaxodc(const TcpError& e, double timeout_s, const char* direction,
                                    const std::string& what) {
  if (e.kind == ErrKind::kTimeout)
    throw TimeoutError("timed out after " + seconds_text(timeout_s) + " " + direction + " " + what);
  throw PeerError("connection to " + std::string(e.what()));
}

}  // namespace

void send_within(int fd, const void* buf, size_t n, double timeout_s, const std::string& what) {
  try {
    send_all(fd, buf, n, now_seconds() + timeout_s, nullptr, what);
  } catch (const TcpError& e) {
    rethrow_as_jaxodc(e, timeout_s, "sending to", what);
  }
}

int accept_ready(int listen_fd, int timeout_ms) {
  pollfd p{listen_fd, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) return -1;
  const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd >= 0) tune_socket(fd);
  return fd;
}

void send_shaped(int fd, const void* buf, size_t n, Link& link, double timeout_s, const std::string& what) {
  const double deadline = now_seconds() + timeout_s;
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    double wait = 0;
    const size_t grant = link.take(n, &wait);
    if (grant == 0) {
      if (now_seconds() + wait > deadline)
        throw TimeoutError("timed out after " + seconds_text(timeout_s) + " sending to " + what +
                           " through the emulated link");
      std::this_thread::sleep_for(std::chrono::duration<double>(wait));
      continue;
    }
    send_within(fd, p, grant, std::max(deadline - now_seconds(), 0.001), what);
    p += grant;
    n -= grant;
  }
}

void recv_within(int fd, void* buf, size_t n, double timeout_s, const std::string& what) {
  try {
    recv_all(fd, buf, n, now_seconds() + timeout_s, nullptr, what);
  } catch (const TcpError& e) {
    rethrow_as_jaxodc(e, timeout_s, "receiving from", what);
  }
}

}  // namespace jaxodc::tcp
