// The cuda_ipc transport of the ODC runtime: server memory in GPU memory, reached by same-host peers
// through CUDA IPC.
//
// Each rank with a device owns one exported block (cudaMalloc + cudaIpcGetMemHandle): its fp32
// master shards, then one receive slot per client (max shard each: the paper's M/N per client). Its
// fp32 accumulators live in a private allocation. The IPC handle and the block's layout are written
// into the rank's host segment (segment.h), which cuda_ipc peers map anyway for the control words:
// versions, slot states, done markers and futex wake-ups stay on the host, only data moves on the
// GPU. A rank reaches its own block the same way (gather_own / push_own).
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
#include "odc/peer.h"
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

// One owner's piece of a device gather from its block mapped in this process (`base`; its control
// words in `seg`). `alive` (null for myself) is watched while waiting for the publication.
void gather_mapped(const CudaDevice& dev, SegmentHeader* seg, const char* base, int owner, const Peer* alive,
                   int unit, int64_t version, float* out, cudaStream_t stream) {
  const std::string of = "rank " + std::to_string(owner);
  const std::string tag = "odc.gather over cuda_ipc: " + dev.core.who() + " unit " + std::to_string(unit) +
                          " version " + std::to_string(version);
  dev.core.wait_published(seg, unit, version, alive,
                          "waiting for " + of + " to publish unit " + std::to_string(unit) + " version " +
                              std::to_string(version) + " (gather over cuda_ipc)");
  int64_t lo, n;
  dev.core.layout.piece(unit, owner, &lo, &n);
  if (n == 0) return;
  DeviceGuard guard(dev.ordinal_, tag);
  const auto* src = reinterpret_cast<const float*>(base + seg->unit(unit)->dev_master_offset);
  check(cudaMemcpyAsync(out + lo, src, static_cast<size_t>(n) * 4, cudaMemcpyDefault, stream),
        tag + ": copy of the shard of " + of);
}

// My piece of a device push into the slot of mine in an owner's block mapped in this process.
void push_mapped(const CudaDevice& dev, SegmentHeader* seg, char* base, int owner, const Peer* alive, int unit,
                 int64_t version, const float* grad, cudaStream_t stream) {
  const std::string of = "rank " + std::to_string(owner);
  const std::string tag = "odc.scatter_accumulate over cuda_ipc: " + dev.core.who() + " unit " +
                          std::to_string(unit) + " version " + std::to_string(version);
  const int me = dev.core.rank;
  dev.core.wait_slot_free(seg, me, alive,
                          "waiting for its receive slot at " + of + " (pushing unit " + std::to_string(unit) +
                              " version " + std::to_string(version) + " over cuda_ipc)");
  int64_t lo, n;
  dev.core.layout.piece(unit, owner, &lo, &n);
  if (n > 0) {
    DeviceGuard guard(dev.ordinal_, tag);
    check(cudaMemcpyAsync(dev.slot_of(base, me), grad + lo, static_cast<size_t>(n) * 4, cudaMemcpyDefault, stream),
          tag + ": copy into the slot at " + of);
    // The flag is raised only once the data landed: the owner's daemon reads the slot right away.
    check(cudaStreamSynchronize(stream), tag + ": copy into the slot at " + of);
  }
  seg->raise_slot(me, unit, version, n, kSlotDevice);
}

// A same-host peer whose device block is mapped here with CUDA IPC; the control words stay in its
// segment, mapped by ShmPeer.
class CudaIpcPeer final : public ShmPeer {
 public:
  CudaIpcPeer(const Core& core, int rank, Mapping seg, CudaDevice& dev);
  ~CudaIpcPeer() override { close(); }
  bool device_reachable() const override { return true; }
  void gather_device(int unit, int64_t version, float* out, CUstream_st* stream) override {
    gather_mapped(dev_, seg_, base_, rank_, this, unit, version, out, stream);
  }
  void push_device(int unit, int64_t version, const float* grad, CUstream_st* stream) override {
    push_mapped(dev_, seg_, base_, rank_, this, unit, version, grad, stream);
  }
  // Unmaps the peer's block and clears my mark in its segment, so that it may free the block.
  void close() override;

 private:
  CudaDevice& dev_;
  char* base_ = nullptr;
};

