/*
 * tbench.c - the C processes of the transport benchmark (bench/latency).
 *
 * The Go driver builds this file with the C reader sources (and libzmq when
 * pkg-config finds it, -DTBENCH_ZMQ) and runs it in one of these roles:
 *
 *   tsock NAME MODE WARMUP TOUCH       a tsock reader (libtsock's C reader, no Go)
 *   tsock-cost NAME ROUNDS             times acquire + release of batches already published:
 *                                      ROUNDS x (2 ms nap, then up to 8 release + acquire
 *                                      pairs, each payload checked while held)
 *   uds-send PATH READERS INTERVAL_NS SECONDS MSG_BYTES
 *   uds-recv PATH MODE WARMUP          the baseline: the descriptor over a Unix socket
 *   zmq-pub ENDPOINT READERS INTERVAL_NS SECONDS MSG_BYTES HWM
 *   zmq-sub ENDPOINT MODE WARMUP TOUCH HWM
 *                                      the baseline: the payload over ZMQ PUB/SUB (TCP),
 *                                      a header frame then the payload frame (sent
 *                                      without a copy), with back-pressure (XPUB_NODROP)
 *   futex-wait PAGE WARMUP             the futex baseline's waiter (see futexChild, baseline.go)
 *   memcpy BYTES SLOTS REPEATS         memcpy and read bandwidth in one process, cycling
 *                                      through SLOTS batches (a ring's working set)
 *
 * MODE is "spin" (busy-poll), "futex" (block in the kernel: a futex for
 * tsock, a blocking recv for the sockets) or "default" (tsock's default:
 * spin 20 us, then the futex; a blocking recv for the sockets). INTERVAL_NS 0 sends flat out
 * (throughput), otherwise one message per interval (latency). TOUCH 1 reads
 * every byte of each payload (a sum of 64-bit words), TOUCH 0 only its
 * first word. Every message starts with its sequence number and its send
 * time (CLOCK_MONOTONIC); receivers record now - send time.
 *
 * A receiver writes to stdout, little-endian uint64: a count N, N values,
 * then two counters: batches missed and batches seen. The values are
 * latencies in ns when the sender paces, and [first, last] receive times
 * with INTERVAL 0. memcpy writes REPEATS memcpy times then REPEATS read
 * times (ns per batch).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "tsock.h"
#if defined(TBENCH_ZMQ_SUBSET)
#include "zmq_subset.h" /* pyzmq's bundled libzmq, no headers installed */
#elif defined(TBENCH_ZMQ)
#include <zmq.h>
#endif

#define STOP UINT64_MAX

typedef struct {
  uint64_t seq, sent_ns;
} head_t;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *what) {
  fprintf(stderr, "tbench: %s: %s\n", what, strerror(errno));
  exit(1);
}

/* ---- samples ---- */

typedef struct {
  uint64_t *v;
  size_t n, cap;
  uint64_t missed, seen, next, first, last;
  int paced;
  uint64_t warmup;
} rec_t;

static void rec_push(rec_t *r, uint64_t v) {
  if (r->n == r->cap) {
    r->cap = r->cap ? 2 * r->cap : 4096;
    r->v = realloc(r->v, r->cap * sizeof *r->v);
    if (r->v == NULL) die("realloc");
  }
  r->v[r->n++] = v;
}

static void rec_add(rec_t *r, uint64_t seq, uint64_t sent, uint64_t t) {
  if (seq > r->next) r->missed += seq - r->next;
  r->next = seq + 1;
  r->seen++;
  if (r->first == 0) r->first = t;
  r->last = t;
  if (r->paced && seq >= r->warmup && t >= sent) rec_push(r, t - sent);
}

static void put(uint64_t x) {
  if (fwrite(&x, sizeof x, 1, stdout) != 1) die("write");
}

static int rec_write(rec_t *r) {
  if (!r->paced) {
    r->v = realloc(r->v, 2 * sizeof *r->v);
    r->v[0] = r->first;
    r->v[1] = r->last;
    r->n = 2;
  }
  put(r->n);
  for (size_t i = 0; i < r->n; i++) put(r->v[i]);
  put(r->missed);
  put(r->seen);
  return fflush(stdout) == 0 ? 0 : 1;
}

