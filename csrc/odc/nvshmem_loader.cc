// Loads the NVSHMEM plugin (csrc/odc/nvshmem/plugin.cu) with dlopen, so that jaxodc._C imports and
// runs without the nvidia-nvshmem-cu13 wheel, a GPU or a driver; only the nvshmem transport needs it.
#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <string>

#include "odc/device.h"
#include "odc/runtime.h"

namespace jaxodc::odc {

namespace {

std::mutex g_mu;
std::atomic<const JaxodcNvshmemApi*> g_api{nullptr};
std::string g_error = "the nvshmem plugin was not loaded";
std::string g_version;

}  // namespace

std::string nvshmem_load(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_api.load()) return "";
  // RTLD_LOCAL: NVSHMEM's symbols stay private to the plugin. Never closed once loaded: NVSHMEM
  // starts threads of its own.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* e = dlerror();
    g_error = "dlopen(" + path + "): " + (e ? e : "unknown error");
    return g_error;
  }
  auto fn = reinterpret_cast<JaxodcNvshmemApiFn>(dlsym(handle, JAXODC_NVSHMEM_API_SYMBOL));
  const JaxodcNvshmemApi* api = fn ? fn(JAXODC_NVSHMEM_ABI) : nullptr;
  if (!api) {
    g_error = path + (fn ? " was built for another plugin ABI than this jaxodc._C (rebuild jaxodc)"
                         : " does not export " JAXODC_NVSHMEM_API_SYMBOL);
    dlclose(handle);
    return g_error;
  }
  char buf[64] = {0};
  api->version(buf, sizeof(buf));
  g_version = buf;
  g_error.clear();
  g_api.store(api, std::memory_order_release);
  return "";
}

const JaxodcNvshmemApi* nvshmem_api() { return g_api.load(std::memory_order_acquire); }

std::string nvshmem_load_error() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_error;
}

std::string nvshmem_version() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_version;
}

}  // namespace jaxodc::odc
