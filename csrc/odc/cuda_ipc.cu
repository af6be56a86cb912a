// The cuda_ipc transport of the ODC runtime: server memory in GPU memory, reached by same-host peers
// through CUDA IPC.
//
// Each rank with a device owns one exported block (cudaMalloc + cudaIpcGetMemHandle): its fp32
// master shards, then one receive slot per client (max shard each: the paper's M/N per client). Its
// fp32 accumulators live in a private allocation. The IPC handle and the block's layout are written
// into the rank's host segment (segment.h), which cuda_ipc peers map anyway for the control words:
// versions, slot states, done markers and futex wake-ups stay on the host, only data moves on the
// GPU.
//
//   gather:   wait (host) for the owner's version, then cudaMemcpyAsync from its mapped master on the
//             call's stream; an event per call lets done() wait until those reads finished, because
//             owners overwrite masters only after every done(version).
//   scatter:  wait (host) for my slot at the owner to be free, copy my slice into it, wait for the
//             copy, raise the slot's flag and ring the owner's doorbell.
//   daemon:   adds full device slots into the device accumulator with a kernel on its own stream,
//             waits for it, frees the slot.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "odc/device_cuda.h"
#include "odc/runtime.h"
#include "odc/segment.h"

namespace jaxodc::odc {

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "CUDA IPC handle size changed");

namespace {

constexpr size_t kDevAlign = 256;
constexpr int kThreads = 256;

size_t dev_align(size_t x) { return (x + kDevAlign - 1) / kDevAlign * kDevAlign; }

std::string uuid_string(const void* bytes) {
  const auto* b = static_cast<const unsigned char*>(bytes);
  char buf[64];
  std::snprintf(buf, sizeof(buf), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return buf;
}

__global__ void add_into(float* __restrict__ acc, const float* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    acc[i] += src[i];
}

}  // namespace


namespace {

// Frees what `st` holds (the block only with free_block) and `st` itself; ignores errors.
void destroy_state(DeviceState* st, bool free_block) {
  for (cudaEvent_t ev : st->pending) cudaEventDestroy(ev);
  for (cudaEvent_t ev : st->spare) cudaEventDestroy(ev);
  if (st->stream) cudaStreamDestroy(st->stream);
  if (st->daemon_stream) cudaStreamDestroy(st->daemon_stream);
  if (st->accum) cudaFree(st->accum);
  if (free_block && st->block) cudaFree(st->block);
  cudaGetLastError();
  delete st;
}

}  // namespace

bool cuda_built() { return true; }

std::vector<std::string> cuda_device_uuids() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  std::vector<std::string> out;
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) {
      cudaGetLastError();
      return {};
    }
    out.push_back(uuid_string(prop.uuid.bytes));
  }
  return out;
}

void Runtime::enable_device(int ordinal) {
  check_open("enable_device");
  const std::string who = "rank " + std::to_string(rank_) + ": enable_device(" + std::to_string(ordinal) + ")";
  if (dev_) throw Error(who + ": device " + std::to_string(device_) + " is already enabled");
  if (connected_) throw Error(who + ": must be called before connect");
  int count = 0;
  check(cudaGetDeviceCount(&count), who + ": no usable CUDA device");
  if (ordinal < 0 || ordinal >= count)
    throw Error(who + ": this process sees " + std::to_string(count) + " CUDA device(s)");
  DeviceGuard guard(ordinal, who);

  auto* st = new DeviceState();
  st->ordinal = ordinal;
  std::vector<uint64_t> master_off(numels_.size());
  cudaIpcMemHandle_t handle;
  cudaDeviceProp prop;
  size_t slots_off = 0, slot_stride = 0;
  try {
    size_t off = 0;
    for (size_t u = 0; u < numels_.size(); ++u) {
      master_off[u] = off;
      off = dev_align(off + static_cast<size_t>(shards_[u]) * 4);
    }
    slots_off = off;
    slot_stride = dev_align(static_cast<size_t>(max_shard_) * 4);
    st->block_bytes = slots_off + slot_stride * static_cast<size_t>(world_);
    size_t acc = 0;
    for (size_t u = 0; u < numels_.size(); ++u) {
      st->accum_off.push_back(acc / 4);
      acc = dev_align(acc + static_cast<size_t>(shards_[u]) * 4);
    }
    st->accum_bytes = acc;

    check(cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking), who + ": cudaStreamCreate");
    check(cudaStreamCreateWithFlags(&st->daemon_stream, cudaStreamNonBlocking), who + ": cudaStreamCreate");
    check(cudaMalloc(reinterpret_cast<void**>(&st->block), st->block_bytes),
          who + ": cudaMalloc of the " + std::to_string(st->block_bytes) + "-byte device block");
    check(cudaMalloc(reinterpret_cast<void**>(&st->accum), st->accum_bytes),
          who + ": cudaMalloc of the " + std::to_string(st->accum_bytes) + "-byte device accumulators");
    // Zeroed and finished before any peer can map the block.
    check(cudaMemsetAsync(st->block, 0, st->block_bytes, st->stream), who + ": cudaMemsetAsync");
    check(cudaMemsetAsync(st->accum, 0, st->accum_bytes, st->stream), who + ": cudaMemsetAsync");
    check(cudaStreamSynchronize(st->stream), who + ": zeroing device memory");
    check(cudaIpcGetMemHandle(&handle, st->block), who + ": cudaIpcGetMemHandle");
    check(cudaGetDeviceProperties(&prop, ordinal), who + ": cudaGetDeviceProperties");
  } catch (...) {
    destroy_state(st, true);
    throw;
  }

  for (size_t u = 0; u < numels_.size(); ++u) seg_->unit(static_cast<int>(u))->dev_master_offset = master_off[u];
  seg_->dev_ordinal = ordinal;
  seg_->dev_bytes = st->block_bytes;
  seg_->dev_slots_off = slots_off;
  seg_->dev_slot_stride = slot_stride;
  std::memcpy(seg_->dev_uuid, prop.uuid.bytes, sizeof(seg_->dev_uuid));
  std::memcpy(seg_->dev_handle, &handle, kIpcHandleBytes);
  seg_->dev_ready.store(1, std::memory_order_release);

  device_ = ordinal;
  device_uuid_ = uuid_string(prop.uuid.bytes);
  device_bytes_ = static_cast<int64_t>(st->block_bytes + st->accum_bytes);
  dev_ = st;
}

