// The ODC runtime of one rank: it is both a worker (gather / scatter_accumulate to every owner)
// and the parameter server of its shard of every unit.
//
// Server state per rank lives in one segment: fp32 master shards with versions, one bounded
// receive slot per client (by default each slot holds one shard of the largest unit, so all slots
// together stay within one unit's size; `slot_elems` bounds them further, and pushes then travel
// in chunks of that size), done markers, per-minibatch scalars and work-stealing counters.
// The segment is POSIX shared memory, so peers on the same host read and write it directly
// (one-sided); peers elsewhere reach it through this rank's TCP server thread, which performs the
// same one-sided operations on their behalf. Gradient accumulators are private to the owner; its
// accumulation thread (the daemon) drains full slots into them.
//
// With a device enabled (enable_device, CUDA builds), the rank also keeps a device block in GPU
// memory (device masters, one device slot per client) exported with CUDA IPC, plus an fp32 device
// accumulator. Same-host peers with a device use the `cuda_ipc` transport: the control words
// (versions, slot states, done markers, futex wake-ups) stay in the host segment and only the data
// moves GPU to GPU (cuda_ipc.cu). publish writes both masters, so every transport can read any
// owner; the owner's gradient is the sum of its host and device accumulators.
//
// Peers on other hosts whose ranks both have a device use the `nvshmem` transport (nvshmem.cu,
// through the optional plugin of csrc/odc/nvshmem): every such rank also keeps a symmetric NVSHMEM
// block with the device block's layout; the control words travel over the rank's TCP connection
// and the data moves with NVSHMEM's stream-ordered get / put.
//
// Where the code lives: runtime.cc (construction, connect, close), segment.cc (layout, segment
// creation, stale-segment reclaim), worker.cc (gather / scatter_accumulate over the peers),
// owner.cc (daemon, accumulation, publish), compress.cc (TAGC's compressed push and its decode),
// core.cc (the waits they share), one class per
// transport in peer.h (shm.cc, tcp_peer.cc, cuda_ipc.cu, nvshmem.cu), the wire format and the TCP
// server in wire.h / tcp_server.cc, the device block in device.h (cuda_ipc.cu, nvshmem.cu).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "common/sync.h"
#include "odc/accumulator.h"
#include "odc/compress.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*; declared here so this header needs no CUDA

namespace jaxodc::odc {

struct Core;
struct Mapping;
class Peer;
class TcpServer;
class HostCache;

// kCudaIpc: the shm control segment plus the peer's device block mapped with CUDA IPC.
// kNvshmem: control over the peer's TCP connection, data in the NVSHMEM symmetric blocks.
enum class Transport : int { kSelf = 0, kShm = 1, kTcp = 2, kCudaIpc = 3, kNvshmem = 4 };

// Which owners a worker operation serves: all, or only those not reached through device memory
// (the CUDA handlers move device owners themselves and stage the rest through the host).
enum class Route : int { kAll = 0, kHostOwners = 1 };

struct PeerConfig {
  int rank = -1;
  Transport transport = Transport::kShm;
  std::string shm_name;  // for kShm and kCudaIpc
  std::string host;      // for kTcp and kNvshmem
  int port = 0;
};

struct Stats {
  int64_t slot_bytes = 0;    // receive slots (all clients)
  int64_t master_bytes = 0;  // fp32 master shards
  int64_t accum_bytes = 0;   // fp32 accumulators
  int64_t segment_bytes = 0;
  int64_t pushes_received = 0;
  int64_t bytes_received = 0;
  int64_t device_bytes = 0;  // device block + device accumulators (0 without a device)
};

class Runtime {
 public:
  // slot_elems: fp32 elements per receive slot; 0 = one shard of the largest unit (a push lands in
  // one piece). Smaller slots save server memory and split pushes into chunks. Part of the layout:
  // every rank must pass the same value.
  Runtime(int rank, int world, const std::string& job_id, const std::vector<int64_t>& unit_numels,
          double timeout_s, const std::string& listen_host, int64_t slot_elems = 0, const std::string& secret = "");
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int rank() const;
  int world() const;
  int num_units() const;
  int64_t numel(int unit) const;
  int64_t shard_size(int unit) const;
  int64_t slot_elems() const;
  uint64_t layout_hash() const;
  const std::string& shm_name() const { return shm_name_; }
  // Names this runtime in jitted code (the `runtime` attribute of the ODC FFI ops) from connect
  // until close; 0 before.
  int64_t handle() const { return handle_; }
  int port() const;
  Stats stats() const;

