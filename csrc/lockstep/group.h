// Lock-step collectives over jaxodc's own transports: the collective baseline's all-gather,
// reduce-scatter and all-reduce(sum) moved over POSIX shared memory (same host) or TCP, the paths
// the ODC runtime uses, so that comparing ODC with the collective trainer measures the protocol
// and not gloo.
//
// A Group is one rank's endpoint. Its operations run on *channels*, fixed at construction: each
// channel has a kind (gather, scatter, reduce), a size n (fp32 elements per rank: the shard of a
// gather or scatter, the vector of a reduce) and a name for errors. Calls on one channel are
// numbered on every rank (call s of channel c on rank a meets call s of channel c on rank b);
// calls on different channels are independent, so XLA may run them in any order or concurrently
// (it does: XLA:CPU runs independent custom calls on several threads) without the ranks ever
// pairing the wrong calls. Calls on one channel must not overlap on a rank (checked).
//
// Buffers: a rank posts its input of a call into one of its shm segment's two staging areas,
// shared by every channel and sized to the largest single post (a gather's or all-reduce's n
// elements; a reduce-scatter's world - 1 slices of n, the peers' slices only), so the segment is
// about one largest unit at world 2 whatever the number of units and channels. The channel's post
// table (entry call % 2) names the area; every shm peer that reads it clears its flag in the area
// (and rings the writer's doorbell when it was the last), and only then may the writer reuse the
// area. A call whose post finds both areas unread waits for them on the progress thread (it never
// blocks its caller): ranks may post in different orders, and a rank reads a peer's post as soon as
// it has started that call, whether or not its own post went out, so the areas always drain (a
// peer reads an area once it starts the call, which it does once the call's inputs are ready,
// which on every rank needs only calls that were posted before). Entry call % 2 of a channel is
// reposted only for call + 2, after every peer posted call + 1, which each peer did only after its
// own call had finished reading. Tcp peers get the input sent; their receiver threads store it in
// per-(channel, sender) double buffers (the same argument makes two enough).
//
// Calls never block their thread: `start` posts and does what it can; if a peer has not posted
// yet, the call is left to the progress thread, which finishes it when the data arrives (its
// completion callback is XLA's async FFI future). A blocking wait inside XLA's thunk executor
// could deadlock two ranks that run independent collectives in different orders.
//
// Sums (scatter, reduce) add the ranks' contributions in rank order, so every rank of an
// all-reduce gets the same bits, and a reduce-scatter does not depend on arrival order.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/sync.h"

namespace jaxodc::lockstep {

enum class Kind : int { kGather = 0, kScatter = 1, kReduce = 2 };

// What a channel carries: float32, or bfloat16 (mixed precision's gathered units and their
// gradients: half the bytes). bf16 sums add in float32 and round to bf16 (nearest even) after
// every rank's addition, in rank order.
enum class DType : int { kF32 = 0, kBF16 = 1 };

struct ChannelSpec {
  Kind kind;
  int64_t n;  // elements per rank: gather in n / out W*n; scatter in W*n / out n; reduce n / n
  std::string name;
  DType dtype = DType::kF32;
};

enum class Link : int { kSelf = 0, kShm = 1, kTcp = 2 };

struct PeerConfig {
  int rank = -1;
  Link link = Link::kShm;
  std::string shm_name;  // kShm
  std::string host;      // kTcp
  int port = 0;
};

// One call in progress; `done(error)` is called once ("" = success), on whichever thread
// finished it.
struct Call;
struct Peer;
struct Segment;
class TcpLinks;

class Group {
 public:
  // `shm_name`: this rank's segment ("/jaxodc_<job>_..."; created here, unlinked by
  // unlink_segment or close). `listen_host`: address of the TCP listener (world > 1); `secret` and
  // `job_id`: what every tcp link proves (jaxodc-auth-v2, listener "lockstep_tcp"; an empty secret
  // only on a loopback listen_host).
  Group(int rank, int world, const std::string& shm_name, const std::vector<ChannelSpec>& channels,
        double timeout_s, const std::string& listen_host, const std::string& secret = "",
        const std::string& job_id = "");
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  int port() const;
  uint64_t layout_hash() const { return layout_hash_; }
  int64_t handle() const { return handle_; }
  const std::string& shm_name() const { return shm_name_; }
  int num_channels() const { return static_cast<int>(channels_.size()); }
  const ChannelSpec& channel(int c) const;
  int64_t in_elems(int c) const;
  int64_t out_elems(int c) const;
  int elem_bytes(int c) const;  // 4 (float32) or 2 (bfloat16)
  // Elements call `c` puts into a staging area (the peers' slices of a reduce-scatter).
  int64_t post_elems(int c) const;
  // This rank's memory: its shm segment's bytes, and the tcp receive buffers (after connect).
  int64_t segment_bytes() const;
  int64_t tcp_buffer_bytes() const;

