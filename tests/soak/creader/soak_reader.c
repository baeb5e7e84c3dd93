/*
 * soak_reader.c - the C reader of the chaos soak (tests/soak). It reads the
 * test stream of internal/batchgen (the same as tests/c/check_reader.c),
 * verifies every batch, and survives its producer: on "producer gone" it
 * reports and attaches again (to the producer that replaces it).
 *
 * Built by the soak with every C file of reader/:
 *   cc -O2 -std=c11 -Iinclude -Iring tests/soak/creader/soak_reader.c \
 *      reader/[a-z]*.c -ldl -lpthread
 *
 * Usage: soak_reader NAME SLOW_US [device] [fork=EVERY_MS:LIFE_MS]
 *   Attaches with TSOCK_START_NOW (waiting up to 30 s for the channel) and
 *   holds each batch SLOW_US microseconds. With "fork=", right after each
 *   attach and then every EVERY_MS while attached it forks a child that
 *   sleeps LIFE_MS without exec and exits (a trainer's helper): the child
 *   inherits the reader's mapping, and must not keep the reader "alive"
 *   once the soak kills the reader. With "device" it also reads each
 *   batch on the device path: the device copy (copied back with
 *   cuMemcpyDtoH) must equal the host copy, and on the fake driver a 200 us
 *   read of it is queued on the GPU before the release and must see the
 *   batch when it runs (the fence holds the slot). Once the producer is
 *   dead, cuda_use says so and the host copy alone is checked.
 *
 * The producer of incarnation K publishes data batches i = K<<40, K<<40+1,
 * ... Within one attachment every batch must follow the previous one (seq
 * + 1, and i + 1 for data batches); a new attachment must come from a later
 * incarnation than the last one. Output lines (stdout):
 *   attached
 *   forked pid=<child>
 *   progress n=<data batches verified by this process> [dev=<device copies> reads=<GPU reads>]
 *   gone inc=<K or -1> last_seq=<last seq acquired in the attachment or -1> mono=<CLOCK_MONOTONIC ns
 *        when acquire returned TSOCK_EPRODUCER_GONE> drained=<CLOCK_MONOTONIC ns when the last batch
 *        was released, or of the attach>
 *   closed n=<N>      (the channel was closed; exit 0)
 *   detached n=<N>    (SIGTERM; exit 0)
 *   MISMATCH ...      (exit 2)
 *   error ...         (exit 1)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tsock.h"
#include "../../../internal/batchgen/batchgen.h"


static volatile sig_atomic_t term;
static void on_term(int sig) { (void)sig; term = 1; }

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- the device path (with "device") ---- */

typedef int (*dtoh_fn)(void *dst, uint64_t src, size_t n);
typedef void (*launch_fn)(void *stream, const void *p, size_t n, unsigned long long ns,
                          unsigned long long *out);
static struct {
  int on;
  dtoh_fn dtoh;     /* cuMemcpyDtoH_v2 of the same driver */
  launch_fn launch; /* the fake driver's slow read; NULL on a real one */
  uint64_t verified, reads;
  struct { unsigned long long sum; uint64_t want, seq; int used; } pending[64];
  uint8_t scratch[1 << 20];
} dev;

static uint64_t fnv(const void *p, size_t n) {
  const unsigned char *b = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t k = 0; k < n; k++) h = (h ^ b[k]) * 1099511628211ull;
  return h;
}

/* The driver the library loaded, for the copy back and (fake) slow reads;
 * a context of the device current on this thread for the copy. */
static int device_setup(int32_t ordinal) {
  const char *path = getenv("TSOCK_LIBCUDA");
  void *lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) return -1;
  typedef int (*retain_fn)(void **ctx, int dev);
  typedef int (*set_fn)(void *ctx);
  typedef int (*get_fn)(int *dev, int ordinal);
  retain_fn retain = (retain_fn)dlsym(lib, "cuDevicePrimaryCtxRetain");
  set_fn set_current = (set_fn)dlsym(lib, "cuCtxSetCurrent");
  get_fn get = (get_fn)dlsym(lib, "cuDeviceGet");
  dev.dtoh = (dtoh_fn)dlsym(lib, "cuMemcpyDtoH_v2");
  dev.launch = (launch_fn)dlsym(lib, "fake_cuda_launch_read");
  int d = 0;
  void *ctx = NULL;
  if (!retain || !set_current || !get || !dev.dtoh || get(&d, ordinal) != 0 || retain(&ctx, d) != 0 ||
      set_current(ctx) != 0)
    return -1;
  return 0;
}

/* Reads of earlier batches that have run must have seen their batch. */
static int device_check_reads(void) {
  for (int k = 0; k < 64; k++) {
    if (!dev.pending[k].used || dev.pending[k].sum == 0) continue;
    if (dev.pending[k].sum != dev.pending[k].want) {
      printf("MISMATCH batch seq=%" PRIu64 ": a GPU read queued before its release saw other data\n",
             dev.pending[k].seq);
      return 2;
    }
    dev.pending[k].used = 0;
    dev.reads++;
  }
  return 0;
}

