/*
 * load.h - opens the CUDA driver and fills a tsock_cuda_driver table
 * (internal, not installed). The driver is libcuda.so.1, or the file named
 * by the environment variable TSOCK_LIBCUDA.
 *
 * A header, everything in it static, included by exactly one C file of
 * each side: reader/cuda_driver.c and producer/pool.c. Not a C file
 * compiled once and linked by both, because cgo compiles only the C files
 * of a package's own folder and checks each package's C objects with a
 * link of that package alone, which cannot resolve a C symbol defined in
 * another Go package. So each side compiles a private copy, and
 * libtsock.so, which holds both sides, has two with no clash.
 */
#ifndef TSOCK_CUDA_LOAD_H
#define TSOCK_CUDA_LOAD_H

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"

#define TSOCK_DEFAULT_LIBCUDA "libcuda.so.1"

static pthread_once_t cuda_load_once = PTHREAD_ONCE_INIT;
static tsock_cuda_driver cuda_table;
static int cuda_loaded;
static char cuda_load_error[400];

/* dlsym of the first of the names the driver has. */
static void *cuda_resolve(void *lib, const char *name, const char *fallback) {
  void *p = dlsym(lib, name);
  if (p == NULL && fallback != NULL) p = dlsym(lib, fallback);
  return p;
}

/* "<what>: CUDA_ERROR_X: text" into buf. */
static void cuda_describe(const tsock_cuda_driver *d, tsock_CUresult rc, const char *what,
                          char *buf, size_t n) {
  const char *name = NULL, *text = NULL;
  if (d->cuGetErrorName(rc, &name) != TSOCK_CUDA_SUCCESS) name = NULL;
  if (d->cuGetErrorString(rc, &text) != TSOCK_CUDA_SUCCESS) text = NULL;
  if (name == NULL)
    snprintf(buf, n, "%s: CUDA error %d", what, rc);
  else
    snprintf(buf, n, "%s: %s: %s", what, name, text ? text : "");
}

static void cuda_load(void) {
  const char *path = getenv("TSOCK_LIBCUDA");
  if (path == NULL || path[0] == '\0') path = TSOCK_DEFAULT_LIBCUDA;
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    const char *why = dlerror();
    snprintf(cuda_load_error, sizeof cuda_load_error,
             "CUDA driver not available: cannot load %s (%s); install the NVIDIA driver, or set "
             "TSOCK_LIBCUDA to the path of libcuda.so.1",
             path, why ? why : "dlopen failed");
    return;
  }
  tsock_cuda_driver d;
  memset(&d, 0, sizeof d);
#define RESOLVE(field, name, fallback)                                                  \
  do {                                                                                  \
    *(void **)&d.field = cuda_resolve(lib, name, fallback);                             \
    if (d.field == NULL) {                                                              \
      snprintf(cuda_load_error, sizeof cuda_load_error,                                 \
               "CUDA driver not available: %s has no %s (driver too old?)", path, name); \
      return;                                                                           \
    }                                                                                   \
  } while (0)
  RESOLVE(cuInit, "cuInit", NULL);
  RESOLVE(cuDriverGetVersion, "cuDriverGetVersion", NULL);
  RESOLVE(cuDeviceGetCount, "cuDeviceGetCount", NULL);
  RESOLVE(cuDeviceGet, "cuDeviceGet", NULL);
  RESOLVE(cuDeviceGetUuid, "cuDeviceGetUuid_v2", "cuDeviceGetUuid");
  RESOLVE(cuCtxGetCurrent, "cuCtxGetCurrent", NULL);
  RESOLVE(cuCtxSetCurrent, "cuCtxSetCurrent", NULL);
  RESOLVE(cuCtxGetDevice, "cuCtxGetDevice", NULL);
  RESOLVE(cuCtxSynchronize, "cuCtxSynchronize", NULL);
  RESOLVE(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL);
  RESOLVE(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
  RESOLVE(cuMemHostRegister, "cuMemHostRegister_v2", "cuMemHostRegister");
  RESOLVE(cuMemHostUnregister, "cuMemHostUnregister", NULL);
  RESOLVE(cuMemAlloc, "cuMemAlloc_v2", "cuMemAlloc");
  RESOLVE(cuMemFree, "cuMemFree_v2", "cuMemFree");
  RESOLVE(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync");
  RESOLVE(cuIpcGetMemHandle, "cuIpcGetMemHandle", NULL);
  RESOLVE(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle");
  RESOLVE(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", NULL);
  RESOLVE(cuStreamCreate, "cuStreamCreate", NULL);
  RESOLVE(cuStreamDestroy, "cuStreamDestroy_v2", "cuStreamDestroy");
  RESOLVE(cuStreamSynchronize, "cuStreamSynchronize", NULL);
  RESOLVE(cuStreamWaitEvent, "cuStreamWaitEvent", NULL);
  RESOLVE(cuEventCreate, "cuEventCreate", NULL);
  RESOLVE(cuEventDestroy, "cuEventDestroy_v2", "cuEventDestroy");
  RESOLVE(cuEventRecord, "cuEventRecord", NULL);
  RESOLVE(cuEventQuery, "cuEventQuery", NULL);
  RESOLVE(cuEventSynchronize, "cuEventSynchronize", NULL);
  RESOLVE(cuIpcGetEventHandle, "cuIpcGetEventHandle", NULL);
  RESOLVE(cuIpcOpenEventHandle, "cuIpcOpenEventHandle", NULL);
  RESOLVE(cuGetErrorString, "cuGetErrorString", NULL);
  RESOLVE(cuGetErrorName, "cuGetErrorName", NULL);
#undef RESOLVE
  tsock_CUresult rc = d.cuInit(0);
  if (rc != TSOCK_CUDA_SUCCESS) {
    char why[300];
    cuda_describe(&d, rc, "cuInit", why, sizeof why);
    snprintf(cuda_load_error, sizeof cuda_load_error, "CUDA driver not available: %s (%s)", why,
             path);
    return;
  }
  cuda_table = d;
  cuda_loaded = 1;
}

/* The table, loading and initialising the driver on the first call
 * (thread-safe). NULL when the driver is not usable; *why then says why. */
static const tsock_cuda_driver *cuda_driver(const char **why) {
  pthread_once(&cuda_load_once, cuda_load);
  if (!cuda_loaded) {
    *why = cuda_load_error;
    return NULL;
  }
  return &cuda_table;
}

/* Makes ctx current on this thread if it is not, the previous one in *prev
 * (a framework's context must be left as it was). */
static tsock_CUresult cuda_push_ctx(const tsock_cuda_driver *d, tsock_CUcontext ctx,
                                    tsock_CUcontext *prev) {
  tsock_CUresult rc = d->cuCtxGetCurrent(prev);
  if (rc != TSOCK_CUDA_SUCCESS) return rc;
  return *prev == ctx ? TSOCK_CUDA_SUCCESS : d->cuCtxSetCurrent(ctx);
}

static void cuda_pop_ctx(const tsock_cuda_driver *d, tsock_CUcontext ctx, tsock_CUcontext prev) {
  if (prev != ctx) d->cuCtxSetCurrent(prev);
}

#endif
