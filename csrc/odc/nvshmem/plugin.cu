// The NVSHMEM plugin of the ODC runtime (jaxodc/_nvshmem_plugin.so): NVSHMEM's host library behind
// the C table of plugin_api.h. Built only when nvcc and the nvidia-nvshmem-cu13 wheel are found;
// linked against libnvshmem_host (host-side API, initialised with nvshmemx_hostlib_init_attr, so no
// relocatable device code and no libnvshmem_device) and the static CUDA runtime.
#include <cuda_runtime.h>
#include <nvshmem_host.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "odc/nvshmem/plugin_api.h"

static_assert(sizeof(nvshmemx_uniqueid_t) == JAXODC_NVSHMEM_UID_BYTES, "NVSHMEM unique id size changed");

namespace {

int fail(char* err, int err_len, const std::string& msg) {
  if (err && err_len > 0) std::snprintf(err, static_cast<size_t>(err_len), "%s", msg.c_str());
  return 1;
}

std::string cuda_msg(cudaError_t e) {
  cudaGetLastError();
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

void p_version(char* out, int out_len) {
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  std::snprintf(out, static_cast<size_t>(out_len), "NVSHMEM %d.%d.%d", major, minor, patch);
}

// The default symmetric heap (1 GiB) may be too small for the unit layout: size it unless the user did.
void size_heap(size_t heap_bytes) {
  if (std::getenv("NVSHMEM_SYMMETRIC_SIZE") != nullptr) return;
  const size_t mib = size_t{1} << 20;
  const size_t want = (heap_bytes + heap_bytes / 8 + 64 * mib + 2 * mib - 1) / (2 * mib) * (2 * mib);
  setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(want).c_str(), 0);
}

int p_get_uniqueid(size_t heap_bytes, void* uid, char* err, int err_len) {
  size_heap(heap_bytes);
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  int s = nvshmemx_get_uniqueid(&id);
  if (s != 0) return fail(err, err_len, "nvshmemx_get_uniqueid failed with status " + std::to_string(s));
  std::memcpy(uid, &id, sizeof(id));
  return 0;
}

int p_init(const void* uid, int pe, int npes, int device, size_t heap_bytes, char* err, int err_len) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return fail(err, err_len, "no usable CUDA device: " + cuda_msg(e));
  if (device < 0 || device >= count)
    return fail(err, err_len, "CUDA device " + std::to_string(device) + " does not exist (this process sees " +
                                  std::to_string(count) + ")");
  // NVSHMEM binds the device that is current at init; cudaFree(0) creates its primary context.
  if ((e = cudaSetDevice(device)) != cudaSuccess || (e = cudaFree(nullptr)) != cudaSuccess)
    return fail(err, err_len, "cannot use CUDA device " + std::to_string(device) + ": " + cuda_msg(e));
  size_heap(heap_bytes);
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid, sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int s = nvshmemx_set_attr_uniqueid_args(pe, npes, &id, &attr);
  if (s != 0) return fail(err, err_len, "nvshmemx_set_attr_uniqueid_args failed with status " + std::to_string(s));
  // Not nvshmemx_init_attr: that inline wrapper exit()s the process on failure.
  s = nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  if (s != 0) return fail(err, err_len, "nvshmemx_hostlib_init_attr failed with status " + std::to_string(s));
  if (nvshmem_my_pe() != pe || nvshmem_n_pes() != npes) {
    std::string got = "PE " + std::to_string(nvshmem_my_pe()) + " of " + std::to_string(nvshmem_n_pes());
    nvshmemx_hostlib_finalize();
    return fail(err, err_len, "NVSHMEM made this process " + got + ", expected PE " + std::to_string(pe) + " of " +
                                  std::to_string(npes));
  }
  return 0;
}

int p_malloc(size_t bytes, void** ptr, char* err, int err_len) {
  *ptr = nvshmem_malloc(bytes);
  if (*ptr == nullptr)
    return fail(err, err_len, "nvshmem_malloc of " + std::to_string(bytes) +
                                  " bytes failed (symmetric heap too small? set NVSHMEM_SYMMETRIC_SIZE)");
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED) {
    nvshmem_free(*ptr);
    *ptr = nullptr;
    return fail(err, err_len, "NVSHMEM did not finish initialising (status " +
                                  std::to_string(nvshmemx_init_status()) + ")");
  }
  return 0;
}

void p_free(void* ptr) { nvshmem_free(ptr); }
void p_finalize() { nvshmemx_hostlib_finalize(); }

void p_get(void* dst, const void* src, size_t bytes, int pe, void* stream) {
  nvshmemx_getmem_on_stream(dst, src, bytes, pe, static_cast<cudaStream_t>(stream));
}

void p_put(void* dst, const void* src, size_t bytes, int pe, void* stream) {
  nvshmemx_putmem_on_stream(dst, src, bytes, pe, static_cast<cudaStream_t>(stream));
}

void p_quiet(void* stream) { nvshmemx_quiet_on_stream(static_cast<cudaStream_t>(stream)); }

const JaxodcNvshmemApi kApi = {JAXODC_NVSHMEM_ABI, p_version, p_get_uniqueid, p_init, p_malloc, p_free,
                               p_finalize,         p_get,     p_put,          p_quiet};

}  // namespace

extern "C" __attribute__((visibility("default"))) const JaxodcNvshmemApi* jaxodc_nvshmem_api(int abi) {
  return abi == JAXODC_NVSHMEM_ABI ? &kApi : nullptr;
}
