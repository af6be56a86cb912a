// Internal to csrc/odc: one owner as this rank's worker reaches it, one class per transport.
//   SelfPeer     this rank: its own segment; its own slice of a push is added locally (shm.cc)
//   ShmPeer      a same-host peer whose segment is mapped here (shm.cc); CudaIpcPeer adds its
//                device block mapped with CUDA IPC (cuda_ipc.cu)
//   TcpPeer      requests to the owner's TCP server (tcp_peer.cc); NvshmemPeer moves the device
//                data with NVSHMEM instead (nvshmem.cu)
// The runtime picks the class of each peer once, at connect.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "odc/compress.h"
#include "odc/core.h"
#include "transport/link_shaper.h"
#include "odc/wire.h"

namespace jaxodc::odc {

class Runtime;

// `count` elements of a gathered piece go to `dst`; a null `dst` skips them (padding no output
// wants).
struct Segment {
  char* dst;
  int64_t count;
};

class Peer {
 public:
  // `where`: the owner's address where it is reached over a network ("host:port"), named with
  // its rank in every error about it.
  Peer(const Core& core, int rank, std::string where = {}) : core_(core), rank_(rank), where_(std::move(where)) {}
  virtual ~Peer() = default;
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;

  int rank() const { return rank_; }
  const std::string& where() const { return where_; }
  std::string name() const { return "rank " + std::to_string(rank_) + (where_.empty() ? "" : " (" + where_ + ")"); }

  // A connection held while its reply is on the way; empty where nothing travels.
  using Pending = std::unique_lock<std::mutex>;

  // gather, in two steps so that requests to remote owners travel while local pieces are copied:
  // request_piece asks for this owner's piece of `unit` at version >= `version`; read_piece then
  // stores it, in order, into `out`: segments covering exactly the piece's elements (of `type`).
  virtual Pending request_piece(int /*unit*/, int64_t /*version*/, ElemType /*type*/) { return {}; }
  virtual void read_piece(int unit, int64_t version, const std::vector<Segment>& out, ElemType type,
                          std::vector<float>& staging) = 0;
  // Adds `count` elements of `src` into this owner's shard of `unit`, from element `offset` on.
  virtual void push(int unit, int64_t version, int64_t offset, const char* src, ElemType type, int64_t count,
                    std::vector<float>& staging) = 0;
  // Hands this owner a compressed chunk (compress.h) for elements [offset, offset + chunk.count)
  // of its shard of `unit`; the chunk fits one receive slot.
  virtual void push_sketch(int /*unit*/, int64_t /*version*/, int64_t /*offset*/, const SketchChunk& /*chunk*/) {
    throw Error(core_.who() + ": " + name() + " takes no compressed pushes (this rank's own slice stays dense)");
  }
  virtual void done(int64_t version) = 0;
  virtual int64_t claim(int64_t version, int64_t count, bool steal) = 0;
  // This owner's `n` values of allgather post `seq` (n <= kScalarWords) into `out`; an owner that
  // posted another count is out of step (Error).
  virtual void scalars(int64_t seq, int64_t n, double* out, const std::string& what) = 0;
  // Throws PeerError naming `what` when this owner is known to be gone, so a wait on its memory
  // does not run into its timeout.
  virtual void check_alive(const std::string& /*what*/) const {}
  // Bytes of gathered pieces this rank received from this owner over the network (tcp), and the
  // pieces it read from the host gather cache that another rank of its host fetched (host_cache.h).
  virtual int64_t gather_bytes() const { return 0; }
  virtual int64_t cache_hits() const { return 0; }

  // The CUDA handlers' path (Runtime::gather_device / scatter_device): whether this owner is
  // reached in device memory, and its piece of a gather / push of fp32 device arrays.
  virtual bool device_reachable() const { return false; }
  virtual void gather_device(int /*unit*/, int64_t /*version*/, float* /*out*/, CUstream_st* /*stream*/) {
    throw Error(core_.who() + ": " + name() + " is not reached through device memory");
  }
  virtual void push_device(int /*unit*/, int64_t /*version*/, const float* /*grad*/, CUstream_st* /*stream*/) {
    throw Error(core_.who() + ": " + name() + " is not reached through device memory");
  }