/* Reads every byte, as a consumer would; the sum keeps the loads. */
static uint64_t touch(const void *p, size_t n) {
  const uint64_t *w = p;
  uint64_t s = 0;
  for (size_t i = 0; i < n / 8; i++) s += w[i];
  return s;
}
static volatile uint64_t sink;

/* 1 busy-polls, 0 blocks; "default" (tsock only: spin 20 us, then the
 * futex) blocks for the sockets. */
static int spin_mode(const char *mode) {
  if (strcmp(mode, "spin") == 0) return 1;
  if (strcmp(mode, "futex") == 0 || strcmp(mode, "default") == 0) return 0;
  fprintf(stderr, "tbench: unknown mode %s\n", mode);
  exit(2);
}

/* ---- tsock reader ---- */

static int tsock_reader(char **a) {
  tsock_reader_options_t o;
  tsock_reader_options_init(&o);
  o.attach_timeout_ns = 10000000000ll;
  o.start = TSOCK_START_NOW;
  o.max_held = 1;
  if (strcmp(a[1], "default") != 0) o.spin_ns = spin_mode(a[1]) ? 1000000000ll : 0;
  rec_t r = {.paced = 1, .warmup = strtoull(a[2], NULL, 10)};
  if (r.warmup == UINT64_MAX) r.paced = 0; /* WARMUP -1: unpaced, time the run only */
  int all = atoi(a[3]);
  tsock_reader_t *h;
  if (tsock_reader_attach(a[0], &o, &h) != 0) {
    fprintf(stderr, "tbench: attach: %s\n", tsock_last_error());
    return 1;
  }
  for (;;) {
    const tsock_batch_t *b;
    int rc = tsock_reader_acquire(h, &b, 30000000000ll);
    uint64_t t = now_ns();
    if (rc == TSOCK_ECLOSED) break;
    if (rc != 0) {
      fprintf(stderr, "tbench: acquire: %s\n", tsock_last_error());
      return 1;
    }
    const tsock_tensor_t *x = &b->tensors[0];
    if (*(const uint64_t *)x->data != b->seq) {
      fprintf(stderr, "tbench: batch %llu carries %llu\n", (unsigned long long)b->seq,
              (unsigned long long)*(const uint64_t *)x->data);
      return 1;
    }
    if (all) sink += touch(x->data, x->nbytes);
    rec_add(&r, b->seq, b->publish_ns, t);
    tsock_reader_release(h, b);
  }
  tsock_reader_detach(h);
  return rec_write(&r);
}

/* ---- tsock reading cost: acquire + release of a batch that is ready ---- */

/* Checks a batch's first payload word while the batch is held: once it is
 * released the producer may reuse its slot at once, so a check after the
 * release reads whatever was published there next (the benchmark's random
 * failure under load: a reader preempted between release and check). */
static int cost_check(const tsock_batch_t *b) {
  if (*(const uint64_t *)b->tensors[0].data == b->seq) return 0;
  fprintf(stderr, "tbench: batch %llu carries %llu\n", (unsigned long long)b->seq,
          (unsigned long long)*(const uint64_t *)b->tensors[0].data);
  return 1;
}

static int tsock_cost(char **a) {
  int rounds = atoi(a[1]);
  tsock_reader_options_t o;
  tsock_reader_options_init(&o);
  o.attach_timeout_ns = 10000000000ll;
  o.start = TSOCK_START_NOW;
  o.max_held = 1;
  tsock_reader_t *h;
  if (tsock_reader_attach(a[0], &o, &h) != 0) {
    fprintf(stderr, "tbench: attach: %s\n", tsock_last_error());
    return 1;
  }
  rec_t r = {.paced = 1};
  struct timespec nap = {0, 2000000};
  /* TBENCH_STALL_NS (tests only): sleep that long before each check, as a
   * preemption on a loaded machine would (bench/latency/cost_test.go). */
  const char *stall_env = getenv("TBENCH_STALL_NS");
  long long stall_ns = stall_env != NULL ? atoll(stall_env) : 0;
  struct timespec stall = {(time_t)(stall_ns / 1000000000ll), (long)(stall_ns % 1000000000ll)};
  for (int k = 0; k < rounds; k++) {
    nanosleep(&nap, NULL); /* the producer fills the ring meanwhile */
    /* Each sample is one release (of the batch held) plus one acquire (of
     * the next, already published): the same two calls per batch as
     * acquire + release, timed together, while the payload check runs
     * outside the timed window and only on a held batch. tsock itself
     * never touches the payload (with large power-of-two slots the first
     * words of all slots share cache sets, and that miss would be counted). */
    const tsock_batch_t *held;
    int rc = tsock_reader_acquire(h, &held, 0);
    for (int i = 0; rc == 0 && i < 8; i++) {
      if (stall_ns > 0) nanosleep(&stall, NULL);
      if (cost_check(held) != 0) return 1;
      const tsock_batch_t *next;
      uint64_t t0 = now_ns();
      tsock_reader_release(h, held);
      rc = tsock_reader_acquire(h, &next, 0);
      uint64_t t1 = now_ns();
      if (rc != 0) break;
      rec_push(&r, t1 - t0);
      held = next;
    }
    if (rc == 0) {
      if (cost_check(held) != 0) return 1;
      tsock_reader_release(h, held);
    } else if (rc != TSOCK_EAGAIN) { /* EAGAIN: drained, the next round refills */
      fprintf(stderr, "tbench: acquire: %s\n", tsock_last_error());
      return 1;
    }
  }
  tsock_reader_detach(h);
  return rec_write(&r);
}

