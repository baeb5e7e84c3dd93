/* test_util.h - tiny check macros and channel-name bookkeeping for the C tests. */
#ifndef TSOCK_TEST_UTIL_H
#define TSOCK_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tsock.h"

static int test_failures;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      test_failures++;                                                         \
    }                                                                          \
  } while (0)

/* Checks a status; a failure (other than TSOCK_EAGAIN) must leave a message. */
#define CHECK_RC(expr, want)                                                              \
  do {                                                                                    \
    int rc_ = (expr), want_ = (want);                                                     \
    if (rc_ != want_) {                                                                   \
      fprintf(stderr, "%s:%d: %s = %d (%s), want %d (%s); last error: %s\n", __FILE__,    \
              __LINE__, #expr, rc_, tsock_status_str(rc_), want_, tsock_status_str(want_), \
              tsock_last_error());                                                        \
      test_failures++;                                                                    \
    } else if (want_ < 0 && want_ != TSOCK_EAGAIN && tsock_last_error()[0] == '\0') {     \
      fprintf(stderr, "%s:%d: %s failed with no tsock_last_error()\n", __FILE__, __LINE__, \
              #expr);                                                                     \
      test_failures++;                                                                    \
    }                                                                                     \
  } while (0)

/* Every channel a test names, removed at exit whatever happened. */
#define TEST_MAX_NAMES 64
static char test_channels[TEST_MAX_NAMES][80];
static int test_nchannels;

static inline void test_cleanup(void) {
  char path[128];
  for (int i = 0; i < test_nchannels; i++) {
    snprintf(path, sizeof path, "/dev/shm/tsock.%.79s", test_channels[i]);
    unlink(path);
  }
}

/* Remembers `name` for removal at exit; returns the kept copy. */
static inline const char *test_keep(const char *name) {
  if (test_nchannels == 0) atexit(test_cleanup);
  if (test_nchannels == TEST_MAX_NAMES || strlen(name) >= sizeof test_channels[0]) abort();
  return strcpy(test_channels[test_nchannels++], name);
}

/* A channel name unique to this process: "<prefix>-<pid>-<tag>". */
static inline const char *test_name(const char *prefix, const char *tag) {
  char n[sizeof test_channels[0]];
  snprintf(n, sizeof n, "%s-%d-%s", prefix, (int)getpid(), tag);
  return test_keep(n);
}

static inline int64_t test_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

#define MS 1000000LL

static inline int test_report(const char *prog) {
  if (test_failures != 0) {
    fprintf(stderr, "%s: %d check(s) failed\n", prog, test_failures);
    return 1;
  }
  printf("%s: all checks passed\n", prog);
  return 0;
}

#endif