  // Shutdown, in this order: say_goodbye (the owner then knows the closed connection is no
  // failure); link_failed, once my server stopped, for a peer whose connection to me died;
  // close, which releases what this rank holds of the owner.
  virtual void say_goodbye() {}
  virtual void link_failed() {}
  virtual void close() {}

 protected:
  const Core& core_;
  const int rank_;
  const std::string where_;
};

// An owner whose segment is mapped in this process: reads, markers, claims and scalars work on it
// directly.
class MappedPeer : public Peer {
 public:
  MappedPeer(const Core& core, int rank, SegmentHeader* seg) : Peer(core, rank), seg_(seg) {}
  void read_piece(int unit, int64_t version, const std::vector<Segment>& out, ElemType type,
                  std::vector<float>& staging) override;
  void done(int64_t version) override;
  int64_t claim(int64_t version, int64_t count, bool steal) override;
  void scalars(int64_t seq, int64_t n, double* out, const std::string& what) override;

 protected:
  SegmentHeader* seg_;
};

// This rank as the owner of its own shards; in device memory when it has a device.
class SelfPeer final : public MappedPeer {
 public:
  SelfPeer(const Core& core, Runtime& rt);
  void push(int unit, int64_t version, int64_t offset, const char* src, ElemType type, int64_t count,
            std::vector<float>& staging) override;
  bool device_reachable() const override { return core_.dev != nullptr; }
  void gather_device(int unit, int64_t version, float* out, CUstream_st* stream) override;
  void push_device(int unit, int64_t version, const float* grad, CUstream_st* stream) override;

 private:
  Runtime& rt_;  // its owner side accumulates my own slices
};

// A same-host peer: pushes go through my receive slot in its segment, in slot-sized chunks.
class ShmPeer : public MappedPeer {
 public:
  ShmPeer(const Core& core, int rank, Mapping seg);
  void push(int unit, int64_t version, int64_t offset, const char* src, ElemType type, int64_t count,
            std::vector<float>& staging) override;
  void push_sketch(int unit, int64_t version, int64_t offset, const SketchChunk& chunk) override;
  void check_alive(const std::string& what) const override;
  void close() override { mapping_.reset(); }

 protected:
  Mapping mapping_;
  const int pid_;
};

// A peer reached through its TCP server, which performs each operation on its segment.
class TcpPeer : public Peer {
 public:
  TcpPeer(const Core& core, const PeerConfig& cfg);  // connects and checks the layout
  ~TcpPeer() override { close(); }
  Pending request_piece(int unit, int64_t version, ElemType type) override;
  void read_piece(int unit, int64_t version, const std::vector<Segment>& out, ElemType type,
                  std::vector<float>& staging) override;
  void push(int unit, int64_t version, int64_t offset, const char* src, ElemType type, int64_t count,
            std::vector<float>& staging) override;
  void push_sketch(int unit, int64_t version, int64_t offset, const SketchChunk& chunk) override;
  void done(int64_t version) override;
  int64_t claim(int64_t version, int64_t count, bool steal) override;
  void scalars(int64_t seq, int64_t n, double* out, const std::string& what) override;
  void say_goodbye() override;
  void close() override;
  int64_t gather_bytes() const override { return gather_bytes_.load(); }

 protected:
  // One request and its reply on the connection (an error reply throws PeerError(what: message)).
  WireHeader call(const WireHeader& request, double reply_timeout_s, const std::string& what);
  // The caller holds mu_. Requests are stamped with their sending time and, like data, pass the
  // emulated link.
  void send(WireHeader request);
  void send_data(const void* data, size_t bytes);

  std::mutex mu_;  // one request at a time on the connection
  int fd_ = -1;
  std::atomic<int64_t> gather_bytes_{0};
  tcp::Link link_;  // to this owner
};

}  // namespace jaxodc::odc
