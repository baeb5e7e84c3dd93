/*
 * shim.c - the producer half of the C ABI in libtsock.so. The public
 * functions live here, in C, so their signatures match include/tsock.h
 * exactly (cgo's generated declarations cannot carry const). They check
 * arguments, refuse to enter the Go runtime in a forked child, and call the
 * Go implementation (exports.go, tsockgo_* symbols).
 */
#include <string.h>

#include "_cgo_export.h"
#include "internal.h"

void tsock_producer_options_init(tsock_producer_options_t *o) {
  if (o == NULL) return;
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->slot_count = 16;
  o->slot_bytes = 1u << 20;
  o->max_readers = 64;
  o->mode = 0600;
  o->gid = -1;
  o->evict_after_ns = 0;
  o->cuda_device = -1;
}

/* The Go runtime does not survive fork(): in a child, fail before entering it. */
static int forked(void) {
  if (tsock__fork_generation() == 0) return 0;
  tsock__fail(TSOCK_EFORKED, "the tsock producer cannot be used in a forked child process");
  return 1;
}

void tsockgo_set_error(const char *msg) { tsock__fail(TSOCK_OK, "%s", msg); }
void tsockgo_track_fd(int fd) { tsock__fork_track(fd); }
void tsockgo_untrack_fd(int fd) { tsock__fork_untrack(fd); }

int tsock_producer_create(const char *name, const tsock_producer_options_t *opts,
                          tsock_producer_t **out) {
  tsock__clear_error();
  if (forked()) return TSOCK_EFORKED;
  if (out == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_producer_create: out is NULL");
  if (name == NULL) return tsock__fail(TSOCK_ENAME, "tsock_producer_create: name is NULL");
  tsock_producer_options_t o;
  tsock_producer_options_init(&o);
  if (opts != NULL) {
    if (opts->size != sizeof *opts)
      return tsock__fail(TSOCK_EINVAL,
                         "producer options: size is %u, expected %zu (call "
                         "tsock_producer_options_init)",
                         opts->size, sizeof *opts);
    o = *opts;
  }
  GoUintptr h = 0;
  int rc = tsockgo_producer_create((char *)name, &o, &h);
  if (rc == TSOCK_OK) *out = (tsock_producer_t *)h;
  return rc;
}

#define ENTER(p)                                                                 \
  do {                                                                           \
    tsock__clear_error();                                                        \
    if (forked()) return TSOCK_EFORKED;                                          \
    if ((p) == NULL) return tsock__fail(TSOCK_EHANDLE, "producer handle is NULL"); \
  } while (0)

int tsock_producer_reserve(tsock_producer_t *p, uint64_t nbytes, int64_t timeout_ns,
                           void **payload) {
  ENTER(p);
  if (payload == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_producer_reserve: payload is NULL");
  return tsockgo_producer_reserve((GoUintptr)p, nbytes, timeout_ns, payload);
}

int tsock_producer_publish(tsock_producer_t *p, const tsock_tensor_t *tensors, uint32_t n,
                           const void *meta, uint32_t meta_len) {
  ENTER(p);
  if (n > 0 && tensors == NULL)
    return tsock__fail(TSOCK_EINVAL, "tsock_producer_publish: %u tensors but tensors is NULL", n);
  if (meta_len > 0 && meta == NULL)
    return tsock__fail(TSOCK_EINVAL, "tsock_producer_publish: meta_len %u but meta is NULL",
                       meta_len);
  return tsockgo_producer_publish((GoUintptr)p, (tsock_tensor_t *)tensors, n, (void *)meta,
                                  meta_len);
}

int tsock_producer_abort(tsock_producer_t *p) {
  ENTER(p);
  return tsockgo_producer_abort((GoUintptr)p);
}

int tsock_producer_end_epoch(tsock_producer_t *p, int64_t timeout_ns) {
  ENTER(p);
  return tsockgo_producer_end_epoch((GoUintptr)p, timeout_ns);
}

int tsock_producer_wait_readers(tsock_producer_t *p, uint32_t n, int64_t timeout_ns) {
  ENTER(p);
  return tsockgo_producer_wait_readers((GoUintptr)p, n, timeout_ns);
}

int tsock_producer_stats(tsock_producer_t *p, tsock_producer_stats_t *stats) {
  ENTER(p);
  if (stats == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_producer_stats: stats is NULL");
  if (stats->size != sizeof *stats)
    return tsock__fail(TSOCK_EINVAL, "tsock_producer_stats: size is %u, expected %zu",
                       stats->size, sizeof *stats);
  return tsockgo_producer_stats((GoUintptr)p, stats);
}

int tsock_producer_close(tsock_producer_t *p) {
  ENTER(p);
  return tsockgo_producer_close((GoUintptr)p);
}
