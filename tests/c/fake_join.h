/* fake_join.h - the join socket of a producer, for segments the C tests
 * craft by hand with the test process as their "producer" (test_segment.c,
 * test_cuda.c), where no Go producer is linked. A thread accepts readers
 * the way the real producer does (layout.h, "The join"): it checks the
 * request, gives each reader a free roster entry and a sealed memfd record
 * whose cursor says "start at published", and frees the entry when the
 * reader's connection ends. It does not gate (the tests publish at will)
 * and does no late join window.
 *
 * Usage: fake_join_start(&j, map) once the header is written (it records
 * the join key there); fake_join_stop(&j) before unmapping. */
#ifndef TSOCK_FAKE_JOIN_H
#define TSOCK_FAKE_JOIN_H

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "layout.h"

typedef struct fake_join {
  tsock_header *h;            /* live header (published) */
  tsock_roster_entry *roster; /* at the geometry of the start, whatever the header says later */
  uint32_t cap;
  int ln;
  int stop[2]; /* a byte on stop[1] ends the thread */
  int *conn;   /* per entry: its reader's connection, -1 free */
  uint64_t *gen;
  pthread_t thread;
} fake_join;

static int fake_join_record(uint64_t start) {
  int fd = memfd_create("fake-record", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  if (ftruncate(fd, TSOCK_RECORD_FILE_BYTES) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    close(fd);
    return -1;
  }
  tsock_reader_record rec;
  memset(&rec, 0, sizeof rec);
  rec.cursor = rec.acquired = start;
  if (pwrite(fd, &rec, sizeof rec, 0) != (ssize_t)sizeof rec) {
    close(fd);
    return -1;
  }
  return fd;
}

static void fake_join_reply(int c, const tsock_join_reply *rep, int fd) {
  struct iovec iov = {.iov_base = (void *)rep, .iov_len = sizeof *rep};
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int))];
  } ctl;
  memset(&ctl, 0, sizeof ctl);
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
  if (fd >= 0) {
    msg.msg_control = ctl.buf;
    msg.msg_controllen = sizeof ctl.buf;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof fd);
  }
  (void)sendmsg(c, &msg, MSG_NOSIGNAL);
}

/* One new connection: the request, an entry, the reply. */
static void fake_join_accept(fake_join *j) {
  int c = accept4(j->ln, NULL, NULL, SOCK_CLOEXEC);
  if (c < 0) return;
  struct timeval tv = {.tv_sec = 5};
  setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  tsock_join_request req;
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(4 * sizeof(int))];
  } ctl;
  struct iovec iov = {.iov_base = &req, .iov_len = sizeof req};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                       .msg_controllen = sizeof ctl.buf};
  ssize_t n = recvmsg(c, &msg, MSG_CMSG_CLOEXEC);
  for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); n >= 0 && cm != NULL; cm = CMSG_NXTHDR(&msg, cm))
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
      for (size_t k = 0; k < (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int); k++) {
        int fd;
        memcpy(&fd, CMSG_DATA(cm) + k * sizeof(int), sizeof fd);
        close(fd);
      }
  tsock_join_reply rep = {.magic = TSOCK_JOIN_MAGIC, .layout_version = TSOCK_LAYOUT_VERSION};
  if (n != (ssize_t)sizeof req || req.magic != TSOCK_JOIN_MAGIC) {
    close(c);
    return;
  }
  uint32_t i = 0;
  while (i < j->cap && j->conn[i] >= 0) i++;
  if (i == j->cap) {
    rep.status = TSOCK_EFULL;
    fake_join_reply(c, &rep, -1);
    close(c);
    return;
  }
  uint64_t start = __atomic_load_n(&j->h->published, __ATOMIC_SEQ_CST);
  int rec = fake_join_record(start);
  if (rec < 0) {
    rep.status = TSOCK_ENOMEM;
    fake_join_reply(c, &rep, -1);
    close(c);
    return;
  }
  j->gen[i]++;
  rep.claim = TSOCK_CLAIM(j->gen[i], TSOCK_READER_ACTIVE);
  rep.start = start;
  rep.index = i;
  struct ucred cred;
  socklen_t cl = sizeof cred;
  if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0) {
    j->roster[i].pid = cred.pid;
    j->roster[i].uid = cred.uid;
  }
  __atomic_store_n(&j->roster[i].claim, rep.claim, __ATOMIC_SEQ_CST);
  j->conn[i] = c;
  fake_join_reply(c, &rep, rec);
  close(rec);
}

