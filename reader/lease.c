/*
 * lease.c - kept batches: tensors that outlive their slot at their
 * addresses (tsock_batch_keep), and the leases behind them.
 *
 * A trainer's arrays point into the slot a batch was read from. Once the
 * batch is released the producer rewrites that slot, and an array kept
 * past that would change under the trainer. Copying the batch elsewhere
 * does not help: the arrays (numpy, torch, XLA buffers) keep their
 * addresses. So the pages move instead: the kept tensors' pages are copied
 * into a private anonymous mapping, and mremap puts that mapping in place
 * of the slot's pages, at the same addresses, in one step (the kernel swaps
 * the page tables under the process's mmap lock; a thread reading them
 * meanwhile sees the same bytes before and after, as the copy was made
 * before the slot could change). The slot then gets a fresh mapping of its
 * file range at another address for the batches that follow.
 *
 * Who owns which range (see tsock_lease in internal.h):
 *   - At attach each slot's lease is its range inside the reader's mapping
 *     of the whole segment, and holds a reference on that mapping: the
 *     ranges go with it, in one munmap at its last reference, after the CUDA
 *     host registration (which covers the whole payload) is undone.
 *   - A retired lease (kept) owns its range, private memory now: it drops
 *     its reference on the whole mapping and marks its slot there as carved
 *     out, so that the final munmap of the whole mapping leaves it alone
 *     (tsock__map_unmap); it unmaps the range itself at its last reference.
 *   - A fresh lease owns its own mapping, and unmaps it at its last
 *     reference; kept in turn, it is retired in place.
 * Pages of a kept batch that hold no kept tensor are anonymous memory never
 * touched: they read as zeros and cost nothing. The retired range is left
 * writable (it is private to this process, and the kernel gives no page
 * for it until written): that way no stale guard range can ever be needed
 * for it, and a write through a tensor the caller unwrapped changes only
 * this process's copy instead of faulting. numpy arrays, DLPack descriptors
 * (read-only flag) and ReadOnlyTensor still present it read-only.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

#define TSOCK_MADV_POPULATE_WRITE 23 /* MADV_POPULATE_WRITE, Linux 5.14; older C headers lack it */

struct tsock_carve {
  uint64_t payload_offset; /* in the whole mapping */
  uint64_t slot_bytes;
  uint32_t slot_count;
  uint8_t carved[]; /* per slot: 1 once a retired lease owns its range */
};

struct tsock_leases {
  tsock_map_ref *map; /* the whole-segment mapping (each original lease holds a reference) */
  int seg_fd;         /* the reader's segment descriptor, reopened for map_fd */
  int map_fd;         /* read-only descriptor that fresh slot mappings are made through; -1 until
                         the first keep */
  uint64_t payload_offset; /* file offset of slot 0's payload */
  uint64_t slot_bytes;
  uint32_t slot_count;
  tsock_lease *cur[];
};

/* ---- references ---- */

void tsock__lease_ref(tsock_lease *l) { __atomic_add_fetch(&l->refs, 1, __ATOMIC_RELAXED); }

/* Kept copies alive in this process, and the most it may have. Each takes
 * memory map entries of the process's vm.max_map_count (65530 by default),
 * which malloc, thread stacks and the frameworks need too: past a quarter
 * of it, a keep fails with a clear error instead of starving them. */
static uint32_t kept_alive;
static uint32_t kept_budget;

static uint32_t keep_budget(void) {
  uint32_t b = __atomic_load_n(&kept_budget, __ATOMIC_RELAXED);
  if (b != 0) return b;
  unsigned long limit = 65530;
  FILE *f = fopen("/proc/sys/vm/max_map_count", "re");
  if (f != NULL) {
    if (fscanf(f, "%lu", &limit) != 1) limit = 65530;
    fclose(f);
  }
  limit /= 4;
  /* TSOCK_MAX_KEPT lowers it (a process that needs its map entries, tests). */
  const char *env = getenv("TSOCK_MAX_KEPT");
  char *end = NULL;
  unsigned long want = env != NULL ? strtoul(env, &end, 10) : 0;
  if (env != NULL && end != env && *end == '\0' && want > 0 && want < limit) limit = want;
  b = limit > UINT32_MAX ? UINT32_MAX : (uint32_t)limit;
  if (b == 0) b = 1;
  __atomic_store_n(&kept_budget, b, __ATOMIC_RELAXED);
  return b;
}