/* The device copy of a verified batch: equal to the host copy. */
static int device_verify(const tsock_batch_t *b) {
  int rc = tsock_batch_cuda_use(b, 0, 0);
  if (rc == TSOCK_EPRODUCER_GONE) return 0; /* its pool went with it: host copy only */
  if (rc != TSOCK_OK) {
    printf("error cuda_use: %s: %s\n", tsock_status_str(rc), tsock_last_error());
    return 1;
  }
  for (uint32_t i = 0; i < b->n_tensors; i++) {
    uint64_t p;
    size_t n = b->tensors[i].nbytes;
    if (tsock_batch_cuda_ptr(b, i, &p) != TSOCK_OK || n > sizeof dev.scratch ||
        dev.dtoh(dev.scratch, p, n) != 0) {
      printf("error device copy of batch seq=%" PRIu64 ": %s\n", b->seq, tsock_last_error());
      return 1;
    }
    if (memcmp(dev.scratch, b->tensors[i].data, n) != 0) {
      printf("MISMATCH batch seq=%" PRIu64 ": device copy of tensor %u differs\n", b->seq, i);
      return 2;
    }
  }
  dev.verified++;
  if (dev.launch != NULL && b->n_tensors > 0) {
    for (int k = 0; k < 64; k++) {
      if (dev.pending[k].used) continue;
      uint64_t p;
      tsock_batch_cuda_ptr(b, 0, &p);
      dev.pending[k].used = 1;
      dev.pending[k].seq = b->seq;
      dev.pending[k].want = fnv(b->tensors[0].data, b->tensors[0].nbytes);
      dev.launch(NULL, (const void *)(uintptr_t)p, b->tensors[0].nbytes, 200000ull, &dev.pending[k].sum);
      break;
    }
  }
  return device_check_reads();
}

/* ---- forked children (with "fork=") ---- */

static struct {
  int on;
  uint64_t every_ns, life_ns, next;
} forks;

/* In the child: what a helper that never calls tsock would do, plus one
 * check that the parent's reader handle refuses to work here. Nothing that
 * takes a lock (the fake CUDA driver has threads). */
static void child_sleeps(tsock_reader_t *r) {
  const tsock_batch_t *b;
  if (tsock_reader_acquire(r, &b, 0) != TSOCK_EFORKED) {
    static const char msg[] = "error forked child: the parent's reader handle did not return EFORKED\n";
    (void)!write(1, msg, sizeof msg - 1);
  }
  /* Let go of the soak's pipes: only the mapping tsock leaves us remains. */
  int devnull = open("/dev/null", O_RDWR);
  for (int fd = 0; fd < 3; fd++) dup2(devnull, fd);
  struct timespec ts = {(time_t)(forks.life_ns / 1000000000ull), (long)(forks.life_ns % 1000000000ull)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
  _exit(0);
}

/* Forks a sleeping child when one is due. */
static int maybe_fork(tsock_reader_t *r, uint64_t now) {
  if (!forks.on || now < forks.next) return 0;
  forks.next = now + forks.every_ns;
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) {
    printf("error fork: %s\n", strerror(errno));
    return 1;
  }
  if (pid == 0) child_sleeps(r);
  printf("forked pid=%d\n", (int)pid);
  return 0;
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
  int bad = argc < 3;
  for (int k = 3; k < argc && !bad; k++) {
    unsigned long every_ms, life_ms;
    if (strcmp(argv[k], "device") == 0) {
      dev.on = 1;
    } else if (sscanf(argv[k], "fork=%lu:%lu", &every_ms, &life_ms) == 2 && every_ms > 0) {
      forks.on = 1;
      forks.every_ns = every_ms * 1000000ull;
      forks.life_ns = life_ms * 1000000ull;
    } else {
      bad = 1;
    }
  }
  if (bad) {
    fprintf(stderr, "usage: %s NAME SLOW_US [device] [fork=EVERY_MS:LIFE_MS]\n", argv[0]);
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
    forks.next = 0; /* the first child right after each attach */
    if (dev.on) {
      int32_t ordinal = -1;
      rc = tsock_reader_open_device(r, &ordinal);
      if (rc != TSOCK_OK || (dev.dtoh == NULL && device_setup(ordinal) != 0)) {
        printf("error open_device: %s: %s\n", tsock_status_str(rc), tsock_last_error());
        return 1;
      }
    }
    int have_seq = 0, have_i = 0;
    uint64_t last_seq = 0, last_i = 0, gone_at = 0, drained_at = now_ns();
    for (;;) {
      if (term) {
        tsock_reader_detach(r);
        printf("detached n=%" PRIu64 " dev=%" PRIu64 " reads=%" PRIu64 "\n", n, dev.verified, dev.reads);
        return 0;
      }
      uint64_t now = now_ns();
      if (maybe_fork(r, now) != 0) return 1;
      if (now - last_progress >= 250000000ull) {
        last_progress = now;
        if (dev.on)
          printf("progress n=%" PRIu64 " dev=%" PRIu64 " reads=%" PRIu64 "\n", n, dev.verified,
                 dev.reads);
        else
          printf("progress n=%" PRIu64 "\n", n);
      }
      const tsock_batch_t *b;
      rc = tsock_reader_acquire(r, &b, 100000000LL);
      if (rc == TSOCK_EAGAIN) continue;
      if (rc == TSOCK_EPRODUCER_GONE) {
        gone_at = now_ns();
        break;
      }
      if (rc == TSOCK_ECLOSED) {
        tsock_reader_detach(r);
        printf("closed n=%" PRIu64 " dev=%" PRIu64 " reads=%" PRIu64 "\n", n, dev.verified, dev.reads);
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
        if (dev.on && (code = device_verify(b)) != 0) return code;
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
      drained_at = now_ns();
    }
    /* Producer gone: everything it published was read. Report, attach again. */
    int64_t inc = have_i ? (int64_t)(last_i >> 40) : -1;
    printf("gone inc=%" PRId64 " last_seq=%" PRId64 " mono=%" PRIu64 " drained=%" PRIu64 "\n", inc,
           have_seq ? (int64_t)last_seq : -1, gone_at, drained_at);
    if (inc >= 0) prev_inc = inc;
    tsock_reader_detach(r);
  }
}
