/*
 * abi_producer.c - a producer written against include/tsock.h and linked
 * with libtsock.so, for the multi-process tests in tests/mp/abi_test.go
 * (a Go test process cannot fork without exec; a C program can).
 *
 *   abi_producer race NAME ITERS
 *       ITERS times: create NAME, start threads calling
 *       tsock_producer_stats and tsock_producer_wait_readers in a loop,
 *       close the producer from the main thread while they run. Every call
 *       must return a status (OK, EHANDLE, ETIMEDOUT): exit 1 otherwise.
 *   abi_producer fork NAME CHILD_SECONDS
 *       create NAME, publish 3 batches, fork() a child that does not exec
 *       and lives CHILD_SECONDS, print "ready CHILD_PID" and wait to be
 *       killed. The child inherits the producer's mapping, never its lock.
 *   abi_producer forkstorm NAME SECONDS MIN_FORKS MIN_CREATES
 *       a thread creates and closes producer NAME in a loop while the main
 *       thread forks children for SECONDS, and longer (up to 60 s) until
 *       there were MIN_FORKS forks and MIN_CREATES creates (a loaded
 *       machine gets fewer done in SECONDS); each child looks for an open
 *       file description with an OFD lock among its descriptors
 *       (/proc/self/fdinfo "lock:" lines), a socket or a reader record's
 *       memfd, and exits 7 if it finds one. The other thread also attaches
 *       and detaches a reader to each producer it creates.
 *       Prints "forks N leaks K creates C".
 *   abi_producer hold NAME GID
 *       create NAME (mode 0640, group GID), print "ready", wait for
 *       SIGUSR1 (peers do their worst meanwhile), then fork() a child
 *       that exits at once and close the producer, each under a 30 s
 *       watchdog (SIGALRM kills the process: exit by signal). Prints
 *       "fork took S" and "close took S".
 *   abi_producer abortclosing NAME
 *       a batch is reserved; a thread closes the producer while the main
 *       thread aborts the reservation as soon as the handle is gone from
 *       the open ones (Close still running), then once more after Close
 *       returned. Prints "first: MSG" and "second: MSG".
 *   abi_producer closereserved NAME
 *       a thread reserves a batch and writes its payload for a while;
 *       the main thread closes the producer meanwhile. The writer must
 *       finish (publish then reports the closed handle): prints
 *       "writer done RC", exits 0 (before the fix: SIGSEGV).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tsock.h"

static tsock_producer_t *_Atomic shared_p;
static atomic_int stop_threads;
static atomic_int bad;
static atomic_long calls;

static void *hammer(void *arg) {
  int kind = (int)(intptr_t)arg;
  while (!atomic_load(&stop_threads)) {
    tsock_producer_t *p = atomic_load(&shared_p);
    int rc;
    if (kind == 0) {
      tsock_producer_stats_t st;
      memset(&st, 0, sizeof st);
      st.size = sizeof st;
      rc = tsock_producer_stats(p, &st);
      if (rc != TSOCK_OK && rc != TSOCK_EHANDLE) {
        fprintf(stderr, "stats: %s: %s\n", tsock_status_str(rc), tsock_last_error());
        atomic_store(&bad, 1);
      }
    } else {
      rc = tsock_producer_wait_readers(p, 1, 1000);
      if (rc != TSOCK_ETIMEDOUT && rc != TSOCK_EHANDLE) {
        fprintf(stderr, "wait_readers: %s: %s\n", tsock_status_str(rc), tsock_last_error());
        atomic_store(&bad, 1);
      }
    }
    atomic_fetch_add(&calls, 1);
  }
  return NULL;
}

static int race(const char *name, int iters) {
  for (int it = 0; it < iters; it++) {
    tsock_producer_options_t o;
    tsock_producer_options_init(&o);
    o.slot_count = 2;
    o.slot_bytes = 4096;
    tsock_producer_t *p = NULL;
    int rc = tsock_producer_create(name, &o, &p);
    if (rc != TSOCK_OK) {
      fprintf(stderr, "create: %s: %s\n", tsock_status_str(rc), tsock_last_error());
      return 1;
    }
    atomic_store(&shared_p, p);
    atomic_store(&stop_threads, 0);
    long before = atomic_load(&calls);
    pthread_t th[4];
    for (int k = 0; k < 4; k++) pthread_create(&th[k], NULL, hammer, (void *)(intptr_t)(k % 2));
    while (atomic_load(&calls) < before + 8) sched_yield();
    rc = tsock_producer_close(p);
    if (rc != TSOCK_OK) {
      fprintf(stderr, "close: %s: %s\n", tsock_status_str(rc), tsock_last_error());
      return 1;
    }
    long after_close = atomic_load(&calls);
    while (atomic_load(&calls) < after_close + 8) sched_yield();
    atomic_store(&stop_threads, 1);
    for (int k = 0; k < 4; k++) pthread_join(th[k], NULL);
    if (atomic_load(&bad)) return 1;
  }
  printf("race ok %ld calls\n", atomic_load(&calls));
  return 0;
}

static int fork_child(const char *name, int child_seconds) {
  tsock_producer_options_t o;
  tsock_producer_options_init(&o);
  o.slot_count = 4;
  o.slot_bytes = 4096;
  tsock_producer_t *p = NULL;
  int rc = tsock_producer_create(name, &o, &p);
  if (rc != TSOCK_OK) {
    fprintf(stderr, "create: %s: %s\n", tsock_status_str(rc), tsock_last_error());
    return 1;
  }
  for (int i = 0; i < 3; i++) {
    void *buf;
    if ((rc = tsock_producer_reserve(p, 8, -1, &buf)) != TSOCK_OK) return 1;
    memcpy(buf, &i, sizeof i);
    if ((rc = tsock_producer_publish(p, NULL, 0, NULL, 0)) != TSOCK_OK) return 1;
  }
  fflush(stdout);
  pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    /* A DataLoader worker: lives on, never calls tsock; the producer's
     * handle must say so if it did. */
    rc = tsock_producer_stats(p, NULL);
    if (rc != TSOCK_EFORKED) _exit(5);
    /* Let go of the test's pipes: only what tsock leaves us may remain. */
    int devnull = open("/dev/null", O_RDWR);
    dup2(devnull, 1);
    dup2(devnull, 2);
    struct timespec ts = {child_seconds, 0};
    while (nanosleep(&ts, &ts) != 0) {
    }
    _exit(0);
  }
  printf("ready %d\n", (int)child);
  fflush(stdout);
  for (;;) pause();
}

