/*
 * reader.c - the reader side of the ring, in plain C so that a trainer
 * process never carries a Go runtime.
 *
 * A reader opens the segment read-only and maps it PROT_READ; the only
 * memory it writes is its own record, which the producer hands it at the
 * join (join.c). It trusts nothing the producer wrote: the header is
 * checked against the geometry rules of layout.h, every slot against its
 * seqlock stamp and the tensor rules.
 *
 * One mechanism a file: the handle tables (handles.c); attach and detach
 * (attach.c), with the join (join.c); acquire and its wait (acquire.c);
 * release and its GPU fences (release.c); slot leases and kept batches
 * (lease.c); DLPack (dlpack.c); the CUDA driver, pinned host memory and
 * the device path (cuda_driver.c, cuda_host.c, cuda_device.c); errors
 * (status.c) and the Linux primitives (platform.c). internal.h declares
 * what crosses files. This file: what the other files and the ABI see of
 * an open reader.
 */
#include "internal.h"

/* Every function here holds a use of the handle while it reads the reader
 * (tsock__handle_get/put). The internal ones (tsock__reader_*) hand out
 * pointers into the reader: their callers, public calls, hold a use of
 * their own for as long as they use them. */

static int payload_range(struct reader_impl *r, const void **base, uint64_t *len) {
  if (base == NULL || len == NULL)
    return tsock__fail(TSOCK_EINVAL, "tsock_reader_payload_range: NULL out-parameter");
  *base = r->payload;
  *len = (r->mask + 1) * r->slot_payload_bytes;
  return TSOCK_OK;
}

int tsock_reader_payload_range(tsock_reader_t *h, const void **base, uint64_t *len) {
  int rc;
  struct reader_impl *r = tsock__handle_get(h, &rc);
  if (r == NULL) return rc;
  rc = payload_range(r, base, len);
  tsock__handle_put(h);
  return rc;
}

int tsock__reader_map(tsock_reader_t *h, tsock_map_ref **m, const void **base, uint64_t *len) {
  int rc;
  struct reader_impl *r = tsock__handle_get(h, &rc);
  if (r == NULL) return rc;
  *m = r->map_ref;
  *base = r->payload;
  *len = (r->mask + 1) * r->slot_payload_bytes;
  tsock__handle_put(h);
  return TSOCK_OK;
}

static int reader_held(struct reader_impl *r, const tsock_batch_t *b, const char *fn,
                       tsock_held_batch **out, tsock_leases **leases) {
  if (b == NULL) return tsock__fail(TSOCK_EINVAL, "%s: batch is NULL", fn);
  /* By address first: b may be anything, and is read only once it is ours. */
  tsock_held_batch *hb = NULL;
  for (uint32_t i = 0; i < r->max_held && hb == NULL; i++)
    if (b == &r->held[i].batch) hb = &r->held[i];
  if (hb == NULL || b->seq < r->released || b->seq >= r->next || !hb->handed ||
      hb->user_released)
    return tsock__fail(TSOCK_ESTATE, "%s: batch is not held by this reader (released, or not "
                                     "one of its batches)", fn);
  int rc = tsock__check_claim(r);
  if (rc != TSOCK_OK) return rc;
  *out = hb;
  *leases = r->leases;
  return TSOCK_OK;
}

int tsock__reader_held(tsock_reader_t *h, const tsock_batch_t *b, const char *fn,
                       tsock_held_batch **out, tsock_leases **leases) {
  int rc;
  struct reader_impl *r = tsock__handle_get(h, &rc);
  if (r == NULL) return rc;
  rc = reader_held(r, b, fn, out, leases);
  tsock__handle_put(h);
  return rc;
}

int tsock_reader_check(tsock_reader_t *h) {
  tsock__clear_error();
  return tsock__reader_claimed(h);
}

int tsock__reader_claimed(tsock_reader_t *h) {
  int rc;
  struct reader_impl *r = tsock__handle_get(h, &rc);
  if (r == NULL) return rc;
  rc = tsock__check_claim(r);
  tsock__handle_put(h);
  return rc;
}

int tsock__reader_view(tsock_reader_t *h, tsock_reader_view *v) {
  int rc;
  struct reader_impl *r = tsock__handle_get(h, &rc);
  if (r == NULL) return rc;
  *v = (tsock_reader_view){.hdr = &r->h, .live = r->live, .slots = r->slots, .rec = r->rec,
                           .slot_count = (uint32_t)(r->mask + 1),
                           .slot_payload_bytes = r->slot_payload_bytes, .fd = r->fd,
                           .device = r->device};
  tsock__handle_put(h);
  return TSOCK_OK;
}

int tsock__reader_set_device(tsock_reader_t *h, void *device, const tsock_device_hooks *hooks) {
  int rc;
  struct reader_impl *r = tsock__handle_get(h, &rc);
  if (r == NULL) return rc;
  if (r->device != NULL) {
    rc = tsock__fail(TSOCK_ESTATE, "reader already has a device");
  } else {
    rc = TSOCK_OK;
    r->device = device;
    r->hooks = hooks;
    for (uint32_t i = 0; i < r->max_held; i++) r->held[i].device = device;
  }
  tsock__handle_put(h);
  return rc;
}
