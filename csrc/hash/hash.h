// Deterministic parallel 64-bit hash of a byte string ("jaxodc hash v1"), identical on CPU (any
// thread count) and GPU because the layout is fixed, not the schedule:
//   * the bytes split into 64 KiB blocks (at least one); words are 8-byte little-endian, zero
//     padded past the end;
//   * in block k, lane l (0..31) hashes words l, l+32, l+64, ... (256 words) starting from
//     P5 ^ ((32k + l) * P2) with the xxh64 round h = rotl(h + w*P2, 31) * P1 (a GPU warp reads the
//     block coalesced);
//   * the block hash folds the 32 lane hashes in lane order: b = rotl(b ^ aval(h_l), 27) * P1 + P4,
//     from b = P3;
//   * block hashes combine pairwise level by level (an odd last one moves up unchanged):
//     c(a, b) = aval((rotl(a, 17) ^ (b * P2)) * P1 + P4);
//   * the result is aval(root ^ (nbytes * P5)).
// tests/test_hash.py re-implements this spec in numpy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__CUDACC__)
#define JAXODC_HASH_HD __host__ __device__ __forceinline__
#else
#define JAXODC_HASH_HD inline
#endif

namespace jaxodc::hash {

constexpr uint64_t P1 = 0x9E3779B185EBCA87ull, P2 = 0xC2B2AE3D27D4EB4Full, P3 = 0x165667B19E3779F9ull,
                   P4 = 0x85EBCA77C2B2AE63ull, P5 = 0x27D4EB2F165667C5ull;
constexpr size_t kBlockBytes = 65536, kLanes = 32, kWordsPerLane = kBlockBytes / 8 / kLanes;

JAXODC_HASH_HD uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
JAXODC_HASH_HD uint64_t aval(uint64_t h) {
  h ^= h >> 33; h *= P2; h ^= h >> 29; h *= P3; h ^= h >> 32;
  return h;
}
JAXODC_HASH_HD uint64_t lane_seed(uint64_t block, uint64_t lane) { return P5 ^ ((block * kLanes + lane) * P2); }
JAXODC_HASH_HD uint64_t lane_round(uint64_t h, uint64_t w) { return rotl(h + w * P2, 31) * P1; }
JAXODC_HASH_HD uint64_t fold_lane(uint64_t b, uint64_t lane_hash) { return rotl(b ^ aval(lane_hash), 27) * P1 + P4; }
JAXODC_HASH_HD uint64_t combine(uint64_t a, uint64_t b) { return aval((rotl(a, 17) ^ (b * P2)) * P1 + P4); }

inline size_t num_blocks(size_t nbytes) { return nbytes == 0 ? 1 : (nbytes + kBlockBytes - 1) / kBlockBytes; }

// Tree combine of block hashes plus the length finish (shared by the CPU and GPU paths).
uint64_t finish(std::vector<uint64_t> blocks, size_t nbytes);
// threads <= 0: hardware concurrency.
uint64_t hash_cpu(const void* data, size_t nbytes, int threads);
#ifdef JAXODC_WITH_CUDA
// data is a device pointer; synchronises the device; throws std::runtime_error on CUDA errors.
uint64_t hash_cuda(const void* data, size_t nbytes);
#endif

}  // namespace jaxodc::hash