static atomic_long creates;

static void *create_loop(void *arg) {
  const char *name = arg;
  while (!atomic_load(&stop_threads)) {
    tsock_producer_options_t o;
    tsock_producer_options_init(&o);
    o.slot_count = 2;
    o.slot_bytes = 4096;
    tsock_producer_t *p = NULL;
    int rc = tsock_producer_create(name, &o, &p);
    if (rc != TSOCK_OK) {
      fprintf(stderr, "create: %s: %s\n", tsock_status_str(rc), tsock_last_error());
      atomic_store(&bad, 1);
      return NULL;
    }
    atomic_fetch_add(&creates, 1);
    /* A reader too: the producer accepts its connection and makes its
     * record, the reader keeps its own end. */
    tsock_reader_t *r = NULL;
    if (tsock_reader_attach(name, NULL, &r) == TSOCK_OK) tsock_reader_detach(r);
    tsock_producer_close(p);
  }
  return NULL;
}

/* Whether socket fd was shut down both ways after it was listening or
 * connected: dead at both ends, it keeps nothing alive (the producer hands
 * its connections and join socket to its discard workers so:
 * internal/readers, handOver). POLLHUP alone would also pass a socket never
 * connected (before listen() or connect()), which the fork guards must
 * keep out of children: a shut-down listener still says SO_ACCEPTCONN, a
 * shut-down connection fails a send with EPIPE (a fresh one: ENOTCONN). */
static int socket_shut_down(int fd) {
  struct pollfd pfd = {.fd = fd, .events = POLLIN};
  if (poll(&pfd, 1, 0) != 1 || !(pfd.revents & POLLHUP)) return 0;
  int listening = 0;
  socklen_t len = sizeof listening;
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && listening) return 1;
  return send(fd, "", 0, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno == EPIPE;
}

