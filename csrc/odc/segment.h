// Internal to csrc/odc: the unit layout, the layout of a rank's ODC segment (POSIX shared memory)
// and the segment's life: creation, mapping a peer's, and reclaiming those of dead processes
// (segment.cc).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "common/sync.h"
#include "transport/shm.h"

namespace jaxodc::odc {

constexpr uint64_t kMagic = 0x3130434f444f584aULL;  // "JXODOC01"
constexpr int kRing = 8;  // versions in flight differ by at most 1; 8 entries leave ample margin
constexpr uint32_t kSlotFree = 0, kSlotFull = 1;
// Where the data of a full slot lies: the owner's host segment, its device block (cuda_ipc), or
// its NVSHMEM block (nvshmem); kSlotSketch: in the host segment, a compressed chunk (compress.h).
constexpr int32_t kSlotHost = 0, kSlotDevice = 1, kSlotNvshmem = 2, kSlotSketch = 3;
constexpr size_t kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t); checked in cuda_ipc.cu

// A process on this host is alive unless it is gone or a zombie (csrc/transport/shm.h).
using shm::pid_alive;

// The unit layout every rank must share (compared through its hash at connect): unit sizes, the
// shard of each (ceil(numel / world) elements, the last owners' pieces padded), and the receive
// slot capacity.
struct Layout {
  Layout(int rank, int world, const std::vector<int64_t>& numels, int64_t slot_elems);

  int num_units() const { return static_cast<int>(numels.size()); }
  // [lo, lo + n) of the flat unit that `owner` holds (n may be 0 for trailing owners).
  void piece(int unit, int owner, int64_t* lo, int64_t* n) const {
    *lo = std::min<int64_t>(static_cast<int64_t>(owner) * shards[unit], numels[unit]);
    *n = std::max<int64_t>(0, std::min<int64_t>(shards[unit], numels[unit] - *lo));
  }

  int world;
  std::vector<int64_t> numels, shards;
  int64_t max_shard = 0;
  int64_t slot_elems = 0;  // capacity of one receive slot (fp32 elements)
  uint64_t hash = 0;
};

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
  int64_t sketch_width;  // kSlotSketch: the sketch's buckets per row and its hash seed
  uint64_t sketch_seed;
};

// One post of Runtime::allgather: up to kScalarWords values (longer vectors take several posts).
constexpr int kScalarWords = 62;
struct alignas(64) ScalarEntry {
  std::atomic<int64_t> version;
  int64_t count;  // values posted
  double values[kScalarWords];
};
static_assert(sizeof(ScalarEntry) == 512, "a post is 512 bytes");

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
  void raise_slot(int client, int unit_index, int64_t version, int64_t count, int32_t where, int64_t offset = 0,
                  int64_t sketch_width = 0, uint64_t sketch_seed = 0) {
    SlotHeader* s = slot(client);
    s->sketch_width = sketch_width;
    s->sketch_seed = sketch_seed;
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

// A segment mapped into this process, unmapped on destruction.
struct Mapping {
  Mapping() = default;
  Mapping(SegmentHeader* seg, size_t bytes) : seg(seg), bytes(bytes) {}
  Mapping(Mapping&& o) noexcept : seg(o.seg), bytes(o.bytes) { o.seg = nullptr; }
  Mapping& operator=(Mapping&& o) noexcept;
  ~Mapping() { reset(); }
  void reset();

  SegmentHeader* seg = nullptr;
  size_t bytes = 0;
};

// Creates this rank's segment `name` for `layout`, zeroed but for its header and the -1 version /
// done / scalar markers; throws if the name exists and its owner is alive (`job_id` names the job
// in that error).
Mapping create_segment(const std::string& name, const std::string& job_id, int rank, const Layout& layout);
// Maps the segment `name` of rank `peer`, checking it is that rank's ODC segment with `layout`
// (`me` names this rank in errors).
Mapping map_segment(const std::string& name, int peer, int me, const Layout& layout);

// LB-Steal: claims one of `count` microbatches of minibatch `version` from the deque of `owner`'s
// segment (the owner from the front, a thief with `steal` from the back); -1 when none is left.
int64_t claim_microbatch(SegmentHeader* seg, int64_t version, int64_t count, bool steal, int owner);

}  // namespace jaxodc::odc
