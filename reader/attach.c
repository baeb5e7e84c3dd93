/*
 * attach.c - a reader's life: its options, opening and mapping the segment
 * (the header checked on a private copy), the join (join.c), detach; and
 * the references that keep the read-only mapping after detach.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define ATTACH_POLL_NS 5000000ll      /* retry period while waiting for a channel */

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
  if (o->start != TSOCK_START_NEXT_EPOCH && o->start != TSOCK_START_NOW &&
      o->start != TSOCK_START_OLDEST)
    return tsock__fail(TSOCK_EINVAL, "reader options: unknown start mode %d", o->start);
  if (o->max_held < 1 || o->max_held > TSOCK_MAX_HELD)
    return tsock__fail(TSOCK_EINVAL, "reader options: max_held %u outside 1..%d", o->max_held,
                       TSOCK_MAX_HELD);
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

int tsock__producer_alive(struct reader_impl *r) {
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
  /* The start is the producer's word: one past what is published would
   * leave us waiting for a batch that never comes. One too old is caught
   * by its slot's stamp at the first acquire. */
  if (j.start > __atomic_load_n(&r->live->published, __ATOMIC_ACQUIRE)) {
    tsock__join_leave(&j);
    return tsock__fail(TSOCK_ECORRUPT, "channel '%s': invalid join reply (start %llu, past what is published)",
                       name, (unsigned long long)j.start);
  }
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
    if (rc == TSOCK_OK && !tsock__producer_alive(r))
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
      tsock_reader_t *h = tsock__handle_new(r);
      if (h == NULL) {
        impl_unmap(r);
        return tsock__fail(TSOCK_ENOMEM, "more than %u readers open in this process",
                           TSOCK_READER_HANDLES);
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

int tsock_reader_detach(tsock_reader_t *h) {
  int rc;
  struct reader_impl *r = tsock__handle_take(h, &rc);
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