CudaIpcPeer::CudaIpcPeer(const Core& core, int rank, Mapping seg, CudaDevice& dev)
    : ShmPeer(core, rank, std::move(seg)), dev_(dev) {
  const std::string who = core.who() + ": cuda_ipc transport to " + name();
  if (seg_->dev_ready.load(std::memory_order_acquire) != 1)
    throw PeerError(who + ": the peer has no device block (it runs without a device; use the shm transport)");
  SegmentHeader* mine = core.seg;
  if (seg_->dev_bytes != dev.block_bytes || seg_->dev_slot_stride != mine->dev_slot_stride ||
      seg_->dev_slots_off != mine->dev_slots_off)
    throw Error(who + ": the peer's device block layout differs from this rank's");
  const std::string where = who + " (its device " + uuid_string(seg_->dev_uuid) + ")";
  DeviceGuard guard(dev.ordinal_, where);
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, seg_->dev_handle, kIpcHandleBytes);
  void* ptr = nullptr;
  cudaError_t e = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw PeerError(where + ": cudaIpcOpenMemHandle: " + cuda_msg(e) +
                    " (GPUs without peer access cannot map each other: use transport='shm')");
  }
  base_ = static_cast<char*>(ptr);
  // The owner frees its block only after this mark is cleared again (close) or I died.
  seg_->slot(core.rank)->mapper_pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
}

void CudaIpcPeer::close() {
  if (base_ != nullptr) {
    cudaIpcCloseMemHandle(base_);
    cudaGetLastError();
    base_ = nullptr;
    if (mapping_.seg) {
      seg_->slot(core_.rank)->mapper_pid.store(0, std::memory_order_release);
      signal_event(&seg_->doorbell);
    }
  }
  ShmPeer::close();
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

std::unique_ptr<Device> make_device(const Core& core, int ordinal) { return std::make_unique<CudaDevice>(core, ordinal); }

std::unique_ptr<Peer> make_cuda_ipc_peer(const Core& core, int rank, Mapping seg) {
  if (!core.dev)
    throw Error(core.who() + ": cuda_ipc transport to rank " + std::to_string(rank) +
                ": this rank has no device (enable_device before connect, or use shm)");
  return std::make_unique<CudaIpcPeer>(core, rank, std::move(seg), static_cast<CudaDevice&>(*core.dev));
}

CudaDevice::CudaDevice(const Core& core, int ordinal) : core(core), ordinal_(ordinal) {
  const std::string who = core.who() + ": enable_device(" + std::to_string(ordinal) + ")";
  int count = 0;
  check(cudaGetDeviceCount(&count), who + ": no usable CUDA device");
  if (ordinal < 0 || ordinal >= count)
    throw Error(who + ": this process sees " + std::to_string(count) + " CUDA device(s)");
  DeviceGuard guard(ordinal, who);

  const Layout& layout = core.layout;
  std::vector<uint64_t> master_off(layout.num_units());
  cudaIpcMemHandle_t handle;
  cudaDeviceProp prop;
  size_t slots_off = 0, slot_stride = 0;
  try {
    size_t off = 0;
    for (int u = 0; u < layout.num_units(); ++u) {
      master_off[u] = off;
      off = dev_align(off + static_cast<size_t>(layout.shards[u]) * 4);
    }
    slots_off = off;
    slot_stride = dev_align(static_cast<size_t>(layout.max_shard) * 4);
    block_bytes = slots_off + slot_stride * static_cast<size_t>(layout.world);
    size_t acc = 0;
    for (int u = 0; u < layout.num_units(); ++u) {
      accum_off.push_back(acc / 4);
      acc = dev_align(acc + static_cast<size_t>(layout.shards[u]) * 4);
    }
    accum_bytes = acc;

    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), who + ": cudaStreamCreate");
    check(cudaStreamCreateWithFlags(&daemon_stream, cudaStreamNonBlocking), who + ": cudaStreamCreate");
    check(cudaMalloc(reinterpret_cast<void**>(&block), block_bytes),
          who + ": cudaMalloc of the " + std::to_string(block_bytes) + "-byte device block");
    check(cudaMalloc(reinterpret_cast<void**>(&accum), accum_bytes),
          who + ": cudaMalloc of the " + std::to_string(accum_bytes) + "-byte device accumulators");
    // Zeroed and finished before any peer can map the block.
    check(cudaMemsetAsync(block, 0, block_bytes, stream), who + ": cudaMemsetAsync");
    check(cudaMemsetAsync(accum, 0, accum_bytes, stream), who + ": cudaMemsetAsync");
    check(cudaStreamSynchronize(stream), who + ": zeroing device memory");
    check(cudaIpcGetMemHandle(&handle, block), who + ": cudaIpcGetMemHandle");
    check(cudaGetDeviceProperties(&prop, ordinal), who + ": cudaGetDeviceProperties");
  } catch (...) {
    destroy();
    throw;
  }

  SegmentHeader* seg = core.seg;
  for (int u = 0; u < layout.num_units(); ++u) seg->unit(u)->dev_master_offset = master_off[u];
  seg->dev_ordinal = ordinal;
  seg->dev_bytes = block_bytes;
  seg->dev_slots_off = slots_off;
  seg->dev_slot_stride = slot_stride;
  std::memcpy(seg->dev_uuid, prop.uuid.bytes, sizeof(seg->dev_uuid));
  std::memcpy(seg->dev_handle, &handle, kIpcHandleBytes);
  seg->dev_ready.store(1, std::memory_order_release);
  uuid_ = uuid_string(prop.uuid.bytes);
}

