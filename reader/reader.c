/*
 * reader.c - the reader side of the ring, in plain C so that a trainer
 * process never carries a Go runtime.
 *
 * A reader opens the segment read-only and maps it PROT_READ; the only
 * memory it writes is its own record, which the producer hands it at the
 * join (join.c). It trusts nothing the producer wrote: the header is
 * checked against the geometry rules of layout.h, every slot against its
 * seqlock stamp and the tensor rules.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define LIVENESS_PERIOD_NS 50000000ll /* check the producer's lock this often while idle */
#define SLEEP_SLICE_NS 50000000ll     /* longest single futex sleep */
#define FENCE_POLL_NS 100000ll       /* poll our own GPU fences this often while waiting */
#define ATTACH_POLL_NS 5000000ll      /* retry period while waiting for a channel */
#define MAX_HELD 64u

typedef tsock_held_batch held_batch;

struct reader_impl {
  int fd;
  uint64_t fork_gen;
  const uint8_t *map; /* whole segment, read-only */
  size_t map_len;
  tsock_map_ref *map_ref; /* owns `map` once attached */
  tsock_leases *leases; /* the current mapping of each slot's payload (lease.c) */
  int send_fd; /* the mapping's descriptor, sent as the join's proof, then closed */
  int sock;    /* connection to the producer (join.c), open while attached */
  /* The header as validated at attach, private: every value the reader
   * derives pointers, sizes or decisions from comes from here, never again
   * from the shared page, which the producer (or anyone who can write the
   * file) may change after the check. */
  tsock_header h;
  /* The live header page: only the words that change while the channel
   * runs (published, state, producer_waiting, epoch_start), each used in a
   * way a wrong value cannot turn into a bad address. */
  const tsock_header *live;
  const tsock_slot *slots;
  const uint8_t *payload;
  uint64_t mask;
  uint64_t slot_payload_bytes;
  uint32_t index;        /* our roster entry */
  const tsock_roster_entry *entry; /* in the read-only mapping: the producer's verdict */
  tsock_reader_record *rec; /* ours, read-write (a memfd of our own) */
  uint64_t claim;        /* our entry's claim word while active */
  uint64_t next;         /* next seq to acquire */
  uint64_t released;     /* every seq below is released (mirror of rec->cursor) */
  int skipping;          /* TSOCK_START_NEXT_EPOCH: drop batches until index 0 */
  int producer_dead;     /* the producer's lock was seen free */
  uint32_t max_held;       /* at most the slot count (see attach) */
  uint32_t max_held_asked; /* the option, for messages */
  int64_t spin_ns;
  uint64_t last_live_check;
  held_batch *held;      /* max_held entries, by seq % max_held */
  /* GPU (cuda/device.c): released batches held back by fences */
  void *device;
  const tsock_device_hooks *hooks;
  uint32_t fenced; /* held batches with an armed fence */
};

/* ---- handle table: handles are ids, so a stale handle is detected, not
 * dereferenced. ---- */

#define HANDLE_SLOTS 1024u
static struct {
  struct reader_impl *impl;
  uint32_t gen;
} handles[HANDLE_SLOTS];
/* Guards allocation and free of handles. A mutex, not a spinlock: the
 * fork handlers below take it, so a child never inherits it held. */
static pthread_mutex_t handle_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t pin_mu = PTHREAD_MUTEX_INITIALIZER; /* the pin table (below) */

static void handles_lock(void) { pthread_mutex_lock(&handle_mu); }
static void handles_unlock(void) { pthread_mutex_unlock(&handle_mu); }

/* fork() at any instant: the forking thread takes both locks first, so no
 * other thread holds one at the fork, and both sides release them. No code
 * holds one of them while taking the other, or the fork guard's lock. */
static void tables_prepare(void) {
  pthread_mutex_lock(&handle_mu);
  pthread_mutex_lock(&pin_mu);
}
static void tables_release(void) {
  pthread_mutex_unlock(&pin_mu);
  pthread_mutex_unlock(&handle_mu);
}
__attribute__((constructor)) static void tables_fork_safe(void) {
  pthread_atfork(tables_prepare, tables_release, tables_release);
}

static tsock_reader_t *handle_new(struct reader_impl *impl) {
  tsock_reader_t *h = NULL;
  handles_lock();
  for (uint32_t i = 0; i < HANDLE_SLOTS; i++) {
    if (handles[i].impl == NULL) {
      handles[i].gen++;
      __atomic_store_n(&handles[i].impl, impl, __ATOMIC_RELEASE);
      h = (tsock_reader_t *)(uintptr_t)(((uint64_t)handles[i].gen << 16) | (i + 1));
      break;
    }
  }
  handles_unlock();
  return h;
}

