// The nvshmem transport of the ODC runtime: server memory in an NVSHMEM symmetric block, reached by
// peers on other hosts (NVSHMEM picks the path: NVLink / P2P on a node, IB / UCX / libfabric
// across nodes).
//
// Every rank of the NVSHMEM job allocates one symmetric block with its device block's layout (fp32
// masters, then one receive slot per client; the layout is the same on every rank, checked by the
// layout hash, so my offsets are the owner's). NVSHMEM itself is reached through the plugin
// (csrc/odc/nvshmem/plugin_api.h); the control words stay with the owner's host segment and travel
// over the peer's TCP connection, exactly as for the tcp transport (NvshmemPeer is a TcpPeer):
//
//   gather:   ask the owner to wait until it published the version (round trip), then
//             nvshmemx_getmem_on_stream from its master on the call's stream; the call's event
//             (Device::track_gather) lets done() wait for the read, as for cuda_ipc.
//   scatter:  ask the owner to wait until my slot there is free (round trip), put my slice into it,
//             quiet (completes the put at the owner), wait for the stream, then tell the owner the
//             slot is full (one-way); its daemon adds the slot into its device accumulator.
#include <cuda_runtime.h>

#include <atomic>
#include <string>
#include <vector>

#include "odc/device_cuda.h"
#include "odc/peer.h"
#include "odc/runtime.h"

namespace jaxodc::odc {

namespace {

// NVSHMEM is one job per process: the device block that joined it, until its collective teardown.
std::atomic<const Device*> g_nv_owner{nullptr};

// A peer in this rank's NVSHMEM job: host operations as a TcpPeer, device data through NVSHMEM.
// A failed control request marks NVSHMEM broken, so that close skips its collective teardown
// (which would wait for the peer forever).
class NvshmemPeer final : public TcpPeer {
 public:
  NvshmemPeer(const Core& core, const PeerConfig& cfg, CudaDevice& dev) : TcpPeer(core, cfg), dev_(dev) {}
  bool device_reachable() const override { return true; }
  void gather_device(int unit, int64_t version, float* out, CUstream_st* stream) override;
  void push_device(int unit, int64_t version, const float* grad, CUstream_st* stream) override;
  void link_failed() override { dev_.nvshmem_broken(); }

 private:
  // A control request with its reply (the owner waits up to its timeout before replying).
  void wait_at_owner(uint32_t op, int unit, int64_t version, const std::string& what) {
    try {
      call(request(op, core_.rank, unit, version), core_.timeout_s + 5, what);
    } catch (...) {
      dev_.nvshmem_broken();
      throw;
    }
  }

