#include "hash/hash.h"

#include <algorithm>
#include <cstring>
#include <thread>

namespace jaxodc::hash {

static uint64_t block_hash(const uint8_t* data, size_t nbytes, size_t k) {
  const uint8_t* p = data + k * kBlockBytes;
  alignas(8) static thread_local uint8_t pad[kBlockBytes];
  size_t avail = nbytes > k * kBlockBytes ? std::min(kBlockBytes, nbytes - k * kBlockBytes) : 0;
  if (avail < kBlockBytes) {  // zero-padded tail block
    std::memset(pad, 0, kBlockBytes);
    if (avail) std::memcpy(pad, p, avail);
    p = pad;
  }
  uint64_t h[kLanes];
  for (size_t l = 0; l < kLanes; ++l) h[l] = lane_seed(k, l);
  for (size_t j = 0; j < kWordsPerLane; ++j) {
    const uint8_t* row = p + j * kLanes * 8;
    for (size_t l = 0; l < kLanes; ++l) {
      uint64_t w;
      std::memcpy(&w, row + l * 8, 8);  // little-endian host
      h[l] = lane_round(h[l], w);
    }
  }
  uint64_t b = P3;
  for (size_t l = 0; l < kLanes; ++l) b = fold_lane(b, h[l]);
  return b;
}

uint64_t finish(std::vector<uint64_t> level, size_t nbytes) {
  while (level.size() > 1) {
    std::vector<uint64_t> up((level.size() + 1) / 2);
    for (size_t i = 0; i + 1 < level.size(); i += 2) up[i / 2] = combine(level[i], level[i + 1]);
    if (level.size() % 2) up.back() = level.back();
    level.swap(up);
  }
  return aval(level[0] ^ (static_cast<uint64_t>(nbytes) * P5));
}

uint64_t hash_cpu(const void* data, size_t nbytes, int threads) {
  size_t nb = num_blocks(nbytes);
  std::vector<uint64_t> blocks(nb);
  const uint8_t* p = static_cast<const uint8_t*>(data);
  size_t t = threads > 0 ? static_cast<size_t>(threads) : std::max(1u, std::thread::hardware_concurrency());
  t = std::min(t, nb);
  if (t <= 1) {
    for (size_t k = 0; k < nb; ++k) blocks[k] = block_hash(p, nbytes, k);
  } else {
    std::vector<std::thread> pool;
    for (size_t i = 0; i < t; ++i)
      pool.emplace_back([&, i] {
        for (size_t k = i; k < nb; k += t) blocks[k] = block_hash(p, nbytes, k);
      });
    for (auto& th : pool) th.join();
  }
  return finish(std::move(blocks), nbytes);
}

}  // namespace jaxodc::hash