  // Maps the shm peers' segments and connects to the tcp peers (one config per rank).
  void connect(const std::vector<PeerConfig>& peers);
  // Removes this rank's segment name once every peer has mapped it, so a crash cannot leak it.
  void unlink_segment();

  // Starts call `c` on `in` (in_elems(c) elements of the channel's dtype) into `out` (out_elems(c)); both must stay
  // valid until `done` runs. `done` may run before start returns (everything was there).
  void start(int c, const void* in, void* out, std::function<void(const std::string&)> done);
  // start, then wait for it (host callers; not from XLA's threads).
  void run(int c, const void* in, void* out);

  void close();

 private:
  friend class TcpLinks;

  // Posts my input of `call` for the peers (a staging area of my segment, tcp sends); false when
  // no staging area is free yet (the progress thread retries).
  bool post(Call& call);
  // A free staging area, claimed for `shm_readers_` reads, or -1.
  int claim_slot();
  // Rank `r` (a shm peer) read its staging area `slot`: it may be reused once every peer has.
  void release(int r, int slot);
  // Consumes what has arrived; true once the call is complete. Throws naming the peer when one
  // failed or the call is out of step.
  bool advance(Call& call);
  // Where peer p's contribution to `call` lies, or null when it has not arrived; `*slot`: the shm
  // peer's staging area holding it (-1 otherwise).
  const char* arrived(Call& call, int p, int* slot);
  void progress_loop();
  void finish(Call& call, const std::string& error);
  // Why `call` still waits ("waiting for rank r to ..."): the first peer whose data is missing, or
  // (not posted yet) which peer has not read my staging areas; throws when that peer is known dead.
  std::string waiting_on(Call& call, bool check_alive);
  std::string describe(const Call& call) const;
  void check_open(const char* op) const;
  void ring_doorbell();

  const int rank_, world_;
  const double timeout_s_;
  std::vector<ChannelSpec> channels_;
  uint64_t layout_hash_ = 0;
  std::string shm_name_;
  bool linked_ = false;
  std::unique_ptr<Segment> segment_;
  int64_t slot_bytes_ = 0;  // capacity of a staging area
  int shm_readers_ = 0;     // peers that read my staging areas (from connect on)
  std::mutex post_mu_;      // claims of staging areas
  std::vector<std::unique_ptr<Peer>> peers_;
  std::unique_ptr<TcpLinks> tcp_;

  std::mutex mu_;  // guards pending_, next_seq_, in_flight_
  std::vector<std::shared_ptr<Call>> pending_;
  std::vector<int64_t> next_seq_;
  std::vector<char> in_flight_;
  // Calls completed per channel (the tcp receivers check a post never overwrites unread data).
  std::unique_ptr<std::atomic<int64_t>[]> completed_;
  std::thread progress_;
  std::atomic<bool> stop_{false};
  int64_t handle_ = 0;
  bool connected_ = false, closed_ = false;
};

// The connected group whose handle() is `handle`, or null.
Group* group_by_handle(int64_t handle);

}  // namespace jaxodc::lockstep
