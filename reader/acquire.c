/*
 * acquire.c - tsock_reader_acquire: the next batch, copied out of its slot
 * under the slot's seqlock and checked; and the wait for one (spin, then
 * sleep on the published word, watching for the end of the stream).
 */
#include <string.h>

#include "internal.h"

#define LIVENESS_PERIOD_NS 50000000ll /* check the producer's lock this often while idle */
#define SLEEP_SLICE_NS 50000000ll     /* longest single futex sleep */
#define FENCE_POLL_NS 100000ll       /* poll our own GPU fences this often while waiting */

int tsock__check_claim(struct reader_impl *r) {
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
static int copy_slot(struct reader_impl *r, uint64_t seq, tsock_held_batch *hb) {
  const tsock_slot *s = &r->slots[seq & r->mask];
  uint64_t stamp = __atomic_load_n(&s->stamp, __ATOMIC_ACQUIRE);
  if (stamp != seq + 1) {
    int rc = tsock__check_claim(r);
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
  __atomic_store_n(&hb->user_released, 0, __ATOMIC_RELAXED); /* read by exports (dlpack.c) */
  hb->stream_set = 0;
  hb->stream = 0;
  hb->use_flags = 0;
  hb->several_streams = 0;
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
    int rc = tsock__check_claim(r);
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

/* Nothing to read: decides whether the stream has ended. */
static int stream_ended(struct reader_impl *r, uint64_t now) {
  if (__atomic_load_n(&r->closing, __ATOMIC_ACQUIRE))
    return tsock__fail(TSOCK_EHANDLE, "reader detached by another thread while acquire waited");
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
    r->producer_dead = !tsock__producer_alive(r);
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
  return tsock__check_claim(r);
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
      tsock__advance(r, 0);
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

static int acquire(struct reader_impl *r, const tsock_batch_t **out, int64_t timeout_ns) {
  int rc;
  if (out == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_reader_acquire: batch is NULL");
  uint64_t start = 0;
  for (;;) {
    /* An evicted reader is no longer gated on: a slot whose stamp still
     * matches may be overwritten while in use, so hand out nothing more. */
    rc = tsock__check_claim(r);
    if (rc != TSOCK_OK) return rc;
    if (r->fenced > 0) tsock__advance(r, r->next - r->released >= r->max_held);
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
    tsock_held_batch *hb = &r->held[seq % r->max_held];
    rc = copy_slot(r, seq, hb);
    r->next = seq + 1;
    int skip = rc == TSOCK_OK && r->skipping &&
               (hb->batch.index != 0 || (hb->batch.flags & TSOCK_BATCH_EPOCH_END));
    if (rc == TSOCK_OK && !skip) r->skipping = 0;
    if (rc != TSOCK_OK || skip) {
      /* Nothing handed out: release it at once if nothing older is held,
       * else with the held batch before it (see tsock_reader_release). */
      hb->handed = 0;
      tsock__advance(r, 0);
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

int tsock_reader_acquire(tsock_reader_t *h, const tsock_batch_t **out, int64_t timeout_ns) {
  int rc;
  struct reader_impl *r = tsock__handle_get(h, &rc);
  if (r == NULL) return rc;
  rc = acquire(r, out, timeout_ns);
  tsock__handle_put(h); /* a detach in another thread waits for this */
  return rc;
}