  // Allocates and exports the device block on CUDA device `ordinal`; before connect. Throws when
  // built without CUDA.
  void enable_device(int ordinal);
  int device() const;  // -1 without a device
  const std::string& device_uuid() const;

  // NVSHMEM (after enable_device, before connect). nvshmem_uniqueid: a fresh bootstrap id, made by
  // the rank that becomes PE 0. init_nvshmem: joins that NVSHMEM job as PE pe_of_rank[rank()] (-1
  // marks ranks outside it) and allocates the symmetric block; collective over the job's ranks.
  std::string nvshmem_uniqueid();
  void init_nvshmem(const std::string& uid, const std::vector<int>& pe_of_rank);
  bool nvshmem_active() const;

  // Emulates a slower network on the tcp transport (experiments on one host): every connection and
  // direction is capped at `bytes_per_s` (<= 0: uncapped) and every message arrives `latency_s`
  // after it was sent. Before connect.
  void set_link(double bytes_per_s, double latency_s);
  // TAGC (compress.h): pushes of elements [offset, offset + size) of `unit` to other ranks travel
  // as bitmap + count sketch (kept `fraction`, sketch `ratio` times smaller than dense fp32, hash
  // `seed`); with compress = false the range is only counted in traffic(). Before the first push.
  void add_range(int unit, int64_t offset, int64_t size, double fraction, double ratio, uint64_t seed,
                 bool compress);
  // This rank's gradient traffic of `unit` so far (as a worker and, for the decode counts, as an owner).
  UnitTraffic traffic(int unit);
  // The error-feedback residual of the compressed range starting at `offset` (a copy; tests).
  std::vector<float> residual(int unit, int64_t offset) const;
  // Replaces it (checkpoint restore); between minibatches, when this rank pushes nothing.
  void set_residual(int unit, int64_t offset, const float* values, int64_t n);
  // How the owner sums the pushes (accumulator.h): exactly, independent of their arrival order
  // (the default; 16 bytes per shard element), or in fp32 in arrival order (4 bytes). Before
  // connect.
  void set_exact_sum(bool exact);
  bool exact_sum() const;

  // The per-host gather cache (host_cache.h), before connect: the host's first rank creates
  // segment `name` with entries for the owners in `remote` (the ranks on other hosts), its other
  // ranks open it once it exists. connect then reads those owners through it where it reaches them
  // over tcp. unlink_host_cache removes the name once every rank of the host mapped it.
  void create_host_cache(const std::string& name, const std::vector<int>& remote);
  void open_host_cache(const std::string& name);
  void unlink_host_cache();
  int64_t host_cache_bytes() const;  // 0 without a cache
  // Gather traffic so far: bytes of pieces received over the network, and pieces read from the
  // host gather cache that another rank of the host fetched.
  int64_t gather_wire_bytes() const;
  int64_t gather_cache_hits() const;

  // Attaches to every peer (shm mapping, + device block for cuda_ipc, or TCP connection + layout
  // handshake).
  void connect(const std::vector<PeerConfig>& peers);
  // Removes the segment's name once every peer has mapped it, so a crash cannot leak it.
  void unlink_segment();

