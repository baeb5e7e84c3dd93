/*
 * soak_producer.c - the C producer of the chaos soak (tests/soak), the twin
 * of the Go producer role (tests/soak/roles.go): it publishes the test
 * stream of internal/batchgen through libtsock.so and, unlike a Go program,
 * can fork without exec: with --fork-every it forks children that sleep
 * --fork-life and exit, never calling tsock, as a DataLoader's workers do.
 * When the soak SIGKILLs this producer, its children live on, holding its
 * mapping of the segment: they must not keep the producer "alive" (readers
 * get "producer gone", a new producer takes the name at once).
 *
 * Built by the soak with:
 *   cc -O2 -std=c11 -Wall -Wextra -Werror -Iinclude tests/soak/cproducer/soak_producer.c \
 *      -Lbuild -ltsock -Wl,-rpath,build
 *
 * Usage: soak_producer --name N [--slots S] [--rate R] [--inc K] [--epoch-every E]
 *                      [--cuda-device D] [--fork-every MS --fork-life MS]
 *   Creates channel N (slot bytes for the largest batchgen batch, 32
 *   reader records) and publishes data batches i = K<<40, K<<40+1, ... at
 *   R per second (0: as fast as the readers allow), an epoch-end marker
 *   every E data batches. Commands on stdin, as the Go role's:
 *   "pause", "drain N" (publish N batches, waiting up to 10 s for each),
 *   "close" (close the channel and exit 0); end of stdin exits 1.
 *
 * Output lines (stdout): created ns=<how long the create took> | forked pid=P | paused | drained ok |
 * drained error: ... | closed | error ...
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tsock.h"
#include "../../../internal/batchgen/batchgen.h"

#define INC_SHIFT 40 /* the incarnation's place in the batch counter (roles.go: incShift) */
#define MS 1000000ll

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static void sleep_until(int64_t t) {
  struct timespec ts = {(time_t)(t / 1000000000ll), (long)(t % 1000000000ll)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
  }
}

static int fail(const char *what, int rc) {
  printf("error %s: %s: %s\n", what, tsock_status_str(rc), tsock_last_error());
  return 1;
}

/* ---- forked children ---- */

/* In the child: only what a DataLoader worker that never calls tsock would
 * do, plus one check that the parent's handle refuses to work here. The
 * parent may have Go runtime threads, so nothing that takes a lock. */
static void child_sleeps(tsock_producer_t *p, int64_t life_ns) {
  if (tsock_producer_stats(p, NULL) != TSOCK_EFORKED) {
    static const char msg[] = "error forked child: the parent's producer handle did not return EFORKED\n";
    (void)!write(1, msg, sizeof msg - 1);
  }
  /* Let go of the soak's pipes: only the mapping tsock leaves us remains. */
  int devnull = open("/dev/null", O_RDWR);
  for (int fd = 0; fd < 3; fd++) dup2(devnull, fd);
  sleep_until(now_ns() + life_ns);
  _exit(0);
}

static int fork_child(tsock_producer_t *p, int64_t life_ns) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) {
    printf("error fork: %s\n", strerror(errno));
    return 1;
  }
  if (pid == 0) child_sleeps(p, life_ns);
  printf("forked pid=%d\n", (int)pid);
  return 0;
}

/* ---- publishing ---- */

struct stream {
  tsock_producer_t *p;
  uint64_t base, i, epoch_every;
};

/* Publishes the next data batch (and an epoch marker after every
 * epoch_every), waiting up to timeout_ns for the readers. */
static int publish_one(struct stream *s, int64_t timeout_ns) {
  void *buf;
  int rc = tsock_producer_reserve(s->p, batchgen_payload_bytes(s->i), timeout_ns, &buf);
  if (rc != TSOCK_OK) return rc;
  tsock_tensor_t t[2];
  uint8_t meta[8];
  batchgen_write(buf, s->i, t, meta);
  if ((rc = tsock_producer_publish(s->p, t, 2, meta, sizeof meta)) != TSOCK_OK) return rc;
  s->i++;
  if (s->epoch_every > 0 && (s->i - s->base) % s->epoch_every == 0) {
    while ((rc = tsock_producer_end_epoch(s->p, timeout_ns)) == TSOCK_ETIMEDOUT) {
    }
  }
  return rc;
}

/* ---- commands on stdin ---- */

static char cmd_buf[256];
static size_t cmd_len;

/* The next complete line from stdin into line: 1 when there is one, 0 when
 * none yet (or wait for one when block), -1 at the end of stdin. */
