// The owner side of the runtime: the daemon that drains full receive slots into the gradient
// accumulators (accumulator.h), the end of a minibatch (wait_complete), reading the summed gradient, and
// publishing new master shards.
#include <chrono>
#include <thread>
#include <cstring>

#include "odc/compress.h"
#include "odc/core.h"
#include "odc/peer.h"
#include "odc/runtime.h"

namespace jaxodc::odc {

bool Runtime::accept_push(int unit, int64_t version, int client) {
  const int64_t expected = accumulating_version_.load(std::memory_order_acquire);
  if (version == expected) return true;
  core_->record_push_error("rank " + std::to_string(client) + " pushed unit " + std::to_string(unit) +
                           " for version " + std::to_string(version) + " while " + core_->who() +
                           " accumulates version " + std::to_string(expected));
  return false;
}

void Runtime::accumulate(int unit, int64_t version, int client, const float* data, int64_t count, int64_t offset) {
  if (!accept_push(unit, version, client)) return;
  // A push of the next minibatch may reach this owner before its trainer has cleared the sum it
  // still reads (grad_view ... clear_grad): it waits for the clear instead of landing in that sum.
  const double deadline = now_seconds() + core_->timeout_s;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(*accum_mu_[unit]);
      if (!accum_[unit]->lent()) {
        add_locked(unit, client, data, count, offset);
        return;
      }
    }
    if (core_->stop.load(std::memory_order_acquire)) return;
    if (now_seconds() > deadline) {
      record_lent_timeout(unit, client);
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void Runtime::record_lent_timeout(int unit, int client) {
  core_->record_push_error("rank " + std::to_string(client) + " pushed unit " + std::to_string(unit) + " to " +
                           core_->who() + ", whose summed gradient stayed lent out (no clear_grad) for " +
                           seconds_text(core_->timeout_s));
}

bool Runtime::unit_lent(int unit) {
  std::lock_guard<std::mutex> lock(*accum_mu_[unit]);
  return accum_[unit]->lent();
}

void Runtime::add_locked(int unit, int client, const float* data, int64_t count, int64_t offset) {
  Accumulator& acc = *accum_[unit];
  if (acc.lent())
    core_->record_push_error("rank " + std::to_string(client) + " pushed unit " + std::to_string(unit) + " to " +
                             core_->who() + " while its summed gradient is lent out (before clear_grad)");
  else
    acc.add(data, offset, count);
}

bool Runtime::drain_slots() {
  Core& core = *core_;
  SegmentHeader* seg = core.seg;
  bool drained = false;
  // Every slot, mine included: with a device, my own pushes arrive in my device slot.
  for (int c = 0; c < world(); ++c) {
    SlotHeader* slot = seg->slot(c);
    if (slot->state.load(std::memory_order_acquire) != kSlotFull) continue;
    const int unit = slot->unit;
    const int64_t count = slot->count, offset = slot->offset;
    const bool host = slot->where == kSlotHost, sketch = slot->where == kSlotSketch;
    // Bounded against the layout without arithmetic that can wrap, before anything is computed from it.
    const bool inside = unit >= 0 && unit < num_units() && count >= 0 && offset >= 0 &&
                        count <= core.layout.shards[unit] && offset <= core.layout.shards[unit] - count;
    const bool fits = inside && (host ? count <= core.layout.slot_elems
                     : sketch ? slot->sketch_width > 0 && slot->sketch_width <= core.layout.slot_elems && count > 0 &&
                                    sketch_payload_bytes(count, slot->sketch_width) <= core.layout.slot_elems * 4
                              : offset == 0);
    // A push into a sum the trainer still reads waits in its slot until clear_grad (accumulate()).
    if (fits && unit_lent(unit)) continue;
    if (!fits) {
      core.record_push_error("rank " + std::to_string(c) + " pushed a malformed message (unit " +
                             std::to_string(unit) + ", " + std::to_string(count) + " elements at " +
                             std::to_string(offset) + ") to " + core.who());
    } else {
      if (slot->where == kSlotDevice || slot->where == kSlotNvshmem) {
        if (!core.dev) {
          core.record_push_error("rank " + std::to_string(c) + " pushed unit " + std::to_string(unit) +
                                 " into device memory of " + core.who() + ", which has no device");
        } else if (accept_push(unit, slot->version, c)) {
          try {
            std::lock_guard<std::mutex> lock(*accum_mu_[unit]);
            core.dev->accumulate(unit, c, count, slot->where);
          } catch (const std::exception& e) {
            core.record_push_error(e.what());
          }
        }
      } else if (sketch) {
        if (accept_push(unit, slot->version, c)) {
          int64_t peeled, estimated;
          // Decoded on its own, then added like a dense push: the decode depends on the payload
          // alone, so the exact sum stays independent of the arrival order.
          decoded_.resize(static_cast<size_t>(count));
          decode(reinterpret_cast<const char*>(seg->slot_data(c)), count, slot->sketch_width, slot->sketch_seed,
                 decoded_.data(), &peeled, &estimated);
          {
            std::lock_guard<std::mutex> lock(*accum_mu_[unit]);
            add_locked(unit, c, decoded_.data(), count, offset);
          }
          compressor_->count_decoded(unit, peeled, estimated);
        }
      } else {
        accumulate(unit, slot->version, c, seg->slot_data(c), count, offset);
      }
      pushes_received_.fetch_add(1, std::memory_order_relaxed);
      bytes_received_.fetch_add(sketch ? sketch_payload_bytes(count, slot->sketch_width) : count * 4,
                                std::memory_order_relaxed);
    }
    slot->state.store(kSlotFree, std::memory_order_release);
    drained = true;
  }
  if (drained) {
    signal_event(&seg->slot_seq);
    signal_event(&seg->doorbell);
  }
  return drained;
}

void Runtime::daemon_loop() {
  SegmentHeader* seg = core_->seg;
  while (!core_->stop.load(std::memory_order_acquire)) {
    const uint32_t seen = seg->doorbell.load(std::memory_order_acquire);
    settle_released();  // zeroing the sums the trainer returned, off its path
    if (drain_slots()) continue;
    futex_wait(&seg->doorbell, seen, 0.1);
  }
}

void Runtime::wait_complete(int64_t version) {
  check_open("wait_complete");
  Core& core = *core_;
  SegmentHeader* seg = core.seg;
  if (version != accumulating_version_.load())
    throw Error("wait_complete: " + core.who() + " accumulates version " +
                std::to_string(accumulating_version_.load()) + ", not " + std::to_string(version));
  const double deadline = now_seconds() + core.timeout_s;
  while (true) {
    const uint32_t seen = seg->doorbell.load(std::memory_order_acquire);
    {
      std::lock_guard<std::mutex> lock(core.error_mu);
      if (!core.push_error.empty()) throw PeerError(core.push_error);
    }
    int missing = -1;
    for (int c = 0; c < world() && missing < 0; ++c) {
      if (seg->done(c)->load(std::memory_order_acquire) < version) missing = c;
      else if (seg->slot(c)->state.load(std::memory_order_acquire) != kSlotFree) missing = c;
    }
    if (missing < 0) break;
    const std::string what = "waiting for done(" + std::to_string(version) + ") and drained pushes from rank " +
                             std::to_string(missing) + " (wait_complete)";
    {
      std::lock_guard<std::mutex> lock(core.error_mu);
      if (!core.client_failure[missing].empty()) throw PeerError(what + ": " + core.client_failure[missing]);
    }
    if (core.stop.load()) throw Error(core.closed(what));
    peers_[missing]->check_alive(what);
    const double now = now_seconds();
    if (now > deadline)
      throw TimeoutError(core.who() + " timed out after " + seconds_text(core.timeout_s) + " " + what);
    futex_wait(&seg->doorbell, seen, std::min(0.05, deadline - now));
  }
  completed_version_.store(version);
  accumulating_version_.store(version + 1);
}

void Runtime::fetch_grad(int unit, float* out, int64_t out_numel) {
  const int64_t shard = core_->layout.shards[unit];
  check_buffer("fetch_grad", unit, shard, "output", out_numel);
  std::memcpy(out, grad_in_place(unit), static_cast<size_t>(shard) * 4);
  clear_grad(unit);
}

float* Runtime::grad_in_place(int unit) {
  check_open("fetch_grad");
  check_unit(unit, "fetch_grad");
  const int64_t completed = completed_version_.load();
  if (completed < 0 || last_fetched_[unit] >= completed)
    throw Error("fetch_grad: " + core_->who() + " unit " + std::to_string(unit) +
                ": no completed minibatch to fetch (call wait_complete(version) first; last completed " +
                std::to_string(completed) + ")");
  std::lock_guard<std::mutex> lock(*accum_mu_[unit]);
  float* grad = accum_[unit]->finish();
  if (core_->dev) core_->dev->fetch_add(unit, grad);  // in fp32 (accumulator.h: not covered)
  last_fetched_[unit] = completed;
  grad_lent_[unit] = 1;
  return grad;
}

void Runtime::clear_grad(int unit) {
  check_unit(unit, "clear_grad");
  release_grads({unit});
}

void Runtime::release_grads(const std::vector<int>& units) {
  for (int u : units) {
    std::lock_guard<std::mutex> lock(*accum_mu_[u]);
    accum_[u]->release();  // zeroed by the daemon (settle_released), or by the next push or read
    grad_lent_[u] = 0;
  }
  zero_pending_.store(true, std::memory_order_release);
  signal_event(&core_->seg->doorbell);  // the daemon; pushes left waiting in their slots (drain_slots)
}

void Runtime::settle_released() {
  if (!zero_pending_.exchange(false, std::memory_order_acq_rel)) return;
  for (int u = 0; u < num_units(); ++u) {
    std::lock_guard<std::mutex> lock(*accum_mu_[u]);
    accum_[u]->settle();
  }
}

void Runtime::lend_grads(const std::vector<int>& units) {
  for (int u : units) grad_in_place(u);
}

void Runtime::clear_and_publish_in_place(const std::vector<int>& units, int64_t version) {
  check_open("publish");
  for (int u : units) check_unit(u, "publish");
  // All returned before any is announced (peers push into them right after), and one wake-up of
  // the daemon and of the readers for all units rather than one per unit.
  release_grads(units);
  for (int u : units) {
    check_publish(u, version);
    announce(u, version, /*wake=*/false);
  }
  signal_event(&core_->seg->pub_seq);
}

float* Runtime::master_data(int unit) {
  check_open("master_data");
  check_unit(unit, "master_data");
  return core_->seg->master(unit);
}

void Runtime::publish(int unit, const float* shard, int64_t shard_numel, int64_t version) {
  check_buffer("publish", unit, core_->layout.shards[unit], "shard", shard_numel);
  check_publish(unit, version);
  std::memcpy(core_->seg->master(unit), shard, static_cast<size_t>(shard_numel) * 4);
  announce(unit, version);
}

void Runtime::publish_in_place(int unit, int64_t version) {
  check_open("publish");
  check_unit(unit, "publish");
  check_publish(unit, version);
  announce(unit, version);
}

void Runtime::check_publish(int unit, int64_t version) const {
  const std::string at = "publish: " + core_->who() + " unit " + std::to_string(unit);
  const int64_t cur = core_->seg->unit(unit)->version.load();
  if (version <= cur)
    throw Error(at + " is at version " + std::to_string(cur) + "; version " + std::to_string(version) +
                " does not move it forward");
  if (version > completed_version_.load() + 1)
    throw Error(at + " version " + std::to_string(version) + " before minibatch " + std::to_string(version - 1) +
                " completed (wait_complete first)");
  // Peers may push version `version` as soon as it is announced; they must land in a cleared
  // accumulator, not in the gradient the optimizer still reads.
  if (grad_lent_[unit]) throw Error(at + ": its gradient is still lent out (call clear_grad first)");
}

void Runtime::announce(int unit, int64_t version, bool wake) {
  SegmentHeader* seg = core_->seg;
  if (core_->dev) core_->dev->publish(unit, seg->master(unit));  // complete before the version announces it
  seg->unit(unit)->version.store(version, std::memory_order_release);
  if (wake) signal_event(&seg->pub_seq);
}

int64_t Runtime::published_version(int unit) const {
  check_unit(unit, "published_version");
  return core_->seg->unit(unit)->version.load();
}

void Runtime::read_shard(int unit, float* out, int64_t out_numel) const {
  check_unit(unit, "read_shard");
  if (out_numel != core_->layout.shards[unit]) throw Error("read_shard: wrong output size");
  std::memcpy(out, core_->seg->master(unit), static_cast<size_t>(out_numel) * 4);
}

}  // namespace jaxodc::odc
