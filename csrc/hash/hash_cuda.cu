// GPU path of the jaxodc hash (spec in hash.h): one warp per 64 KiB block, coalesced word loads,
// block hashes folded on the host with the same finish() as the CPU path.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "hash/hash.h"

namespace jaxodc::hash {

__global__ void block_hash_kernel(const uint8_t* data, size_t nbytes, size_t nblocks, uint64_t* out) {
  size_t warp = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  unsigned lane = threadIdx.x % 32;
  if (warp >= nblocks) return;
  bool aligned = (reinterpret_cast<uintptr_t>(data) % 8) == 0;
  uint64_t h = lane_seed(warp, lane);
  size_t base = warp * kBlockBytes;
  for (size_t j = 0; j < kWordsPerLane; ++j) {
    size_t off = base + (j * kLanes + lane) * 8;
    uint64_t w = 0;
    if (aligned && off + 8 <= nbytes) {
      w = *reinterpret_cast<const uint64_t*>(data + off);
    } else {
      for (int b = 0; b < 8; ++b)
        if (off + b < nbytes) w |= static_cast<uint64_t>(data[off + b]) << (8 * b);
    }
    h = lane_round(h, w);
  }
  uint64_t acc = P3;
  for (int l = 0; l < 32; ++l) acc = fold_lane(acc, __shfl_sync(0xffffffffu, h, l));
  if (lane == 0) out[warp] = acc;
}

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("hash_cuda: ") + what + ": " + cudaGetErrorString(e));
}

uint64_t hash_cuda(const void* data, size_t nbytes) {
  size_t nb = num_blocks(nbytes);
  uint64_t* d_out = nullptr;
  check(cudaMalloc(&d_out, nb * sizeof(uint64_t)), "cudaMalloc");
  constexpr int kThreads = 256;
  size_t warps_per_cta = kThreads / 32;
  unsigned grid = static_cast<unsigned>((nb + warps_per_cta - 1) / warps_per_cta);
  check(cudaDeviceSynchronize(), "synchronise before hashing");
  block_hash_kernel<<<grid, kThreads>>>(static_cast<const uint8_t*>(data), nbytes, nb, d_out);
  cudaError_t e = cudaGetLastError();
  std::vector<uint64_t> blocks(nb);
  if (e == cudaSuccess) e = cudaMemcpy(blocks.data(), d_out, nb * sizeof(uint64_t), cudaMemcpyDeviceToHost);
  cudaFree(d_out);
  check(e, "kernel");
  return finish(std::move(blocks), nbytes);
}

}  // namespace jaxodc::hash
