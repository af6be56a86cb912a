// Integer handles for native objects, so jitted code names the object an FFI call works on by an
// np.int64 attribute (mpi4jax's explicit comm=), never by a pointer or a process-global "current"
// object. A handle is live from add() until remove(); find() of any other handle is null.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>

namespace jaxodc {

template <class T>
class Handles {
 public:
  int64_t add(T* obj) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t handle = next_++;
    live_[handle] = obj;
    return handle;
  }
  void remove(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(handle);
  }
  T* find(int64_t handle) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(handle);
    return it == live_.end() ? nullptr : it->second;
  }

 private:
  mutable std::mutex mu_;
  std::map<int64_t, T*> live_;
  int64_t next_ = 1;
};

}  // namespace jaxodc
