/*
 * release.c - tsock_reader_release: the reader's cursor, the word the
 * producer gates on, moves past released batches; a batch used on a CUDA
 * stream goes back only once its fence (cuda_device.c, through
 * tsock_device_hooks) has fired.
 */
#include "internal.h"

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
static int batch_done(struct reader_impl *r, tsock_held_batch *hb, int wait) {
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
void tsock__advance(struct reader_impl *r, int wait_oldest) {
  uint64_t c = r->released;
  while (c < r->next && batch_done(r, &r->held[c % r->max_held], wait_oldest && c == r->released))
    c++;
  if (c != r->released) publish_cursor(r, c);
}

static int release(struct reader_impl *r, const tsock_batch_t *b) {
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
    tsock_held_batch *x = &r->held[s % r->max_held];
    if (!x->handed || x->user_released) continue;
    __atomic_store_n(&x->user_released, 1, __ATOMIC_RELAXED); /* read by exports */
    if (x->stream_set && r->hooks != NULL) {
      r->hooks->arm(x);
      if (x->fence != NULL) r->fenced++;
    }
  }
  tsock__advance(r, 0);
  return tsock__check_claim(r);
}

int tsock_reader_release(tsock_reader_t *h, const tsock_batch_t *b) {
  int rc;
  struct reader_impl *r = tsock__handle_get(h, &rc);
  if (r == NULL) return rc;
  rc = release(r, b);
  tsock__handle_put(h);
  return rc;
}