/* In the child: only system calls (the parent has other threads). 1 if
 * the child holds a descriptor that tsock must not leave it: an open file
 * description with an OFD lock, a socket (the producer's join socket, a
 * reader's connection, either end, unless shut down) or a reader record's
 * memfd. */
static int child_holds_tsock_fd(void) {
  char path[64], buf[4096];
  for (int fd = 0; fd < 1024; fd++) {
    if (fcntl(fd, F_GETFD) < 0) continue;
    /* "/proc/self/fdinfo/" + fd */
    static const char pre[] = "/proc/self/fdinfo/";
    size_t n = sizeof pre - 1;
    memcpy(path, pre, n);
    char digits[12];
    int nd = 0, v = fd;
    do {
      digits[nd++] = (char)('0' + v % 10);
      v /= 10;
    } while (v > 0);
    while (nd > 0) path[n++] = digits[--nd];
    path[n] = 0;
    int f = open(path, O_RDONLY);
    if (f < 0) continue;
    ssize_t got = read(f, buf, sizeof buf - 1);
    close(f);
    if (got <= 0) continue;
    buf[got] = 0;
    if (strstr(buf, "OFDLCK") != NULL) return 1;
    memcpy(path, "/proc/self/fd/", 14);
    memmove(path + 14, path + sizeof pre - 1, strlen(path + sizeof pre - 1) + 1);
    got = readlink(path, buf, sizeof buf - 1);
    if (got <= 0) continue;
    buf[got] = 0;
    if (strstr(buf, "memfd:tsock") != NULL) return 1;
    if (strncmp(buf, "socket:", 7) == 0 && !socket_shut_down(fd)) return 1;
  }
  return 0;
}

static int forkstorm(const char *name, int seconds, long min_forks, long min_creates) {
  pthread_t th;
  pthread_create(&th, NULL, create_loop, (void *)name);
  struct timespec t0, now;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  long forks = 0, leaks = 0;
  for (;;) {
    pid_t c = fork();
    if (c < 0) break;
    if (c == 0) _exit(child_holds_tsock_fd() ? 7 : 0);
    int ws = 0;
    waitpid(c, &ws, 0);
    forks++;
    if (WIFEXITED(ws) && WEXITSTATUS(ws) == 7) leaks++;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long elapsed = now.tv_sec - t0.tv_sec;
    int enough = forks >= min_forks && atomic_load(&creates) >= min_creates;
    if (elapsed >= 60 || (elapsed >= seconds && enough)) break;
  }
  atomic_store(&stop_threads, 1);
  pthread_join(th, NULL);
  printf("forks %ld leaks %ld creates %ld\n", forks, leaks, atomic_load(&creates));
  return atomic_load(&bad) ? 1 : 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static volatile sig_atomic_t usr1_seen;
static void on_usr1(int sig) {
  (void)sig;
  usr1_seen = 1;
}

static int hold(const char *name, int gid) {
  /* A handler, not sigwait(): the Go runtime's threads exist before main
   * and do not block SIGUSR1, so a signal that arrives while the main
   * thread is out of sigwait (after a SIGSTOP/SIGCONT, before it is
   * scheduled again) went to one of them and its default action killed
   * the process. A handler runs on whichever thread gets it. */
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_usr1;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGUSR1, &sa, NULL);
  tsock_producer_options_t o;
  tsock_producer_options_init(&o);
  o.slot_count = 4;
  o.slot_bytes = 4096;
  o.mode = 0640;
  o.gid = gid;
  tsock_producer_t *p = NULL;
  int rc = tsock_producer_create(name, &o, &p);
  if (rc != TSOCK_OK) {
    fprintf(stderr, "create: %s: %s\n", tsock_status_str(rc), tsock_last_error());
    return 1;
  }
  printf("ready\n");
  fflush(stdout);
  while (!usr1_seen) usleep(10 * 1000);
  alarm(30);
  double t0 = now_s();
  pid_t child = fork();
  if (child == 0) _exit(0);
  printf("fork took %.3f\n", now_s() - t0);
  fflush(stdout);
  waitpid(child, NULL, 0);
  t0 = now_s();
  rc = tsock_producer_close(p);
  printf("close took %.3f (%s)\n", now_s() - t0, tsock_status_str(rc));
  fflush(stdout);
  return rc == TSOCK_OK ? 0 : 1;
}

