/*
 * pool.c - the producer's device pool (see pool.h), with the producer's
 * copy of the CUDA loader (cuda/load.h). Compiled into the producer
 * package, hence into libtsock.so; reader code never links it.
 */
#include "pool.h"

#include "../cuda/load.h"
#include "../include/tsock.h"

struct tsock_pool {
  const tsock_cuda_driver *d;
  tsock_CUdevice dev;
  tsock_CUcontext ctx; /* the device's primary context, retained */
  tsock_CUdeviceptr base;
  uint64_t slot_bytes;
  uint32_t slots;
  void *host;
  int host_registered;
  tsock_CUstream stream;
  tsock_CUevent *events; /* one per slot */
};

/* Formats the failed call into err and returns TSOCK_ESYS. */
static int pool_fail(const tsock_pool *p, tsock_CUresult rc, const char *what, char *err,
                     size_t errn) {
  cuda_describe(p->d, rc, what, err, errn);
  return TSOCK_ESYS;
}

void tsock_pool_quiesce(tsock_pool *p) {
  if (p == NULL || p->ctx == NULL) return;
  const tsock_cuda_driver *d = p->d;
  tsock_CUcontext prev = NULL;
  if (cuda_push_ctx(d, p->ctx, &prev) != TSOCK_CUDA_SUCCESS) return;
  if (p->stream != NULL) d->cuStreamSynchronize(p->stream); /* no copy reads the host range after this */
  if (p->host_registered) d->cuMemHostUnregister(p->host);
  p->host_registered = 0;
  cuda_pop_ctx(d, p->ctx, prev);
}

void tsock_pool_close(tsock_pool *p) {
  if (p == NULL) return;
  const tsock_cuda_driver *d = p->d;
  tsock_pool_quiesce(p);
  tsock_CUcontext prev = NULL;
  if (p->ctx != NULL && cuda_push_ctx(d, p->ctx, &prev) == TSOCK_CUDA_SUCCESS) {
    if (p->stream != NULL) d->cuStreamDestroy(p->stream);
    for (uint32_t s = 0; p->events != NULL && s < p->slots; s++)
      if (p->events[s] != NULL) d->cuEventDestroy(p->events[s]);
    if (p->base != 0) d->cuMemFree(p->base);
    cuda_pop_ctx(d, p->ctx, prev);
  }
  if (p->ctx != NULL) d->cuDevicePrimaryCtxRelease(p->dev);
  free(p->events);
  free(p);
}

/* The steps of tsock_pool_open after the context is current. */
static int pool_build(tsock_pool *p, uint8_t *event_handles, tsock_pool_export *out, char *err,
                      size_t errn) {
  const tsock_cuda_driver *d = p->d;
  uint64_t bytes = (uint64_t)p->slots * p->slot_bytes;
  tsock_CUresult rc = d->cuMemAlloc(&p->base, (size_t)bytes);
  if (rc != TSOCK_CUDA_SUCCESS) {
    p->base = 0;
    char what[96];
    snprintf(what, sizeof what, "cuMemAlloc(%llu bytes)", (unsigned long long)bytes);
    return pool_fail(p, rc, what, err, errn);
  }
  tsock_CUipcMemHandle mh;
  rc = d->cuIpcGetMemHandle(&mh, p->base);
  if (rc != TSOCK_CUDA_SUCCESS) return pool_fail(p, rc, "cuIpcGetMemHandle", err, errn);
  tsock_CUuuid uuid;
  rc = d->cuDeviceGetUuid(&uuid, p->dev);
  if (rc != TSOCK_CUDA_SUCCESS) return pool_fail(p, rc, "cuDeviceGetUuid", err, errn);
  rc = d->cuMemHostRegister(p->host, (size_t)bytes, TSOCK_CU_MEMHOSTREGISTER_PORTABLE);
  if (rc != TSOCK_CUDA_SUCCESS) return pool_fail(p, rc, "cuMemHostRegister(payload)", err, errn);
  p->host_registered = 1;
  rc = d->cuStreamCreate(&p->stream, TSOCK_CU_STREAM_NON_BLOCKING);
  if (rc != TSOCK_CUDA_SUCCESS) {
    p->stream = NULL;
    return pool_fail(p, rc, "cuStreamCreate", err, errn);
  }
  for (uint32_t s = 0; s < p->slots; s++) {
    rc = d->cuEventCreate(&p->events[s],
                          TSOCK_CU_EVENT_DISABLE_TIMING | TSOCK_CU_EVENT_INTERPROCESS);
    if (rc != TSOCK_CUDA_SUCCESS) {
      p->events[s] = NULL;
      return pool_fail(p, rc, "cuEventCreate(INTERPROCESS)", err, errn);
    }
    tsock_CUipcEventHandle eh;
    rc = d->cuIpcGetEventHandle(&eh, p->events[s]);
    if (rc != TSOCK_CUDA_SUCCESS) return pool_fail(p, rc, "cuIpcGetEventHandle", err, errn);
    memcpy(event_handles + (size_t)s * sizeof eh, &eh, sizeof eh);
  }
  out->pool_bytes = bytes;
  memcpy(out->uuid, &uuid, sizeof out->uuid);
  memcpy(out->mem_handle, &mh, sizeof out->mem_handle);
  return TSOCK_OK;
}

