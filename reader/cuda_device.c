/*
 * cuda_device.c - the reader's device path: the producer's device pool opened
 * through CUDA IPC, batches read zero-copy on the GPU (see tsock.h, "GPU").
 *
 * The state belongs to the reader and to every DLPack descriptor of device
 * memory (refs): the pool stays mapped until the last of them is gone.
 * Each slot's interprocess event (recorded by the producer after its copy)
 * is opened once; fences, plain events recorded on the caller's stream at
 * release, hold the slot back from the producer until that stream's work
 * has run (release.c polls them through tsock_device_hooks).
 *
 * While the pool is mapped, the process holds a read lock on the segment's
 * byte TSOCK_LOCK_DEVICE_MAP (layout.h), on an open file description of its
 * own (map_fd): the reader's descriptor, and its record lock, go at detach,
 * but the mapping lives on with the DLPack descriptors. The producer frees
 * the pool only while no process holds that lock.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_driver.h"

typedef struct device_state {
  const tsock_cuda_driver *d;
  uint32_t refs; /* the reader, and each DLPack descriptor (atomic) */
  uint64_t fork_gen;
  tsock_CUdevice dev;
  tsock_CUcontext ctx; /* the device's primary context, retained */
  int32_t ordinal;
  int fd; /* the reader's segment, for the producer's liveness lock */
  int map_fd; /* holds the TSOCK_LOCK_DEVICE_MAP read lock while mapped; -1 if none */
  tsock_CUdeviceptr base; /* the pool, opened with cuIpcOpenMemHandle */
  uint64_t slot_bytes;
  uint32_t slot_count;
  tsock_CUevent *copied; /* per slot: the producer's interprocess event */
  /* Fence events not in use: at most one per held batch (TSOCK_MAX_HELD,
   * the bound attach.c applies to max_held), since a batch has one fence
   * at a time. */
  tsock_CUevent spare[TSOCK_MAX_HELD];
  uint32_t n_spare;
} device_state;

static void device_free(device_state *g) {
  const tsock_cuda_driver *d = g->d;
  if (g->fork_gen == tsock__fork_generation() && g->ctx != NULL) {
    tsock_CUcontext prev = NULL;
    if (tsock__cuda_push_ctx(d, g->ctx, &prev) == TSOCK_CUDA_SUCCESS) {
      for (uint32_t i = 0; i < g->n_spare; i++) d->cuEventDestroy(g->spare[i]);
      for (uint32_t s = 0; g->copied != NULL && s < g->slot_count; s++)
        if (g->copied[s] != NULL) d->cuEventDestroy(g->copied[s]);
      if (g->base != 0 && d->cuIpcCloseMemHandle(g->base) == TSOCK_CUDA_SUCCESS) g->base = 0;
      tsock__cuda_pop_ctx(d, g->ctx, prev);
    }
    d->cuDevicePrimaryCtxRelease(g->dev);
    /* Only once the pool is unmapped does the producer learn it may free it;
     * if the close failed, the lock stays until this process exits (the
     * descriptor is leaked on purpose: freeing under a mapping is worse). */
    if (g->map_fd >= 0 && g->base == 0) {
      tsock__fork_close(g->map_fd);
    }
  }
  /* In a forked child the fork guard has closed map_fd already. */
  free(g->copied);
  free(g);
}

static void device_unref(void *p) {
  device_state *g = p;
  if (__atomic_sub_fetch(&g->refs, 1, __ATOMIC_ACQ_REL) == 0) device_free(g);
}

/* ---- fences (tsock_device_hooks) ----
 *
 * Fail closed: a released batch goes back to the producer only once it is
 * proven that no GPU work queued before the release can still read it: its
 * fence fired, or a synchronize covering its stream returned success. When
 * neither can be had (the context cannot be made current, the event calls
 * and the synchronizes fail: a broken context), the batch stays held, with
 * FENCE_UNPROVEN as its fence, and every later poll tries again. */