/* ---- pacing (as the Go driver's pacer: absolute deadlines, 1 ns slack) ---- */

typedef struct {
  uint64_t interval, next;
} pacer_t;

static void pace(pacer_t *p) {
  if (p->interval == 0) return;
  p->next += p->interval;
  uint64_t t = now_ns();
  if (t >= p->next) {
    p->next = t;
    return;
  }
  struct timespec ts = {(time_t)(p->next / 1000000000ull), (long)(p->next % 1000000000ull)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
  }
}

/* ---- Unix-domain socket baseline ---- */

static int uds_send(char **a) {
  int readers = atoi(a[1]);
  uint64_t interval = strtoull(a[2], NULL, 10);
  double seconds = atof(a[3]);
  size_t len = strtoull(a[4], NULL, 10);
  if (len < sizeof(head_t)) len = sizeof(head_t);
  int ls = socket(AF_UNIX, SOCK_SEQPACKET, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", a[0]);
  if (ls < 0 || bind(ls, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(ls, 128) != 0)
    die("uds listen");
  int *fd = calloc((size_t)readers, sizeof *fd);
  for (int i = 0; i < readers; i++)
    if ((fd[i] = accept(ls, NULL, NULL)) < 0) die("uds accept");
  unlink(a[0]);
  prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0);
  uint8_t *msg = calloc(1, len);
  head_t *h = (head_t *)msg;
  pacer_t p = {interval, now_ns()};
  uint64_t end = now_ns() + (uint64_t)(seconds * 1e9);
  for (uint64_t seq = 0;; seq++) {
    pace(&p);
    uint64_t t = now_ns();
    h->seq = t >= end ? STOP : seq;
    h->sent_ns = t;
    for (int i = 0; i < readers; i++)
      if (send(fd[i], msg, len, 0) != (ssize_t)len) die("uds send");
    if (h->seq == STOP) break;
  }
  for (int i = 0; i < readers; i++) close(fd[i]);
  return 0;
}

static int uds_recv(char **a) {
  int spin = spin_mode(a[1]);
  rec_t r = {.paced = 1, .warmup = strtoull(a[2], NULL, 10)};
  if (r.warmup == UINT64_MAX) r.paced = 0;
  int s = socket(AF_UNIX, SOCK_SEQPACKET, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", a[0]);
  for (int i = 0; connect(s, (struct sockaddr *)&sa, sizeof sa) != 0; i++) {
    if (i > 10000) die("uds connect");
    usleep(1000);
  }
  uint8_t buf[4096];
  for (;;) {
    ssize_t n = recv(s, buf, sizeof buf, spin ? MSG_DONTWAIT : 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    uint64_t t = now_ns();
    if (n < (ssize_t)sizeof(head_t)) die("uds recv");
    head_t h;
    memcpy(&h, buf, sizeof h);
    if (h.seq == STOP) break;
    rec_add(&r, h.seq, h.sent_ns, t);
  }
  return rec_write(&r);
}

/* ---- ZMQ PUB/SUB baseline ---- */

#ifdef TBENCH_ZMQ
static void zfail(const char *what) {
  fprintf(stderr, "tbench: %s: %s\n", what, zmq_strerror(zmq_errno()));
  exit(1);
}

static void no_free(void *data, void *hint) {
  (void)data;
  (void)hint;
}

/* Sends with back-pressure: XPUB_NODROP makes a full subscriber queue
 * refuse the message instead of dropping it; wait a little and retry (XPUB
 * cannot be polled for room). */
static void zsend(void *pub, void *data, size_t len, int zero_copy, int more) {
  struct timespec nap = {0, 20000};
  for (;;) {
    zmq_msg_t m;
    if (zero_copy)
      zmq_msg_init_data(&m, data, len, no_free, NULL);
    else if (zmq_msg_init_size(&m, len) == 0)
      memcpy(zmq_msg_data(&m), data, len);
    if (zmq_msg_send(&m, pub, ZMQ_DONTWAIT | more) >= 0) return;
    zmq_msg_close(&m);
    if (zmq_errno() != EAGAIN) zfail("zmq send");
    nanosleep(&nap, NULL);
  }
}

static int zmq_pub(char **a) {
  int readers = atoi(a[1]);
  uint64_t interval = strtoull(a[2], NULL, 10);
  double seconds = atof(a[3]);
  size_t len = strtoull(a[4], NULL, 10);
  int hwm = atoi(a[5]), one = 1;
  if (len < sizeof(head_t)) len = sizeof(head_t);
  void *ctx = zmq_ctx_new();
  /* XPUB is PUB that also reports subscriptions: the sender starts once
   * every subscriber is in (PUB/SUB drops messages sent before that). */
  void *pub = zmq_socket(ctx, ZMQ_XPUB);
  zmq_setsockopt(pub, ZMQ_XPUB_VERBOSE, &one, sizeof one);
  zmq_setsockopt(pub, ZMQ_XPUB_NODROP, &one, sizeof one);
  zmq_setsockopt(pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
  if (zmq_bind(pub, a[0]) != 0) zfail("zmq bind");
  char sub[64];
  for (int i = 0; i < readers;)
    if (zmq_recv(pub, sub, sizeof sub, 0) > 0 && sub[0] == 1) i++;
  prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0);
  uint8_t *buf = aligned_alloc(64, (len + 63) / 64 * 64);
  memset(buf, 1, len);
  pacer_t p = {interval, now_ns()};
  uint64_t end = now_ns() + (uint64_t)(seconds * 1e9);
  for (uint64_t seq = 0;; seq++) {
    pace(&p);
    uint64_t t = now_ns();
    head_t h = {t >= end ? STOP : seq, t};
    /* Two frames: the header, copied, and the payload, never copied (the
     * same buffer each time). */
    zsend(pub, &h, sizeof h, 0, h.seq == STOP ? 0 : ZMQ_SNDMORE);
    if (h.seq == STOP) break;
    zsend(pub, buf, len, 1, 0);
  }
  zmq_close(pub);
  zmq_ctx_term(ctx);
  return 0;
}

static int zmq_sub(char **a) {
  int spin = spin_mode(a[1]);
  rec_t r = {.paced = 1, .warmup = strtoull(a[2], NULL, 10)};
  if (r.warmup == UINT64_MAX) r.paced = 0;
  int all = atoi(a[3]), hwm = atoi(a[4]);
  void *ctx = zmq_ctx_new();
  void *s = zmq_socket(ctx, ZMQ_SUB);
  zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof hwm);
  zmq_setsockopt(s, ZMQ_SUBSCRIBE, "", 0);
  if (zmq_connect(s, a[0]) != 0) zfail("zmq connect");
  for (;;) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, s, spin ? ZMQ_DONTWAIT : 0) < 0) {
      zmq_msg_close(&m);
      if (zmq_errno() == EAGAIN || zmq_errno() == EINTR) continue;
      zfail("zmq recv");
    }
    uint64_t t = now_ns();
    head_t h;
    if (zmq_msg_size(&m) != sizeof h) zfail("zmq: not a header");
    memcpy(&h, zmq_msg_data(&m), sizeof h);
    zmq_msg_close(&m);
    if (h.seq == STOP) break;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, s, 0) < 0) zfail("zmq recv payload");
    if (all) sink += touch(zmq_msg_data(&m), zmq_msg_size(&m));
    zmq_msg_close(&m);
    rec_add(&r, h.seq, h.sent_ns, t);
  }
  zmq_close(s);
  zmq_ctx_term(ctx);
  return rec_write(&r);
}
#endif

