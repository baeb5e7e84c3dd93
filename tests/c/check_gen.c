/*
 * check_gen.c - publishes the test stream that check_reader verifies (see
 * check_reader.c), so check_reader can be tested without Go tests.
 *
 * Usage: check_gen NAME N [READERS=1] [EPOCH_EVERY=0] [SLOTS=16] [close|die]
 *   Waits for READERS readers, publishes N data batches with an epoch-end
 *   marker after every EPOCH_EVERY of them (0: none), prints the line a
 *   reader of the whole stream must print, then closes the channel, or with
 *   "die" removes its name and exits without closing (readers then see
 *   TSOCK_EPRODUCER_GONE).
 */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tsock.h"

#define FNV_BASIS 14695981039346656037ull
#define FNV_PRIME 1099511628211ull

static int fail(const char *call, int rc) {
  fprintf(stderr, "check_gen: %s: %s (%s)\n", call, tsock_status_str(rc), tsock_last_error());
  return 1;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s NAME N [READERS] [EPOCH_EVERY] [SLOTS] [close|die]\n", argv[0]);
    return 1;
  }
  const char *name = argv[1];
  uint64_t n = strtoull(argv[2], NULL, 10);
  uint32_t readers = argc > 3 ? (uint32_t)atoi(argv[3]) : 1;
  uint64_t every = argc > 4 ? strtoull(argv[4], NULL, 10) : 0;
  uint32_t slots = argc > 5 ? (uint32_t)atoi(argv[5]) : 16;
  int die = argc > 6 && strcmp(argv[6], "die") == 0;

  tsock_producer_options_t o;
  tsock_producer_options_init(&o);
  o.slot_count = slots;
  o.slot_bytes = 64 * 1024;
  tsock_producer_t *p;
  int rc = tsock_producer_create(name, &o, &p);
  if (rc != TSOCK_OK) return fail("create", rc);
  rc = tsock_producer_wait_readers(p, readers, 10 * 1000000000LL);
  if (rc != TSOCK_OK) return fail("wait_readers", rc);

  uint64_t fold = FNV_BASIS, markers = 0;
  for (uint64_t i = 0; i < n; i++) {
    uint64_t len = 1 + (i * 7919) % 60000, off1 = (len + 7) / 8 * 8;
    uint8_t *buf;
    rc = tsock_producer_reserve(p, off1 + 16, 10 * 1000000000LL, (void **)&buf);
    if (rc != TSOCK_OK) return fail("reserve", rc);
    uint64_t h = FNV_BASIS;
    for (uint64_t j = 0; j < len; j++) {
      buf[j] = (uint8_t)((i * 31 + j * 7) ^ (j >> 8));
      h = (h ^ buf[j]) * FNV_PRIME;
    }
    int64_t vals[2] = {(int64_t)i, (int64_t)len};
    memcpy(buf + off1, vals, sizeof vals);
    uint8_t meta[8];
    for (int k = 0; k < 8; k++) meta[k] = (uint8_t)(h >> (8 * k));
    tsock_tensor_t t[2];
    const int64_t s0[1] = {(int64_t)len}, s1[1] = {2};
    tsock_tensor_init(&t[0], TSOCK_DTYPE_UINT8, 1, s0, 0);
    tsock_tensor_init(&t[1], TSOCK_DTYPE_INT64, 1, s1, off1);
    rc = tsock_producer_publish(p, t, 2, meta, sizeof meta);
    if (rc != TSOCK_OK) return fail("publish", rc);
    fold = (fold ^ h) * FNV_PRIME;
    if (every != 0 && (i + 1) % every == 0) {
      rc = tsock_producer_end_epoch(p, 10 * 1000000000LL);
      if (rc != TSOCK_OK) return fail("end_epoch", rc);
      markers++;
    }
  }
  if (n == 0)
    printf("check_reader batches=0 markers=%" PRIu64 " first=-1 last=-1 fold=%016" PRIx64 "\n",
           markers, fold);
  else
    printf("check_reader batches=%" PRIu64 " markers=%" PRIu64 " first=0 last=%" PRIu64
           " fold=%016" PRIx64 "\n",
           n, markers, n - 1, fold);
  fflush(stdout);
  if (die) {
    char path[128];
    snprintf(path, sizeof path, "/dev/shm/tsock.%s", name);
    unlink(path);
    _exit(0); /* no close: the kernel drops the producer's lock */
  }
  rc = tsock_producer_close(p);
  return rc == TSOCK_OK ? 0 : fail("close", rc);
}