static int next_command(char *line, size_t cap, int block) {
  for (;;) {
    char *nl = memchr(cmd_buf, '\n', cmd_len);
    if (nl != NULL) {
      size_t n = (size_t)(nl - cmd_buf);
      snprintf(line, cap, "%.*s", (int)n, cmd_buf);
      memmove(cmd_buf, nl + 1, cmd_len - n - 1);
      cmd_len -= n + 1;
      return 1;
    }
    if (cmd_len == sizeof cmd_buf) cmd_len = 0; /* a line longer than any command: drop it */
    struct pollfd pfd = {0, POLLIN, 0};
    if (poll(&pfd, 1, block ? -1 : 0) <= 0) return 0;
    ssize_t got = read(0, cmd_buf + cmd_len, sizeof cmd_buf - cmd_len);
    if (got == 0) return -1;
    if (got < 0) return errno == EINTR || errno == EAGAIN ? 0 : -1;
    cmd_len += (size_t)got;
  }
}

struct config {
  const char *name;
  long slots, rate, inc, epoch_every, cuda_device, fork_every_ms, fork_life_ms;
};

static int parse(int argc, char **argv, struct config *c) {
  *c = (struct config){NULL, 16, 2000, 0, 500, -1, 0, 0};
  for (int k = 1; k + 1 < argc; k += 2) {
    const char *f = argv[k], *v = argv[k + 1];
    char *end;
    long n = strtol(v, &end, 10);
    int num = *v != 0 && *end == 0 && n >= -1;
    if (strcmp(f, "--name") == 0) c->name = v;
    else if (strcmp(f, "--slots") == 0 && num) c->slots = n;
    else if (strcmp(f, "--rate") == 0 && num) c->rate = n;
    else if (strcmp(f, "--inc") == 0 && num) c->inc = n;
    else if (strcmp(f, "--epoch-every") == 0 && num) c->epoch_every = n;
    else if (strcmp(f, "--cuda-device") == 0 && num) c->cuda_device = n;
    else if (strcmp(f, "--fork-every") == 0 && num) c->fork_every_ms = n;
    else if (strcmp(f, "--fork-life") == 0 && num) c->fork_life_ms = n;
    else return -1;
  }
  return argc % 2 == 1 && c->name != NULL && c->inc >= 0 && c->rate >= 0 ? 0 : -1;
}

int main(int argc, char **argv) {
  struct config cfg;
  if (parse(argc, argv, &cfg) != 0) {
    fprintf(stderr, "usage: %s --name N [--slots S] [--rate R] [--inc K] [--epoch-every E] "
                    "[--cuda-device D] [--fork-every MS --fork-life MS]\n", argv[0]);
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  tsock_producer_options_t o;
  tsock_producer_options_init(&o);
  o.slot_count = (uint32_t)cfg.slots;
  o.slot_bytes = batchgen_offset1(BATCHGEN_MAX_LEN) + 16;
  o.max_readers = 32;
  o.cuda_device = (int32_t)cfg.cuda_device;
  struct stream s = {NULL, (uint64_t)cfg.inc << INC_SHIFT, 0, (uint64_t)cfg.epoch_every};
  s.i = s.base;
  int64_t t0 = now_ns();
  int rc = tsock_producer_create(cfg.name, &o, &s.p);
  if (rc != TSOCK_OK) return fail("create", rc);
  printf("created ns=%lld\n", (long long)(now_ns() - t0));

  int forking = cfg.fork_every_ms > 0 && cfg.fork_life_ms > 0;
  int64_t next_fork = now_ns(), period = cfg.rate > 0 ? 1000000000ll / cfg.rate : 0;
  int64_t next_publish = now_ns();
  int paused = 0;
  char line[256];
  for (;;) {
    if (forking && !paused && now_ns() >= next_fork) {
      if (fork_child(s.p, cfg.fork_life_ms * MS) != 0) return 1;
      next_fork = now_ns() + cfg.fork_every_ms * MS;
    }
    int got = next_command(line, sizeof line, paused);
    if (got < 0) return 1; /* stdin closed: the orchestrator is gone */
    if (got > 0) {
      long n;
      if (strcmp(line, "pause") == 0) {
        paused = 1;
        printf("paused\n");
      } else if (sscanf(line, "drain %ld", &n) == 1) {
        rc = TSOCK_OK;
        for (long k = 0; k < n && rc == TSOCK_OK; k++) rc = publish_one(&s, 10000 * MS);
        if (rc == TSOCK_OK) printf("drained ok\n");
        else printf("drained error: %s: %s\n", tsock_status_str(rc), tsock_last_error());
      } else if (strcmp(line, "close") == 0) {
        if ((rc = tsock_producer_close(s.p)) != TSOCK_OK) return fail("close", rc);
        printf("closed\n");
        return 0;
      }
      continue;
    }
    if (period > 0) {
      /* Like Go's ticker: a late producer does not catch up in a burst. */
      int64_t now = now_ns();
      if (next_publish < now - period) next_publish = now;
      sleep_until(next_publish);
      next_publish += period;
    }
    rc = publish_one(&s, 100 * MS);
    if (rc != TSOCK_OK && rc != TSOCK_ETIMEDOUT) return fail("publish", rc);
  }
}