/* ---- futex baseline waiter ----
 * The C twin of futexChild in baseline.go (same page layout): the waiter of
 * the futex baseline is then the same kind of process as the tsock readers
 * it is compared with (a Go waiter's runtime threads keep its CPU awake). */

static int futex_wait_role(char **a) {
  uint64_t warmup = strtoull(a[1], NULL, 10);
  int fd = open(a[0], O_RDWR);
  uint8_t *page = fd < 0 ? MAP_FAILED : mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (page == MAP_FAILED) die("map the baseline page");
  uint32_t *word = (uint32_t *)(page + 192), *stop = (uint32_t *)(page + 196);
  const uint64_t *stamps = (const uint64_t *)(page + 256);
  rec_t r = {.paced = 1}; /* samples pushed as they are */
  uint64_t late = 0;
  __atomic_store_n((uint32_t *)(page + 128), 1, __ATOMIC_SEQ_CST);
  for (;;) {
    uint32_t w = __atomic_load_n(word, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(stop, __ATOMIC_SEQ_CST)) break;
    long e = syscall(SYS_futex, word, FUTEX_WAIT, w, NULL, NULL, 0);
    uint64_t t = now_ns();
    uint32_t nw = __atomic_load_n(word, __ATOMIC_SEQ_CST);
    if (nw == w) continue; /* spurious */
    if (e != 0) {          /* the word moved before we slept: no wake-up to time */
      late++;
      continue;
    }
    if (__atomic_load_n(stop, __ATOMIC_SEQ_CST)) break;
    uint64_t stamp = __atomic_load_n(&stamps[nw % 64], __ATOMIC_SEQ_CST);
    if (nw > warmup && t >= stamp) rec_push(&r, t - stamp);
  }
  r.seen = late;
  return rec_write(&r);
}

