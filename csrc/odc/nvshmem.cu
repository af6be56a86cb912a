// The nvshmem transport of the ODC runtime: server memory in an NVSHMEM symmetric block, reached by
// peers on other hosts (NVSHMEM picks the path: NVLink / P2P on a node, IB / UCX / libfabric
// across nodes).
//
// Every rank of the NVSHMEM job allocates one symmetric block with its device block's layout (fp32
// masters, then one receive slot per client; the layout is the same on every rank, checked by the
// layout hash, so my offsets are the owner's). NVSHMEM itself is reached through the plugin
// (csrc/odc/nvshmem/plugin_api.h); the control words stay with the owner's host segment and travel
// over the peer's TCP connection, exactly as for the tcp transport:
//
//   gather:   ask the owner to wait until it published the version (round trip), then
//             nvshmemx_getmem_on_stream from its master on the call's stream; the call's event
//             (gather_device) lets done() wait for the read, as for cuda_ipc.
//   scatter:  ask the owner to wait until my slot there is free (round trip), put my slice into it,
//             quiet (completes the put at the owner), wait for the stream, then tell the owner the
//             slot is full (one-way); its daemon adds the slot into its device accumulator.
#include <cuda_runtime.h>

#include <atomic>
#include <string>
#include <vector>

#include "odc/device_cuda.h"
#include "odc/nvshmem/plugin_api.h"
#include "odc/runtime.h"
#include "odc/segment.h"

