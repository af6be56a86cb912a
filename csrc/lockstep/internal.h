// Internal to csrc/lockstep: the shm segment layout, a peer as the group reaches it, a call in
// progress and the tcp links (tcp_links.cc).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/group.h"

namespace jaxodc::lockstep {

constexpr uint64_t kMagic = 0x3130504b53434f4cULL;  // "LOCKSTP1": not the ODC magic, so ODC's reclaim skips it

constexpr size_t kTableOffset = 256;

// Where call `seq` of a channel lies in the segment: area seq % 2.
struct PostEntry {
  std::atomic<int64_t> seq;  // -1 until the first post
  uint64_t offset;           // of the area's data from the segment base
};

struct SegmentHeader {
  uint64_t magic;
  int32_t rank, world, pid, num_channels;
  uint64_t layout_hash;
  uint64_t bytes;
  alignas(64) std::atomic<uint32_t> doorbell;  // bumped by every post a peer makes, by tcp arrivals
  alignas(64) std::atomic<uint32_t> closing;   // this rank closed its group

  PostEntry* entry(int channel, int64_t seq) {
    auto* table = reinterpret_cast<PostEntry*>(reinterpret_cast<char*>(this) + kTableOffset);
    return table + 2 * channel + (seq & 1);
  }
  float* data(const PostEntry* e) { return reinterpret_cast<float*>(reinterpret_cast<char*>(this) + e->offset); }
};
static_assert(sizeof(SegmentHeader) <= kTableOffset, "the post table follows the header");

// A segment mapped into this process (mine or a peer's), unmapped on destruction.
struct Segment {
  SegmentHeader* hdr = nullptr;
  size_t bytes = 0;
  ~Segment();
};

struct Peer {
  int rank = -1;
  Link link = Link::kSelf;
  std::unique_ptr<Segment> seg;  // kShm
  int pid = 0;
  // kTcp: my connection to its receiver, and its posts to me (per channel and parity).
  int send_fd = -1;
  std::mutex send_mu;
  std::vector<float> recv;
  std::vector<int64_t> recv_offset;                   // per channel: start of its 2 areas in recv
  std::unique_ptr<std::atomic<int64_t>[]> recv_seq;  // per channel and parity, -1 until the first
  std::mutex fail_mu;
  std::string failure;  // why its connection to me died ("" while alive)
  std::atomic<bool> failed{false};
};

struct Call {
  int c;
  int64_t seq;
  const float* in;
  float* out;
  std::function<void(const std::string&)> done;
  std::vector<char> got;  // gather: per rank, copied
  int next = 0;           // sums: the next rank to add (rank order)
  double started, deadline;
};

// The tcp side of a group: a listener whose accepted connections each get a receiver thread that
// stores one peer's posts, and my outgoing connections (Peer::send_fd).
class TcpLinks {
 public:
  TcpLinks(Group& group, const std::string& host);  // listens on an ephemeral port
  ~TcpLinks() { stop(); }
  int port() const { return port_; }
  void connect(Peer& peer, const std::string& host, int port);
  // Sends my post of call `seq` of channel `c` (`count` floats from `data`) to `peer`.
  void send(Peer& peer, int c, int64_t seq, const float* data, int64_t count);
  void stop();

 private:
  void accept_loop();
  void receive(int fd);

  Group& group_;
  int listen_fd_ = -1, port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<std::thread> threads_;
  std::vector<int> fds_;
};

}  // namespace jaxodc::lockstep