void tsock__lease_unref(tsock_lease *l) {
  if (l == NULL || __atomic_sub_fetch(&l->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
  if (__atomic_load_n(&l->retired, __ATOMIC_ACQUIRE)) __atomic_sub_fetch(&kept_alive, 1, __ATOMIC_RELAXED);
  if (l->parent != NULL)
    tsock__map_unref(l->parent); /* its range goes with the whole mapping */
  else
    munmap(l->addr, l->len); /* fresh, or retired: the range is its own */
  free(l);
}

void tsock__lease_hold(tsock_lease **held, tsock_lease *l) {
  if (*held == l) return;
  if (l != NULL) tsock__lease_ref(l);
  tsock__lease_unref(*held);
  *held = l;
}

/* ---- the table ---- */

tsock_leases *tsock__leases_open(tsock_map_ref *m, const uint8_t *payload, uint64_t payload_offset,
                                 uint32_t slot_count, uint64_t slot_bytes, int fd) {
  tsock_leases *t = calloc(1, sizeof *t + slot_count * sizeof t->cur[0]);
  if (t == NULL) return NULL;
  *t = (tsock_leases){.map = m, .seg_fd = fd, .map_fd = -1, .payload_offset = payload_offset,
                      .slot_bytes = slot_bytes, .slot_count = slot_count};
  for (uint32_t k = 0; k < slot_count; k++) {
    tsock_lease *l = calloc(1, sizeof *l);
    if (l == NULL) {
      tsock__leases_close(t);
      return NULL;
    }
    tsock__map_ref(m);
    *l = (tsock_lease){.refs = 1, .slot = k, .addr = (uint8_t *)payload + k * slot_bytes,
                       .len = (size_t)slot_bytes, .parent = m};
    t->cur[k] = l;
  }
  return t;
}

void tsock__leases_close(tsock_leases *t) {
  for (uint32_t k = 0; k < t->slot_count; k++) tsock__lease_unref(t->cur[k]);
  tsock__fork_close(t->map_fd);
  free(t);
}

tsock_lease *tsock__leases_current(const tsock_leases *t, uint32_t slot) { return t->cur[slot]; }

void tsock__map_unmap(tsock_map_ref *m) {
  const struct tsock_carve *c = m->carve;
  if (c == NULL) {
    munmap(m->addr, m->len);
  } else {
    /* Runs of slots still ours; the header and slot area before them. */
    uint8_t *base = m->addr;
    uint64_t from = 0;
    for (uint32_t k = 0; k <= c->slot_count; k++) {
      uint64_t at = c->payload_offset + k * c->slot_bytes;
      if (k == c->slot_count || c->carved[k]) {
        if (at > from) munmap(base + from, at - from);
        from = at + c->slot_bytes;
      }
    }
  }
  free(m->carve);
}

/* ---- keeping ---- */

/* The descriptor fresh slot mappings are made through: a read-only open of
 * the segment, without a lock (a mapping holds its open file description,
 * and a forked child inherits mappings: see open_segment in attach.c),
 * closed in a child by the fork guard. */
static int map_fd(tsock_leases *t) {
  if (t->map_fd >= 0) return TSOCK_OK;
  t->map_fd = tsock__fork_reopen(t->seg_fd);
  if (t->map_fd < 0)
    return tsock__fail_errno(TSOCK_ESYS, errno,
                             "tsock_batch_keep: reopening the segment (/proc/self/fd/%d)", t->seg_fd);
  return TSOCK_OK;
}

static int carve_table(tsock_leases *t) {
  tsock_map_ref *m = t->map;
  if (m->carve != NULL) return TSOCK_OK;
  struct tsock_carve *c = calloc(1, sizeof *c + t->slot_count);
  if (c == NULL) return tsock__fail(TSOCK_ENOMEM, "tsock_batch_keep: out of memory");
  c->payload_offset = (uint64_t)((const uint8_t *)t->cur[0]->addr - (const uint8_t *)m->addr);
  c->slot_bytes = t->slot_bytes;
  c->slot_count = t->slot_count;
  /* Only this reader's thread writes it; the last unref of the mapping,
   * on any thread, reads it after the release of the reference that a
   * retired lease drops once it has carved its slot. */
  m->carve = c;
  return TSOCK_OK;
}

/* [from, to) page-aligned byte ranges of the slot that hold the tensors of
 * `mask`, sorted and merged; returns how many (at most TSOCK_MAX_TENSORS). */
static int kept_pages(const tsock_held_batch *hb, uint32_t mask, uint64_t page, uint64_t (*r)[2]) {
  int n = 0;
  for (uint32_t i = 0; i < hb->batch.n_tensors; i++) {
    const tsock_tensor_t *t = &hb->tensors[i];
    if (!(mask & (1u << i)) || t->nbytes == 0) continue;
    uint64_t from = t->offset / page * page, to = (t->offset + t->nbytes + page - 1) / page * page;
    int j = n++;
    while (j > 0 && r[j - 1][0] > from) {
      r[j][0] = r[j - 1][0];
      r[j][1] = r[j - 1][1];
      j--;
    }
    r[j][0] = from;
    r[j][1] = to;
  }
  int m = 0;
  for (int j = 0; j < n; j++) {
    if (m > 0 && r[j][0] <= r[m - 1][1]) {
      if (r[j][1] > r[m - 1][1]) r[m - 1][1] = r[j][1];
    } else {
      r[m][0] = r[j][0];
      r[m][1] = r[j][1];
      m++;
    }
  }
  return m;
}

static uint64_t file_offset(const tsock_leases *t, uint32_t slot) {
  return t->payload_offset + (uint64_t)slot * t->slot_bytes;
}

/* Copies the pages of the tensors of `mask` of slot `slot` into the
 * same offsets of `dst`, with pread from the file: the slot's bytes as the
 * held batch has them (a read past the end of a file cut short is an
 * error, not a SIGBUS), never faulting the source pages into this process.
 * The destination pages are faulted in first, in one call (older kernels:
 * EINVAL, then one by one as the copy writes). */
static int copy_pages(tsock_leases *t, uint8_t *dst, uint32_t slot, const tsock_held_batch *hb,
                      uint32_t mask) {
  uint64_t pages[TSOCK_MAX_TENSORS][2];
  int n = kept_pages(hb, mask, (uint64_t)sysconf(_SC_PAGESIZE), pages);
  for (int j = 0; j < n; j++) {
    uint64_t done = 0, len = pages[j][1] - pages[j][0];
    madvise(dst + pages[j][0], len, TSOCK_MADV_POPULATE_WRITE);
    while (done < len) {
      ssize_t got = pread(t->map_fd, dst + pages[j][0] + done, len - done,
                          (off_t)(file_offset(t, slot) + pages[j][0] + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        return tsock__fail_errno(TSOCK_ESYS, got < 0 ? errno : EIO,
                                 "tsock_batch_keep: reading slot %u", slot);
      done += (uint64_t)got;
    }
  }
  return TSOCK_OK;
}

/* Retires l (not yet retired): its range becomes a private copy of the
 * pages of `want`, and the slot gets a fresh lease. Nothing changes on
 * failure. */
static int swap_pages(tsock_leases *t, tsock_lease *l, const tsock_held_batch *hb, uint32_t want) {
  uint32_t budget = keep_budget();
  if (__atomic_load_n(&kept_alive, __ATOMIC_RELAXED) >= budget)
    return tsock__fail(TSOCK_ENOMEM,
                       "tsock_batch_keep: %u kept batches are alive in this process, the most "
                       "tsock keeps (a quarter of vm.max_map_count: each takes memory map "
                       "entries the rest of the process needs too); copy what you keep for "
                       "long (np.array(x), x.clone()) or raise vm.max_map_count",
                       budget);
  int rc = map_fd(t);
  if (rc == TSOCK_OK && l->parent != NULL) rc = carve_table(t);
  if (rc != TSOCK_OK) return rc;
  tsock_lease *fresh = calloc(1, sizeof *fresh);
  if (fresh == NULL) return tsock__fail(TSOCK_ENOMEM, "tsock_batch_keep: out of memory");
  void *at = mmap(NULL, l->len, PROT_READ, MAP_SHARED, t->map_fd, (off_t)file_offset(t, l->slot));
  void *copy = mmap(NULL, l->len, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (at == MAP_FAILED || copy == MAP_FAILED) {
    int err = errno;
    if (at != MAP_FAILED) munmap(at, l->len);
    if (copy != MAP_FAILED) munmap(copy, l->len);
    free(fresh);
    return tsock__fail_errno(err == ENOMEM ? TSOCK_ENOMEM : TSOCK_ESYS, err,
                             "tsock_batch_keep: mapping %zu bytes (each kept batch takes a "
                             "memory map entry: see vm.max_map_count)",
                             l->len);
  }
  rc = copy_pages(t, copy, l->slot, hb, want);
  if (rc != TSOCK_OK) {
    munmap(copy, l->len);
    munmap(at, l->len);
    free(fresh);
    return rc;
  }
  if (mremap(copy, l->len, l->len, MREMAP_MAYMOVE | MREMAP_FIXED, l->addr) == MAP_FAILED) {
    int err = errno;
    /* The kernel may have unmapped the target before failing: map the
     * slot back there (its bytes are still the batch's: it is held). */
    mmap(l->addr, l->len, PROT_READ, MAP_SHARED | MAP_FIXED, t->map_fd,
         (off_t)file_offset(t, l->slot));
    munmap(copy, l->len);
    munmap(at, l->len);
    free(fresh);
    return tsock__fail_errno(err == ENOMEM ? TSOCK_ENOMEM : TSOCK_ESYS, err,
                             "tsock_batch_keep: mremap of %zu bytes", l->len);
  }
  __atomic_add_fetch(&kept_alive, 1, __ATOMIC_RELAXED);
  __atomic_store_n(&l->retired, 1, __ATOMIC_RELEASE);
  if (l->parent != NULL) {
    tsock_map_ref *m = l->parent;
    m->carve->carved[l->slot] = 1;
    l->parent = NULL;
    tsock__map_unref(m); /* releases the carve mark to its last unref */
  }
  *fresh = (tsock_lease){.refs = 1, .slot = l->slot, .addr = at, .len = l->len};
  t->cur[l->slot] = fresh;
  tsock__lease_unref(l); /* the table's reference; the batch holds one */
  return TSOCK_OK;
}

/* l is retired and the batch still held, so the slot's file range still
 * holds its bytes: reads the pages of `more` from there into the copy. */
static int add_pages(tsock_leases *t, tsock_lease *l, const tsock_held_batch *hb, uint32_t more) {
  return copy_pages(t, l->addr, l->slot, hb, more);
}

/* A kept batch: a held batch of its own (so tsock_batch_dlpack takes it),
 * holding a reference on its retired lease. */
static void kept_free(void *p) {
  tsock_held_batch *kb = p;
  tsock__lease_unref(kb->lease);
  free(kb);
}

static int kept_make(const tsock_held_batch *hb, const tsock_batch_t **out) {
  tsock_held_batch *kb = calloc(1, sizeof *kb);
  if (kb == NULL) return tsock__fail(TSOCK_ENOMEM, "tsock_batch_keep: out of memory");
  kb->batch = hb->batch;
  memcpy(kb->tensors, hb->tensors, sizeof kb->tensors);
  memcpy(kb->meta, hb->meta, sizeof kb->meta);
  kb->batch.tensors = kb->tensors;
  kb->batch.meta = kb->meta;
  kb->handed = 1;
  kb->user_released = 1;
  kb->kept = 1;
  kb->slot = hb->slot;
  kb->payload_kind = hb->payload_kind;
  kb->lease = hb->lease;
  tsock__lease_ref(kb->lease);
  int rc = tsock__pin_add(kept_free, kb, NULL);
  if (rc != TSOCK_OK) {
    kept_free(kb);
    return rc;
  }
  *out = &kb->batch;
  return TSOCK_OK;
}

/* The system's page size must divide the slot ranges for their pages to be
 * swapped one slot at a time (4096-byte slots on a 64 KiB-page system do
 * not). */
static int pages_fit(const tsock_leases *t) {
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  uint64_t first = (uint64_t)(uintptr_t)t->cur[0]->addr;
  if (t->slot_bytes % page == 0 && t->payload_offset % page == 0 && first % page == 0)
    return TSOCK_OK;
  return tsock__fail(TSOCK_ESTATE, "tsock_batch_keep: the channel's slots (%llu bytes) are not "
                                   "a multiple of this system's page size (%llu): batches cannot "
                                   "be kept; have the producer use a slot size that is",
                     (unsigned long long)t->slot_bytes, (unsigned long long)page);
}

static int batch_keep(tsock_reader_t *r, const tsock_batch_t *b, uint32_t tensor_mask,
                      const tsock_batch_t **kept) {
  tsock_held_batch *hb = NULL;
  tsock_leases *t = NULL;
  int rc = tsock__reader_held(r, b, "tsock_batch_keep", &hb, &t);
  if (rc != TSOCK_OK) return rc;
  if (tensor_mask >> b->n_tensors != 0)
    return tsock__fail(TSOCK_EINVAL, "tsock_batch_keep: mask 0x%x names tensors a batch of %u "
                                     "does not have", tensor_mask, b->n_tensors);
  if (hb->device != NULL)
    return tsock__fail(TSOCK_ESTATE, "tsock_batch_keep: the reader reads the producer's device "
                                     "pool, whose memory cannot be kept: copy what you keep");
  if (t->map->cuda != NULL)
    return tsock__fail(TSOCK_ESTATE, "tsock_batch_keep: the reader's mapping is registered with "
                                     "CUDA (tsock_reader_register_host), which pinned its pages: "
                                     "they cannot be swapped; copy what you keep");
  rc = pages_fit(t);
  if (rc != TSOCK_OK) return rc;
  tsock_lease *l = hb->lease;
  uint32_t want = tensor_mask;
  for (uint32_t i = 0; i < b->n_tensors; i++)
    if (__atomic_load_n(&l->live[i], __ATOMIC_ACQUIRE) != 0) want |= 1u << i;
  if (want == 0) {
    if (kept != NULL) *kept = NULL;
    return TSOCK_OK;
  }
  if (!l->retired)
    rc = swap_pages(t, l, hb, want);
  else if ((want & ~l->kept) != 0)
    rc = add_pages(t, l, hb, want & ~l->kept);
  if (rc != TSOCK_OK) return rc;
  l->kept |= want;
  /* Evicted while copying: the producer may have rewritten the slot. */
  rc = tsock__reader_claimed(r);
  if (rc != TSOCK_OK) return rc;
  const tsock_batch_t *k = NULL;
  if (kept != NULL) {
    rc = kept_make(hb, &k);
    if (rc != TSOCK_OK) return rc;
    *kept = k;
  }
  return TSOCK_OK;
}

/* Holds a use of the handle (tsock__handle_get) throughout, as every call
 * on one does: a detach in another thread waits for it to end. */
int tsock_batch_keep(tsock_reader_t *r, const tsock_batch_t *b, uint32_t tensor_mask,
                     const tsock_batch_t **kept) {
  tsock__clear_error();
  int rc;
  if (tsock__handle_get(r, &rc) == NULL) return rc;
  rc = batch_keep(r, b, tensor_mask, kept);
  tsock__handle_put(r);
  return rc;
}

int tsock_batch_free(const tsock_batch_t *kept) {
  tsock__clear_error();
  if (!tsock__pin_take(kept, kept_free))
    return tsock__fail(TSOCK_EHANDLE, "tsock_batch_free: %p is not a kept batch (freed already, "
                                      "or not returned by tsock_batch_keep)",
                       (const void *)kept);
  kept_free((void *)(uintptr_t)kept);
  return TSOCK_OK;
}

static void drop_lease(void *l) { tsock__lease_unref(l); }

static int batch_pin(tsock_reader_t *r, const tsock_batch_t *b, void **token) {
  tsock_held_batch *hb = NULL;
  tsock_leases *t = NULL;
  int rc = tsock__reader_held(r, b, "tsock_batch_pin", &hb, &t);
  if (rc != TSOCK_OK) return rc;
  if (token == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_batch_pin: token is NULL");
  tsock__lease_ref(hb->lease);
  rc = tsock__pin_add(drop_lease, hb->lease, token);
  if (rc != TSOCK_OK) tsock__lease_unref(hb->lease);
  return rc;
}

int tsock_batch_pin(tsock_reader_t *r, const tsock_batch_t *b, void **token) {
  tsock__clear_error();
  int rc;
  if (tsock__handle_get(r, &rc) == NULL) return rc;
  rc = batch_pin(r, b, token);
  tsock__handle_put(r);
  return rc;
}