void Runtime::dev_open_peer(Peer& peer) {
  const std::string who = "rank " + std::to_string(rank_) + ": cuda_ipc transport to " + peer.name();
  if (!dev_) throw Error(who + ": this rank has no device (enable_device before connect, or use shm)");
  SegmentHeader* s = peer.seg;
  if (s->dev_ready.load(std::memory_order_acquire) != 1)
    throw PeerError(who + ": the peer has no device block (it runs without a device; use the shm transport)");
  if (s->dev_bytes != dev_->block_bytes || s->dev_slot_stride != seg_->dev_slot_stride ||
      s->dev_slots_off != seg_->dev_slots_off)
    throw Error(who + ": the peer's device block layout differs from this rank's");
  const std::string where = who + " (its device " + uuid_string(s->dev_uuid) + ")";
  DeviceGuard guard(device_, where);
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, s->dev_handle, kIpcHandleBytes);
  void* ptr = nullptr;
  cudaError_t e = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw PeerError(where + ": cudaIpcOpenMemHandle: " + cuda_msg(e) +
                    " (GPUs without peer access cannot map each other: use transport='shm')");
  }
  peer.dev_base = static_cast<char*>(ptr);
  // The owner frees its block only after this mark is cleared again (dev_release) or I died.
  s->slot(rank_)->mapper_pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
}

void Runtime::gather_device(int unit, int64_t version, float* out, CUstream_st* stream) {
  check_open("gather");
  check_unit(unit, "gather");
  const std::string tag = "odc.gather over cuda_ipc: rank " + std::to_string(rank_) + " unit " +
                          std::to_string(unit) + " version " + std::to_string(version);
  if (!dev_) throw Error(tag + ": this rank has no device");
  DeviceGuard guard(device_, tag);
  for (int i = 0; i < world_; ++i) {
    const int d = (rank_ + i) % world_;
    if (!device_owner(d)) continue;
    Peer& p = *peers_[d];
    if (p.transport == Transport::kNvshmem) {  // covered by this call's event below too
      nv_gather_owner(p, unit, version, out, stream);
      continue;
    }
    SegmentHeader* seg = p.seg;  // mine for d == rank_
    UnitEntry* e = seg->unit(unit);
    wait_until(
        &seg->pub_seq, [&] { return e->version.load(std::memory_order_acquire) >= version; },
        d == rank_ ? nullptr : &p,
        "waiting for " + p.name() + " to publish unit " + std::to_string(unit) + " version " +
            std::to_string(version) + " (gather over cuda_ipc)");
    int64_t lo, n;
    piece(unit, d, &lo, &n);
    if (n == 0) continue;
    const char* base = d == rank_ ? dev_->block : p.dev_base;
    const auto* src = reinterpret_cast<const float*>(base + e->dev_master_offset);
    check(cudaMemcpyAsync(out + lo, src, static_cast<size_t>(n) * 4, cudaMemcpyDefault, stream),
          tag + ": copy of the shard of " + p.name());
  }

  std::lock_guard<std::mutex> lock(dev_->pending_mu);
  // Recycle the events of finished gathers so the list stays short.
  size_t keep = 0;
  for (size_t i = 0; i < dev_->pending.size(); ++i) {
    cudaEvent_t ev = dev_->pending[i];
    cudaError_t q = cudaEventQuery(ev);
    if (q == cudaSuccess) {
      dev_->spare.push_back(ev);
    } else if (q == cudaErrorNotReady) {
      cudaGetLastError();
      dev_->pending[keep++] = ev;
    } else {
      dev_->pending.resize(keep);  // the failed one and the unchecked rest are dropped (leaked)
      check(q, tag + ": an earlier gather over cuda_ipc failed");
    }
  }
  dev_->pending.resize(keep);
  cudaEvent_t ev;
  if (!dev_->spare.empty()) {
    ev = dev_->spare.back();
    dev_->spare.pop_back();
  } else {
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), tag + ": cudaEventCreate");
  }
  cudaError_t e = cudaEventRecord(ev, stream);
  if (e != cudaSuccess) {
    dev_->spare.push_back(ev);
    check(e, tag + ": cudaEventRecord on the call's stream (is the stream on device " + std::to_string(device_) +
                 "?)");
  }
  dev_->pending.push_back(ev);
}

