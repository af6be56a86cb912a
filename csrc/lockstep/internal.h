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
#include "transport/auth.h"
#include "transport/shm.h"

namespace jaxodc::lockstep {

constexpr uint64_t kMagic = 0x3230504b53434f4cULL;  // "LOCKSTP2": not the ODC magic, so ODC's reclaim skips it

constexpr size_t kTableOffset = 256;

// Staging areas per rank, shared by every channel (see group.h, "Buffers"): two, so that a rank
// can post its next call while its peers still read the previous one, and so that a host call's
// post (allgather_bytes' channel, run while a jitted step may still be in flight) that a peer
// reads only once its own host thread gets there never holds up the step's calls.
constexpr int kSlots = 2;

// Where call `seq` of a channel lies in the segment: entry seq % 2 of the channel names the
// staging area that holds it.
struct PostEntry {
  std::atomic<int64_t> seq;   // -1 until the first post
  std::atomic<int32_t> slot;  // the staging area holding call `seq`
  int32_t pad;
};

// A staging area: which call it holds and how many shm peers have yet to read it (0: free).
struct SlotHeader {
  std::atomic<int32_t> left;
  int32_t channel;
  int64_t seq;
  uint64_t offset;  // of the area's data from the segment base
  uint64_t pad;
};

struct SegmentHeader {
  uint64_t magic;
  int32_t rank, world, pid, num_channels;
  uint64_t layout_hash;
  uint64_t bytes;
  int32_t num_slots, pad;
  uint64_t slot_bytes;    // capacity of each staging area
  uint64_t slots_offset;  // SlotHeader[num_slots]
  uint64_t unread_offset; // uint32 [num_slots][world]: 1 while rank r has not read that area's post
  alignas(64) std::atomic<uint32_t> doorbell;  // bumped by every post a peer makes, by tcp arrivals, by reads
  alignas(64) std::atomic<uint32_t> closing;   // this rank closed its group

  PostEntry* entry(int channel, int64_t seq) {
    auto* table = reinterpret_cast<PostEntry*>(reinterpret_cast<char*>(this) + kTableOffset);
    return table + 2 * channel + (seq & 1);
  }
  SlotHeader* slot(int k) {
    return reinterpret_cast<SlotHeader*>(reinterpret_cast<char*>(this) + slots_offset) + k;
  }
  std::atomic<uint32_t>* unread(int k, int reader) {
    return reinterpret_cast<std::atomic<uint32_t>*>(reinterpret_cast<char*>(this) + unread_offset) + k * world + reader;
  }
  char* data(int k) { return reinterpret_cast<char*>(this) + slot(k)->offset; }
};
static_assert(sizeof(SegmentHeader) <= kTableOffset, "the post table follows the header");

// A segment mapped into this process (mine or a peer's), unmapped on destruction.
struct Segment {
  shm::Mapping map;
  SegmentHeader* hdr = nullptr;
  size_t bytes = 0;
};

struct Peer {
  int rank = -1;
  Link link = Link::kSelf;
  std::unique_ptr<Segment> seg;  // kShm
  int pid = 0;
  // kTcp: my connection to its receiver, and its posts to me (per channel and parity).
  int send_fd = -1;
  std::mutex send_mu;
  std::vector<char> recv;
  std::vector<int64_t> recv_offset;                   // per channel: start (bytes) of its 2 areas in recv
  std::unique_ptr<std::atomic<int64_t>[]> recv_seq;  // per channel and parity, -1 until the first
  std::mutex fail_mu;
  std::string failure;  // why its connection to me died ("" while alive)
  std::atomic<bool> failed{false};
};

struct Call {
  int c;
  int64_t seq;
  const char* in;
  char* out;
  int64_t eb;  // element bytes
  std::function<void(const std::string&)> done;
  std::vector<char> got;  // gather: per rank, copied
  int next = 0;           // sums: the next rank to add (rank order)
  bool posted = false;    // my input is in a staging area (shm peers) and sent (tcp peers)
  double started, deadline;
};

// The tcp side of a group: a listener whose accepted connections each get a receiver thread that
// stores one peer's posts, and my outgoing connections (Peer::send_fd). A connection is served only
// once it proved the job secret (jaxodc-auth-v2) as a rank of the group that holds no other link to
// me; posts are checked against the channels before a byte is stored. Every read wakes on stop().
class TcpLinks {
 public:
  TcpLinks(Group& group, const std::string& host, auth::Identity identity);  // listens on an ephemeral port
  ~TcpLinks() { stop(); }
  int port() const { return port_; }
  void connect(Peer& peer, const std::string& host, int port);
  // Sends my post of call `seq` of channel `c` (`count` elements from `data`) to `peer`.
  void send(Peer& peer, int c, int64_t seq, const char* data, int64_t count);
  void stop();

 private:
  struct Connection {
    std::thread thread;
    int fd;
    std::shared_ptr<std::atomic<bool>> done;
  };
  void accept_loop();
  void receive(int fd);
  void read(int fd, void* buf, size_t n, const std::string& what);

  Group& group_;
  const auth::Identity identity_;
  int listen_fd_ = -1, port_ = 0;
  std::atomic<bool> stop_{false};
  auth::RefusalLog refusals_;
  auth::ConnectionBudget budget_;
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<Connection> conns_;
  std::vector<bool> linked_;  // per rank: its link to me is up (one per rank)
};

}  // namespace jaxodc::lockstep
