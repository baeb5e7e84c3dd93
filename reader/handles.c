/*
 * handles.c - the reader's handle tables. Open readers (tsock_reader_t)
 * and pin tokens (tsock_reader_pin_mapping, tsock_batch_pin) are ids into
 * tables here, never pointers, so that a stale or forged one is detected,
 * not dereferenced; the fork handlers keep both tables usable in a child.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- handle table: handles are ids, so a stale handle is detected, not
 * dereferenced. ---- */

/* An entry per handle. `uses` counts the calls inside the reader right now,
 * whatever their thread (tsock__handle_get .. tsock__handle_put): detach
 * (tsock__handle_take) unregisters the handle first, so no new call gets
 * in, then waits for `uses` to drop to zero before the reader is freed, so
 * that a thread blocked in tsock_reader_acquire while another detaches (an
 * interpreter's exit finalizers, with a daemon thread reading) never runs
 * in freed or unmapped memory. A cache line each: readers used by
 * different threads do not share one. */
static struct handle_entry {
  struct reader_impl *impl; /* atomic */
  uint32_t gen;             /* atomic loads; stored under handle_mu */
  uint32_t uses;            /* atomic */
} __attribute__((aligned(64))) handles[TSOCK_READER_HANDLES];
/* Guards allocation and free of handles. A mutex, not a spinlock: the
 * fork handlers below take it, so a child never inherits it held. */
static pthread_mutex_t handle_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t pin_mu = PTHREAD_MUTEX_INITIALIZER; /* the pin table (below) */

static void handles_lock(void) { pthread_mutex_lock(&handle_mu); }
static void handles_unlock(void) { pthread_mutex_unlock(&handle_mu); }

/* fork() at any instant: the forking thread takes both locks first, so no
 * other thread holds one at the fork, and both sides release them. No code
 * holds one of them while taking the other, or the fork guard's lock
 * (platform.c). That is also why the order in which the two files'
 * constructors install their handlers, which is the link order and so
 * follows the files' names, does not matter: with no lock taken inside
 * another, no order of prepare handlers can deadlock. */
static void tables_prepare(void) {
  pthread_mutex_lock(&handle_mu);
  pthread_mutex_lock(&pin_mu);
}
static void tables_release(void) {
  pthread_mutex_unlock(&pin_mu);
  pthread_mutex_unlock(&handle_mu);
}
/* The child has none of the other threads whose calls `uses` counted: a
 * count left by one would make a detach in the child wait forever. */
static void tables_child(void) {
  for (uint32_t i = 0; i < TSOCK_READER_HANDLES; i++) handles[i].uses = 0;
  tables_release();
}
__attribute__((constructor)) static void tables_fork_safe(void) {
  pthread_atfork(tables_prepare, tables_release, tables_child);
}

tsock_reader_t *tsock__handle_new(struct reader_impl *impl) {
  tsock_reader_t *h = NULL;
  handles_lock();
  for (uint32_t i = 0; i < TSOCK_READER_HANDLES; i++) {
    if (handles[i].impl == NULL) {
      uint32_t gen = handles[i].gen + 1;
      __atomic_store_n(&handles[i].gen, gen, __ATOMIC_SEQ_CST);
      __atomic_store_n(&handles[i].impl, impl, __ATOMIC_SEQ_CST);
      h = (tsock_reader_t *)(uintptr_t)(((uint64_t)gen << 16) | (i + 1));
      break;
    }
  }
  handles_unlock();
  return h;
}

/* The entry index of h, or -1 when h cannot name one. */
static int64_t handle_index(tsock_reader_t *h) {
  uint32_t i = (uint32_t)((uint64_t)(uintptr_t)h & 0xffff) - 1;
  return h == NULL || i >= TSOCK_READER_HANDLES ? -1 : (int64_t)i;
}

/* The reader of entry i if h is its open handle, else NULL with *status. */
static struct reader_impl *lookup(tsock_reader_t *h, int64_t i, int *status) {
  if (i < 0 || __atomic_load_n(&handles[i].gen, __ATOMIC_SEQ_CST) !=
                   (uint32_t)((uint64_t)(uintptr_t)h >> 16)) {
    *status = tsock__fail(TSOCK_EHANDLE, "reader handle %p is not open", (void *)h);
    return NULL;
  }
  struct reader_impl *impl = __atomic_load_n(&handles[i].impl, __ATOMIC_SEQ_CST);
  if (impl == NULL || impl == (struct reader_impl *)(uintptr_t)1) {
    *status = tsock__fail(TSOCK_EHANDLE, "reader handle %p is not open", (void *)h);
    return NULL;
  }
  if (impl->fork_gen != tsock__fork_generation()) {
    *status = tsock__fail(TSOCK_EFORKED,
                          "reader handle %p belongs to the parent process; attach again", (void *)h);
    return NULL;
  }
  return impl;
}

