// POSIX shared-memory helpers of the native transports (shm.h).
#include "transport/shm.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "common/sync.h"

namespace jaxodc::shm {

bool pid_alive(int pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  if (!std::getline(stat, content)) return false;
  size_t paren = content.rfind(')');
  if (paren == std::string::npos || paren + 2 >= content.size()) return true;
  char state = content[paren + 2];
  return state != 'Z' && state != 'X';
}

Mapping::~Mapping() {
  if (base) munmap(base, bytes);
}

void create(const std::string& name, size_t bytes, const std::string& who, Mapping* out) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw Error(who + ": shm_open(" + name + "): " + strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const std::string msg = strerror(errno);
    ::close(fd);
    shm_unlink(name.c_str());
    throw Error(who + ": cannot size " + name + " to " + std::to_string(bytes) + " bytes: " + msg);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    const std::string msg = strerror(errno);
    shm_unlink(name.c_str());
    throw Error(who + ": mmap of " + name + " failed: " + msg);
  }
  out->base = p;
  out->bytes = bytes;
}

void unlink(const std::string& name) { shm_unlink(name.c_str()); }

void map_existing(const std::string& name, const std::string& what, Mapping* out) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw PeerError(what + " cannot be opened: " + strerror(errno) + " (another host? use tcp)");
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const std::string msg = strerror(errno);
    ::close(fd);
    throw PeerError(what + ": fstat failed: " + msg);
  }
  void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw PeerError(what + ": mmap failed: " + strerror(errno));
  out->base = p;
  out->bytes = static_cast<size_t>(st.st_size);
}

}  // namespace jaxodc::shm
