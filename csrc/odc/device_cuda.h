// Internal to the CUDA sources of csrc/odc (cuda_ipc.cu, nvshmem.cu; needs cuda_runtime.h): CUDA error checks, the
// device guard and a rank's device state.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <string>
#include <vector>

#include "odc/runtime.h"

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

struct DeviceState {
  int ordinal = -1;
  char* block = nullptr;  // exported: masters, then one slot per client
  size_t block_bytes = 0;
  float* accum = nullptr;  // private fp32 accumulators
  size_t accum_bytes = 0;
  std::vector<size_t> accum_off;  // per unit, in elements
  cudaStream_t stream = nullptr;  // publish / fetch_grad (Python's threads), under stream_mu
  std::mutex stream_mu;
  cudaStream_t daemon_stream = nullptr;  // the accumulation daemon's
  std::mutex pending_mu;
  std::vector<cudaEvent_t> pending;  // one per device gather not yet known to be finished
  std::vector<cudaEvent_t> spare;
};

}  // namespace jaxodc::odc
