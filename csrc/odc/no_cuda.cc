// Builds without CUDA (no nvcc at build time): no device block can exist, so the factories of
// device.h fail with the reason and the host transports serve every peer.
#ifndef JAXODC_WITH_CUDA
#include "odc/core.h"
#include "odc/peer.h"
#include "odc/runtime.h"

namespace jaxodc::odc {

bool cuda_built() { return false; }
std::vector<std::string> cuda_device_uuids() { return {}; }

std::unique_ptr<Device> make_device(const Core& core, int ordinal) {
  throw Error(core.who() + ": cannot use CUDA device " + std::to_string(ordinal) +
              ": jaxodc was built without CUDA (no nvcc at build time)");
}

std::unique_ptr<Peer> make_cuda_ipc_peer(const Core& core, int rank, Mapping) {
  throw Error(core.who() + ": the cuda_ipc transport to rank " + std::to_string(rank) +
              " needs a CUDA build of jaxodc");
}

std::unique_ptr<Peer> make_nvshmem_peer(const Core& core, const PeerConfig& cfg) {
  throw Error(core.who() + ": the nvshmem transport to rank " + std::to_string(cfg.rank) +
              " needs a CUDA build of jaxodc");
}

}  // namespace jaxodc::odc
#endif