CudaDevice::~CudaDevice() { destroy(); }

void CudaDevice::destroy() {
  for (cudaEvent_t ev : pending) cudaEventDestroy(ev);
  for (cudaEvent_t ev : spare) cudaEventDestroy(ev);
  pending.clear();
  spare.clear();
  if (stream) cudaStreamDestroy(stream);
  if (daemon_stream) cudaStreamDestroy(daemon_stream);
  if (accum) cudaFree(accum);
  if (free_block && block) cudaFree(block);
  stream = daemon_stream = nullptr;
  accum = nullptr;
  block = nullptr;
  cudaGetLastError();
}

void CudaDevice::gather_own(int unit, int64_t version, float* out, CUstream_st* s) {
  gather_mapped(*this, core.seg, block, core.rank, nullptr, unit, version, out, s);
}

void CudaDevice::push_own(int unit, int64_t version, const float* grad, CUstream_st* s) {
  push_mapped(*this, core.seg, block, core.rank, nullptr, unit, version, grad, s);
}

void CudaDevice::track_gather(CUstream_st* s, const std::string& tag) {
  DeviceGuard guard(ordinal_, tag);
  std::lock_guard<std::mutex> lock(pending_mu);
  // Recycle the events of finished gathers so the list stays short.
  size_t keep = 0;
  for (size_t i = 0; i < pending.size(); ++i) {
    cudaEvent_t ev = pending[i];
    cudaError_t q = cudaEventQuery(ev);
    if (q == cudaSuccess) {
      spare.push_back(ev);
    } else if (q == cudaErrorNotReady) {
      cudaGetLastError();
      pending[keep++] = ev;
    } else {
      pending.resize(keep);  // the failed one and the unchecked rest are dropped (leaked)
      check(q, tag + ": an earlier device gather failed");
    }
  }
  pending.resize(keep);
  cudaEvent_t ev;
  if (!spare.empty()) {
    ev = spare.back();
    spare.pop_back();
  } else {
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), tag + ": cudaEventCreate");
  }
  cudaError_t e = cudaEventRecord(ev, s);
  if (e != cudaSuccess) {
    spare.push_back(ev);
    check(e, tag + ": cudaEventRecord on the call's stream (is the stream on device " + std::to_string(ordinal_) +
                 "?)");
  }
  pending.push_back(ev);
}

void CudaDevice::wait_gathers(const std::string& tag) {
  std::lock_guard<std::mutex> lock(pending_mu);
  cudaError_t first = cudaSuccess;
  for (cudaEvent_t ev : pending) {
    cudaError_t e = cudaEventSynchronize(ev);
    if (e != cudaSuccess && first == cudaSuccess) first = e;
    spare.push_back(ev);
  }
  pending.clear();
  check(first, tag + ": a device gather failed");
}

