/*
 * internal.h - private declarations shared by the C files of the reader
 * (and by the producer's C shim in cabi/). Not installed.
 */
#ifndef TSOCK_READER_INTERNAL_H
#define TSOCK_READER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "layout.h"
#include "tsock.h"

/* Hidden: internal symbols stay out of the libraries' exported ABI. */
#define TSOCK_INTERNAL __attribute__((visibility("hidden")))

/* ---- errors (status.c) ---- */

/* Records a detailed message for the calling thread and returns `status`,
 * so failures read `return tsock__fail(TSOCK_EINVAL, "...", ...)`. */
TSOCK_INTERNAL int tsock__fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Like tsock__fail, appending ": strerror(errno)" and mapping errno. */
TSOCK_INTERNAL int tsock__fail_errno(int status, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
TSOCK_INTERNAL void tsock__clear_error(void);

/* ---- platform (platform.c) ---- */

TSOCK_INTERNAL uint64_t tsock__now_ns(void); /* CLOCK_MONOTONIC */
/* futex on a word of a MAP_SHARED mapping; timeout_ns < 0 waits forever. */
TSOCK_INTERNAL void tsock__futex_wait(const uint32_t *word, uint32_t expected, int64_t timeout_ns);
TSOCK_INTERNAL void tsock__futex_wake_all(uint32_t *word);
/* OFD write lock on one byte: 0 on success, -1 if another description holds
 * it, -2 on another error (errno set). */
TSOCK_INTERNAL int tsock__lock_byte(int fd, uint64_t byte);
/* 1 if some other open file description holds a lock on `byte`, 0 if not,
 * -1 on error. */
TSOCK_INTERNAL int tsock__byte_locked(int fd, uint64_t byte);
TSOCK_INTERNAL uint64_t tsock__proc_start_time(int pid); /* 0 if unknown */

/* Fork guard: descriptors registered here are closed in a child process
 * right after fork(), so a child never keeps a parent's liveness lock;
 * tsock__fork_generation() changes in the child. */
TSOCK_INTERNAL void tsock__fork_track(int fd);
TSOCK_INTERNAL void tsock__fork_untrack(int fd);
TSOCK_INTERNAL uint64_t tsock__fork_generation(void);

/* ---- the read-only mapping (reader.c) ----
 * Tensor memory handed out (DLPack descriptors, pinned views) points into
 * the reader's read-only mapping; each such holder keeps a reference, so the
 * mapping outlives a detached reader until the last one is dropped. */
typedef struct tsock_map_ref {
  void *addr;
  size_t len;
  uint32_t refs;
  /* Called once, just before the mapping is unmapped, when set (the CUDA
   * host registration of cuda/host.c undoes itself there). */
  void (*on_unmap)(struct tsock_map_ref *m);
  void *cuda; /* owned by cuda/host.c */
} tsock_map_ref;

TSOCK_INTERNAL void tsock__map_ref(tsock_map_ref *m);
TSOCK_INTERNAL void tsock__map_unref(tsock_map_ref *m);

/* The mapping and payload range of an open reader handle (fails like any
 * call on a bad handle). For cuda/host.c; keeps reader.c free of CUDA, so
 * programs that compile reader.c alone still link. */
TSOCK_INTERNAL int tsock__reader_map(tsock_reader_t *h, tsock_map_ref **m, const void **base,
                                     uint64_t *len);

/* What a reader keeps per held batch; tsock_batch_t is its first member, so
 * a batch pointer leads back to it. */
typedef struct tsock_held_batch {
  tsock_batch_t batch;
  tsock_tensor_t tensors[TSOCK_MAX_TENSORS];
  uint8_t meta[TSOCK_META_MAX];
  int handed; /* handed out to the caller (not skipped or rejected) */
  tsock_map_ref *map;
} tsock_held_batch;

#endif
