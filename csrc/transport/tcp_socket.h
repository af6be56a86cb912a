// The TCP helpers of every native transport (the ring and ODC's tcp / nvshmem transports):
// listen/connect with deadlines, full reads and writes that give up on a deadline or an abort
// flag, and "host:port" parsing. Errors are TcpError with a kind so callers can map them to
// timeout / connection / abort; the *_within variants report jaxodc's error types instead.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace jaxodc::tcp {

enum class ErrKind { kTimeout, kConnection, kAborted, kProtocol };

struct TcpError : std::runtime_error {
  ErrKind kind;
  TcpError(ErrKind k, const std::string& msg) : std::runtime_error(msg), kind(k) {}
};

// Splits "host:port"; throws std::invalid_argument naming the address.
void split_address(const std::string& addr, std::string* host, int* port);

// Listening socket bound to host:port (port 0 = any); returns fd and the bound port.
int listen_on(const std::string& host, int port, int* bound_port);

// Connects to addr (non-blocking connect + poll), retrying refused connections until timeout_s
// elapses; abort_flag (may be null) is checked at least every 50 ms (TcpError kAborted).
int connect_to(const std::string& addr, double timeout_s, const std::atomic<bool>* abort_flag);

// Waits up to timeout_ms for a connection on listen_fd: the accepted socket (close-on-exec,
// tuned), or -1 when none came (the accept loops poll so they can see their stop flag).
int accept_ready(int listen_fd, int timeout_ms);

void set_nonblocking(int fd, bool on);
void tune_socket(int fd);  // TCP_NODELAY and large kernel buffers

// Reads/writes exactly n bytes before `deadline` (a now_seconds() time, common/sync.h); `what`
// names the operation in errors. abort_flag (may be null) is checked at least every 50 ms.
void send_all(int fd, const void* buf, size_t n, double deadline, const std::atomic<bool>* abort_flag,
              const std::string& what);
void recv_all(int fd, void* buf, size_t n, double deadline, const std::atomic<bool>* abort_flag,
              const std::string& what);

void fill_random(void* buf, size_t n);

// Shuts down and closes fd (if open) and sets it to -1.
void close_fd(int& fd);

// For callers that report jaxodc's error types (common/sync.h): timeouts relative to now;
// PeerError when the peer cannot be reached, closed or reset the connection; TimeoutError naming
// `what`.
int connect_within(const std::string& host, int port, double timeout_s, const std::string& what);
void send_within(int fd, const void* buf, size_t n, double timeout_s, const std::string& what);
void recv_within(int fd, void* buf, size_t n, double timeout_s, const std::string& what);

}  // namespace jaxodc::tcp
