// Userspace link emulation (a test and benchmark aid): a token bucket caps the bytes/s sent to one
// peer, and pieces are held back by a latency. Endpoint::set_link configures one per peer.
#pragma once

#include <algorithm>
#include <cstddef>
#include <mutex>

#include "common/sync.h"

namespace jaxodc::ring {

// Per-link emulation: a token bucket caps the bytes/s sent to one peer over all connections, and
// every piece is held back `latency` seconds after it became ready to send.
struct Link {
  std::mutex mu;
  double rate = 0;  // bytes/s; 0 = unlimited
  double latency = 0;
  double tokens = 0, last = 0;

  double burst() const { return std::max(65536.0, rate * 0.005); }
  // Grants up to `want` bytes now (0 and a wait in seconds when the bucket is too low). Grants
  // come in steps of >= 2 ms of traffic (64 KiB at least), so a capped sender wakes a few hundred
  // times a second instead of once per 16 KiB; the 5 ms burst absorbs a late wake-up, so the cap
  // is still reached.
  size_t take(size_t want, double* wait) {
    std::lock_guard<std::mutex> g(mu);
    if (rate <= 0) return want;
    double t = now_seconds();
    tokens = std::min(burst(), tokens + rate * (t - last));
    last = t;
    double need = std::min<double>(want, std::max(65536.0, rate * 0.002));
    if (tokens < need) {
      *wait = (need - tokens) / rate;
      return 0;
    }
    size_t grant = std::min<size_t>(want, static_cast<size_t>(tokens));
    tokens -= static_cast<double>(grant);
    return grant;
  }
  void refund(size_t n) {
    std::lock_guard<std::mutex> g(mu);
    if (rate > 0) tokens += static_cast<double>(n);
  }
  double lat() {
    std::lock_guard<std::mutex> g(mu);
    return latency;
  }
};

}  // namespace jaxodc::ring