static struct reader_impl *handle_get(tsock_reader_t *h, int *status) {
  uint64_t v = (uint64_t)(uintptr_t)h;
  uint32_t i = (uint32_t)(v & 0xffff) - 1;
  if (h == NULL || i >= HANDLE_SLOTS || handles[i].gen != (uint32_t)(v >> 16)) {
    *status = tsock__fail(TSOCK_EHANDLE, "reader handle %p is not open", (void *)h);
    return NULL;
  }
  struct reader_impl *impl = __atomic_load_n(&handles[i].impl, __ATOMIC_ACQUIRE);
  if (impl == NULL) {
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

static struct reader_impl *handle_take(tsock_reader_t *h, int *status) {
  handles_lock();
  struct reader_impl *impl = handle_get(h, status);
  if (impl != NULL) {
    uint32_t i = (uint32_t)((uint64_t)(uintptr_t)h & 0xffff) - 1;
    handles[i].gen++;
    __atomic_store_n(&handles[i].impl, NULL, __ATOMIC_RELEASE);
  }
  handles_unlock();
  return impl;
}

/* ---- options ---- */

void tsock_reader_options_init(tsock_reader_options_t *o) {
  if (o == NULL) return;
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->start = TSOCK_START_NEXT_EPOCH;
  o->attach_timeout_ns = 0;
  o->max_held = 4;
  o->spin_ns = 20000;
}

static int options_read(const tsock_reader_options_t *in, tsock_reader_options_t *o) {
  tsock_reader_options_init(o);
  if (in == NULL) return TSOCK_OK;
  if (in->size != sizeof *in)
    return tsock__fail(TSOCK_EINVAL,
                       "reader options: size is %u, expected %zu (call tsock_reader_options_init)",
                       in->size, sizeof *in);
  *o = *in;
  if (o->start != TSOCK_START_NEXT_EPOCH && o->start != TSOCK_START_NOW)
    return tsock__fail(TSOCK_EINVAL, "reader options: unknown start mode %d", o->start);
  if (o->max_held < 1 || o->max_held > MAX_HELD)
    return tsock__fail(TSOCK_EINVAL, "reader options: max_held %u outside 1..%u", o->max_held,
                       MAX_HELD);
  if (o->reserved != 0) return tsock__fail(TSOCK_EINVAL, "reader options: reserved must be 0");
  if (o->spin_ns < 0) return tsock__fail(TSOCK_EINVAL, "reader options: negative spin_ns");
  return TSOCK_OK;
}

/* ---- attach ---- */

void tsock__map_ref(tsock_map_ref *m) { __atomic_add_fetch(&m->refs, 1, __ATOMIC_RELAXED); }

void tsock__map_unref(tsock_map_ref *m) {
  if (m != NULL && __atomic_sub_fetch(&m->refs, 1, __ATOMIC_ACQ_REL) == 0) {
    if (m->on_unmap != NULL) m->on_unmap(m);
    tsock__map_unmap(m); /* all but the ranges kept batches own (lease.c) */
    free(m);
  }
}

static void impl_unmap(struct reader_impl *r) {
  tsock_join j = {.sock = r->sock, .rec = r->rec};
  tsock__join_leave(&j); /* the producer sees our connection end */
  tsock__fork_close(r->send_fd);
  for (uint32_t i = 0; r->held != NULL && i < r->max_held; i++)
    tsock__lease_hold(&r->held[i].lease, NULL);
  if (r->leases != NULL) tsock__leases_close(r->leases);
  if (r->map_ref != NULL)
    tsock__map_unref(r->map_ref);
  else if (r->map != NULL)
    munmap((void *)r->map, r->map_len);
  tsock__fork_close(r->fd); /* drops our OFD lock on the entry's byte */
  free(r->held);
  free(r);
}

/* Checks the header of an open segment against layout.h, with a message. */
static int check_header(const tsock_header *h, uint64_t file_size, const char *name) {
  int why;
  int rc = tsock_layout_check_header(h, file_size, &why);
  switch (rc) {
  case TSOCK_OK:
    return rc;
  case TSOCK_EAGAIN:
    return tsock__fail(rc, "channel '%s' is still being created", name);
  case TSOCK_EVERSION:
    return tsock__fail(rc, "channel '%s': segment layout version %u, this library reads version %u",
                       name, h->layout_version, TSOCK_LAYOUT_VERSION);
  default:
    if (why == TSOCK_HEADER_FILE_SIZE)
      return tsock__fail(rc, "channel '%s': segment is %llu bytes, header says %llu (truncated?)",
                         name, (unsigned long long)file_size, (unsigned long long)h->total_bytes);
    return tsock__fail(rc, "channel '%s': %s", name, tsock_layout_header_fault_str(why));
  }
}

static int map_segment(struct reader_impl *r, int mfd, const struct stat *st, const char *path,
                       const char *name);

/* A second open file description of the file open at fd (path names it,
 * or did): through /proc/self/fd, which opens that very file even when the
 * name has gone or names another file since (a new producer replacing a
 * dead one), else, without /proc, through the name. Read-only, as every
 * open of the segment by a reader. -1 with errno. */
static int reopen(int fd, const char *path) {
  int m = tsock__fork_reopen(fd);
  if (m >= 0 || errno != ENOENT) return m;
  return tsock__fork_open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
}

/* Opens and maps the segment (st: the file's status). TSOCK_EAGAIN means
 * "not there yet, retry". */
static int open_segment(const char *name, struct reader_impl *r, struct stat *st_out) {
  char path[sizeof(TSOCK_SHM_DIR) + sizeof(TSOCK_SHM_PREFIX) + TSOCK_NAME_MAX + 2];
  snprintf(path, sizeof path, "%s/%s%s", TSOCK_SHM_DIR, TSOCK_SHM_PREFIX, name);
  r->fd = tsock__fork_open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (r->fd < 0) {
    if (errno == ENOENT) return tsock__fail(TSOCK_ENOENT, "no channel '%s' (%s)", name, path);
    if (errno == ELOOP)
      return tsock__fail(TSOCK_ECORRUPT, "channel '%s': %s is a symbolic link; not followed", name,
                         path);
    return tsock__fail_errno(TSOCK_ESYS, errno, "open %s", path);
  }
  struct stat st;
  if (fstat(r->fd, &st) != 0) return tsock__fail_errno(TSOCK_ESYS, errno, "fstat %s", path);
  *st_out = st;
  if (!S_ISREG(st.st_mode))
    return tsock__fail(TSOCK_ECORRUPT, "channel '%s': %s is not a regular file", name, path);
  if ((uint64_t)st.st_size < sizeof(tsock_header))
    return tsock__fail(TSOCK_ECORRUPT, "channel '%s': segment is %lld bytes, truncated", name,
                       (long long)st.st_size);
  /* The mappings are made through a second open of the file, never through
   * r->fd: a mapping holds the open file description it was made from, and
   * a forked child inherits mappings (the fork guard closes descriptors, it
   * cannot unmap). Mapped from r->fd, the description that carries our
   * record lock would live on in such a child after we die, and the
   * producer would wait for a dead reader as long as the child lives. */
  r->send_fd = reopen(r->fd, path);
  if (r->send_fd < 0 && errno == ENOENT)
    return tsock__fail(TSOCK_EAGAIN, "channel '%s' was replaced while attaching", name);
  if (r->send_fd < 0) return tsock__fail_errno(TSOCK_ESYS, errno, "open %s", path);
  return map_segment(r, r->send_fd, &st, path, name); /* send_fd is closed after the join */
}

/* open_segment's second half: reads the header once into r->h, checks
 * that private copy, and maps the segment through mfd at its geometry. */
static int map_segment(struct reader_impl *r, int mfd, const struct stat *st, const char *path,
                       const char *name) {
  struct stat st2;
  if (fstat(mfd, &st2) != 0) return tsock__fail_errno(TSOCK_ESYS, errno, "fstat %s", path);
  if (st2.st_dev != st->st_dev || st2.st_ino != st->st_ino)
    return tsock__fail(TSOCK_EAGAIN, "channel '%s' was replaced while attaching", name);
  ssize_t n = pread(mfd, &r->h, sizeof r->h, 0);
  if (n < 0) return tsock__fail_errno(TSOCK_ESYS, errno, "read %s", path);
  if ((size_t)n != sizeof r->h)
    return tsock__fail(TSOCK_ECORRUPT, "channel '%s': segment is %zd bytes, truncated", name, n);
  __atomic_thread_fence(__ATOMIC_ACQUIRE); /* pairs with the release store of layout_version */
  int rc = check_header(&r->h, (uint64_t)st->st_size, name);
  if (rc != TSOCK_OK) return rc;
  /* The join window only means something below the ring (the producer
   * refuses others, docs/ARCHITECTURE.md, "Late join window"); a larger
   * one, which layout.h's rule lets through, is taken as none. */
  if (r->h.join_window >= r->h.slot_count) r->h.join_window = 0;

  r->map_len = (size_t)r->h.total_bytes;
  void *m = mmap(NULL, r->map_len, PROT_READ, MAP_SHARED, mfd, 0);
  if (m == MAP_FAILED) return tsock__fail_errno(TSOCK_ESYS, errno, "mmap %s", path);
  r->map = m;
  r->map_ref = malloc(sizeof *r->map_ref);
  if (r->map_ref == NULL) return tsock__fail(TSOCK_ENOMEM, "tsock_reader_attach: out of memory");
  *r->map_ref = (tsock_map_ref){.addr = m, .len = r->map_len, .refs = 1};
  r->live = (const tsock_header *)r->map;
  r->slots = (const tsock_slot *)(r->map + r->h.slots_offset);
  r->payload = r->map + r->h.payload_offset;
  r->mask = r->h.slot_count - 1;
  r->slot_payload_bytes = r->h.slot_payload_bytes;
  return TSOCK_OK;
}

static int producer_alive(struct reader_impl *r) {
  return tsock__byte_write_locked(r->fd, TSOCK_LOCK_PRODUCER) != 0; /* error: assume alive */
}

/* Joins the channel (join.c): the producer gives us a roster entry, our
 * record and where to start (it stored that start in our record and
 * gates on it from before any batch it could overwrite; the late join
 * window is decided there too: docs/ARCHITECTURE.md, "Joining"). Then we
 * mark our presence with a read lock on the entry's byte. */
static int join_channel(struct reader_impl *r, const struct stat *st, const char *name,
                        int start_mode, uint64_t attach_start, int64_t attach_timeout_ns) {
  tsock_join j;
  int rc = tsock__join(&r->h, r->send_fd, (uint32_t)st->st_uid, (uint32_t)start_mode, attach_start,
                       attach_timeout_ns, name, &j);
  /* A closing producer stops accepting readers: say closed, not gone. */
  if (rc == TSOCK_EPRODUCER_GONE &&
      __atomic_load_n(&r->live->state, __ATOMIC_ACQUIRE) == TSOCK_STATE_CLOSED)
    return tsock__fail(TSOCK_ECLOSED, "channel '%s': closed by the producer", name);
  if (rc != TSOCK_OK) return rc;
  r->sock = j.sock;
  r->rec = j.rec;
  r->index = j.index;
  r->claim = j.claim;
  r->entry = (const tsock_roster_entry *)(r->map + r->h.roster_offset) + j.index;
  r->next = r->released = j.start;
  /* Nothing published yet: the stream starts here, so nothing is skipped,
   * not even a leading epoch-end marker (a successor producer's first
   * publication can end an epoch its predecessor published whole). */
  r->skipping = start_mode == TSOCK_START_NEXT_EPOCH && !j.in_window && j.start > 0;
  if (tsock__lock_byte_shared(r->fd, TSOCK_LOCK_READER0 + j.index) == -2)
    return tsock__fail_errno(TSOCK_ESYS, errno, "channel '%s': lock reader entry %u", name, j.index);
  /* The producer gated on us from the join on; it counts us as attached
   * (tsock_producer_wait_readers) from here on. */
  __atomic_store_n(&r->rec->attached, 1, __ATOMIC_RELEASE);
  return TSOCK_OK;
}

int tsock_reader_attach(const char *name, const tsock_reader_options_t *opts,
                        tsock_reader_t **out) {
  tsock__clear_error();
  if (out == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_reader_attach: out is NULL");
  if (!tsock_layout_name_ok(name))
    return tsock__fail(TSOCK_ENAME, "channel name '%.80s' is not 1..%d of [A-Za-z0-9._-]",
                       name ? name : "(null)", TSOCK_NAME_MAX);
  tsock_reader_options_t o;
  int rc = options_read(opts, &o);
  if (rc != TSOCK_OK) return rc;

  uint64_t start = tsock__now_ns();
  for (;;) {
    struct reader_impl *r = calloc(1, sizeof *r);
    if (r == NULL) return tsock__fail(TSOCK_ENOMEM, "tsock_reader_attach: out of memory");
    r->fd = r->send_fd = r->sock = -1;
    struct stat st = {0};
    rc = open_segment(name, r, &st);
    if (rc == TSOCK_OK && !producer_alive(r))
      rc = tsock__fail(TSOCK_EPRODUCER_GONE, "channel '%s': its producer is gone", name);
    if (rc == TSOCK_OK) {
      r->fork_gen = tsock__fork_generation();
      /* A reader never needs to hold more than the ring: with max_held >
       * slot_count, holding every slot it would wait in acquire for a
       * batch the producer can only publish once it releases one (a
       * deadlock of the whole ring). Clamped, it always either gets the
       * next batch or is told to release one (TSOCK_ESTATE). Silently,
       * since the default (4) must work on a 2-slot ring. */
      r->max_held = o.max_held < r->mask + 1 ? o.max_held : (uint32_t)(r->mask + 1);
      r->max_held_asked = o.max_held;
      r->spin_ns = o.spin_ns;
      r->held = calloc(r->max_held, sizeof *r->held);
      r->leases = tsock__leases_open(r->map_ref, r->payload, r->h.payload_offset,
                                     (uint32_t)(r->mask + 1), r->slot_payload_bytes, r->fd);
      rc = r->held && r->leases ? join_channel(r, &st, name, o.start, start, o.attach_timeout_ns)
                                : tsock__fail(TSOCK_ENOMEM, "tsock_reader_attach: out of memory");
      tsock__fork_close(r->send_fd); /* the mapping keeps the file */
      r->send_fd = -1;
    }
    if (rc == TSOCK_OK) {
      tsock_reader_t *h = handle_new(r);
      if (h == NULL) {
        impl_unmap(r);
        return tsock__fail(TSOCK_ENOMEM, "more than %u readers open in this process",
                           HANDLE_SLOTS);
      }
      *out = h;
      tsock__clear_error();
      return TSOCK_OK;
    }
    impl_unmap(r);
    /* Worth waiting for: no file yet, one being built, one left by a dead
     * producer that a new producer will replace, a producer too busy to
     * take the join. */
    int retry = rc == TSOCK_ENOENT || rc == TSOCK_EAGAIN || rc == TSOCK_EPRODUCER_GONE;
    int64_t waited = (int64_t)(tsock__now_ns() - start);
    if (!retry || o.attach_timeout_ns == 0 ||
        (o.attach_timeout_ns > 0 && waited >= o.attach_timeout_ns)) {
      if (rc == TSOCK_EAGAIN) rc = TSOCK_ETIMEDOUT; /* with the message of why */
      return rc;
    }
    struct timespec ts = {0, ATTACH_POLL_NS};
    nanosleep(&ts, NULL);
  }
}

/* ---- acquire ---- */

static int check_claim(struct reader_impl *r) {
  uint64_t c = __atomic_load_n(&r->entry->claim, __ATOMIC_ACQUIRE);
  if (c == r->claim) return TSOCK_OK;
  if (TSOCK_CLAIM_STATE(c) == TSOCK_READER_EVICTED)
    return tsock__fail(TSOCK_EEVICTED, "reader %u was evicted: it held the producer back too long",
                       r->index);
  return tsock__fail(TSOCK_EEVICTED, "reader entry %u was taken from this reader", r->index);
}

/* Copies slot `seq` into a held batch and checks it. Returns TSOCK_OK,
 * TSOCK_EEVICTED when the slot was overwritten under us, TSOCK_ECORRUPT
 * when the producer wrote something invalid. */
static int copy_slot(struct reader_impl *r, uint64_t seq, held_batch *hb) {
  const tsock_slot *s = &r->slots[seq & r->mask];
  uint64_t stamp = __atomic_load_n(&s->stamp, __ATOMIC_ACQUIRE);
  if (stamp != seq + 1) {
    int rc = check_claim(r);
    if (rc != TSOCK_OK) return rc;
    return tsock__fail(TSOCK_EEVICTED, "slot of batch %llu holds stamp %llu: overwritten",
                       (unsigned long long)seq, (unsigned long long)stamp);
  }
  tsock_batch_t *b = &hb->batch;
  b->seq = seq;
  b->epoch = s->epoch;
  b->index = s->index;
  b->flags = s->flags;
  b->n_tensors = s->n_tensors;
  b->meta_len = s->meta_len;
  b->publish_ns = s->publish_ns;
  b->reserved = 0;
  uint64_t used = s->payload_bytes;
  uint32_t kind = s->payload_kind;
  if (b->n_tensors > TSOCK_MAX_TENSORS || b->meta_len > TSOCK_META_MAX ||
      used > r->slot_payload_bytes ||
      (kind != TSOCK_PAYLOAD_HOST && !(kind == TSOCK_PAYLOAD_HOST_DEVICE && r->h.gpu_pool == 1)))
    goto corrupt;
  hb->slot = (uint32_t)(seq & r->mask);
  hb->payload_kind = kind;
  hb->user_released = 0;
  hb->stream_set = 0;
  hb->stream = 0;
  hb->use_flags = 0;
  memcpy(hb->meta, s->meta, b->meta_len);
  for (uint32_t i = 0; i < b->n_tensors; i++) {
    const tsock_shm_tensor *d = &s->tensors[i];
    tsock_tensor_t *t = &hb->tensors[i];
    t->dtype = d->dtype;
    t->ndim = d->ndim;
    t->offset = d->offset;
    t->nbytes = d->nbytes;
    /* From the private copy: d->ndim may change between two reads. */
    int nd = (t->ndim >= 0 && t->ndim <= TSOCK_MAX_DIMS) ? t->ndim : 0;
    memset(t->shape, 0, sizeof t->shape);
    memset(t->strides, 0, sizeof t->strides);
    memcpy(t->shape, d->shape, (size_t)nd * sizeof(int64_t));
    memcpy(t->strides, d->strides, (size_t)nd * sizeof(int64_t));
  }
  /* Seqlock: what we copied is only valid if the stamp did not move. */
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  if (__atomic_load_n(&s->stamp, __ATOMIC_RELAXED) != stamp) {
    int rc = check_claim(r);
    return rc != TSOCK_OK ? rc
                          : tsock__fail(TSOCK_EEVICTED, "batch %llu was overwritten while read",
                                        (unsigned long long)seq);
  }
  /* Validate the private copy: the producer is not trusted. */
  tsock_lease *lease = tsock__leases_current(r->leases, hb->slot);
  for (uint32_t i = 0; i < b->n_tensors; i++) {
    tsock_tensor_t *t = &hb->tensors[i];
    if (tsock_layout_check_tensor(t->dtype, t->ndim, t->shape, t->strides, t->offset, t->nbytes,
                                  used) != 0)
      goto corrupt;
    t->data = lease->addr + t->offset;
  }
  tsock__lease_hold(&hb->lease, lease);
  b->tensors = hb->tensors;
  b->meta = hb->meta;
  b->payload = lease->addr;
  b->payload_capacity = r->slot_payload_bytes;
  b->dlpack_live = lease->live;
  return TSOCK_OK;
corrupt:
  return tsock__fail(TSOCK_ECORRUPT, "batch %llu: invalid descriptor written by the producer",
                     (unsigned long long)seq);
}

static void publish_cursor(struct reader_impl *r, uint64_t cursor) {
  r->released = cursor;
  __atomic_store_n(&r->rec->cursor, cursor, __ATOMIC_SEQ_CST);
  /* Dekker pairing with the producer: it sets producer_waiting, then
   * rescans cursors, then sleeps on the cursor word of the reader it waits
   * for; we store the cursor (which changes that word), then look at
   * producer_waiting and wake whoever sleeps on our word. */
  if (__atomic_load_n(&r->live->producer_waiting, __ATOMIC_SEQ_CST))
    tsock__futex_wake_all((uint32_t *)&r->rec->cursor);
}

/* 1 when the producer may have hb's slot back: never handed out, or
 * released by the caller with no armed fence left (wait: block on it). */
static int batch_done(struct reader_impl *r, held_batch *hb, int wait) {
  if (!hb->handed) return 1;
  if (!hb->user_released) return 0;
  if (hb->fence != NULL) {
    if (r->hooks->pending(hb, wait)) return 0;
    r->fenced--;
  }
  return 1;
}

/* Moves the cursor past every batch that is done (see batch_done); with
 * wait_oldest, first waits for the oldest held batch's fence. */
static void advance(struct reader_impl *r, int wait_oldest) {
  uint64_t c = r->released;
  while (c < r->next && batch_done(r, &r->held[c % r->max_held], wait_oldest && c == r->released))
    c++;
  if (c != r->released) publish_cursor(r, c);
}

/* Nothing to read: decides whether the stream has ended. */
static int stream_ended(struct reader_impl *r, uint64_t now) {
  if (__atomic_load_n(&r->live->state, __ATOMIC_ACQUIRE) == TSOCK_STATE_CLOSED) {
    /* The producer publishes before it closes: re-read published. */
    if (r->next >= __atomic_load_n(&r->live->published, __ATOMIC_ACQUIRE))
      /* In words: r->next counts epoch-end markers too, and from the
       * channel's start, not from this reader's join. */
      return tsock__fail(TSOCK_ECLOSED, "channel closed by the producer; this reader has read every batch "
                                        "published since it attached");
    return TSOCK_OK;
  }
  /* A dead producer stays dead: once seen, no need to ask the kernel again. */
  if (!r->producer_dead && now - r->last_live_check >= (uint64_t)LIVENESS_PERIOD_NS) {
    r->last_live_check = now;
    r->producer_dead = !producer_alive(r);
  }
  if (r->producer_dead) {
    if (r->next >= __atomic_load_n(&r->live->published, __ATOMIC_ACQUIRE)) {
      /* Close stores the closed state before it drops the lock: a close
       * that came after the state check above is not a death. */
      if (__atomic_load_n(&r->live->state, __ATOMIC_ACQUIRE) == TSOCK_STATE_CLOSED)
        return stream_ended(r, now);
      return tsock__fail(TSOCK_EPRODUCER_GONE, "producer (pid %d) died after %llu batches",
                         r->h.producer_pid, (unsigned long long)r->next);
    }
  }
  return check_claim(r);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Waits until published moves past r->next, the deadline passes, or the
 * stream ends. Returns TSOCK_OK when there may be something to read. */
static int wait_for_data(struct reader_impl *r, int64_t timeout_ns, uint64_t start) {
  const uint64_t *pub = &r->live->published;
  for (;;) {
    uint64_t now = tsock__now_ns();
    int rc = stream_ended(r, now);
    if (rc != TSOCK_OK) return rc;
    int64_t elapsed = (int64_t)(now - start);
    if (timeout_ns >= 0 && elapsed >= timeout_ns) return TSOCK_EAGAIN;
    if (elapsed < r->spin_ns) {
      for (int i = 0; i < 256; i++) {
        if (__atomic_load_n(pub, __ATOMIC_ACQUIRE) > r->next) return TSOCK_OK;
        cpu_relax();
      }
      continue;
    }
    int64_t slice = SLEEP_SLICE_NS;
    if (r->fenced > 0) {
      /* Released batches wait for our GPU work: look again soon, as the
       * producer may be waiting for exactly those slots. */
      advance(r, 0);
      if (r->fenced > 0 && slice > FENCE_POLL_NS) slice = FENCE_POLL_NS;
    }
    if (timeout_ns >= 0 && timeout_ns - elapsed < slice) slice = timeout_ns - elapsed;
    uint32_t word = (uint32_t)__atomic_load_n(pub, __ATOMIC_SEQ_CST);
    /* Dekker pairing with publish: it stores published, then loads every
     * attached reader's sleeping flag. */
    __atomic_store_n(&r->rec->sleeping, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(pub, __ATOMIC_SEQ_CST) <= r->next)
      tsock__futex_wait((const uint32_t *)pub, word, slice);
    __atomic_store_n(&r->rec->sleeping, 0, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(pub, __ATOMIC_ACQUIRE) > r->next) return TSOCK_OK;
  }
}

int tsock_reader_acquire(tsock_reader_t *h, const tsock_batch_t **out, int64_t timeout_ns) {
  int rc;
  struct reader_impl *r = handle_get(h, &rc);
  if (r == NULL) return rc;
  if (out == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_reader_acquire: batch is NULL");
  uint64_t start = 0;
  for (;;) {
    /* An evicted reader is no longer gated on: a slot whose stamp still
     * matches may be overwritten while in use, so hand out nothing more. */
    rc = check_claim(r);
    if (rc != TSOCK_OK) return rc;
    if (r->fenced > 0) advance(r, r->next - r->released >= r->max_held);
    if (r->next - r->released >= r->max_held) {
      if (r->held[r->released % r->max_held].user_released)
        return tsock__fail(TSOCK_ESYS, "reader holds %u batches (max_held): batch %llu was "
                           "released, but CUDA cannot confirm that the GPU work queued on it "
                           "has finished (the CUDA context failed), so its slot stays held",
                           r->max_held, (unsigned long long)r->released);
      if (r->max_held < r->max_held_asked)
        return tsock__fail(TSOCK_ESTATE,
                           "reader already holds %u batches, the whole ring of %u slots "
                           "(max_held %u is clamped to it); release one",
                           r->max_held, (unsigned)(r->mask + 1), r->max_held_asked);
      return tsock__fail(TSOCK_ESTATE, "reader already holds %u batches (max_held); release one",
                         r->max_held);
    }
    if (__atomic_load_n(&r->live->published, __ATOMIC_ACQUIRE) <= r->next) {
      if (start == 0) start = tsock__now_ns();
      rc = wait_for_data(r, timeout_ns, start);
      if (rc == TSOCK_EAGAIN) return rc;
      if (rc != TSOCK_OK) return rc;
      continue;
    }
    uint64_t seq = r->next;
    held_batch *hb = &r->held[seq % r->max_held];
    rc = copy_slot(r, seq, hb);
    r->next = seq + 1;
    int skip = rc == TSOCK_OK && r->skipping &&
               (hb->batch.index != 0 || (hb->batch.flags & TSOCK_BATCH_EPOCH_END));
    if (rc == TSOCK_OK && !skip) r->skipping = 0;
    if (rc != TSOCK_OK || skip) {
      /* Nothing handed out: release it at once if nothing older is held,
       * else with the held batch before it (see tsock_reader_release). */
      hb->handed = 0;
      advance(r, 0);
      if (rc != TSOCK_OK) return rc;
      continue;
    }
    hb->handed = 1;
    tsock_reader_record *rec = r->rec;
    __atomic_store_n(&rec->acquired, seq + 1, __ATOMIC_RELAXED);
    rec->batches++;
    if (start != 0) {
      uint64_t now = tsock__now_ns();
      rec->wait_ns += now - start;
      rec->heartbeat_ns = now;
    }
    *out = &hb->batch;
    return TSOCK_OK;
  }
}

int tsock_reader_release(tsock_reader_t *h, const tsock_batch_t *b) {
  int rc;
  struct reader_impl *r = handle_get(h, &rc);
  if (r == NULL) return rc;
  if (b == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_reader_release: batch is NULL");
  uint64_t seq = b->seq;
  if (seq < r->released || seq >= r->next || b != &r->held[seq % r->max_held].batch ||
      !r->held[seq % r->max_held].handed)
    return tsock__fail(TSOCK_ESTATE, "tsock_reader_release: batch is not held by this reader");
  /* It and every batch before it are released; one used on a CUDA stream
   * goes back to the producer only once the work queued there has run.
   * Batches after it that were never handed out (rejected or skipped while
   * it was held) go with it: nothing else would ever release them. */
  for (uint64_t s = r->released; s <= seq; s++) {
    held_batch *x = &r->held[s % r->max_held];
    if (!x->handed || x->user_released) continue;
    x->user_released = 1;
    if (x->stream_set && r->hooks != NULL) {
      r->hooks->arm(x);
      if (x->fence != NULL) r->fenced++;
    }
  }
  advance(r, 0);
  return check_claim(r);
}

int tsock_reader_payload_range(tsock_reader_t *h, const void **base, uint64_t *len) {
  int rc;
  struct reader_impl *r = handle_get(h, &rc);
  if (r == NULL) return rc;
  if (base == NULL || len == NULL)
    return tsock__fail(TSOCK_EINVAL, "tsock_reader_payload_range: NULL out-parameter");
  *base = r->payload;
  *len = (r->mask + 1) * r->slot_payload_bytes;
  return TSOCK_OK;
}

int tsock__reader_map(tsock_reader_t *h, tsock_map_ref **m, const void **base, uint64_t *len) {
  int rc;
  struct reader_impl *r = handle_get(h, &rc);
  if (r == NULL) return rc;
  *m = r->map_ref;
  *base = r->payload;
  *len = (r->mask + 1) * r->slot_payload_bytes;
  return TSOCK_OK;
}

int tsock__reader_held(tsock_reader_t *h, const tsock_batch_t *b, const char *fn,
                       tsock_held_batch **out, tsock_leases **leases) {
  int rc;
  struct reader_impl *r = handle_get(h, &rc);
  if (r == NULL) return rc;
  if (b == NULL) return tsock__fail(TSOCK_EINVAL, "%s: batch is NULL", fn);
  /* By address first: b may be anything, and is read only once it is ours. */
  held_batch *hb = NULL;
  for (uint32_t i = 0; i < r->max_held && hb == NULL; i++)
    if (b == &r->held[i].batch) hb = &r->held[i];
  if (hb == NULL || b->seq < r->released || b->seq >= r->next || !hb->handed ||
      hb->user_released)
    return tsock__fail(TSOCK_ESTATE, "%s: batch is not held by this reader (released, or not "
                                     "one of its batches)", fn);
  rc = check_claim(r);
  if (rc != TSOCK_OK) return rc;
  *out = hb;
  *leases = r->leases;
  return TSOCK_OK;
}

int tsock__reader_claimed(tsock_reader_t *h) {
  int rc;
  struct reader_impl *r = handle_get(h, &rc);
  return r == NULL ? rc : check_claim(r);
}

int tsock__reader_view(tsock_reader_t *h, tsock_reader_view *v) {
  int rc;
  struct reader_impl *r = handle_get(h, &rc);
  if (r == NULL) return rc;
  *v = (tsock_reader_view){.hdr = &r->h, .live = r->live, .slots = r->slots, .rec = r->rec,
                           .slot_count = (uint32_t)(r->mask + 1),
                           .slot_payload_bytes = r->slot_payload_bytes, .fd = r->fd,
                           .device = r->device};
  return TSOCK_OK;
}

int tsock__reader_set_device(tsock_reader_t *h, void *device, const tsock_device_hooks *hooks) {
  int rc;
  struct reader_impl *r = handle_get(h, &rc);
  if (r == NULL) return rc;
  if (r->device != NULL) return tsock__fail(TSOCK_ESTATE, "reader already has a device");
  r->device = device;
  r->hooks = hooks;
  for (uint32_t i = 0; i < r->max_held; i++) r->held[i].device = device;
  return TSOCK_OK;
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
  struct reader_impl *r = handle_get(h, &rc);
  if (r == NULL) return rc;
  if (token == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_reader_pin_mapping: token is NULL");
  tsock__map_ref(r->map_ref);
  rc = tsock__pin_add(drop_map, r->map_ref, token);
  if (rc != TSOCK_OK) tsock__map_unref(r->map_ref);
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

int tsock_reader_detach(tsock_reader_t *h) {
  int rc;
  struct reader_impl *r = handle_take(h, &rc);
  if (r == NULL) return rc;
  /* GPU work queued before a release may still read its slot: let it
   * finish before the record (and with it the hold on those slots) goes. */
  int unproven = 0;
  for (uint32_t i = 0; r->hooks != NULL && i < r->max_held; i++)
    if (r->held[i].fence != NULL && r->hooks->pending(&r->held[i], 1)) unproven = 1;
  if (r->hooks != NULL) r->hooks->detach(r->device);
  if (unproven) {
    /* Fail closed: GPU work may still read a released slot. The entry
     * stays ours and its lock held (the connection and the descriptor are
     * left open) until this process exits; the producer sees a stalled
     * reader. */
    r->fd = -1;
    r->sock = -1;
    impl_unmap(r);
    return tsock__fail(TSOCK_ESYS, "tsock_reader_detach: CUDA cannot confirm that GPU work "
                                   "queued on released batches has finished (the CUDA context "
                                   "failed): the reader's slots stay held until this process "
                                   "exits");
  }
  /* Closing our connection (impl_unmap) tells the producer we left: it
   * frees our entry and stops gating on us at once. */
  impl_unmap(r);
  return TSOCK_OK;
}