/* A number for the calling thread, never reused in the process (a
 * pthread_t is, once its thread has exited). */
static uint64_t this_thread(void) {
  static uint64_t last;
  static __thread uint64_t id;
  if (id == 0) id = __atomic_add_fetch(&last, 1, __ATOMIC_RELAXED);
  return id;
}

/* 1 when hb's stream is not the stream its handle names on this thread:
 * CU_STREAM_PER_THREAD used from another thread. */
static int stream_elsewhere(const tsock_held_batch *hb) {
  return hb->stream == TSOCK_CU_STREAM_PER_THREAD && hb->use_thread != this_thread();
}

/* hb->fence of a released batch whose safety is not yet established. */
static char fence_unproven_tag;
#define FENCE_UNPROVEN ((void *)&fence_unproven_tag)

static void spare_event(device_state *g, tsock_CUevent ev) {
  if (g->n_spare < TSOCK_MAX_HELD)
    g->spare[g->n_spare++] = ev;
  else
    g->d->cuEventDestroy(ev);
}

/* In g's context (current): records a fence for hb (1, hb->fence set), or
 * waits until its stream or the device is idle (0: safe now). -1 when
 * neither worked: nothing is proven. */
static int fence_establish(device_state *g, tsock_held_batch *hb) {
  const tsock_cuda_driver *d = g->d;
  /* The per-thread default stream of another thread cannot be named here:
   * only the device as a whole covers it. */
  if (!(hb->use_flags & TSOCK_CUDA_SYNC) && !hb->several_streams && !stream_elsewhere(hb)) {
    tsock_CUstream stream = (tsock_CUstream)hb->stream;
    tsock_CUevent ev = NULL;
    tsock_CUresult rc = TSOCK_CUDA_SUCCESS;
    if (g->n_spare > 0)
      ev = g->spare[--g->n_spare];
    else
      rc = d->cuEventCreate(&ev, TSOCK_CU_EVENT_DISABLE_TIMING);
    if (rc == TSOCK_CUDA_SUCCESS) rc = d->cuEventRecord(ev, stream);
    if (rc == TSOCK_CUDA_SUCCESS) {
      hb->fence = ev;
      return 1;
    }
    if (ev != NULL) spare_event(g, ev);
    /* No event: wait for the stream now rather than risk the slot. */
    if (d->cuStreamSynchronize(stream) == TSOCK_CUDA_SUCCESS) return 0;
  }
  /* The caller's streams are unknown (TSOCK_CUDA_SYNC), it used several,
   * its stream is another thread's, or it could not be fenced nor
   * synchronized: wait for the whole device. */
  return d->cuCtxSynchronize() == TSOCK_CUDA_SUCCESS ? 0 : -1;
}

static void fence_arm(tsock_held_batch *hb) {
  device_state *g = hb->device;
  tsock_CUcontext prev = NULL;
  hb->fence = FENCE_UNPROVEN;
  if (tsock__cuda_push_ctx(g->d, g->ctx, &prev) != TSOCK_CUDA_SUCCESS) return;
  if (fence_establish(g, hb) == 0) hb->fence = NULL;
  tsock__cuda_pop_ctx(g->d, g->ctx, prev);
}

