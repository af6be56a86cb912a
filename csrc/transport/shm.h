// POSIX shared memory between the processes of one host, as the native transports use it: create a
// named segment, map a peer's, and tell whether the process behind a segment is still alive.
// (ODC's segment layout and its reclaim of dead processes' segments stay in csrc/odc/segment.h.)
#pragma once

#include <cstddef>
#include <string>

namespace jaxodc::shm {

// A process on this host is alive unless it is gone or a zombie (dead, not yet reaped).
bool pid_alive(int pid);

// A mapping of a shared-memory segment into this process, unmapped on destruction.
struct Mapping {
  void* base = nullptr;
  size_t bytes = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();
};

// Creates segment `name` (it must not exist) of `bytes` bytes, zeroed, and maps it into `*out`.
// Throws jaxodc::Error naming `who` and the segment; on failure nothing is left behind.
void create(const std::string& name, size_t bytes, const std::string& who, Mapping* out);

// Removes the name of segment `name` (mappings stay valid); quiet when it is already gone.
void unlink(const std::string& name);

// Maps the existing segment `name` (its whole size) into `*out`. Throws jaxodc::PeerError naming
// `what` (the segment as the caller describes it) when it cannot be opened or mapped.
void map_existing(const std::string& name, const std::string& what, Mapping* out);

}  // namespace jaxodc::shm