void Runtime::scatter_device(int unit, int64_t version, const float* grad, CUstream_st* stream) {
  check_open("scatter_accumulate");
  check_unit(unit, "scatter_accumulate");
  const std::string tag = "odc.scatter_accumulate over cuda_ipc: rank " + std::to_string(rank_) + " unit " +
                          std::to_string(unit) + " version " + std::to_string(version);
  if (!dev_) throw Error(tag + ": this rank has no device");
  DeviceGuard guard(device_, tag);
  // Start with the next owner so that ranks do not all queue at owner 0 at once.
  for (int i = 0; i < world_; ++i) {
    const int d = (rank_ + 1 + i) % world_;
    if (!device_owner(d)) continue;
    Peer& p = *peers_[d];
    if (p.transport == Transport::kNvshmem) {
      nv_push_owner(p, unit, version, grad, stream);
      continue;
    }
    SegmentHeader* seg = p.seg;  // mine for d == rank_: my own slice goes through my own slot
    SlotHeader* slot = seg->slot(rank_);
    wait_until(
        &seg->slot_seq, [&] { return slot->state.load(std::memory_order_acquire) == kSlotFree; },
        d == rank_ ? nullptr : &p,
        "waiting for its receive slot at " + p.name() + " (pushing unit " + std::to_string(unit) + " version " +
            std::to_string(version) + " over cuda_ipc)");
    int64_t lo, n;
    piece(unit, d, &lo, &n);
    if (n > 0) {
      char* base = d == rank_ ? dev_->block : p.dev_base;
      auto* dst = reinterpret_cast<float*>(base + seg->dev_slots_off + seg->dev_slot_stride * static_cast<uint64_t>(rank_));
      check(cudaMemcpyAsync(dst, grad + lo, static_cast<size_t>(n) * 4, cudaMemcpyDefault, stream),
            tag + ": copy into the slot at " + p.name());
      // The flag is raised only once the data landed: the owner's daemon reads the slot right away.
      check(cudaStreamSynchronize(stream), tag + ": copy into the slot at " + p.name());
    }
    seg->raise_slot(rank_, unit, version, n, kSlotDevice);
  }
}

void Runtime::dev_accumulate(int unit, int client, int64_t count, int32_t where) {
  if (count <= 0) return;
  const std::string tag = "rank " + std::to_string(rank_) + ": accumulating the device push of rank " +
                          std::to_string(client) + " (unit " + std::to_string(unit) + ")";
  DeviceGuard guard(device_, tag);
  // The NVSHMEM block has the device block's layout.
  const char* base = where == kSlotNvshmem ? nv_block_ : dev_->block;
  const auto* src = reinterpret_cast<const float*>(base + seg_->dev_slots_off +
                                                   seg_->dev_slot_stride * static_cast<uint64_t>(client));
  float* acc = dev_->accum + dev_->accum_off[unit];
  std::lock_guard<std::mutex> lock(*accum_mu_[unit]);
  const int blocks = static_cast<int>(std::min<int64_t>((count + kThreads - 1) / kThreads, 1024));
  add_into<<<blocks, kThreads, 0, dev_->daemon_stream>>>(acc, src, count);
  check(cudaGetLastError(), tag + ": kernel launch");
  // The slot is freed (and may be overwritten by the client) only after the kernel read it.
  check(cudaStreamSynchronize(dev_->daemon_stream), tag);
}

