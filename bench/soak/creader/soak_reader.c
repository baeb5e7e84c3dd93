/*
 * soak_reader.c - the C reader of the chaos soak (bench/soak). It reads the
 * test stream of internal/batchgen (the same as tests/c/check_reader.c),
 * verifies every batch, and survives its producer: on "producer gone" it
 * reports and attaches again (to the producer that replaces it).
 *
 * Built by the soak with:
 *   cc -O2 -std=c11 -Iinclude -Iring bench/soak/creader/soak_reader.c \
 *      reader/status.c reader/platform.c reader/reader.c -lpthread
 *
 * Usage: soak_reader NAME SLOW_US
 *   Attaches with TSOCK_START_NOW (waiting up to 30 s for the channel) and
 *   holds each batch SLOW_US microseconds.
 *
 * The producer of incarnation K publishes data batches i = K<<40, K<<40+1,
 * ... Within one attachment every batch must follow the previous one (seq
 * + 1, and i + 1 for data batches); a new attachment must come from a later
 * incarnation than the last one. Output lines (stdout):
 *   attached
 *   progress n=<data batches verified by this process>
 *   gone inc=<K or -1> last_seq=<last seq acquired in the attachment or -1>
 *   closed n=<N>      (the channel was closed; exit 0)
 *   detached n=<N>    (SIGTERM; exit 0)
 *   MISMATCH ...      (exit 2)
 *   error ...         (exit 1)
 */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tsock.h"
#include "../../../internal/batchgen/batchgen.h"


static volatile sig_atomic_t term;
static void on_term(int sig) { (void)sig; term = 1; }

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int mismatch(uint64_t seq, const char *what) {
  printf("MISMATCH batch seq=%" PRIu64 ": %s\n", seq, what);
  fflush(stdout);
  return 2;
}

/* Verifies one data batch of the batchgen format; sets *i. */
static int verify(const tsock_batch_t *b, uint64_t *i_out) {
  char why[160];
  uint64_t hash;
  return batchgen_verify(b, i_out, &hash, why, sizeof why) == 0 ? 0 : mismatch(b->seq, why);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s NAME SLOW_US\n", argv[0]);
    return 1;
  }
  const char *name = argv[1];
  long slow_us = strtol(argv[2], NULL, 10);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_term;
  sigaction(SIGTERM, &sa, NULL);
  setvbuf(stdout, NULL, _IOLBF, 0);

  tsock_reader_options_t opts;
  tsock_reader_options_init(&opts);
  opts.start = TSOCK_START_NOW;
  opts.attach_timeout_ns = 30 * 1000000000LL;

  uint64_t n = 0, last_progress = 0;
  int64_t prev_inc = -1; /* incarnation of the previous attachment */
  for (;;) {
    tsock_reader_t *r;
    int rc = tsock_reader_attach(name, &opts, &r);
    if (rc != TSOCK_OK) {
      printf("error attach: %s: %s\n", tsock_status_str(rc), tsock_last_error());
      return 1;
    }
    printf("attached\n");
    int have_seq = 0, have_i = 0;
    uint64_t last_seq = 0, last_i = 0;
    for (;;) {
      if (term) {
        tsock_reader_detach(r);
        printf("detached n=%" PRIu64 "\n", n);
        return 0;
      }
      uint64_t now = now_ns();
      if (now - last_progress >= 250000000ull) {
        last_progress = now;
        printf("progress n=%" PRIu64 "\n", n);
      }
      const tsock_batch_t *b;
      rc = tsock_reader_acquire(r, &b, 100000000LL);
      if (rc == TSOCK_EAGAIN) continue;
      if (rc == TSOCK_EPRODUCER_GONE) break;
      if (rc == TSOCK_ECLOSED) {
        tsock_reader_detach(r);
        printf("closed n=%" PRIu64 "\n", n);
        return 0;
      }
      if (rc != TSOCK_OK) {
        printf("error acquire: %s: %s\n", tsock_status_str(rc), tsock_last_error());
        return 1;
      }
      char msg[160];
      if (have_seq && b->seq != last_seq + 1) {
        snprintf(msg, sizeof msg, "seq %" PRIu64 " follows seq %" PRIu64, b->seq, last_seq);
        return mismatch(b->seq, msg);
      }
      have_seq = 1;
      last_seq = b->seq;
      if (b->flags & TSOCK_BATCH_EPOCH_END) {
        if (b->n_tensors != 0) return mismatch(b->seq, "epoch-end marker with tensors");
      } else {
        uint64_t i = 0;
        int code = verify(b, &i);
        if (code != 0) return code;
        if (have_i && i != last_i + 1) {
          snprintf(msg, sizeof msg, "i=%" PRIu64 " follows i=%" PRIu64, i, last_i);
          return mismatch(b->seq, msg);
        }
        if (!have_i && prev_inc >= 0 && (int64_t)(i >> 40) <= prev_inc) {
          snprintf(msg, sizeof msg, "attached to incarnation %" PRIu64 " after incarnation %" PRId64,
                   i >> 40, prev_inc);
          return mismatch(b->seq, msg);
        }
        have_i = 1;
        last_i = i;
        n++;
      }
      if (slow_us > 0) {
        struct timespec ts = {slow_us / 1000000, (slow_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
      }
      rc = tsock_reader_release(r, b);
      if (rc != TSOCK_OK) {
        printf("error release: %s: %s\n", tsock_status_str(rc), tsock_last_error());
        return 1;
      }
    }
    /* Producer gone: everything it published was read. Report, attach again. */
    int64_t inc = have_i ? (int64_t)(last_i >> 40) : -1;
    printf("gone inc=%" PRId64 " last_seq=%" PRId64 "\n", inc, have_seq ? (int64_t)last_seq : -1);
    if (inc >= 0) prev_inc = inc;
    tsock_reader_detach(r);
  }
}