  // Worker side. `out` / `grad` hold numel(unit) elements of `type` in host memory.
  void gather(int unit, int64_t version, void* out, ElemType type, int64_t out_numel,
              Route route = Route::kAll);
  // gather into one buffer per piece: elements [offsets[i], offsets[i] + counts[i]) of the unit go
  // to outs[i] (pieces sorted and disjoint; elements in no piece are not stored), so the whole
  // unit never exists on this side.
  void gather_pieces(int unit, int64_t version, const std::vector<int64_t>& offsets,
                     const std::vector<int64_t>& counts, const std::vector<void*>& outs, ElemType type,
                     Route route = Route::kAll);
  void scatter_accumulate(int unit, int64_t version, const void* grad, ElemType type,
                          int64_t grad_numel, Route route = Route::kAll);
  // The same for elements [offset, offset + n) of the flat unit only (e.g. one parameter of it):
  // `grad` holds those n elements. Host owners only (the CUDA handlers push whole units).
  void scatter_accumulate_range(int unit, int64_t version, int64_t offset, const void* grad, ElemType type,
                                int64_t n);
  // [lo, lo + n) of the flat unit that `owner` holds (n may be 0 for trailing owners).
  void piece(int unit, int owner, int64_t* lo, int64_t* n) const;
  // True when the CUDA handlers reach `owner` through device memory (self, a cuda_ipc or an nvshmem
  // peer).
  bool device_owner(int owner) const;
  bool has_host_owners() const;
  // Device-memory worker operations for the device owners only; `out` / `grad` are fp32 device
  // pointers to the whole unit. gather waits on the host for each owner's publication and
  // enqueues device-to-device copies on `stream` (not waited for; done() waits for them).
  // scatter_device copies each owner's slice into my slot there, waits for the copy, raises the
  // slot's flag.
  void gather_device(int unit, int64_t version, float* out, CUstream_st* stream);
  void scatter_device(int unit, int64_t version, const float* grad, CUstream_st* stream);
  void done(int64_t version);
  // LB-Steal: claims one of `owner`'s `count` microbatches of minibatch `version` (the owner from
  // the front, a thief with `steal` from the back); its index, or -1 when none is left. Every
  // caller passes the same count for one (version, owner).
  int64_t claim(int64_t version, int owner, int64_t count, bool steal);
  // Every rank's `value` for this call; all ranks make the same sequence of calls. `version` only
  // labels errors.
  std::vector<double> allgather_scalar(int64_t version, double value);
  // Every rank's `values` in one exchange (a post per kScalarWords values), rank-major: element
  // [d * n + i] is rank d's values[i]. Every rank passes the same length.
  std::vector<double> allgather(int64_t version, const std::vector<double>& values);

  // Owner side.
  void wait_complete(int64_t version);
  void fetch_grad(int unit, float* out, int64_t out_numel);
  void publish(int unit, const float* shard, int64_t shard_numel, int64_t version);
  // Zero-copy owner path (the trainer's optimizer reads the gradient and rewrites the master in
  // place, so neither is held twice): grad_in_place is fetch_grad without the copy -- the
  // accumulator stays readable until clear_grad; master_data is my master shard, which may be
  // written between wait_complete(v) (no peer reads version v any more) and publish_in_place(v+1).
  float* grad_in_place(int unit);
  void clear_grad(int unit);
  float* master_data(int unit);
  void publish_in_place(int unit, int64_t version);
  // The end of a minibatch for several units in one call: grad_in_place of each (the trainer keeps
  // its zero-copy arrays of the accumulators, whose memory never moves), and after the optimizer
  // clear_grad of each, then publish_in_place(version) of each.
  void lend_grads(const std::vector<int>& units);
  void clear_and_publish_in_place(const std::vector<int>& units, int64_t version);
  int64_t published_version(int unit) const;
  void read_shard(int unit, float* out, int64_t out_numel) const;

  // `collective`: every rank is closing too (the Python close barrier passed), so the collective
  // NVSHMEM teardown (nvshmem_free, finalize) cannot block on a peer that is gone.
  void close(bool collective = true);

 private:
  friend class SelfPeer;  // my own slice of a push goes straight into my accumulator