void Runtime::dev_publish(int unit, const float* shard) {
  const std::string tag = "publish: rank " + std::to_string(rank_) + " unit " + std::to_string(unit) +
                          ": device master";
  DeviceGuard guard(device_, tag);
  std::lock_guard<std::mutex> lock(dev_->stream_mu);
  auto* dst = reinterpret_cast<float*>(dev_->block + seg_->unit(unit)->dev_master_offset);
  check(cudaMemcpyAsync(dst, shard, static_cast<size_t>(shards_[unit]) * 4, cudaMemcpyHostToDevice, dev_->stream),
        tag);
  if (nv_block_) {  // the copy nvshmem peers read
    auto* nv_dst = reinterpret_cast<float*>(nv_block_ + seg_->unit(unit)->dev_master_offset);
    check(cudaMemcpyAsync(nv_dst, dst, static_cast<size_t>(shards_[unit]) * 4, cudaMemcpyDeviceToDevice,
                          dev_->stream),
          tag + " (NVSHMEM block)");
  }
  // Finished (not merely staged) before the caller stores the version that announces it.
  check(cudaStreamSynchronize(dev_->stream), tag);
}

void Runtime::dev_fetch_add(int unit, float* out) {
  const std::string tag = "fetch_grad: rank " + std::to_string(rank_) + " unit " + std::to_string(unit) +
                          ": device accumulator";
  const size_t n = static_cast<size_t>(shards_[unit]);
  std::vector<float> tmp(n);
  DeviceGuard guard(device_, tag);
  std::lock_guard<std::mutex> lock(dev_->stream_mu);
  float* acc = dev_->accum + dev_->accum_off[unit];
  check(cudaMemcpyAsync(tmp.data(), acc, n * 4, cudaMemcpyDeviceToHost, dev_->stream), tag);
  check(cudaMemsetAsync(acc, 0, n * 4, dev_->stream), tag);
  check(cudaStreamSynchronize(dev_->stream), tag);
  for (size_t i = 0; i < n; ++i) out[i] += tmp[i];
}

void Runtime::dev_sync_pending() {
  const std::string tag = "done: rank " + std::to_string(rank_);
  std::lock_guard<std::mutex> lock(dev_->pending_mu);
  cudaError_t first = cudaSuccess;
  for (cudaEvent_t ev : dev_->pending) {
    cudaError_t e = cudaEventSynchronize(ev);
    if (e != cudaSuccess && first == cudaSuccess) first = e;
    dev_->spare.push_back(ev);
  }
  dev_->pending.clear();
  check(first, tag + ": a gather over cuda_ipc failed");
}

void Runtime::dev_release() {
  DeviceState* st = dev_;
  if (!st) return;
  dev_ = nullptr;
  std::unique_ptr<DeviceGuard> guard;
  try {
    guard = std::make_unique<DeviceGuard>(st->ordinal, "close");
  } catch (const std::exception&) {
    // Keep going: unmapping and the marks below matter more than the device being current.
  }
  // 1. None of my copies may still read the peers' blocks.
  for (cudaEvent_t ev : st->pending) cudaEventSynchronize(ev);
  // NVSHMEM's teardown is collective, so it comes before the bounded wait for cuda_ipc mappers.
  nv_release();
  // 2. Unmap the peers' blocks and clear my marks there, so they may free them.
  for (auto& p : peers_) {
    if (p->dev_base == nullptr) continue;
    cudaIpcCloseMemHandle(p->dev_base);
    p->dev_base = nullptr;
    if (p->seg) {
      p->seg->slot(rank_)->mapper_pid.store(0, std::memory_order_release);
      signal_event(&p->seg->doorbell);
    }
  }
  // 3. Free my block once no live client maps it. Freeing a block a peer still maps is undefined
  // for that peer, so after a bounded wait a still-mapped block is left to process exit.
  bool still_mapped = false;
  const double deadline = now_seconds() + std::min(timeout_s_, 10.0);
  for (int c = 0; c < world_ && !still_mapped; ++c) {
    if (c == rank_) continue;
    std::atomic<int32_t>& mark = seg_->slot(c)->mapper_pid;
    while (true) {
      uint32_t seen = seg_->doorbell.load(std::memory_order_acquire);
      int32_t pid = mark.load(std::memory_order_acquire);
      if (pid == 0 || !pid_alive(pid)) break;
      double now = now_seconds();
      if (now > deadline) {
        still_mapped = true;
        break;
      }
      futex_wait(&seg_->doorbell, seen, std::min(0.05, deadline - now));
    }
  }
  destroy_state(st, !still_mapped);
}

}  // namespace jaxodc::odc
