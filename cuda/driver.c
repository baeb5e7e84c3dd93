/*
 * driver.c - loads the CUDA driver at run time (see driver.h).
 *
 * Compiled into libtsock_reader.so (CMake, setup.py) and, through the shim
 * reader/cuda_shim.c, into libtsock.so (cgo builds only the .c files of a
 * package's own folder).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

#define DEFAULT_LIBCUDA "libcuda.so.1"

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static tsock_cuda_driver table;
static int load_status = TSOCK_ENOCUDA;
static char load_error[400];

/* dlsym of the first of the names the driver has. */
static void *resolve(void *lib, const char *name, const char *fallback) {
  void *p = dlsym(lib, name);
  if (p == NULL && fallback != NULL) p = dlsym(lib, fallback);
  return p;
}

static void load(void) {
  const char *path = getenv("TSOCK_LIBCUDA");
  if (path == NULL || path[0] == '\0') path = DEFAULT_LIBCUDA;
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    const char *why = dlerror();
    snprintf(load_error, sizeof load_error,
             "CUDA driver not available: cannot load %s (%s); install the NVIDIA driver, or set "
             "TSOCK_LIBCUDA to the path of libcuda.so.1",
             path, why ? why : "dlopen failed");
    return;
  }
  tsock_cuda_driver d;
  memset(&d, 0, sizeof d);
#define RESOLVE(field, name, fallback)                                                 \
  do {                                                                                 \
    *(void **)&d.field = resolve(lib, name, fallback);                                 \
    if (d.field == NULL) {                                                             \
      snprintf(load_error, sizeof load_error,                                          \
               "CUDA driver not available: %s has no %s (driver too old?)", path, name); \
      return;                                                                          \
    }                                                                                  \
  } while (0)
  RESOLVE(cuInit, "cuInit", NULL);
  RESOLVE(cuDriverGetVersion, "cuDriverGetVersion", NULL);
  RESOLVE(cuDeviceGetCount, "cuDeviceGetCount", NULL);
  RESOLVE(cuDeviceGet, "cuDeviceGet", NULL);
  RESOLVE(cuCtxGetCurrent, "cuCtxGetCurrent", NULL);
  RESOLVE(cuCtxSetCurrent, "cuCtxSetCurrent", NULL);
  RESOLVE(cuCtxGetDevice, "cuCtxGetDevice", NULL);
  RESOLVE(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL);
  RESOLVE(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
  RESOLVE(cuMemHostRegister, "cuMemHostRegister_v2", "cuMemHostRegister");
  RESOLVE(cuMemHostUnregister, "cuMemHostUnregister", NULL);
  RESOLVE(cuGetErrorString, "cuGetErrorString", NULL);
  RESOLVE(cuGetErrorName, "cuGetErrorName", NULL);
#undef RESOLVE
  tsock_CUresult rc = d.cuInit(0);
  if (rc != TSOCK_CUDA_SUCCESS) {
    const char *name = NULL, *text = NULL;
    if (d.cuGetErrorName(rc, &name) != TSOCK_CUDA_SUCCESS) name = NULL;
    if (d.cuGetErrorString(rc, &text) != TSOCK_CUDA_SUCCESS) text = NULL;
    snprintf(load_error, sizeof load_error, "CUDA driver not available: cuInit (%s): %s: %s",
             path, name ? name : "CUDA error", text ? text : "unknown error");
    return;
  }
  table = d;
  load_status = TSOCK_OK;
}

int tsock__cuda_driver(const tsock_cuda_driver **out) {
  pthread_once(&load_once, load);
  if (load_status != TSOCK_OK) return tsock__fail(load_status, "%s", load_error);
  *out = &table;
  return TSOCK_OK;
}

int tsock__cuda_fail(const tsock_cuda_driver *d, tsock_CUresult rc, const char *what) {
  const char *name = NULL, *text = NULL;
  if (d->cuGetErrorName(rc, &name) != TSOCK_CUDA_SUCCESS) name = NULL;
  if (d->cuGetErrorString(rc, &text) != TSOCK_CUDA_SUCCESS) text = NULL;
  if (name == NULL) return tsock__fail(TSOCK_ESYS, "%s: CUDA error %d", what, rc);
  return tsock__fail(TSOCK_ESYS, "%s: %s: %s", what, name, text ? text : "");
}
