/*
 * driver.h - the CUDA driver API, loaded at run time (internal, not
 * installed).
 *
 * Neither library links CUDA: builds and CPU-only runs never need it. The
 * driver (libcuda.so.1, or the file named by TSOCK_LIBCUDA) is opened with
 * dlopen on first use and the few entry points tsock calls are resolved
 * into a table. The types are the driver ABI's own (cuda.h), declared here
 * so that no CUDA header is needed to build.
 */
#ifndef TSOCK_CUDA_DRIVER_H
#define TSOCK_CUDA_DRIVER_H

#include <stddef.h>

#include "../reader/internal.h"

typedef int tsock_CUresult;            /* CUresult */
typedef int tsock_CUdevice;            /* CUdevice */
typedef struct tsock_CUctx *tsock_CUcontext; /* CUcontext (opaque) */

#define TSOCK_CUDA_SUCCESS 0
#define TSOCK_CU_MEMHOSTREGISTER_PORTABLE 0x01u
#define TSOCK_CU_MEMHOSTREGISTER_READ_ONLY 0x08u

/* The entry points tsock uses. Versioned names (cuMemHostRegister_v2,
 * cuDevicePrimaryCtxRelease_v2) are preferred where the driver has them, as
 * cuda.h maps the plain names to them. */
typedef struct tsock_cuda_driver {
  tsock_CUresult (*cuInit)(unsigned flags);
  tsock_CUresult (*cuDriverGetVersion)(int *version);
  tsock_CUresult (*cuDeviceGetCount)(int *count);
  tsock_CUresult (*cuDeviceGet)(tsock_CUdevice *dev, int ordinal);
  tsock_CUresult (*cuCtxGetCurrent)(tsock_CUcontext *ctx);
  tsock_CUresult (*cuCtxSetCurrent)(tsock_CUcontext ctx);
  tsock_CUresult (*cuCtxGetDevice)(tsock_CUdevice *dev);
  tsock_CUresult (*cuDevicePrimaryCtxRetain)(tsock_CUcontext *ctx, tsock_CUdevice dev);
  tsock_CUresult (*cuDevicePrimaryCtxRelease)(tsock_CUdevice dev);
  tsock_CUresult (*cuMemHostRegister)(void *p, size_t bytes, unsigned flags);
  tsock_CUresult (*cuMemHostUnregister)(void *p);
  tsock_CUresult (*cuGetErrorString)(tsock_CUresult rc, const char **str);
  tsock_CUresult (*cuGetErrorName)(tsock_CUresult rc, const char **str);
} tsock_cuda_driver;

/* Loads and initialises the driver once per process (cuInit(0)); thread-safe.
 * Returns 0 and sets *out, or TSOCK_ENOCUDA with a message saying why
 * (no such file, a missing entry point, cuInit's error). */
TSOCK_INTERNAL int tsock__cuda_driver(const tsock_cuda_driver **out);

/* Records "<what>: CUDA_ERROR_X: text" as the thread's message and returns
 * TSOCK_ESYS. */
TSOCK_INTERNAL int tsock__cuda_fail(const tsock_cuda_driver *d, tsock_CUresult rc,
                                    const char *what);

#endif