namespace jaxodc::odc {

namespace {

// NVSHMEM is one job per process: the runtime that joined it, until its collective teardown.
std::atomic<const Runtime*> g_nv_owner{nullptr};

const JaxodcNvshmemApi* plugin_or_throw(const std::string& who) {
  const JaxodcNvshmemApi* api = nvshmem_api();
  if (!api) throw Error(who + ": the nvshmem plugin is not loaded: " + nvshmem_load_error());
  return api;
}

}  // namespace

std::string Runtime::nvshmem_uniqueid() {
  check_open("nvshmem_uniqueid");
  const std::string who = "rank " + std::to_string(rank_) + ": nvshmem_uniqueid";
  const JaxodcNvshmemApi* api = plugin_or_throw(who);
  if (!dev_) throw Error(who + ": this rank has no device (enable_device first)");
  std::string uid(JAXODC_NVSHMEM_UID_BYTES, '\0');
  char err[512] = {0};
  if (api->get_uniqueid(dev_->block_bytes, uid.data(), err, sizeof(err)) != 0) throw Error(who + ": " + err);
  return uid;
}

void Runtime::init_nvshmem(const std::string& uid, const std::vector<int>& pe_of_rank) {
  check_open("init_nvshmem");
  std::string peers;
  int npes = 0;
  for (size_t r = 0; r < pe_of_rank.size(); ++r) {
    if (pe_of_rank[r] < 0) continue;
    ++npes;
    if (static_cast<int>(r) != rank_) peers += (peers.empty() ? "" : ", ") + std::to_string(r);
  }
  const std::string who = "rank " + std::to_string(rank_) + ": nvshmem transport (NVSHMEM job with rank(s) " +
                          (peers.empty() ? std::string("none") : peers) + ")";
  if (nv_block_) throw Error(who + ": NVSHMEM is already initialised by this runtime");
  if (connected_) throw Error(who + ": init_nvshmem must come before connect");
  if (static_cast<int>(pe_of_rank.size()) != world_)
    throw Error(who + ": expected a PE for each of the " + std::to_string(world_) + " ranks, got " +
                std::to_string(pe_of_rank.size()));
  const int pe = pe_of_rank[rank_];
  if (pe < 0 || pe >= npes) throw Error(who + ": this rank's PE " + std::to_string(pe) + " is outside [0, " +
                                        std::to_string(npes) + ")");
  if (!dev_)
    throw Error(who + ": this rank has no CUDA device block (Runtime(device=...) is None, or no usable CUDA "
                      "device); nvshmem needs one on both sides of a pair");
  if (uid.size() != JAXODC_NVSHMEM_UID_BYTES)
    throw Error(who + ": the NVSHMEM unique id holds " + std::to_string(uid.size()) + " bytes, expected " +
                std::to_string(JAXODC_NVSHMEM_UID_BYTES));
  const JaxodcNvshmemApi* api = plugin_or_throw(who);
  const Runtime* expected = nullptr;
  if (!g_nv_owner.compare_exchange_strong(expected, this))
    throw Error(who + ": NVSHMEM is held by another ODC runtime of this process (one at a time; a runtime "
                      "closed after a failure leaves NVSHMEM to process exit)");
  DeviceGuard guard(device_, who);
  char err[512] = {0};
  const size_t bytes = dev_->block_bytes;
  if (api->init(uid.data(), pe, npes, device_, bytes, err, sizeof(err)) != 0) {
    g_nv_owner.store(nullptr);
    throw Error(who + ": " + err);
  }
  void* block = nullptr;
  if (api->malloc(bytes, &block, err, sizeof(err)) != 0) {
    api->finalize();
    g_nv_owner.store(nullptr);
    throw Error(who + ": " + err);
  }
  // Zeroed and finished before any peer can reach it (peers connect after every rank's init).
  cudaError_t e = cudaMemsetAsync(block, 0, bytes, dev_->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(dev_->stream);
  if (e != cudaSuccess) {
    cudaGetLastError();
    api->free(block);
    api->finalize();
    g_nv_owner.store(nullptr);
    throw Error(who + ": zeroing the NVSHMEM block: " + cuda_msg(e));
  }
  nv_block_ = static_cast<char*>(block);
  nv_pe_ = pe_of_rank;
  device_bytes_ += static_cast<int64_t>(bytes);
}

void Runtime::nv_gather_owner(Peer& p, int unit, int64_t version, float* out, CUstream_st* stream) {
  nv_wait_published(p, unit, version);
  int64_t lo, n;
  piece(unit, p.rank, &lo, &n);
  if (n == 0) return;
  const char* src = nv_block_ + seg_->unit(unit)->dev_master_offset;
  // A failed get surfaces on the stream: done() synchronises this call's event (gather_device).
  nvshmem_api()->getmem_on_stream(out + lo, src, static_cast<size_t>(n) * 4, nv_pe_[p.rank], stream);
}

void Runtime::nv_push_owner(Peer& p, int unit, int64_t version, const float* grad, CUstream_st* stream) {
  nv_wait_slot(p, unit, version);
  int64_t lo, n;
  piece(unit, p.rank, &lo, &n);
  if (n > 0) {
    const std::string tag = "odc.scatter_accumulate over nvshmem: rank " + std::to_string(rank_) + " unit " +
                            std::to_string(unit) + " version " + std::to_string(version) + ": put into the slot at " +
                            p.name();
    char* dst = nv_block_ + seg_->dev_slots_off + seg_->dev_slot_stride * static_cast<uint64_t>(rank_);
    const JaxodcNvshmemApi* api = nvshmem_api();
    api->putmem_on_stream(dst, grad + lo, static_cast<size_t>(n) * 4, nv_pe_[p.rank], stream);
    api->quiet_on_stream(stream);
    // The owner's daemon reads the slot as soon as it hears of it: the put must have landed.
    check(cudaStreamSynchronize(stream), tag);
  }
  nv_commit(p, unit, version, n);
}

void Runtime::nv_release() {
  if (!nv_block_) return;
  bool collective = nv_collective_close_ && !nv_broken_.load();
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    for (int c = 0; c < world_; ++c)
      if (peers_[c]->transport == Transport::kNvshmem && !client_failure_[c].empty()) collective = false;
  }
  if (collective) {
    // Both collective over the NVSHMEM job: every member is closing too (the close barrier passed).
    const JaxodcNvshmemApi* api = nvshmem_api();
    api->free(nv_block_);
    api->finalize();
    g_nv_owner.store(nullptr);
  }
  // Otherwise a peer is gone or not closing: nvshmem_free would wait for it forever, so the block
  // and NVSHMEM's state are left to process exit (and NVSHMEM stays held, see init_nvshmem).
  nv_block_ = nullptr;
}

}  // namespace jaxodc::odc
