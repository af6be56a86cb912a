// Internal to csrc/ring: the connections of one ring epoch, shared by the endpoint (which builds
// them and routes incoming operations, endpoint.cc) and the all-reduces that use them
// (all_reduce.cc).
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ring/wire.h"

namespace jaxodc::ring {

inline void shut(int fd) {
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
}

struct RingState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t epoch = 0;
  int world = 1, rank = 0;
  std::string next, prev;
  std::vector<int> out_fds, in_fds;
  std::vector<bool> out_busy;
  std::vector<int> in_state;  // 0 idle (dispatcher reads its next start header), 1 routed/owned, 2 dead
  struct Routed { int idx; StartHdr hdr; };
  std::map<uint32_t, std::deque<Routed>> routed;
  std::string broken;  // set once the ring is unusable (peer lost, timeout, protocol error)
  bool aborted = false, stop = false;
  uint64_t next_ticket = 0, serving = 0;
  std::set<uint64_t> cancelled;
  int wake[2] = {-1, -1};
  std::thread dispatcher;

  ~RingState() {
    for (int fd : out_fds) ::close(fd);
    for (int fd : in_fds) ::close(fd);
    if (wake[0] >= 0) { ::close(wake[0]); ::close(wake[1]); }
  }
  void poke() {
    char c = 1;
    if (wake[1] >= 0) (void)!::write(wake[1], &c, 1);
  }
  void shut_all() {
    for (int fd : out_fds) shut(fd);
    for (int fd : in_fds) shut(fd);
  }
  void advance_serving() {  // skip tickets of ops that gave up waiting
    while (cancelled.count(serving)) cancelled.erase(serving++);
  }
};

}  // namespace jaxodc::ring
