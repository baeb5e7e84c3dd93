/*
 * api.h - the slice of the CUDA driver API tsock calls, as a table of
 * entry points filled at run time (internal, not installed).
 *
 * The types are the driver ABI's own (cuda.h), declared here so that no
 * CUDA header or toolkit is needed to build. load.h fills the table with
 * dlopen/dlsym; the reader (reader/cuda_driver.c, for cuda_host.c and
 * cuda_device.c) and the producer's device pool (producer/pool.c) each
 * compile their own copy of it.
 */
#ifndef TSOCK_CUDA_API_H
#define TSOCK_CUDA_API_H

#include <stddef.h>
#include <stdint.h>

typedef int tsock_CUresult;                    /* CUresult */
typedef int tsock_CUdevice;                    /* CUdevice */
typedef unsigned long long tsock_CUdeviceptr;  /* CUdeviceptr (64-bit) */
typedef struct tsock_CUctx *tsock_CUcontext;   /* CUcontext (opaque) */
typedef struct tsock_CUstr *tsock_CUstream;    /* CUstream (opaque) */
typedef struct tsock_CUevt *tsock_CUevent;     /* CUevent (opaque) */
typedef struct { char bytes[16]; } tsock_CUuuid;           /* CUuuid */
typedef struct { char reserved[64]; } tsock_CUipcMemHandle;   /* CUipcMemHandle */
typedef struct { char reserved[64]; } tsock_CUipcEventHandle; /* CUipcEventHandle */

#define TSOCK_CUDA_SUCCESS 0
#define TSOCK_CUDA_ERROR_NOT_READY 600
#define TSOCK_CU_MEMHOSTREGISTER_PORTABLE 0x01u
#define TSOCK_CU_MEMHOSTREGISTER_READ_ONLY 0x08u
#define TSOCK_CU_STREAM_NON_BLOCKING 0x1u
#define TSOCK_CU_STREAM_LEGACY ((uintptr_t)0x1)     /* the legacy default stream (as 0) */
#define TSOCK_CU_STREAM_PER_THREAD ((uintptr_t)0x2) /* the calling thread's default stream */
#define TSOCK_CU_EVENT_DISABLE_TIMING 0x2u
#define TSOCK_CU_EVENT_INTERPROCESS 0x4u
#define TSOCK_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1u

/* The entry points tsock uses. Versioned names (cuMemAlloc_v2, ...) are
 * resolved first where the driver has them, as cuda.h maps the plain names
 * to them; cuDeviceGetUuid_v2 matters: it gives a MIG instance its own
 * UUID, which keeps CUDA IPC (which does not cross MIG instances) off. */
typedef struct tsock_cuda_driver {
  tsock_CUresult (*cuInit)(unsigned flags);
  tsock_CUresult (*cuDriverGetVersion)(int *version);
  tsock_CUresult (*cuDeviceGetCount)(int *count);
  tsock_CUresult (*cuDeviceGet)(tsock_CUdevice *dev, int ordinal);
  tsock_CUresult (*cuDeviceGetUuid)(tsock_CUuuid *uuid, tsock_CUdevice dev);
  tsock_CUresult (*cuCtxGetCurrent)(tsock_CUcontext *ctx);
  tsock_CUresult (*cuCtxSetCurrent)(tsock_CUcontext ctx);
  tsock_CUresult (*cuCtxGetDevice)(tsock_CUdevice *dev);
  tsock_CUresult (*cuCtxSynchronize)(void);
  tsock_CUresult (*cuDevicePrimaryCtxRetain)(tsock_CUcontext *ctx, tsock_CUdevice dev);
  tsock_CUresult (*cuDevicePrimaryCtxRelease)(tsock_CUdevice dev);
  tsock_CUresult (*cuMemHostRegister)(void *p, size_t bytes, unsigned flags);
  tsock_CUresult (*cuMemHostUnregister)(void *p);
  tsock_CUresult (*cuMemAlloc)(tsock_CUdeviceptr *dptr, size_t bytes);
  tsock_CUresult (*cuMemFree)(tsock_CUdeviceptr dptr);
  tsock_CUresult (*cuMemcpyHtoDAsync)(tsock_CUdeviceptr dst, const void *src, size_t bytes,
                                      tsock_CUstream stream);
  tsock_CUresult (*cuIpcGetMemHandle)(tsock_CUipcMemHandle *handle, tsock_CUdeviceptr dptr);
  tsock_CUresult (*cuIpcOpenMemHandle)(tsock_CUdeviceptr *dptr, tsock_CUipcMemHandle handle,
                                       unsigned flags);
  tsock_CUresult (*cuIpcCloseMemHandle)(tsock_CUdeviceptr dptr);
  tsock_CUresult (*cuStreamCreate)(tsock_CUstream *stream, unsigned flags);
  tsock_CUresult (*cuStreamDestroy)(tsock_CUstream stream);
  tsock_CUresult (*cuStreamSynchronize)(tsock_CUstream stream);
  tsock_CUresult (*cuStreamWaitEvent)(tsock_CUstream stream, tsock_CUevent ev, unsigned flags);
  tsock_CUresult (*cuEventCreate)(tsock_CUevent *ev, unsigned flags);
  tsock_CUresult (*cuEventDestroy)(tsock_CUevent ev);
  tsock_CUresult (*cuEventRecord)(tsock_CUevent ev, tsock_CUstream stream);
  tsock_CUresult (*cuEventQuery)(tsock_CUevent ev);
  tsock_CUresult (*cuEventSynchronize)(tsock_CUevent ev);
  tsock_CUresult (*cuIpcGetEventHandle)(tsock_CUipcEventHandle *handle, tsock_CUevent ev);
  tsock_CUresult (*cuIpcOpenEventHandle)(tsock_CUevent *ev, tsock_CUipcEventHandle handle);
  tsock_CUresult (*cuGetErrorString)(tsock_CUresult rc, const char **str);
  tsock_CUresult (*cuGetErrorName)(tsock_CUresult rc, const char **str);
} tsock_cuda_driver;

#endif
