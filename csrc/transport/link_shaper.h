// Userspace link emulation (a test and benchmark aid): a token bucket caps the bytes/s sent to one
// peer, and pieces are held back by a latency. The ring (Endpoint::set_link, one per peer) and
// ODC's tcp transport (Runtime::set_link, one per connection and direction) share it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <string>
#include <thread>

#include "common/sync.h"

namespace jaxodc::tcp {

// Per-link emulation: a token bucket caps the bytes/s sent to one peer over all connections, and
// every piece is held back `latency` seconds after it became ready to send.
struct Link {
  std::mutex mu;
  double rate = 0;  // bytes/s; 0 = unlimited
  double latency = 0;
  double tokens = 0, last = 0;

  double burst() const { return std::max(65536.0, rate * 0.005); }
  // bw: bytes/s (<= 0: uncapped); latency_s: added to every piece (<= 0: none).
  void set(double bw, double latency_s) {
    std::lock_guard<std::mutex> g(mu);
    rate = bw > 0 ? bw : 0;
    latency = latency_s > 0 ? latency_s : 0;
    tokens = rate > 0 ? burst() : 0;
    last = now_seconds();
  }
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

// Sends n bytes through `link` (blocking: grants as the bucket allows), within timeout_s overall.
void send_shaped(int fd, const void* buf, size_t n, Link& link, double timeout_s, const std::string& what);

// Holds a received message until it would have arrived over the emulated link: `latency` after its
// last byte left, which at `rate` bytes/s (0: uncapped) is no earlier than `sent_at + bytes / rate`
// (sent_at: now_seconds() when its sender started it; one clock for all processes of a host).
inline void arrive_after(double sent_at, double bytes, double rate, double latency) {
  if (latency <= 0) return;
  // sent_at comes from the peer: one in the future (or NaN) holds nothing back beyond the link's own delay.
  const double now = now_seconds();
  const double wait = std::min(sent_at, now) + (rate > 0 ? bytes / rate : 0.0) + latency - now;
  if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
}

}  // namespace jaxodc::tcp
