/*
 * cuda_host.c - tsock_reader_register_host: the reader's payload mapping as
 * pinned (page-locked) host memory for the CUDA driver.
 *
 * The registration belongs to the mapping (tsock_map_ref), not to the
 * reader handle: DLPack tensors and pins keep the mapping after detach, and
 * a range must be unregistered before it is unmapped, so the mapping's
 * last unref undoes it (on_unmap), in whatever thread drops it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_driver.h"

typedef struct cuda_reg {
  const tsock_cuda_driver *d;
  tsock_CUdevice dev;
  tsock_CUcontext ctx; /* the device's primary context, retained */
  void *addr;
  uint64_t fork_gen; /* CUDA state does not survive fork() */
} cuda_reg;

/* on_unmap: unregisters before the munmap. Errors have no caller to go to,
 * and the range goes away with the mapping anyway. */
static void unregister_host(tsock_map_ref *m) {
  cuda_reg *g = m->cuda;
  m->cuda = NULL;
  m->on_unmap = NULL;
  if (g == NULL) return;
  if (g->fork_gen == tsock__fork_generation()) {
    const tsock_cuda_driver *d = g->d;
    tsock_CUcontext prev = NULL;
    if (tsock__cuda_push_ctx(d, g->ctx, &prev) == TSOCK_CUDA_SUCCESS) {
      d->cuMemHostUnregister(g->addr);
      tsock__cuda_pop_ctx(d, g->ctx, prev);
    }
    d->cuDevicePrimaryCtxRelease(g->dev);
  }
  free(g);
}

static int register_host(tsock_reader_t *h) {
  tsock_map_ref *m;
  const void *base;
  uint64_t len;
  int st = tsock__reader_map(h, &m, &base, &len);
  if (st != TSOCK_OK) return st;
  if (m->cuda != NULL) return TSOCK_OK; /* once per reader (per mapping) */
  if (m->carve != NULL)
    return tsock__fail(TSOCK_ESTATE, "tsock_reader_register_host: a batch of this reader was kept "
                                     "(tsock_batch_keep), so its payload is no longer one mapping; "
                                     "register before keeping any");
  const tsock_cuda_driver *d;
  st = tsock__cuda_driver(&d);
  if (st != TSOCK_OK) return st;

  /* The device: that of the thread's current context (the one a framework
   * made current), else device 0. Its primary context registers the range;
   * PORTABLE makes it pinned for every context. */
  tsock_CUcontext cur = NULL;
  tsock_CUdevice dev = 0;
  tsock_CUresult rc = d->cuCtxGetCurrent(&cur);
  if (rc != TSOCK_CUDA_SUCCESS) return tsock__cuda_fail(d, rc, "cuCtxGetCurrent");
  if (cur != NULL) {
    rc = d->cuCtxGetDevice(&dev);
    if (rc != TSOCK_CUDA_SUCCESS) return tsock__cuda_fail(d, rc, "cuCtxGetDevice");
  } else {
    int count = 0;
    rc = d->cuDeviceGetCount(&count);
    if (rc != TSOCK_CUDA_SUCCESS) return tsock__cuda_fail(d, rc, "cuDeviceGetCount");
    if (count < 1) return tsock__fail(TSOCK_ENOCUDA, "CUDA driver not available: no CUDA device");
    rc = d->cuDeviceGet(&dev, 0);
    if (rc != TSOCK_CUDA_SUCCESS) return tsock__cuda_fail(d, rc, "cuDeviceGet(0)");
  }
  tsock_CUcontext ctx = NULL;
  rc = d->cuDevicePrimaryCtxRetain(&ctx, dev);
  if (rc != TSOCK_CUDA_SUCCESS) return tsock__cuda_fail(d, rc, "cuDevicePrimaryCtxRetain");
  tsock_CUcontext prev = NULL;
  rc = tsock__cuda_push_ctx(d, ctx, &prev);
  if (rc != TSOCK_CUDA_SUCCESS) {
    d->cuDevicePrimaryCtxRelease(dev);
    return tsock__cuda_fail(d, rc, "cuCtxSetCurrent");
  }
  void *addr = (void *)(uintptr_t)base;
  rc = d->cuMemHostRegister(addr, (size_t)len,
                            TSOCK_CU_MEMHOSTREGISTER_PORTABLE | TSOCK_CU_MEMHOSTREGISTER_READ_ONLY);
  tsock__cuda_pop_ctx(d, ctx, prev);
  if (rc != TSOCK_CUDA_SUCCESS) {
    d->cuDevicePrimaryCtxRelease(dev);
    char what[256];
    snprintf(what, sizeof what,
             "cuMemHostRegister(%p, %llu bytes, PORTABLE|READ_ONLY) on device %d (read-only "
             "registration needs CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED)",
             addr, (unsigned long long)len, dev);
    return tsock__cuda_fail(d, rc, what);
  }
  cuda_reg *g = malloc(sizeof *g);
  if (g == NULL) {
    if (tsock__cuda_push_ctx(d, ctx, &prev) == TSOCK_CUDA_SUCCESS) {
      d->cuMemHostUnregister(addr);
      tsock__cuda_pop_ctx(d, ctx, prev);
    }
    d->cuDevicePrimaryCtxRelease(dev);
    return tsock__fail(TSOCK_ENOMEM, "tsock_reader_register_host: out of memory");
  }
  *g = (cuda_reg){.d = d, .dev = dev, .ctx = ctx, .addr = addr,
                  .fork_gen = tsock__fork_generation()};
  m->cuda = g;
  m->on_unmap = unregister_host;
  tsock_CUuuid uuid;
  int ordinal = -1;
  if (d->cuDeviceGetUuid(&uuid, dev) != TSOCK_CUDA_SUCCESS) memset(&uuid, 0, sizeof uuid);
  int count = 0;
  for (int i = 0; d->cuDeviceGetCount(&count) == TSOCK_CUDA_SUCCESS && i < count; i++) {
    tsock_CUdevice di;
    if (d->cuDeviceGet(&di, i) == TSOCK_CUDA_SUCCESS && di == dev) ordinal = i;
  }
  tsock__record_pinned(h, ordinal, &uuid);
  return TSOCK_OK;
}

/* Holds a use of the handle (tsock__handle_get) throughout, as every call
 * on one does: a detach in another thread waits for it to end. */
int tsock_reader_register_host(tsock_reader_t *h) {
  tsock__clear_error();
  int rc;
  if (tsock__handle_get(h, &rc) == NULL) return rc;
  rc = register_host(h);
  tsock__handle_put(h);
  return rc;
}
