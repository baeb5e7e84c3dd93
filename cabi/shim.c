/*
 * shim.c - the producer half of the C ABI in libtsock.so. The public
 * functions live here, in C, so their signatures match include/tsock.h
 * exactly (cgo's generated declarations cannot carry const). They check
 * arguments, refuse to enter the Go runtime in a forked child, and call the
 * Go implementation (exports.go, tsockgo_* symbols).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../producer/defaults.h"
#include "_cgo_export.h"
#include "internal.h"

void tsock_producer_options_init(tsock_producer_options_t *o) {
  if (o == NULL) return;
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->slot_count = TSOCK_DEFAULT_SLOT_COUNT; /* the producer's defaults (producer/defaults.h) */
  o->slot_bytes = TSOCK_DEFAULT_SLOT_BYTES;
  o->max_readers = TSOCK_DEFAULT_MAX_READERS;
  o->mode = TSOCK_DEFAULT_MODE;
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

/* ---- the producer's fork guard ----
 * The producer's descriptors that hold (or may come to hold) an OFD lock:
 * its segment's producer lock, and a dead producer's segment while it is
 * reclaimed. A child forked without exec must not keep any of them, or a
 * dead parent's lock stays held for the child's lifetime. Each is opened
 * and closed by Go inside tsockgo_fork_hold/unhold, whose mutex the atfork
 * prepare handler also takes: fork() cannot run between the open and the
 * registration, nor between the unregistration and the close, so at every
 * fork each such descriptor is either registered (closed in the child) or
 * not open. The list is the producer's own, not the reader's
 * (reader/platform.c): the hold never waits for another lock, so it cannot
 * deadlock against the reader's handlers, whatever their order. */
static pthread_mutex_t pfork_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t pfork_once = PTHREAD_ONCE_INIT;
static int *pfork_fds;
static size_t pfork_n, pfork_cap;

static void pfork_prepare(void) { pthread_mutex_lock(&pfork_mu); }
static void pfork_parent(void) { pthread_mutex_unlock(&pfork_mu); }
static void pfork_child(void) {
  for (size_t i = 0; i < pfork_n; i++) close(pfork_fds[i]);
  pfork_n = 0;
  pthread_mutex_unlock(&pfork_mu);
}
static void pfork_install(void) { pthread_atfork(pfork_prepare, pfork_parent, pfork_child); }

/* Installed at load, like the reader's guard, so no fork can precede it. */
__attribute__((constructor)) static void pfork_at_load(void) {
  pthread_once(&pfork_once, pfork_install);
}

/* They return an int only because cgo's prologue for a void(void) function
 * does not compile with -Wextra -Werror. */
int tsockgo_fork_hold(void) {
  pthread_once(&pfork_once, pfork_install);
  return pthread_mutex_lock(&pfork_mu);
}
int tsockgo_fork_unhold(void) { return pthread_mutex_unlock(&pfork_mu); }

/* Under the hold. Returns 0, or -1 when out of memory (the caller closes
 * the descriptor: an untracked one must not stay open). */
int tsockgo_fork_track_held(int fd) {
  if (pfork_n == pfork_cap) {
    size_t cap = pfork_cap ? 2 * pfork_cap : 16;
    int *n = realloc(pfork_fds, cap * sizeof *n);
    if (n == NULL) return -1;
    pfork_fds = n;
    pfork_cap = cap;
  }
  pfork_fds[pfork_n++] = fd;
  return 0;
}

/* Under the hold, just before the descriptor is closed. */
void tsockgo_fork_untrack_held(int fd) {
  for (size_t i = 0; i < pfork_n; i++) {
    if (pfork_fds[i] == fd) {
      pfork_fds[i] = pfork_fds[--pfork_n];
      return;
    }
  }
}

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

int tsock_producer_reader_pids(tsock_producer_t *p, int32_t *pids, uint32_t cap, uint32_t *count) {
  ENTER(p);
  if (count == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_producer_reader_pids: count is NULL");
  if (pids == NULL && cap != 0)
    return tsock__fail(TSOCK_EINVAL, "tsock_producer_reader_pids: pids is NULL with cap %u", cap);
  return tsockgo_producer_reader_pids((GoUintptr)p, pids, cap, count);
}

int tsock_producer_close(tsock_producer_t *p) {
  ENTER(p);
  return tsockgo_producer_close((GoUintptr)p);
}

int tsock_producer_peek(const char *name, uint64_t back, tsock_peek_t *out) {
  tsock__clear_error();
  if (forked()) return TSOCK_EFORKED;
  if (name == NULL) return tsock__fail(TSOCK_ENAME, "tsock_producer_peek: name is NULL");
  if (out == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_producer_peek: out is NULL");
  if (out->size != sizeof *out)
    return tsock__fail(TSOCK_EINVAL, "tsock_producer_peek: size is %u, expected %zu", out->size,
                       sizeof *out);
  return tsockgo_producer_peek((char *)name, back, out);
}