  // The constructor's work once the segment exists (accumulators, peers, server, daemon).
  void start(int rank, int world, const std::string& listen_host, const std::string& secret);

  void check_unit(int unit, const char* op) const;
  void check_open(const char* op) const;
  // check_open + check_unit + a caller's buffer of `got` elements where `expected` are needed.
  void check_buffer(const char* op, int unit, int64_t expected, const char* buffer, int64_t got) const;
  void check_publish(int unit, int64_t version) const;
  // The owners a worker operation visits, starting at `first` and going round the ring.
  std::vector<Peer*> owners(int first, Route route) const;
  void announce(int unit, int64_t version, bool wake = true);  // wake: signal the readers (pub_seq)
  void release_grads(const std::vector<int>& units);  // clear_grad of each, one wake-up of the daemon
  void daemon_loop();
  void settle_released();
  bool drain_slots();
  bool accept_push(int unit, int64_t version, int client);
  void accumulate(int unit, int64_t version, int client, const float* data, int64_t count, int64_t offset = 0);
  // Adds an accepted push; the caller holds the unit's lock.
  void record_lent_timeout(int unit, int client);
  bool unit_lent(int unit);
  void add_locked(int unit, int client, const float* data, int64_t count, int64_t offset);
  // Pushes elements [a, a + n) of the unit (`src`) to owner p, whose piece starts at owner_lo:
  // registered ranges compressed, the rest dense.
  void push_piece(Peer* p, int unit, int64_t version, int64_t owner_lo, int64_t a, const char* src, ElemType type,
                  int64_t n, std::vector<float>& staging);

  std::string job_id_;
  std::unique_ptr<Core> core_;
  std::unique_ptr<Mapping> segment_;  // mine; stays mapped until destruction (see close)
  std::string shm_name_;
  bool linked_ = false;
  std::vector<std::unique_ptr<Peer>> peers_;  // by rank; null until connect
  std::unique_ptr<TcpServer> server_;         // null in a world of one
  std::unique_ptr<HostCache> host_cache_;     // null unless create_host_cache / open_host_cache
  std::unique_ptr<Compressor> compressor_;

  // Per unit; their fp32 sums are 64-byte aligned, so Python can wrap them without a copy (jax
  // aliases aligned host memory).
  std::vector<std::unique_ptr<Accumulator>> accum_;
  std::vector<float> decoded_;   // the daemon's decoded compressed chunk
  std::vector<char> grad_lent_;  // per unit: grad_in_place handed out, clear_grad not yet called
  std::atomic<bool> zero_pending_{false};  // a clear_grad's accumulator awaits the daemon's zeroing
  std::vector<std::unique_ptr<std::mutex>> accum_mu_;
  std::atomic<int64_t> accumulating_version_{0};
  std::atomic<int64_t> completed_version_{-1};
  std::vector<int64_t> last_fetched_;
  std::atomic<int64_t> pushes_received_{0}, bytes_received_{0};
  std::thread daemon_;
  int64_t scalar_calls_ = 0;
  int64_t handle_ = 0;
  bool closed_ = false;
  bool connected_ = false;
};

// Unlinks /dev/shm/jaxodc_* segments whose creating process is gone (crash recovery).
int reclaim_stale_segments();

// Whether this build has the CUDA IPC transport, and the UUIDs ("GPU-...") of the CUDA devices this
// process sees (empty without CUDA, driver or device).
bool cuda_built();
std::vector<std::string> cuda_device_uuids();

// The NVSHMEM plugin (nvshmem_loader.cc), loaded at most once per process: "" once loaded, else
// why not (the dlopen / symbol / ABI message). nvshmem_version: "NVSHMEM x.y.z", "" when not loaded.
std::string nvshmem_load(const std::string& path);
std::string nvshmem_version();

// The connected runtime whose handle() is `handle`, or null (common/handles.h).
Runtime* runtime_by_handle(int64_t handle);

}  // namespace jaxodc::odc