static tsock_producer_t *reserving_p;
static atomic_int payload_reserved;

static void *reserved_writer(void *arg) {
  (void)arg;
  void *buf;
  int rc = tsock_producer_reserve(reserving_p, 1 << 20, 0, &buf);
  if (rc != TSOCK_OK) {
    fprintf(stderr, "reserve: %s\n", tsock_status_str(rc));
    exit(2);
  }
  atomic_store(&payload_reserved, 1);
  for (int k = 0; k < 200; k++) {
    memset(buf, k, 1 << 20);
    usleep(100);
  }
  rc = tsock_producer_publish(reserving_p, NULL, 0, NULL, 0);
  printf("writer done %s\n", rc == TSOCK_EHANDLE ? "EHANDLE" : tsock_status_str(rc));
  fflush(stdout);
  return NULL;
}

static int close_reserved(const char *name) {
  tsock_producer_options_t o;
  tsock_producer_options_init(&o);
  o.slot_count = 2;
  o.slot_bytes = 1 << 20;
  int rc = tsock_producer_create(name, &o, &reserving_p);
  if (rc != TSOCK_OK) {
    fprintf(stderr, "create: %s: %s\n", tsock_status_str(rc), tsock_last_error());
    return 1;
  }
  pthread_t t;
  pthread_create(&t, NULL, reserved_writer, NULL);
  while (!atomic_load(&payload_reserved)) usleep(100);
  usleep(5000);
  rc = tsock_producer_close(reserving_p);
  printf("close %s\n", tsock_status_str(rc));
  fflush(stdout);
  pthread_join(t, NULL);
  /* The pages were freed with the publish: a second one says "not open". */
  int again = tsock_producer_abort(reserving_p);
  printf("abort after %s\n", tsock_status_str(again));
  return rc == TSOCK_OK && again == TSOCK_EHANDLE ? 0 : 1;
}

static tsock_producer_t *closing_p;
static atomic_int closing_go;

static void *closing_closer(void *arg) {
  (void)arg;
  while (!atomic_load(&closing_go)) {
  }
  tsock_producer_close(closing_p);
  return NULL;
}

static int abort_closing(const char *name) {
  tsock_producer_options_t o;
  tsock_producer_options_init(&o);
  o.slot_count = 4;
  o.slot_bytes = 1 << 20;
  if (tsock_producer_create(name, &o, &closing_p) != TSOCK_OK) {
    fprintf(stderr, "create: %s\n", tsock_last_error());
    return 1;
  }
  void *buf;
  if (tsock_producer_reserve(closing_p, 1 << 20, 0, &buf) != TSOCK_OK) return 1;
  pthread_t b;
  pthread_create(&b, NULL, closing_closer, NULL);
  atomic_store(&closing_go, 1);
  tsock_producer_stats_t st;
  memset(&st, 0, sizeof st);
  st.size = sizeof st;
  while (tsock_producer_stats(closing_p, &st) == TSOCK_OK) {
  }
  tsock_producer_abort(closing_p);
  printf("first: %s\n", tsock_last_error());
  pthread_join(b, NULL);
  tsock_producer_abort(closing_p);
  printf("second: %s\n", tsock_last_error());
  fflush(stdout);
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 4 && strcmp(argv[1], "race") == 0) return race(argv[2], atoi(argv[3]));
  if (argc == 3 && strcmp(argv[1], "closereserved") == 0) return close_reserved(argv[2]);
  if (argc == 3 && strcmp(argv[1], "abortclosing") == 0) return abort_closing(argv[2]);
  if (argc == 4 && strcmp(argv[1], "hold") == 0) return hold(argv[2], atoi(argv[3]));
  if (argc == 4 && strcmp(argv[1], "fork") == 0) return fork_child(argv[2], atoi(argv[3]));
  if (argc == 6 && strcmp(argv[1], "forkstorm") == 0)
    return forkstorm(argv[2], atoi(argv[3]), atol(argv[4]), atol(argv[5]));
  fprintf(stderr, "usage: abi_producer race NAME ITERS | fork NAME CHILD_SECONDS | "
                  "forkstorm NAME SECONDS MIN_FORKS MIN_CREATES\n");
  return 2;
}