static int fence_pending(tsock_held_batch *hb, int wait) {
  device_state *g = hb->device;
  const tsock_cuda_driver *d = g->d;
  tsock_CUcontext prev = NULL;
  if (tsock__cuda_push_ctx(d, g->ctx, &prev) != TSOCK_CUDA_SUCCESS) return 1;
  int pending = 1;
  if (hb->fence == FENCE_UNPROVEN) {
    int e = fence_establish(g, hb); /* may arm a real fence: then query it below */
    if (e == 0) {
      hb->fence = NULL;
      pending = 0;
    }
    if (e <= 0) {
      tsock__cuda_pop_ctx(d, g->ctx, prev);
      return pending;
    }
  }
  tsock_CUevent ev = hb->fence;
  tsock_CUresult rc = d->cuEventQuery(ev);
  if (rc == TSOCK_CUDA_ERROR_NOT_READY && wait) rc = d->cuEventSynchronize(ev);
  if (rc == TSOCK_CUDA_SUCCESS) {
    pending = 0;
  } else if (rc != TSOCK_CUDA_ERROR_NOT_READY) {
    /* The event cannot say: only an idle device proves the slot free. */
    pending = d->cuCtxSynchronize() != TSOCK_CUDA_SUCCESS;
  }
  if (!pending) {
    spare_event(g, ev);
    hb->fence = NULL;
  }
  tsock__cuda_pop_ctx(d, g->ctx, prev);
  return pending;
}

static void device_detach(void *p) { device_unref(p); }

static const tsock_device_hooks hooks = {
    .arm = fence_arm, .pending = fence_pending, .detach = device_detach};

/* ---- opening the pool ---- */

static void format_uuid(const uint8_t *u, char *out, size_t n) {
  snprintf(out, n,
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
           u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
           u[14], u[15]);
}

static void record_placement(tsock_reader_record *rec, uint32_t placement, int32_t ordinal,
                             const void *uuid) {
  rec->cuda_ordinal = ordinal;
  if (uuid != NULL) memcpy(rec->gpu_uuid, uuid, sizeof rec->gpu_uuid);
  __atomic_store_n(&rec->placement, placement, __ATOMIC_RELEASE);
}

void tsock__record_pinned(tsock_reader_t *h, int32_t ordinal, const void *uuid) {
  tsock_reader_view v;
  if (tsock__reader_view(h, &v) != TSOCK_OK || v.device != NULL) return;
  record_placement(v.rec, TSOCK_PLACEMENT_PINNED, ordinal, uuid);
}

/* The device of this process whose UUID is the pool's; -1 if none. */
static int find_device(const tsock_cuda_driver *d, const uint8_t *want, tsock_CUdevice *out,
                       int *count, int *rc_out) {
  *count = 0;
  tsock_CUresult rc = d->cuDeviceGetCount(count);
  if (rc != TSOCK_CUDA_SUCCESS) return *rc_out = rc, -1;
  for (int i = 0; i < *count; i++) {
    tsock_CUdevice dev;
    tsock_CUuuid u;
    if (d->cuDeviceGet(&dev, i) != TSOCK_CUDA_SUCCESS) continue;
    if (d->cuDeviceGetUuid(&u, dev) != TSOCK_CUDA_SUCCESS) continue;
    if (memcmp(u.bytes, want, sizeof u.bytes) == 0) {
      *out = dev;
      return i;
    }
  }
  *rc_out = TSOCK_CUDA_SUCCESS;
  return -1;
}

/* Takes the TSOCK_LOCK_DEVICE_MAP read lock on a new open file description
 * of the segment (reopened through /proc, so it is the same file even if its
 * name was taken since), kept in g->map_fd. Then the channel must still be
 * open: the producer stores CLOSED before it checks the lock, so either it
 * sees our lock or we see CLOSED, and it never frees a pool we go on to map. */
static int lock_mapping(device_state *g, const tsock_reader_view *v) {
  int fd = tsock__fork_reopen(v->fd); /* tracked from its first instant */
  if (fd < 0)
    return tsock__fail_errno(TSOCK_ESYS, errno, "tsock_reader_open_device: reopening the segment "
                                               "(/proc/self/fd/%d) for its device-mapping lock", v->fd);
  if (tsock__lock_byte_shared(fd, TSOCK_LOCK_DEVICE_MAP) != 0) {
    int err = errno;
    tsock__fork_close(fd);
    return tsock__fail_errno(TSOCK_ESYS, err, "tsock_reader_open_device: the device-mapping lock");
  }
  g->map_fd = fd;
  /* The live page: the private header copy never changes state. */
  if (__atomic_load_n(&v->live->state, __ATOMIC_SEQ_CST) == TSOCK_STATE_CLOSED)
    return tsock__fail(TSOCK_ENODEVICE, "the channel is closed: its device pool is about to be "
                                        "freed; read host memory");
  return TSOCK_OK;
}

