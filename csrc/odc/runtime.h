// The ODC runtime of one rank: it is both a worker (gather / scatter_accumulate to every owner)
// and the parameter server of its shard of every unit.
//
// Server state per rank lives in one segment: fp32 master shards with versions, one bounded
// receive slot per client (each slot holds one shard of the largest unit, so all slots together
// stay within one unit's size), done markers, per-minibatch scalars and work-stealing counters.
// The segment is POSIX shared memory, so peers on the same host read and write it directly
// (one-sided); peers elsewhere reach it through this rank's TCP server thread, which performs the
// same one-sided operations on their behalf. Gradient accumulators are private to the owner; its
// accumulation thread (the daemon) drains full slots into them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "common/sync.h"

namespace jaxodc::odc {

struct SegmentHeader;
struct UnitEntry;
struct SlotHeader;

enum class Transport : int { kSelf = 0, kShm = 1, kTcp = 2 };

struct PeerConfig {
  int rank = -1;
  Transport transport = Transport::kShm;
  std::string shm_name;  // for kShm
  std::string host;      // for kTcp
  int port = 0;
  int pid = 0;
};

struct Stats {
  int64_t slot_bytes = 0;    // receive slots (all clients)
  int64_t master_bytes = 0;  // fp32 master shards
  int64_t accum_bytes = 0;   // fp32 accumulators
  int64_t segment_bytes = 0;
  int64_t pushes_received = 0;
  int64_t bytes_received = 0;
};

class Runtime {
 public:
  Runtime(int rank, int world, const std::string& job_id, const std::vector<int64_t>& unit_numels,
          double timeout_s, const std::string& listen_host);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  int num_units() const { return static_cast<int>(numels_.size()); }
  int64_t numel(int unit) const;
  int64_t shard_size(int unit) const;
  uint64_t layout_hash() const { return layout_hash_; }
  const std::string& shm_name() const { return shm_name_; }
  int port() const { return port_; }
  Stats stats() const;

  // Attaches to every peer (shm mapping or TCP connection + layout handshake).
  void connect(const std::vector<PeerConfig>& peers);
  // Removes the segment's name once every peer has mapped it, so a crash cannot leak it.
  void unlink_segment();

  // Worker side. `out` / `grad` hold numel(unit) elements of `type`.
  void gather(int unit, int64_t version, void* out, ElemType type, int64_t out_numel);
  void scatter_accumulate(int unit, int64_t version, const void* grad, ElemType type,
                          int64_t grad_numel);
  void done(int64_t version);
  int64_t next_task(int64_t version);
  // Every rank's `value` for this call; all ranks make the same sequence of calls. `version` only
  // labels errors.
  std::vector<double> allgather_scalar(int64_t version, double value);

  // Owner side.
  void wait_complete(int64_t version);
  void fetch_grad(int unit, float* out, int64_t out_numel);
  void publish(int unit, const float* shard, int64_t shard_numel, int64_t version);
  int64_t published_version(int unit) const;
  void read_shard(int unit, float* out, int64_t out_numel) const;

  void close();

 private:
  struct Peer;
  void check_unit(int unit, const char* op) const;
  void check_open(const char* op) const;
  template <class Pred>
  void wait_for(std::atomic<uint32_t>* word, Pred ready, const Peer* peer, const std::string& what);
  void check_peer_alive(const Peer& peer, const std::string& what) const;
  void daemon_loop();
  bool drain_slots();
  void accumulate(int unit, int64_t version, int client, const float* data, int64_t count);
  void serve_loop();
  void serve_connection(int fd);
  // Operations performed on this rank's own segment (for itself, or for a TCP client).
  void wait_published(int unit, int64_t version, const Peer* via, const std::string& what);
  void write_slot_begin(int client, const std::string& what);
  int64_t local_next_task(int64_t version);
  void wait_scalar(SegmentHeader* seg, int64_t version, const Peer* peer, const std::string& what);

  int rank_, world_;
  std::string job_id_;
  std::vector<int64_t> numels_, shards_;
  int64_t max_shard_ = 0;
  double timeout_s_;
  uint64_t layout_hash_ = 0;

  std::string shm_name_;
  bool linked_ = false;
  SegmentHeader* seg_ = nullptr;
  size_t seg_bytes_ = 0;

  std::vector<std::unique_ptr<Peer>> peers_;
  std::vector<std::vector<float>> accum_;
  std::vector<std::unique_ptr<std::mutex>> accum_mu_;
  std::atomic<int64_t> accumulating_version_{0};
  std::atomic<int64_t> completed_version_{-1};
  std::vector<int64_t> last_fetched_;
  std::mutex error_mu_;
  std::string daemon_error_;
  std::vector<std::string> client_failure_;  // per client rank, set when its TCP link dies

  std::atomic<bool> stop_{false};
  std::thread daemon_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread server_;
  std::mutex conn_mu_;
  std::vector<std::thread> conn_threads_;
  std::vector<int> conn_fds_;
  std::atomic<int64_t> pushes_received_{0}, bytes_received_{0};
  int64_t scalar_calls_ = 0;
  bool closed_ = false;
};

// Unlinks /dev/shm/jaxodc_* segments whose creating process is gone (crash recovery).
int reclaim_stale_segments();

// The runtime FFI handlers use; set by the Python Runtime object.
Runtime* current_runtime();
void set_current_runtime(Runtime* rt);

}  // namespace jaxodc::odc
