/* platform.c - the Linux primitives tsock stands on: monotonic clock,
 * futexes on shared words, OFD byte locks, process start times, and the
 * fork guard. The Go producer's twins are ring/platform.go and
 * ring/segment.go (Reopen): same contract, see reader/internal.h. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
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

int tsock__lock_byte_shared(int fd, uint64_t byte) {
  struct flock fl = byte_lock(F_RDLCK, byte);
  if (fcntl(fd, F_OFD_SETLK, &fl) == 0) return 0;
  return (errno == EAGAIN || errno == EACCES) ? -1 : -2;
}

int tsock__byte_write_locked(int fd, uint64_t byte) {
  struct flock fl = byte_lock(F_WRLCK, byte);
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return -1;
  /* A write lock excludes every other lock on the byte: if one is
   * reported, it is the only one. Read locks, which anyone who may read
   * the file can take, do not count. */
  return fl.l_type == F_WRLCK;
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

/* ---- fork guard ----
 * Every tsock descriptor is opened and closed under fork_mu, and the
 * prepare handler takes fork_mu: so at the instant of any fork() the set
 * below is exactly the set of tsock descriptors that exist, with no window
 * where one is open but not yet tracked (or closed but still tracked, its
 * number free for someone else's file). The set grows as needed. */

static pthread_mutex_t fork_mu = PTHREAD_MUTEX_INITIALIZER;
static int *fork_fds;
static size_t fork_nfds, fork_cap;
static uint64_t fork_gen;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void fork_prepare(void) { pthread_mutex_lock(&fork_mu); }
static void fork_parent(void) { pthread_mutex_unlock(&fork_mu); }
static void fork_child(void) {
  /* Closing our reference drops nothing in the parent, but means the lock
   * dies with the parent even while this child lives on. */
  for (size_t i = 0; i < fork_nfds; i++) close(fork_fds[i]);
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

/* With fork_mu held: room for one more descriptor, else -1. */
static int fork_reserve(void) {
  if (fork_nfds < fork_cap) return 0;
  size_t cap = fork_cap == 0 ? 64 : fork_cap * 2;
  int *grown = realloc(fork_fds, cap * sizeof *grown);
  if (grown == NULL) return -1;
  fork_fds = grown;
  fork_cap = cap;
  return 0;
}

static void fork_remove(int fd) {
  for (size_t i = 0; i < fork_nfds; i++) {
    if (fork_fds[i] == fd) {
      fork_fds[i] = fork_fds[--fork_nfds];
      return;
    }
  }
}

int tsock__fork_open(const char *path, int flags) {
  pthread_once(&fork_once, fork_install);
  pthread_mutex_lock(&fork_mu);
  int fd = -1;
  if (fork_reserve() != 0) {
    errno = ENOMEM;
  } else {
    fd = open(path, flags);
    if (fd >= 0) fork_fds[fork_nfds++] = fd;
  }
  int err = errno;
  pthread_mutex_unlock(&fork_mu);
  errno = err;
  return fd;
}

int tsock__fork_socket(int domain, int type, int protocol) {
  pthread_once(&fork_once, fork_install);
  pthread_mutex_lock(&fork_mu);
  int fd = -1;
  if (fork_reserve() != 0) {
    errno = ENOMEM;
  } else {
    fd = socket(domain, type, protocol);
    if (fd >= 0) fork_fds[fork_nfds++] = fd;
  }
  int err = errno;
  pthread_mutex_unlock(&fork_mu);
  errno = err;
  return fd;
}

ssize_t tsock__fork_recvmsg(int sock, struct msghdr *msg, int flags) {
  pthread_once(&fork_once, fork_install);
  pthread_mutex_lock(&fork_mu);
  ssize_t n = recvmsg(sock, msg, flags | MSG_DONTWAIT);
  int err = errno;
  for (struct cmsghdr *c = n < 0 ? NULL : CMSG_FIRSTHDR(msg); c != NULL; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    for (size_t k = 0; k < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); k++) {
      int fd;
      memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof fd);
      if (fork_reserve() == 0) {
        fork_fds[fork_nfds++] = fd;
      } else {
        close(fd);
        int none = -1;
        memcpy(CMSG_DATA(c) + k * sizeof(int), &none, sizeof none);
      }
    }
  }
  pthread_mutex_unlock(&fork_mu);
  errno = err;
  return n;
}

int tsock__fork_reopen(int fd) {
  char self[40];
  snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
  return tsock__fork_open(self, O_RDONLY | O_CLOEXEC); /* a link to our own descriptor: followed */
}

void tsock__fork_close(int fd) {
  if (fd < 0) return;
  pthread_mutex_lock(&fork_mu);
  fork_remove(fd);
  close(fd);
  pthread_mutex_unlock(&fork_mu);
}

int tsock__fork_track(int fd) {
  pthread_once(&fork_once, fork_install);
  pthread_mutex_lock(&fork_mu);
  int rc = fork_reserve();
  if (rc == 0) fork_fds[fork_nfds++] = fd;
  pthread_mutex_unlock(&fork_mu);
  return rc;
}

void tsock__fork_untrack(int fd) {
  pthread_mutex_lock(&fork_mu);
  fork_remove(fd);
  pthread_mutex_unlock(&fork_mu);
}

uint64_t tsock__fork_generation(void) { return __atomic_load_n(&fork_gen, __ATOMIC_ACQUIRE); }