/* Maps the pool and opens the slot events, in g's context (current). */
static int open_pool(device_state *g, const tsock_reader_view *v) {
  const tsock_cuda_driver *d = g->d;
  int st = lock_mapping(g, v);
  if (st != TSOCK_OK) return st;
  tsock_CUipcMemHandle mh;
  memcpy(&mh, v->hdr->gpu_mem_handle, sizeof mh);
  tsock_CUresult rc = d->cuIpcOpenMemHandle(&g->base, mh, TSOCK_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (rc != TSOCK_CUDA_SUCCESS) {
    g->base = 0;
    tsock__cuda_fail(d, rc, "cuIpcOpenMemHandle (the producer's device pool)");
    return TSOCK_ENODEVICE;
  }
  for (uint32_t s = 0; s < g->slot_count; s++) {
    tsock_CUipcEventHandle eh;
    memcpy(&eh, v->slots[s].cuda_event, sizeof eh);
    rc = d->cuIpcOpenEventHandle(&g->copied[s], eh);
    if (rc != TSOCK_CUDA_SUCCESS) {
      g->copied[s] = NULL;
      tsock__cuda_fail(d, rc, "cuIpcOpenEventHandle (a slot's copy event)");
      return TSOCK_ENODEVICE;
    }
  }
  return TSOCK_OK;
}

static int open_device(tsock_reader_t *h, int32_t *cuda_ordinal) {
  tsock_reader_view v;
  int st = tsock__reader_view(h, &v);
  if (st != TSOCK_OK) return st;
  if (cuda_ordinal == NULL)
    return tsock__fail(TSOCK_EINVAL, "tsock_reader_open_device: cuda_ordinal is NULL");
  if (v.device != NULL) {
    *cuda_ordinal = ((device_state *)v.device)->ordinal;
    return TSOCK_OK;
  }
  if (v.hdr->gpu_pool != 1)
    return tsock__fail(TSOCK_ENODEVICE,
                       "the producer has no device pool (created without a CUDA device): read "
                       "host memory");
  const tsock_cuda_driver *d;
  st = tsock__cuda_driver(&d);
  if (st != TSOCK_OK) return st;
  uint8_t want[TSOCK_CUDA_UUID_BYTES];
  memcpy(want, v.hdr->gpu_uuid, sizeof want);
  char uuid[48];
  format_uuid(want, uuid, sizeof uuid);
  tsock_CUdevice dev = 0;
  int count = 0, rc = 0;
  int ordinal = find_device(d, want, &dev, &count, &rc);
  if (ordinal < 0 && rc != TSOCK_CUDA_SUCCESS)
    return tsock__cuda_fail(d, rc, "cuDeviceGetCount");
  if (ordinal < 0)
    return tsock__fail(TSOCK_ENODEVICE,
                       "the producer's GPU (%s) is not among this process's %d CUDA devices "
                       "(another GPU, CUDA_VISIBLE_DEVICES, or a MIG instance, which CUDA IPC "
                       "cannot reach): use the pinned host path",
                       uuid, count);
  device_state *g = calloc(1, sizeof *g);
  if (g != NULL) g->copied = calloc(v.slot_count, sizeof *g->copied);
  if (g == NULL || g->copied == NULL) {
    free(g);
    return tsock__fail(TSOCK_ENOMEM, "tsock_reader_open_device: out of memory");
  }
  g->d = d;
  g->refs = 1;
  g->fork_gen = tsock__fork_generation();
  g->dev = dev;
  g->ordinal = ordinal;
  g->slot_bytes = v.slot_payload_bytes;
  g->slot_count = v.slot_count;
  g->fd = v.fd;
  g->map_fd = -1;
  tsock_CUresult cr = d->cuDevicePrimaryCtxRetain(&g->ctx, dev);
  if (cr != TSOCK_CUDA_SUCCESS) {
    g->ctx = NULL;
    device_free(g);
    return tsock__cuda_fail(d, cr, "cuDevicePrimaryCtxRetain");
  }
  tsock_CUcontext prev = NULL;
  cr = tsock__cuda_push_ctx(d, g->ctx, &prev);
  if (cr != TSOCK_CUDA_SUCCESS) {
    device_free(g);
    return tsock__cuda_fail(d, cr, "cuCtxSetCurrent");
  }
  st = open_pool(g, &v);
  tsock__cuda_pop_ctx(d, g->ctx, prev);
  if (st == TSOCK_OK) st = tsock__reader_set_device(h, g, &hooks);
  if (st != TSOCK_OK) {
    device_free(g);
    return st;
  }
  record_placement(v.rec, TSOCK_PLACEMENT_DEVICE, ordinal, want);
  *cuda_ordinal = ordinal;
  return TSOCK_OK;
}

static int device_range(tsock_reader_t *h, uint64_t *base, uint64_t *len) {
  tsock_reader_view v;
  int st = tsock__reader_view(h, &v);
  if (st != TSOCK_OK) return st;
  if (base == NULL || len == NULL)
    return tsock__fail(TSOCK_EINVAL, "tsock_reader_device_range: NULL out-parameter");
  const device_state *g = v.device;
  if (g == NULL)
    return tsock__fail(TSOCK_ENODEVICE, "tsock_reader_device_range: no device path "
                                        "(tsock_reader_open_device)");
  *base = g->base;
  *len = (uint64_t)g->slot_count * g->slot_bytes;
  return TSOCK_OK;
}

/* Both hold a use of the handle (tsock__handle_get) throughout, as every
 * call on one does: a detach in another thread waits for them to end. */
int tsock_reader_open_device(tsock_reader_t *h, int32_t *cuda_ordinal) {
  tsock__clear_error();
  int rc;
  if (tsock__handle_get(h, &rc) == NULL) return rc;
  rc = open_device(h, cuda_ordinal);
  tsock__handle_put(h);
  return rc;
}

int tsock_reader_device_range(tsock_reader_t *h, uint64_t *base, uint64_t *len) {
  tsock__clear_error();
  int rc;
  if (tsock__handle_get(h, &rc) == NULL) return rc;
  rc = device_range(h, base, len);
  tsock__handle_put(h);
  return rc;
}

/* ---- batches ---- */

/* The held batch behind b when it has a usable device copy. */
static int device_batch(const tsock_batch_t *b, const char *fn, tsock_held_batch **out) {
  if (b == NULL) return tsock__fail(TSOCK_EINVAL, "%s: batch is NULL", fn);
  tsock_held_batch *hb = (tsock_held_batch *)b; /* from tsock_reader_acquire */
  if (hb->device == NULL)
    return tsock__fail(TSOCK_ENODEVICE, "%s: the reader has no device path "
                                        "(tsock_reader_open_device)", fn);
  if (hb->payload_kind != TSOCK_PAYLOAD_HOST_DEVICE)
    return tsock__fail(TSOCK_ENODEVICE, "%s: batch %llu was published without a device copy", fn,
                       (unsigned long long)b->seq);
  *out = hb;
  return TSOCK_OK;
}

/* The device address of tensor i of a batch with a usable device copy. */
static uint64_t device_ptr(const tsock_held_batch *hb, uint32_t i) {
  const device_state *g = hb->device;
  return g->base + (uint64_t)hb->slot * g->slot_bytes + hb->batch.tensors[i].offset;
}

int tsock_batch_cuda_ptr(const tsock_batch_t *b, uint32_t i, uint64_t *dptr) {
  tsock__clear_error();
  tsock_held_batch *hb = NULL;
  int st = device_batch(b, "tsock_batch_cuda_ptr", &hb);
  if (st != TSOCK_OK) return st;
  if (dptr == NULL || i >= b->n_tensors)
    return tsock__fail(TSOCK_EINVAL, "tsock_batch_cuda_ptr: tensor %u of %u, or NULL dptr", i,
                       b->n_tensors);
  *dptr = device_ptr(hb, i);
  return TSOCK_OK;
}

int tsock_batch_cuda_use(const tsock_batch_t *b, uintptr_t stream, uint32_t flags) {
  tsock__clear_error();
  tsock_held_batch *hb = NULL;
  int st = device_batch(b, "tsock_batch_cuda_use", &hb);
  if (st != TSOCK_OK) return st;
  if ((flags & ~TSOCK_CUDA_SYNC) != 0)
    return tsock__fail(TSOCK_EINVAL, "tsock_batch_cuda_use: unknown flags 0x%x", flags);
  if (!hb->handed || hb->user_released)
    return tsock__fail(TSOCK_ESTATE, "tsock_batch_cuda_use: batch is not held");
  if (hb->stream_set && hb->stream == stream && hb->use_flags == flags && !stream_elsewhere(hb))
    return TSOCK_OK;
  device_state *g = hb->device;
  /* The pool and its events belong to the producer's process: once it is
   * gone, CUDA leaves their use undefined. Its batches' host copies stay
   * valid, so say so and let the caller read those. */
  if (tsock__byte_write_locked(g->fd, TSOCK_LOCK_PRODUCER) == 0)
    return tsock__fail(TSOCK_EPRODUCER_GONE,
                       "tsock_batch_cuda_use: the producer died, and its device pool with it; "
                       "batch %llu is still readable in host memory (tensors[i].data)",
                       (unsigned long long)b->seq);
  const tsock_cuda_driver *d = g->d;
  tsock_CUcontext prev = NULL;
  tsock_CUresult rc = tsock__cuda_push_ctx(d, g->ctx, &prev);
  if (rc != TSOCK_CUDA_SUCCESS) return tsock__cuda_fail(d, rc, "cuCtxSetCurrent");
  tsock_CUevent copied = g->copied[hb->slot];
  if (flags & TSOCK_CUDA_SYNC)
    rc = d->cuEventSynchronize(copied);
  else
    rc = d->cuStreamWaitEvent((tsock_CUstream)stream, copied, 0);
  tsock__cuda_pop_ctx(d, g->ctx, prev);
  if (rc != TSOCK_CUDA_SUCCESS)
    return tsock__cuda_fail(d, rc, flags & TSOCK_CUDA_SYNC ? "cuEventSynchronize (the copy)"
                                                           : "cuStreamWaitEvent (the copy)");
  if (hb->stream_set) {
    /* Another stream (a framework that names one per import, another
     * thread's per-thread stream) or mode: each is ordered after the copy,
     * and no single event at release covers them all. */
    hb->several_streams = 1;
    return TSOCK_OK;
  }
  hb->stream = stream;
  hb->use_flags = flags;
  hb->use_thread = this_thread();
  hb->stream_set = 1;
  return TSOCK_OK;
}

int tsock__dlpack_device_where(const char *fn, const tsock_batch_t *b, uint32_t i,
                               tsock_dlpack_where *at) {
  tsock_held_batch *hb = NULL;
  int st = device_batch(b, fn, &hb);
  if (st != TSOCK_OK) return st;
  if (i >= b->n_tensors)
    return tsock__fail(TSOCK_EINVAL, "%s: tensor %u of a batch of %u", fn, i, b->n_tensors);
  device_state *g = hb->device;
  __atomic_add_fetch(&g->refs, 1, __ATOMIC_RELAXED);
  at->data = (uintptr_t)device_ptr(hb, i);
  at->device_id = g->ordinal;
  at->unref = device_unref;
  at->ref = g;
  return TSOCK_OK;
}