/* ---- memcpy and read bandwidth ---- */

static int mem_bw(char **a) {
  size_t n = strtoull(a[0], NULL, 10), slots = strtoull(a[1], NULL, 10);
  int repeats = atoi(a[2]);
  /* A ring of `slots` batches, as the transports cycle through: the same
   * working set, so the same caches. */
  uint8_t *src = aligned_alloc(4096, n * slots), *dst = aligned_alloc(4096, n);
  if (src == NULL || dst == NULL) die("alloc");
  memset(src, 1, n * slots);
  memset(dst, 2, n);
  uint64_t *v = calloc(2 * (size_t)repeats, sizeof *v);
  for (int k = 0; k < 2; k++) {
    for (int i = 0; i < repeats; i++) {
      /* At least 2 laps and about 200 MB, so that small sizes time well. */
      size_t batches = 2 * slots + 200000000ull / n;
      uint64_t t0 = now_ns();
      for (size_t j = 0; j < batches; j++) {
        const uint8_t *b = src + (j % slots) * n;
        if (k == 0) {
          memcpy(dst, b, n);
          __asm__ __volatile__("" : : "r"(dst) : "memory");
        } else {
          sink += touch(b, n);
        }
      }
      v[k * repeats + i] = (now_ns() - t0) / batches;
    }
  }
  put(2 * (uint64_t)repeats);
  for (int i = 0; i < 2 * repeats; i++) put(v[i]);
  put(0);
  put(0);
  return fflush(stdout) == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
  static const struct {
    const char *role;
    int nargs;
    int (*fn)(char **);
  } roles[] = {
      {"tsock", 4, tsock_reader}, {"tsock-cost", 2, tsock_cost},
      {"uds-send", 5, uds_send},  {"uds-recv", 3, uds_recv},
#ifdef TBENCH_ZMQ
      {"zmq-pub", 6, zmq_pub},    {"zmq-sub", 5, zmq_sub},
#endif
      {"futex-wait", 2, futex_wait_role}, {"memcpy", 3, mem_bw},
  };
  for (size_t i = 0; argc > 1 && i < sizeof roles / sizeof roles[0]; i++)
    if (strcmp(argv[1], roles[i].role) == 0) {
      if (argc - 2 != roles[i].nargs) break;
      return roles[i].fn(argv + 2);
    }
  fprintf(stderr, "usage: tbench ROLE ARGS... (see the top of tbench.c)%s\n",
#ifdef TBENCH_ZMQ
          ""
#else
          "; built without libzmq"
#endif
  );
  return 2;
}