/* The entries this thread is inside a call on (index + 1, innermost last;
 * deeper than MY_CALLS, from signal handlers nesting calls, is counted but
 * not recorded): a detach made from inside one (a signal handler that
 * interrupted a call on the same reader) would wait for its own call for
 * ever, so it is refused instead (review 32, F5). Small on purpose: the
 * library's thread-local storage comes out of glibc's static TLS reserve,
 * which other libraries need too (review 34, B1). */
#define MY_CALLS 4
static _Thread_local uint16_t my_calls[MY_CALLS];
static _Thread_local uint32_t my_depth;

/* A signal handler may run between any two steps, and make calls of its
 * own: the depth is taken before the slot is written (a handler then uses
 * the next slot, not ours) and given back after it is cleared; the signal
 * fences keep the compiler from reordering the steps (review 35, C1). A
 * handler that runs before our slot is written cannot wait for us: our use
 * is counted after it (tsock__handle_get). */
static void my_enter(int64_t i) {
  uint32_t d = my_depth;
  my_depth = d + 1;
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  if (d < MY_CALLS) my_calls[d] = (uint16_t)(i + 1);
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

static void my_leave(void) {
  uint32_t d = my_depth - 1;
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  if (d < MY_CALLS) my_calls[d] = 0;
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  my_depth = d;
}

static int my_inside(int64_t i) {
  for (uint32_t k = 0; k < my_depth && k < MY_CALLS; k++)
    if (my_calls[k] == (uint16_t)(i + 1)) return 1;
  return 0;
}

struct reader_impl *tsock__handle_get(tsock_reader_t *h, int *status) {
  int64_t i = handle_index(h);
  if (i < 0) return lookup(h, i, status);
  /* The use first, then the checks; detach unregisters first, then reads
   * the uses (both sequentially consistent): either this call sees the
   * handle gone, or detach sees this use and waits for it. */
  /* Recorded before the use and dropped after it (review 34, B4): a
   * signal handler that detaches in between sees the use as this thread's. */
  my_enter(i);
  __atomic_add_fetch(&handles[i].uses, 1, __ATOMIC_SEQ_CST);
  struct reader_impl *impl = lookup(h, i, status);
  if (impl == NULL) {
    __atomic_sub_fetch(&handles[i].uses, 1, __ATOMIC_RELEASE);
    my_leave();
  }
  return impl;
}

void tsock__handle_put(tsock_reader_t *h) {
  __atomic_sub_fetch(&handles[handle_index(h)].uses, 1, __ATOMIC_RELEASE);
  my_leave();
}

#define TAKEN ((struct reader_impl *)(uintptr_t)1) /* detached, draining */
#define DETACH_POLL_NS 1000000ll /* how often detach looks whether other calls have left */

struct reader_impl *tsock__handle_take(tsock_reader_t *h, int *status) {
  int64_t i = handle_index(h);
  if (i >= 0 && my_inside(i)) {
    *status = tsock__fail(TSOCK_ESTATE,
                          "tsock_reader_detach: called from inside a call on the same reader "
                          "(a signal handler?); detach it after that call returns");
    return NULL;
  }
  handles_lock();
  struct reader_impl *impl = lookup(h, i, status);
  if (impl != NULL) {
    __atomic_store_n(&handles[i].gen, handles[i].gen + 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&handles[i].impl, TAKEN, __ATOMIC_SEQ_CST);
  }
  handles_unlock();
  if (impl == NULL) return NULL;
  /* Calls of other threads still inside the reader: an acquire waiting for
   * a batch sees `closing` and returns TSOCK_EHANDLE (woken from its sleep
   * on the published word: other readers sleeping there wake too, and sleep
   * again); the others are short. The reader is freed after the last. */
  uint32_t n = __atomic_load_n(&handles[i].uses, __ATOMIC_SEQ_CST);
  if (n != 0) {
    __atomic_store_n(&impl->closing, 1, __ATOMIC_SEQ_CST);
    /* Woken again at every poll: an acquire that read `closing` just
     * before it was set sleeps after the first wake. */
    while ((n = __atomic_load_n(&handles[i].uses, __ATOMIC_ACQUIRE)) != 0) {
      tsock__futex_wake_all((uint32_t *)(uintptr_t)&impl->live->published);
      tsock__futex_wait(&handles[i].uses, n, DETACH_POLL_NS);
    }
  }
  /* The entry stays reserved (impl = TAKEN) until now: a reader attached
   * meanwhile must not share the `uses` this detach waited on. */
  handles_lock();
  __atomic_store_n(&handles[i].impl, NULL, __ATOMIC_SEQ_CST);
  handles_unlock();
  return impl;
}

/* ---- pin tokens: handles too, so that a second unpin of a token (which
 * would drop a reference someone else owns and unmap memory a live tensor
 * uses) or a token that was never handed out is detected, not trusted.
 * A token is (generation << PIN_INDEX_BITS) | (index + 1); the generation
 * of an entry changes at every unpin. ---- */

#define PIN_INDEX_BITS 24u
#define PIN_MAX ((1u << PIN_INDEX_BITS) - 1u)
static struct pin_entry {
  void *obj; /* NULL: free */
  void (*drop)(void *);
  uint64_t gen;
} *pins;
static uint32_t pin_cap;

int tsock__pin_add(void (*drop)(void *), void *obj, void **token) {
  pthread_mutex_lock(&pin_mu);
  uint32_t i = 0;
  while (i < pin_cap && pins[i].obj != NULL) i++;
  if (i == pin_cap) {
    uint32_t cap = pin_cap == 0 ? 16 : pin_cap * 2;
    struct pin_entry *grown = cap <= PIN_MAX ? realloc(pins, cap * sizeof *pins) : NULL;
    if (grown == NULL) {
      pthread_mutex_unlock(&pin_mu);
      return tsock__fail(TSOCK_ENOMEM, "pin: out of memory (%u pins)", pin_cap);
    }
    memset(grown + pin_cap, 0, (cap - pin_cap) * sizeof *pins);
    pins = grown;
    pin_cap = cap;
  }
  pins[i].obj = obj;
  pins[i].drop = drop;
  pins[i].gen = (pins[i].gen + 1) & ((1ull << (64 - PIN_INDEX_BITS)) - 1);
  if (pins[i].gen == 0) pins[i].gen = 1;
  if (token != NULL) *token = (void *)(uintptr_t)((pins[i].gen << PIN_INDEX_BITS) | (i + 1));
  pthread_mutex_unlock(&pin_mu);
  return TSOCK_OK;
}

int tsock__pin_take(const void *obj, void (*drop)(void *)) {
  int found = 0;
  pthread_mutex_lock(&pin_mu);
  for (uint32_t i = 0; obj != NULL && i < pin_cap && !found; i++) {
    if (pins[i].obj == obj && pins[i].drop == drop) {
      pins[i].obj = NULL;
      found = 1;
    }
  }
  pthread_mutex_unlock(&pin_mu);
  return found;
}

static void drop_map(void *m) { tsock__map_unref(m); }

int tsock_reader_pin_mapping(tsock_reader_t *h, void **token) {
  int rc;
  struct reader_impl *r = tsock__handle_get(h, &rc);
  if (r == NULL) return rc;
  if (token == NULL) {
    rc = tsock__fail(TSOCK_EINVAL, "tsock_reader_pin_mapping: token is NULL");
  } else {
    tsock__map_ref(r->map_ref);
    rc = tsock__pin_add(drop_map, r->map_ref, token);
    if (rc != TSOCK_OK) tsock__map_unref(r->map_ref);
  }
  tsock__handle_put(h);
  return rc;
}

int tsock_mapping_unpin(void *token) {
  tsock__clear_error();
  uint64_t v = (uint64_t)(uintptr_t)token;
  uint64_t idx = v & ((1ull << PIN_INDEX_BITS) - 1);
  struct pin_entry e = {0};
  pthread_mutex_lock(&pin_mu);
  if (idx != 0 && idx <= pin_cap && pins[idx - 1].obj != NULL &&
      pins[idx - 1].gen == v >> PIN_INDEX_BITS) {
    e = pins[idx - 1];
    pins[idx - 1].obj = NULL;
  }
  pthread_mutex_unlock(&pin_mu);
  if (e.obj == NULL)
    return tsock__fail(TSOCK_EHANDLE, "tsock_mapping_unpin: %p is not a pin token in use "
                                      "(already unpinned, or never returned by "
                                      "tsock_reader_pin_mapping or tsock_batch_pin)",
                       token);
  e.drop(e.obj); /* outside the lock: it may unmap and call CUDA */
  return TSOCK_OK;
}