/* A reader's connection spoke: a leave or its end frees its entry. */
static void fake_join_read(fake_join *j, uint32_t i) {
  char buf[64];
  ssize_t n = recv(j->conn[i], buf, sizeof buf, MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n > 0 && memchr(buf, TSOCK_MSG_LEAVE, (size_t)n) == NULL) return;
  __atomic_store_n(&j->roster[i].claim, TSOCK_CLAIM(j->gen[i], TSOCK_READER_FREE), __ATOMIC_SEQ_CST);
  close(j->conn[i]);
  j->conn[i] = -1;
}

static void *fake_join_thread(void *arg) {
  fake_join *j = arg;
  struct pollfd *p = calloc(j->cap + 2, sizeof *p);
  uint32_t *who = calloc(j->cap + 2, sizeof *who);
  if (p == NULL || who == NULL) abort();
  for (;;) {
    nfds_t n = 0;
    p[n++] = (struct pollfd){.fd = j->stop[0], .events = POLLIN};
    p[n++] = (struct pollfd){.fd = j->ln, .events = POLLIN};
    for (uint32_t i = 0; i < j->cap; i++)
      if (j->conn[i] >= 0) {
        who[n] = i;
        p[n++] = (struct pollfd){.fd = j->conn[i], .events = POLLIN};
      }
    if (poll(p, n, -1) < 0) continue;
    if (p[0].revents != 0) break;
    for (nfds_t k = 2; k < n; k++)
      if (p[k].revents != 0) fake_join_read(j, who[k]);
    if (p[1].revents != 0) fake_join_accept(j);
  }
  free(p);
  free(who);
  return NULL;
}

/* Binds a join socket at a fresh key, writes the key into the header at
 * map and starts the thread. 0, or -1 with errno. */
static int fake_join_start(fake_join *j, uint8_t *map) {
  memset(j, 0, sizeof *j);
  j->h = (tsock_header *)map;
  j->cap = j->h->reader_capacity;
  j->roster = (tsock_roster_entry *)(map + j->h->roster_offset);
  j->conn = malloc(j->cap * sizeof *j->conn);
  j->gen = calloc(j->cap, sizeof *j->gen);
  if (j->conn == NULL || j->gen == NULL || pipe2(j->stop, O_CLOEXEC) != 0) return -1;
  for (uint32_t i = 0; i < j->cap; i++) j->conn[i] = -1;
  j->ln = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (j->ln < 0) return -1;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)j;
  for (uint32_t i = 0; i < TSOCK_JOIN_KEY_BYTES; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    j->h->join_key[i] = (uint8_t)x;
  }
  struct sockaddr_un sun = {.sun_family = AF_UNIX};
  char path[TSOCK_JOIN_ADDR_MAX];
  uint32_t len = tsock_layout_join_address(j->h->join_key, path);
  memcpy(sun.sun_path, path, len);
  if (bind(j->ln, (struct sockaddr *)&sun, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len)) !=
          0 ||
      listen(j->ln, 128) != 0)
    return -1;
  return pthread_create(&j->thread, NULL, fake_join_thread, j) == 0 ? 0 : -1;
}

static void fake_join_stop(fake_join *j) {
  if (write(j->stop[1], "x", 1) == 1) pthread_join(j->thread, NULL);
  for (uint32_t i = 0; i < j->cap; i++)
    if (j->conn[i] >= 0) close(j->conn[i]);
  close(j->ln);
  close(j->stop[0]);
  close(j->stop[1]);
  free(j->conn);
  free(j->gen);
}

#endif