  CudaDevice& dev_;
};

void NvshmemPeer::gather_device(int unit, int64_t version, float* out, CUstream_st* stream) {
  wait_at_owner(kNvWaitPublished, unit, version,
                "gather over nvshmem: " + core_.who() + " waiting for " + name() + " to publish unit " +
                    std::to_string(unit) + " version " + std::to_string(version));
  int64_t lo, n;
  core_.layout.piece(unit, rank_, &lo, &n);
  if (n == 0) return;
  const char* src = dev_.nv_block + core_.seg->unit(unit)->dev_master_offset;
  // A failed get surfaces on the stream: done() synchronises this call's event (track_gather).
  nvshmem_api()->getmem_on_stream(out + lo, src, static_cast<size_t>(n) * 4, dev_.nv_pe[rank_], stream);
}

void NvshmemPeer::push_device(int unit, int64_t version, const float* grad, CUstream_st* stream) {
  const std::string at = core_.who() + " pushing unit " + std::to_string(unit) + " version " +
                         std::to_string(version) + " to " + name();
  wait_at_owner(kNvWaitSlot, unit, version,
                "scatter_accumulate over nvshmem: " + core_.who() + " waiting for its receive slot at " + name() +
                    " (pushing unit " + std::to_string(unit) + " version " + std::to_string(version) + ")");
  int64_t lo, n;
  core_.layout.piece(unit, rank_, &lo, &n);
  if (n > 0) {
    const JaxodcNvshmemApi* api = nvshmem_api();
    api->putmem_on_stream(dev_.slot_of(dev_.nv_block, core_.rank), grad + lo, static_cast<size_t>(n) * 4,
                          dev_.nv_pe[rank_], stream);
    api->quiet_on_stream(stream);
    // The owner's daemon reads the slot as soon as it hears of it: the put must have landed.
    check(cudaStreamSynchronize(stream), "odc.scatter_accumulate over nvshmem: " + at + ": put into its slot");
  }
  try {
    std::lock_guard<std::mutex> lock(mu_);
    send(request(kNvCommit, core_.rank, unit, version, n));
  } catch (const std::exception& e) {
    dev_.nvshmem_broken();
    throw PeerError("scatter_accumulate over nvshmem: " + at + ": raising its slot: " + e.what());
  }
}

}  // namespace

std::unique_ptr<Peer> make_nvshmem_peer(const Core& core, const PeerConfig& cfg) {
  auto* dev = static_cast<CudaDevice*>(core.dev.get());
  const bool joined = dev && dev->nv_block;
  if (!joined || dev->nv_pe[cfg.rank] < 0 || dev->nv_pe[core.rank] < 0)
    throw Error(core.who() + ": nvshmem transport to rank " + std::to_string(cfg.rank) + ": " +
                (joined ? "that rank is not part of this rank's NVSHMEM job"
                        : "NVSHMEM is not initialised (init_nvshmem before connect)"));
  return std::make_unique<NvshmemPeer>(core, cfg, *dev);
}

std::string CudaDevice::nvshmem_uniqueid(const std::string& who) {
  std::string uid(JAXODC_NVSHMEM_UID_BYTES, '\0');
  char err[512] = {0};
  if (nvshmem_api()->get_uniqueid(block_bytes, uid.data(), err, sizeof(err)) != 0) throw Error(who + ": " + err);
  return uid;
}

void CudaDevice::join_nvshmem(const std::string& who, const std::string& uid, int pe, int npes,
                              const std::vector<int>& pe_of_rank) {
  const JaxodcNvshmemApi* api = nvshmem_api();
  const Device* expected = nullptr;
  if (!g_nv_owner.compare_exchange_strong(expected, this))
    throw Error(who + ": NVSHMEM is held by another ODC runtime of this process (one at a time; a runtime "
                      "closed after a failure leaves NVSHMEM to process exit)");
  DeviceGuard guard(ordinal_, who);
  char err[512] = {0};
  if (api->init(uid.data(), pe, npes, ordinal_, block_bytes, err, sizeof(err)) != 0) {
    g_nv_owner.store(nullptr);
    throw Error(who + ": " + err);
  }
  void* nv = nullptr;
  if (api->malloc(block_bytes, &nv, err, sizeof(err)) != 0) {
    api->finalize();
    g_nv_owner.store(nullptr);
    throw Error(who + ": " + err);
  }
  // Zeroed and finished before any peer can reach it (peers connect after every rank's init).
  cudaError_t e = cudaMemsetAsync(nv, 0, block_bytes, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    cudaGetLastError();
    api->free(nv);
    api->finalize();
    g_nv_owner.store(nullptr);
    throw Error(who + ": zeroing the NVSHMEM block: " + cuda_msg(e));
  }
  nv_block = static_cast<char*>(nv);
  nv_bytes = block_bytes;
  nv_pe = pe_of_rank;
}

void CudaDevice::leave_nvshmem(bool collective) {
  if (!nv_block) return;
  if (collective && !nv_broken.load()) {
    // Both collective over the NVSHMEM job: every member is closing too (the close barrier passed).
    const JaxodcNvshmemApi* api = nvshmem_api();
    api->free(nv_block);
    api->finalize();
    g_nv_owner.store(nullptr);
  }
  // Otherwise a peer is gone or not closing: nvshmem_free would wait for it forever, so the block
  // and NVSHMEM's state are left to process exit (and NVSHMEM stays held, see join_nvshmem).
  nv_block = nullptr;
}

}  // namespace jaxodc::odc
