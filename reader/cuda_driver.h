/*
 * cuda_driver.h - the reader's handle on the CUDA driver, loaded at run
 * time, shared by cuda_driver.c, cuda_host.c and cuda_device.c (internal,
 * not installed).
 *
 * Neither library links CUDA: builds and CPU-only runs never need it. The
 * driver is opened with dlopen on first use (cuda/load.h) and the few entry
 * points tsock calls are resolved into a table (cuda/api.h).
 */
#ifndef TSOCK_READER_CUDA_DRIVER_H
#define TSOCK_READER_CUDA_DRIVER_H

#include <stddef.h>

#include "../cuda/api.h"
#include "internal.h"

/* Loads and initialises the driver once per process (cuInit(0)); thread-safe.
 * Returns 0 and sets *out, or TSOCK_ENOCUDA with a message saying why
 * (no such file, a missing entry point, cuInit's error). */
TSOCK_INTERNAL int tsock__cuda_driver(const tsock_cuda_driver **out);

/* Records "<what>: CUDA_ERROR_X: text" as the thread's message and returns
 * TSOCK_ESYS. */
TSOCK_INTERNAL int tsock__cuda_fail(const tsock_cuda_driver *d, tsock_CUresult rc,
                                    const char *what);

/* Makes ctx current on the calling thread, the previous context in *prev;
 * tsock__cuda_pop_ctx puts it back. Frameworks keep their own current
 * context, which every tsock call leaves as it found it. */
TSOCK_INTERNAL tsock_CUresult tsock__cuda_push_ctx(const tsock_cuda_driver *d,
                                                   tsock_CUcontext ctx, tsock_CUcontext *prev);
TSOCK_INTERNAL void tsock__cuda_pop_ctx(const tsock_cuda_driver *d, tsock_CUcontext ctx,
                                        tsock_CUcontext prev);

/* Records in the reader's record that it reads pinned host memory on the
 * device `ordinal` (cuda_device.c), unless it is on the device path. */
TSOCK_INTERNAL void tsock__record_pinned(tsock_reader_t *h, int32_t ordinal, const void *uuid);

#endif
