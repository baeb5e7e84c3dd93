/*
 * check_reader.c - a C reader program for multi-process tests. It reads the
 * test stream (below), verifies every batch, and prints one summary line.
 *
 * Builds standalone, without CMake or Go, with every C file of reader/:
 *   cc -O2 -std=c11 -Iinclude -Iring tests/c/check_reader.c \
 *      reader/[a-z]*.c -ldl -lpthread -o check_reader
 *
 * Usage: check_reader NAME EXPECTED_BATCHES [next|now] [slow_us]
 *   Attaches (waiting up to 10 s for the channel), reads until
 *   EXPECTED_BATCHES data batches (0: no limit), TSOCK_ECLOSED or
 *   TSOCK_EPRODUCER_GONE. slow_us: sleep that long holding each batch.
 *
 * Test stream: data batch i (the i-th data batch of the run, from 0,
 * epoch-end markers not counted) has two tensors:
 *   0: UINT8 [L], offset 0, L = 1 + (i*7919) % 60000,
 *      byte j = (uint8_t)((i*31 + j*7) ^ (j >> 8))
 *   1: INT64 [2], offset (L+7)/8*8, values {i, L}
 * and 8 bytes of metadata: the FNV-1a 64 hash of tensor 0's bytes, little-endian.
 *
 * Output (stdout): "check_reader status=<TSOCK_...>" when the stream ended,
 * then, last, exactly one line
 *   check_reader batches=<N> markers=<M> first=<first i> last=<last i> fold=<016x>
 * where fold starts at the FNV offset basis and is (fold ^ meta) * FNV prime
 * for each data batch; first and last are -1 without data batches.
 * Exit: 0 complete or closed, 2 on a mismatch ("MISMATCH ..."), 3 producer
 * gone, 1 on any other error.
 */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tsock.h"
#include "../../internal/batchgen/batchgen.h"


static const char *status_name(int s) {
#define S(x) \
  case x: return #x
  switch (s) {
    S(TSOCK_OK); S(TSOCK_EAGAIN); S(TSOCK_EINVAL); S(TSOCK_EHANDLE); S(TSOCK_ENAME);
    S(TSOCK_ENOENT); S(TSOCK_EEXIST); S(TSOCK_EVERSION); S(TSOCK_ECORRUPT);
    S(TSOCK_EPRODUCER_GONE); S(TSOCK_ECLOSED); S(TSOCK_EFULL); S(TSOCK_EBACKPRESSURE);
    S(TSOCK_ETIMEDOUT); S(TSOCK_ETOOBIG); S(TSOCK_EDTYPE); S(TSOCK_EEVICTED);
    S(TSOCK_ESTATE); S(TSOCK_EPERM); S(TSOCK_ESYS); S(TSOCK_EFORKED); S(TSOCK_ENOMEM);
    S(TSOCK_ENOCUDA);
  default: return "TSOCK_UNKNOWN";
  }
#undef S
}

static int mismatch(uint64_t seq, const char *what) {
  printf("MISMATCH batch seq=%" PRIu64 ": %s\n", seq, what);
  fflush(stdout);
  return 2;
}

/* Verifies one data batch; sets *i and *hash. Returns 0 or 2. */
static int verify(const tsock_batch_t *b, uint64_t *i_out, uint64_t *hash_out) {
  char why[160];
  return batchgen_verify(b, i_out, hash_out, why, sizeof why) == 0 ? 0 : mismatch(b->seq, why);
}

int main(int argc, char **argv) {
  if (argc < 3 || argc > 5) {
    fprintf(stderr, "usage: %s NAME EXPECTED_BATCHES [next|now] [slow_us]\n", argv[0]);
    return 1;
  }
  const char *name = argv[1];
  uint64_t expected = strtoull(argv[2], NULL, 10);
  tsock_reader_options_t opts;
  tsock_reader_options_init(&opts);
  opts.attach_timeout_ns = 10 * 1000000000LL;
  if (argc > 3) {
    if (strcmp(argv[3], "now") == 0) {
      opts.start = TSOCK_START_NOW;
    } else if (strcmp(argv[3], "next") != 0) {
      fprintf(stderr, "check_reader: start mode must be next or now, not %s\n", argv[3]);
      return 1;
    }
  }
  long slow_us = argc > 4 ? strtol(argv[4], NULL, 10) : 0;

  tsock_reader_t *r;
  int rc = tsock_reader_attach(name, &opts, &r);
  if (rc != TSOCK_OK) {
    printf("check_reader attach failed: %s: %s\n", status_name(rc), tsock_last_error());
    return 1;
  }

  uint64_t batches = 0, markers = 0, first = 0, last = 0, fold = BATCHGEN_FNV_BASIS;
  int code = 0;
  while (expected == 0 || batches < expected) {
    const tsock_batch_t *b;
    rc = tsock_reader_acquire(r, &b, -1);
    if (rc != TSOCK_OK) break;
    if (b->flags & TSOCK_BATCH_EPOCH_END) {
      if (b->n_tensors != 0) {
        code = mismatch(b->seq, "epoch-end marker with tensors");
        break;
      }
      markers++;
    } else {
      uint64_t i, h;
      code = verify(b, &i, &h);
      if (code == 0 && batches > 0 && i != last + 1) {
        char msg[96];
        snprintf(msg, sizeof msg, "i=%" PRIu64 " follows i=%" PRIu64, i, last);
        code = mismatch(b->seq, msg);
      }
      if (code != 0) break;
      if (batches == 0) first = i;
      last = i;
      batches++;
      fold = (fold ^ h) * BATCHGEN_FNV_PRIME;
    }
    if (slow_us > 0) {
      struct timespec ts = {slow_us / 1000000, (slow_us % 1000000) * 1000};
      nanosleep(&ts, NULL);
    }
    rc = tsock_reader_release(r, b);
    if (rc != TSOCK_OK) break;
  }
  if (code != 0) return code; /* exit without detaching: the kernel frees the record */

  if (rc == TSOCK_ECLOSED || rc == TSOCK_EPRODUCER_GONE) {
    printf("check_reader status=%s\n", status_name(rc));
    code = rc == TSOCK_ECLOSED ? 0 : 3;
  } else if (rc != TSOCK_OK) {
    printf("check_reader error %s: %s\n", status_name(rc), tsock_last_error());
    code = 1;
  }
  tsock_reader_detach(r);
  if (batches == 0)
    printf("check_reader batches=0 markers=%" PRIu64 " first=-1 last=-1 fold=%016" PRIx64 "\n",
           markers, fold);
  else
    printf("check_reader batches=%" PRIu64 " markers=%" PRIu64 " first=%" PRIu64 " last=%" PRIu64
           " fold=%016" PRIx64 "\n",
           batches, markers, first, last, fold);
  return code;
}
