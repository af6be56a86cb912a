// C ABI between the ODC runtime (jaxodc._C) and its NVSHMEM plugin (jaxodc/_nvshmem_plugin.so).
//
// NVSHMEM comes from the optional pip wheel nvidia-nvshmem-cu13, so the main module never links it:
// the runtime dlopen()s the plugin only when an nvshmem peer may be chosen, and reaches NVSHMEM's
// host-side API (no relocatable device code) through this table. Plain C types only: the plugin
// and the module may come from different compilers. Functions returning int give 0 on success,
// else write a NUL-terminated message into `err` (err_len bytes).
#pragma once

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define JAXODC_NVSHMEM_ABI 1
#define JAXODC_NVSHMEM_UID_BYTES 128  // sizeof(nvshmemx_uniqueid_t); checked in the plugin

typedef struct JaxodcNvshmemApi {
  int abi;  // JAXODC_NVSHMEM_ABI
  // "NVSHMEM <major>.<minor>.<patch>" of the library the plugin loaded.
  void (*version)(char* out, int out_len);
  // Both size the symmetric heap for `heap_bytes` of allocations before NVSHMEM reads its options
  // (unless NVSHMEM_SYMMETRIC_SIZE is set).
  // Rank 0 of the NVSHMEM job: a fresh bootstrap id (JAXODC_NVSHMEM_UID_BYTES) for every PE.
  int (*get_uniqueid)(size_t heap_bytes, void* uid, char* err, int err_len);
  // Every PE: binds CUDA device `device` and joins the job of `uid` as PE `pe` of `npes`.
  int (*init)(const void* uid, int pe, int npes, int device, size_t heap_bytes, char* err, int err_len);
  // Collective symmetric allocation / release (same size on every PE).
  int (*malloc)(size_t bytes, void** ptr, char* err, int err_len);
  void (*free)(void* ptr);
  void (*finalize)(void);
  // Stream-ordered one-sided copies; `stream` is a cudaStream_t. Errors surface on the stream.
  void (*getmem_on_stream)(void* dst, const void* src, size_t bytes, int pe, void* stream);
  void (*putmem_on_stream)(void* dst, const void* src, size_t bytes, int pe, void* stream);
  // Completes every put this PE issued on `stream` at its targets, in stream order.
  void (*quiet_on_stream)(void* stream);
} JaxodcNvshmemApi;

// The plugin's only export; returns null when `abi` differs from the plugin's.
typedef const JaxodcNvshmemApi* (*JaxodcNvshmemApiFn)(int abi);
#define JAXODC_NVSHMEM_API_SYMBOL "jaxodc_nvshmem_api"

#ifdef __cplusplus
}
#endif
