/* platform.c - the Linux primitives tsock stands on: monotonic clock,
 * futexes on shared words, OFD byte locks, process start times, and the
 * fork guard. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

uint64_t tsock__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void tsock__futex_wait(const uint32_t *word, uint32_t expected, int64_t timeout_ns) {
  struct timespec ts, *tp = NULL;
  if (timeout_ns >= 0) {
    ts.tv_sec = timeout_ns / 1000000000;
    ts.tv_nsec = timeout_ns % 1000000000;
    tp = &ts;
  }
  /* Shared (not PRIVATE) futex: the word lives in a file mapping shared
   * between processes. EAGAIN (value changed), EINTR and ETIMEDOUT all mean
   * "look again", which every caller does. */
  syscall(SYS_futex, word, FUTEX_WAIT, expected, tp, NULL, 0);
}

void tsock__futex_wake_all(uint32_t *word) {
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static struct flock byte_lock(short type, uint64_t byte) {
  struct flock fl;
  memset(&fl, 0, sizeof fl);
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = (off_t)byte;
  fl.l_len = 1;
  return fl;
}

int tsock__lock_byte(int fd, uint64_t byte) {
  struct flock fl = byte_lock(F_WRLCK, byte);
  if (fcntl(fd, F_OFD_SETLK, &fl) == 0) return 0;
  return (errno == EAGAIN || errno == EACCES) ? -1 : -2;
}

int tsock__byte_locked(int fd, uint64_t byte) {
  struct flock fl = byte_lock(F_WRLCK, byte);
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return -1;
  return fl.l_type != F_UNLCK;
}

uint64_t tsock__proc_start_time(int pid) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  /* The command name (field 2) may hold spaces and parentheses: count
   * fields from the last ')'. starttime is field 22. */
  char *p = strrchr(buf, ')');
  if (p == NULL) return 0;
  int field = 2;
  unsigned long long v = 0;
  for (; *p != '\0'; p++) {
    if (*p == ' ' && ++field == 22) {
      if (sscanf(p + 1, "%llu", &v) != 1) return 0;
      return v;
    }
  }
  return 0;
}

/* ---- fork guard ---- */

#define FORK_TRACK_MAX 256
static pthread_mutex_t fork_mu = PTHREAD_MUTEX_INITIALIZER;
static int fork_fds[FORK_TRACK_MAX];
static int fork_nfds;
static uint64_t fork_gen;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void fork_prepare(void) { pthread_mutex_lock(&fork_mu); }
static void fork_parent(void) { pthread_mutex_unlock(&fork_mu); }
static void fork_child(void) {
  /* Closing our reference drops nothing in the parent, but means the lock
   * dies with the parent even while this child lives on. */
  for (int i = 0; i < fork_nfds; i++) close(fork_fds[i]);
  fork_nfds = 0;
  __atomic_add_fetch(&fork_gen, 1, __ATOMIC_SEQ_CST);
  pthread_mutex_unlock(&fork_mu);
}
static void fork_install(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }

/* Installed at load, so a child forked before any tsock call still learns
 * that it is a child (its fork generation is no longer 0). */
__attribute__((constructor)) static void fork_guard_at_load(void) {
  pthread_once(&fork_once, fork_install);
}

void tsock__fork_track(int fd) {
  pthread_once(&fork_once, fork_install);
  pthread_mutex_lock(&fork_mu);
  if (fork_nfds < FORK_TRACK_MAX) fork_fds[fork_nfds++] = fd;
  pthread_mutex_unlock(&fork_mu);
}

void tsock__fork_untrack(int fd) {
  pthread_mutex_lock(&fork_mu);
  for (int i = 0; i < fork_nfds; i++) {
    if (fork_fds[i] == fd) {
      fork_fds[i] = fork_fds[--fork_nfds];
      break;
    }
  }
  pthread_mutex_unlock(&fork_mu);
}

uint64_t tsock__fork_generation(void) { return __atomic_load_n(&fork_gen, __ATOMIC_ACQUIRE); }