int tsock_pool_open(int ordinal, uint32_t slots, uint64_t slot_bytes, void *host,
                    uint8_t *event_handles, tsock_pool_export *out, tsock_pool **pool, char *err,
                    size_t errn) {
  const char *why = NULL;
  const tsock_cuda_driver *d = cuda_driver(&why);
  if (d == NULL) {
    snprintf(err, errn, "%s", why);
    return TSOCK_ENOCUDA;
  }
  int count = 0;
  tsock_CUresult rc = d->cuDeviceGetCount(&count);
  if (rc != TSOCK_CUDA_SUCCESS) {
    cuda_describe(d, rc, "cuDeviceGetCount", err, errn);
    return TSOCK_ESYS;
  }
  if (ordinal < 0 || ordinal >= count) {
    snprintf(err, errn, "CUDA device %d does not exist here (%d visible)", ordinal, count);
    return TSOCK_EINVAL;
  }
  tsock_pool *p = calloc(1, sizeof *p);
  if (p != NULL) p->events = calloc(slots, sizeof *p->events);
  if (p == NULL || p->events == NULL) {
    if (p != NULL) free(p);
    snprintf(err, errn, "device pool: out of memory");
    return TSOCK_ENOMEM;
  }
  *p = (tsock_pool){.d = d, .slot_bytes = slot_bytes, .slots = slots, .host = host,
                    .events = p->events};
  rc = d->cuDeviceGet(&p->dev, ordinal);
  if (rc == TSOCK_CUDA_SUCCESS) rc = d->cuDevicePrimaryCtxRetain(&p->ctx, p->dev);
  if (rc != TSOCK_CUDA_SUCCESS) {
    p->ctx = NULL;
    int st = pool_fail(p, rc, "cuDevicePrimaryCtxRetain", err, errn);
    tsock_pool_close(p);
    return st;
  }
  tsock_CUcontext prev = NULL;
  rc = cuda_push_ctx(d, p->ctx, &prev);
  if (rc != TSOCK_CUDA_SUCCESS) {
    int st = pool_fail(p, rc, "cuCtxSetCurrent", err, errn);
    tsock_pool_close(p);
    return st;
  }
  int st = pool_build(p, event_handles, out, err, errn);
  cuda_pop_ctx(d, p->ctx, prev);
  if (st != TSOCK_OK) {
    tsock_pool_close(p);
    return st;
  }
  out->ordinal = ordinal;
  *pool = p;
  return TSOCK_OK;
}

int tsock_pool_copy(tsock_pool *p, uint32_t slot, uint64_t nbytes, char *err, size_t errn) {
  if (slot >= p->slots || nbytes > p->slot_bytes) {
    snprintf(err, errn, "device pool: slot %u / %llu bytes out of range", slot,
             (unsigned long long)nbytes);
    return TSOCK_EINVAL;
  }
  const tsock_cuda_driver *d = p->d;
  tsock_CUcontext prev = NULL;
  tsock_CUresult rc = cuda_push_ctx(d, p->ctx, &prev);
  if (rc != TSOCK_CUDA_SUCCESS) return pool_fail(p, rc, "cuCtxSetCurrent", err, errn);
  uint64_t off = (uint64_t)slot * p->slot_bytes;
  if (nbytes > 0)
    rc = d->cuMemcpyHtoDAsync(p->base + off, (const char *)p->host + off, (size_t)nbytes,
                              p->stream);
  int st = TSOCK_OK;
  if (rc != TSOCK_CUDA_SUCCESS)
    st = pool_fail(p, rc, "cuMemcpyHtoDAsync", err, errn);
  else if ((rc = d->cuEventRecord(p->events[slot], p->stream)) != TSOCK_CUDA_SUCCESS)
    st = pool_fail(p, rc, "cuEventRecord", err, errn);
  cuda_pop_ctx(d, p->ctx, prev);
  return st;
}

int tsock_pool_wait_slot(tsock_pool *p, uint32_t slot, char *err, size_t errn) {
  if (slot >= p->slots) {
    snprintf(err, errn, "device pool: slot %u out of range", slot);
    return TSOCK_EINVAL;
  }
  const tsock_cuda_driver *d = p->d;
  tsock_CUcontext prev = NULL;
  tsock_CUresult rc = cuda_push_ctx(d, p->ctx, &prev);
  if (rc != TSOCK_CUDA_SUCCESS) return pool_fail(p, rc, "cuCtxSetCurrent", err, errn);
  rc = d->cuEventQuery(p->events[slot]); /* the common case: long done */
  if (rc == TSOCK_CUDA_ERROR_NOT_READY) rc = d->cuEventSynchronize(p->events[slot]);
  cuda_pop_ctx(d, p->ctx, prev);
  return rc == TSOCK_CUDA_SUCCESS ? TSOCK_OK : pool_fail(p, rc, "cuEventSynchronize", err, errn);
}
