// Internal to csrc/odc: what a rank's runtime shares with its transports (peer.h), its TCP server
// (wire.h) and its accumulation daemon: the unit layout, this rank's segment, its device block,
// the timeout, the stop flag, and the owner-side failure records.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/sync.h"
#include "odc/device.h"
#include "odc/segment.h"
#include "transport/auth.h"

namespace jaxodc::odc {

class Peer;

// Throws Error naming `what` unless an owner posted `want` values (it posted `got`).
void check_scalar_count(int64_t got, int64_t want, const std::string& what);

struct Core {
  Core(int rank, Layout layout, double timeout_s) : rank(rank), layout(std::move(layout)), timeout_s(timeout_s) {}

  std::string who() const { return "rank " + std::to_string(rank); }
  std::string closed(const std::string& what) const { return what + ": the ODC runtime of " + who() + " was closed"; }

  // Wait on segment `seg` (mine or a mapped peer's) for: `unit` published at >= version; the
  // receive slot of `client` free; the scalar of call `seq` posted (exactly that call). Every
  // round checks that `peer` (null: none to watch) is alive and that the runtime is open; they
  // throw TimeoutError naming `what` after timeout_s.
  void wait_published(SegmentHeader* seg, int unit, int64_t version, const Peer* peer, const std::string& what) const;
  void wait_slot_free(SegmentHeader* seg, int client, const Peer* peer, const std::string& what) const;
  void wait_scalar(SegmentHeader* seg, int64_t seq, const Peer* peer, const std::string& what) const;

  // Owner-side failures, reported by wait_complete: the first malformed or out-of-step push, and
  // per client why its TCP link died.
  void record_push_error(const std::string& msg);
  void record_client_failure(int client, const std::string& msg);

  const int rank;
  const Layout layout;
  const double timeout_s;
  // Emulated link of the tcp transport (bytes/s, 0 = uncapped; seconds added per message), set
  // before connect; every connection and direction gets a token bucket of its own.
  double link_rate = 0, link_latency = 0;
  // The job secret and id every tcp connection proves (jaxodc-auth-v2, listener "odc_tcp").
  auth::Identity identity;
  SegmentHeader* seg = nullptr;  // mine, mapped until the runtime is destroyed
  std::unique_ptr<Device> dev;   // my device block; null without a device
  std::atomic<bool> stop{false};

  std::mutex error_mu;
  std::string push_error;
  std::vector<std::string> client_failure;
};

}  // namespace jaxodc::odc
