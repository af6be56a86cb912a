// TCP helpers of the ODC tcp transport: transport/tcp_socket with relative timeouts and ODC errors.
#pragma once

#include <cstdint>
#include <string>

namespace jaxodc::net {

// Listens on host:port (port 0 = ephemeral); returns the fd and writes the bound port.
int listen_tcp(const std::string& host, int port, int* bound_port);
// Connects with retries until `timeout_s`; throws PeerError naming `what` on failure.
int connect_tcp(const std::string& host, int port, double timeout_s, const std::string& what);
// Full send / receive; throw PeerError (peer closed or reset) or TimeoutError naming `what`.
void send_all(int fd, const void* data, size_t n, double timeout_s, const std::string& what);
void recv_all(int fd, void* data, size_t n, double timeout_s, const std::string& what);
void set_nodelay(int fd);
void close_fd(int& fd);

}  // namespace jaxodc::net
