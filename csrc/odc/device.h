// Internal to csrc/odc: the GPU side of a rank's server memory, seen from host code. Implemented
// only in CUDA builds (cuda_ipc.cu, nvshmem.cu); without CUDA the factories below throw
// (no_cuda.cc), so host code never branches on the build.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "odc/nvshmem/plugin_api.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*; declared here so host code needs no CUDA

namespace jaxodc::odc {

struct Core;
struct Mapping;
struct PeerConfig;
class Peer;

// A rank's device block: fp32 device masters and one device receive slot per client, exported
// with CUDA IPC, plus private fp32 device accumulators and, after join_nvshmem, an NVSHMEM
// symmetric block with the same layout. The control words stay in the host segment.
class Device {
 public:
  virtual ~Device() = default;
  virtual int ordinal() const = 0;
  virtual const std::string& uuid() const = 0;
  virtual int64_t bytes() const = 0;  // every device allocation of this block

  // Owner side. publish: my host master of `unit` -> the device master (and the NVSHMEM block),
  // finished on return. fetch_add: out += the device accumulator of `unit`, which is zeroed.
  // accumulate (the daemon): the full device (kSlotDevice) or NVSHMEM (kSlotNvshmem) slot of
  // `client` -> the device accumulator, finished on return.
  virtual void publish(int unit, const float* master) = 0;
  virtual void fetch_add(int unit, float* out) = 0;
  virtual void accumulate(int unit, int client, int64_t count, int32_t where) = 0;

  // Worker side on my own shard (the cuda_ipc path applied to my own block). The copies of a
  // device gather are not waited for: track_gather records them, wait_gathers (done) waits.
  virtual void gather_own(int unit, int64_t version, float* out, CUstream_st* stream) = 0;
  virtual void push_own(int unit, int64_t version, const float* grad, CUstream_st* stream) = 0;
  virtual void track_gather(CUstream_st* stream, const std::string& tag) = 0;
  virtual void wait_gathers(const std::string& tag) = 0;

  // NVSHMEM (nvshmem.cu): see Runtime::nvshmem_uniqueid / init_nvshmem (which check the
  // arguments first); `who` prefixes errors.
  virtual std::string nvshmem_uniqueid(const std::string& who) = 0;
  virtual void join_nvshmem(const std::string& who, const std::string& uid, int pe, int npes,
                            const std::vector<int>& pe_of_rank) = 0;
  virtual bool nvshmem_active() const = 0;
  // An nvshmem peer is gone or stopped answering: NVSHMEM's collective teardown would wait for
  // it forever, so leave() skips it.
  virtual void nvshmem_broken() = 0;

  // Close, in this order: leave() waits for my pending device reads and leaves the NVSHMEM job
  // (collective: every member is closing too); the peers unmap my block (Peer::close); release()
  // frees it once no live peer maps it (bounded wait; past it the block is left to process exit).
  virtual void leave(bool collective) = 0;
  virtual void release() = 0;
};

// The loaded NVSHMEM plugin's table, or null (nvshmem_loader.cc); nvshmem_load_error says why.
const JaxodcNvshmemApi* nvshmem_api();
std::string nvshmem_load_error();

// The device block of `core`'s rank on CUDA device `ordinal`, exported through its segment.
std::unique_ptr<Device> make_device(const Core& core, int ordinal);
// Peers whose data this rank reaches in device memory: a same-host peer's block mapped with CUDA
// IPC (its segment already mapped), or a peer in the NVSHMEM job (control over TCP).
std::unique_ptr<Peer> make_cuda_ipc_peer(const Core& core, int rank, Mapping seg);
std::unique_ptr<Peer> make_nvshmem_peer(const Core& core, const PeerConfig& cfg);

}  // namespace jaxodc::odc
