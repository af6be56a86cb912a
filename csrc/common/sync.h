// Cross-process waiting on 32-bit words in shared memory (Linux futex), deadlines, and the error
// type every native subsystem throws (bindings turn it into a Python exception).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <stdexcept>
#include <string>

namespace jaxodc {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A wait that ran past its deadline; the message says what it waited for.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A peer failed (died, closed its connection, shut down) while we depended on it.
class PeerError : public Error {
 public:
  using Error::Error;
};

// A duration for a message: "1 s", "2.5 s" (std::to_string would print "1.000000").
inline std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g s", s);
  return buf;
}

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Sleeps until *word != expected, a wake, or `seconds` pass. Shared (not PRIVATE) futexes so
// waiters in other processes that map the same page are woken too.
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, double seconds) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(seconds);
  ts.tv_nsec = static_cast<long>((seconds - static_cast<double>(ts.tv_sec)) * 1e9);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Bumps an event counter and wakes everyone sleeping on it.
inline void signal_event(std::atomic<uint32_t>* word) {
  word->fetch_add(1, std::memory_order_acq_rel);
  futex_wake_all(word);
}

}  // namespace jaxodc
