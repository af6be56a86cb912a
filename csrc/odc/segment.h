// Layout of a rank's ODC segment (POSIX shared memory) and the runtime's view of a peer. Internal
// to csrc/odc: shared by the host runtime (runtime.cc) and the CUDA IPC transport (cuda_ipc.cu).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "common/sync.h"
#include "odc/nvshmem/plugin_api.h"
#include "odc/runtime.h"

namespace jaxodc::odc {

constexpr uint64_t kMagic = 0x3130434f444f584aULL;  // "JXODOC01"
constexpr int kRing = 8;  // versions in flight differ by at most 1; 8 entries leave ample margin
constexpr uint32_t kSlotFree = 0, kSlotFull = 1;
// Where the data of a full slot lies: the owner's host segment, its device block (cuda_ipc), or
// its NVSHMEM block (nvshmem).
constexpr int32_t kSlotHost = 0, kSlotDevice = 1, kSlotNvshmem = 2;
constexpr size_t kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t); checked in cuda_ipc.cu

// A process on this host is alive unless it is gone or a zombie (dead, not yet reaped).
bool pid_alive(int pid);

// The loaded NVSHMEM plugin's table, or null (nvshmem_loader.cc); nvshmem_load_error says why.
const JaxodcNvshmemApi* nvshmem_api();
std::string nvshmem_load_error();

inline bool is_mapped(Transport t) { return t == Transport::kShm || t == Transport::kCudaIpc; }

struct alignas(64) UnitEntry {
  std::atomic<int64_t> version;  // -1 until first publish
  int64_t numel;
  int64_t shard;
  uint64_t master_offset;
  uint64_t dev_master_offset;  // in the device block (cuda_ipc), once a device is enabled
};

struct alignas(64) SlotHeader {
  std::atomic<uint32_t> state;
  int32_t unit;
  int64_t version;
  int64_t count;
  int32_t where;  // kSlotHost / kSlotDevice / kSlotNvshmem, written with the data
  // The client's pid while it maps this owner's device block (0 otherwise): the owner frees the
  // block only when no live client maps it any more.
  std::atomic<int32_t> mapper_pid;
  int64_t offset;  // where in the owner's shard the slot's `count` elements go
};

struct alignas(64) ScalarEntry {
  std::atomic<int64_t> version;
  double value;
};

struct SegmentHeader {
  uint64_t magic;
  int32_t rank, world, pid, num_units;
  uint64_t layout_hash;
  int64_t max_shard;
  uint64_t total_bytes, units_off, masters_off, slots_off, slot_stride, done_off, scalars_off;
  alignas(64) std::atomic<uint32_t> pub_seq;     // bumped on publish
  alignas(64) std::atomic<uint32_t> doorbell;    // bumped on push / done / drained slot
  alignas(64) std::atomic<uint32_t> slot_seq;    // bumped when a slot is freed
  alignas(64) std::atomic<uint32_t> scalar_seq;  // bumped when a scalar is posted
  alignas(64) std::atomic<uint32_t> closing;     // owner shut down
  alignas(64) std::atomic<uint64_t> deques[kRing];  // this owner's LB-Steal deque per minibatch (Runtime::claim)
  // CUDA IPC: the owner's device block (masters, then one slot per client). Appended, so the
  // fields above keep their offsets (reclaim_stale_segments reads magic and pid).
  alignas(64) std::atomic<uint32_t> dev_ready;  // 1 once the fields below are written
  int32_t dev_ordinal;
  uint64_t dev_bytes, dev_slots_off, dev_slot_stride;
  unsigned char dev_uuid[16];
  unsigned char dev_handle[kIpcHandleBytes];

  char* base() { return reinterpret_cast<char*>(this); }
  UnitEntry* unit(int u) { return reinterpret_cast<UnitEntry*>(base() + units_off) + u; }
  float* master(int u) { return reinterpret_cast<float*>(base() + unit(u)->master_offset); }
  SlotHeader* slot(int client) {
    return reinterpret_cast<SlotHeader*>(base() + slots_off + slot_stride * static_cast<uint64_t>(client));
  }
  float* slot_data(int client) { return reinterpret_cast<float*>(reinterpret_cast<char*>(slot(client)) + 64); }
  // Hands client's filled receive slot to this owner's daemon; the data must already be in place.
  // `offset`: the first element of the owner's shard the data adds to (host slots may carry a
  // chunk of a push; device slots always hold a whole shard piece).
  void raise_slot(int client, int unit_index, int64_t version, int64_t count, int32_t where, int64_t offset = 0) {
    SlotHeader* s = slot(client);
    s->unit = unit_index;
    s->version = version;
    s->count = count;
    s->offset = offset;
    s->where = where;
    s->state.store(kSlotFull, std::memory_order_release);
    signal_event(&doorbell);
  }
  std::atomic<int64_t>* done(int client) {
    return reinterpret_cast<std::atomic<int64_t>*>(base() + done_off) + client;
  }
  ScalarEntry* scalar(int64_t version) {
    return reinterpret_cast<ScalarEntry*>(base() + scalars_off) + (version % kRing);
  }
};

static_assert(sizeof(SlotHeader) == 64, "slot data starts 64 bytes after its header");
static_assert(std::atomic<int32_t>::is_always_lock_free, "cross-process atomics must be lock-free");
static_assert(std::atomic<int64_t>::is_always_lock_free, "cross-process atomics must be lock-free");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "cross-process atomics must be lock-free");

struct Runtime::Peer {
  int rank = -1;
  Transport transport = Transport::kSelf;
  SegmentHeader* seg = nullptr;  // mapped segment (self, shm or cuda_ipc)
  size_t seg_bytes = 0;
  int pid = 0;
  std::string host;
  int port = 0;
  int fd = -1;
  std::mutex mu;             // one request at a time on the TCP connection
  char* dev_base = nullptr;  // cuda_ipc: the peer's device block mapped into this process
  std::string name() const { return "rank " + std::to_string(rank); }
};

}  // namespace jaxodc::odc