void CudaDevice::accumulate(int unit, int client, int64_t count, int32_t where) {
  if (count <= 0) return;
  const std::string tag = core.who() + ": accumulating the device push of rank " + std::to_string(client) +
                          " (unit " + std::to_string(unit) + ")";
  DeviceGuard guard(ordinal_, tag);
  // The NVSHMEM block has the device block's layout.
  const auto* src = reinterpret_cast<const float*>(slot_of(where == kSlotNvshmem ? nv_block : block, client));
  float* acc = accum + accum_off[unit];
  const int blocks = static_cast<int>(std::min<int64_t>((count + kThreads - 1) / kThreads, 1024));
  add_into<<<blocks, kThreads, 0, daemon_stream>>>(acc, src, count);
  check(cudaGetLastError(), tag + ": kernel launch");
  // The slot is freed (and may be overwritten by the client) only after the kernel read it.
  check(cudaStreamSynchronize(daemon_stream), tag);
}

void CudaDevice::publish(int unit, const float* master) {
  const std::string tag = "publish: " + core.who() + " unit " + std::to_string(unit) + ": device master";
  const size_t bytes = static_cast<size_t>(core.layout.shards[unit]) * 4;
  const uint64_t offset = core.seg->unit(unit)->dev_master_offset;
  DeviceGuard guard(ordinal_, tag);
  std::lock_guard<std::mutex> lock(stream_mu);
  check(cudaMemcpyAsync(block + offset, master, bytes, cudaMemcpyHostToDevice, stream), tag);
  if (nv_block)  // the copy nvshmem peers read
    check(cudaMemcpyAsync(nv_block + offset, block + offset, bytes, cudaMemcpyDeviceToDevice, stream),
          tag + " (NVSHMEM block)");
  // Finished (not merely staged) before the caller stores the version that announces it.
  check(cudaStreamSynchronize(stream), tag);
}

void CudaDevice::fetch_add(int unit, float* out) {
  const std::string tag = "fetch_grad: " + core.who() + " unit " + std::to_string(unit) + ": device accumulator";
  const size_t n = static_cast<size_t>(core.layout.shards[unit]);
  std::vector<float> tmp(n);
  DeviceGuard guard(ordinal_, tag);
  std::lock_guard<std::mutex> lock(stream_mu);
  float* acc = accum + accum_off[unit];
  check(cudaMemcpyAsync(tmp.data(), acc, n * 4, cudaMemcpyDeviceToHost, stream), tag);
  check(cudaMemsetAsync(acc, 0, n * 4, stream), tag);
  check(cudaStreamSynchronize(stream), tag);
  for (size_t i = 0; i < n; ++i) out[i] += tmp[i];
}

void CudaDevice::leave(bool collective) {
  std::unique_ptr<DeviceGuard> guard;
  try {
    guard = std::make_unique<DeviceGuard>(ordinal_, "close");
  } catch (const std::exception&) {
    // Keep going: unmapping and the marks matter more than the device being current.
  }
  // None of my copies may still read the peers' blocks once they are unmapped.
  for (cudaEvent_t ev : pending) cudaEventSynchronize(ev);
  // NVSHMEM's teardown is collective, so it comes before the bounded wait for cuda_ipc mappers.
  leave_nvshmem(collective);
}

void CudaDevice::release() {
  std::unique_ptr<DeviceGuard> guard;
  try {
    guard = std::make_unique<DeviceGuard>(ordinal_, "close");
  } catch (const std::exception&) {
  }
  // Freeing a block a peer still maps is undefined for that peer, so after a bounded wait a
  // still-mapped block is left to process exit.
  SegmentHeader* seg = core.seg;
  const double deadline = now_seconds() + std::min(core.timeout_s, 10.0);
  for (int c = 0; c < core.layout.world && free_block; ++c) {
    if (c == core.rank) continue;
    std::atomic<int32_t>& mark = seg->slot(c)->mapper_pid;
    while (true) {
      uint32_t seen = seg->doorbell.load(std::memory_order_acquire);
      int32_t pid = mark.load(std::memory_order_acquire);
      if (pid == 0 || !pid_alive(pid)) break;
      double now = now_seconds();
      if (now > deadline) {
        free_block = false;
        break;
      }
      futex_wait(&seg->doorbell, seen, std::min(0.05, deadline - now));
    }
  }
  destroy();
}

}  // namespace jaxodc::odc
