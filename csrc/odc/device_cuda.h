// Internal to the CUDA sources of csrc/odc (cuda_ipc.cu, nvshmem.cu; needs cuda_runtime.h): CUDA
// error checks, the device guard and the device block (device.h) as CUDA sees it.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "common/sync.h"
#include "odc/core.h"
#include "odc/device.h"

namespace jaxodc::odc {

inline std::string cuda_msg(cudaError_t e) { return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")"; }

// Throws `what` with the CUDA error; clears the thread's last-error state first so that a later
// cudaGetLastError() after a kernel launch does not report this (non-sticky) error again.
inline void check(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  throw Error(what + ": " + cuda_msg(e));
}

// Makes `device` current for a scope: XLA's, the daemon's and Python's threads all call in.
class DeviceGuard {
 public:
  DeviceGuard(int device, const std::string& who) {
    check(cudaGetDevice(&prev_), who + ": cudaGetDevice");
    if (prev_ != device) {
      check(cudaSetDevice(device), who + ": cudaSetDevice(" + std::to_string(device) + ")");
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool changed_ = false;
};

// The device block of one rank. Its memory and CUDA IPC export live in cuda_ipc.cu, its NVSHMEM
// membership in nvshmem.cu; the transports there read the fields directly.
struct CudaDevice final : Device {
  CudaDevice(const Core& core, int ordinal);
  ~CudaDevice() override;

  int ordinal() const override { return ordinal_; }
  const std::string& uuid() const override { return uuid_; }
  int64_t bytes() const override {
    return static_cast<int64_t>(block_bytes + accum_bytes + nv_bytes);
  }
  void publish(int unit, const float* master) override;
  void fetch_add(int unit, float* out) override;
  void accumulate(int unit, int client, int64_t count, int32_t where) override;
  void gather_own(int unit, int64_t version, float* out, CUstream_st* stream) override;
  void push_own(int unit, int64_t version, const float* grad, CUstream_st* stream) override;
  void track_gather(CUstream_st* stream, const std::string& tag) override;
  void wait_gathers(const std::string& tag) override;
  std::string nvshmem_uniqueid(const std::string& who) override;
  void join_nvshmem(const std::string& who, const std::string& uid, int pe, int npes,
                    const std::vector<int>& pe_of_rank) override;
  bool nvshmem_active() const override { return nv_block != nullptr; }
  void nvshmem_broken() override { nv_broken.store(true); }
  void leave(bool collective) override;
  void release() override;

  void leave_nvshmem(bool collective);  // nvshmem.cu
  // Frees what is still held (the block itself only while free_block); safe to repeat.
  void destroy();
  // The receive slot of `client` in a block with this layout (`base`: a device or NVSHMEM block,
  // mine or an owner's: every rank's layout is the same).
  char* slot_of(char* base, int client) const {
    return base + core.seg->dev_slots_off + core.seg->dev_slot_stride * static_cast<uint64_t>(client);
  }

  const Core& core;
  const int ordinal_;
  std::string uuid_;
  char* block = nullptr;  // exported: masters, then one slot per client
  size_t block_bytes = 0;
  float* accum = nullptr;  // private fp32 accumulators
  size_t accum_bytes = 0;
  std::vector<size_t> accum_off;  // per unit, in elements
  cudaStream_t stream = nullptr;  // publish / fetch_add (Python's threads), under stream_mu
  std::mutex stream_mu;
  cudaStream_t daemon_stream = nullptr;  // the accumulation daemon's
  std::mutex pending_mu;
  std::vector<cudaEvent_t> pending;  // one per device gather not yet known to be finished
  std::vector<cudaEvent_t> spare;
  bool free_block = true;  // false once a peer that still maps the block outlived release()'s wait

  char* nv_block = nullptr;  // the NVSHMEM symmetric block (the device block's layout), or null
  size_t nv_bytes = 0;
  std::vector<int> nv_pe;    // the NVSHMEM PE of each rank, -1 outside the NVSHMEM job
  std::atomic<bool> nv_broken{false};
};

}  // namespace jaxodc::odc
