/*
 * join.c - the reader's side of the join (layout.h, "The join";
 * docs/ARCHITECTURE.md, "Joining"): connect to the producer's join socket,
 * prove with a descriptor of the segment that this process may read the
 * channel, and receive its record: a sealed memfd that only this reader
 * and the producer hold. The connection then stays open while attached:
 * the producer learns from its end of file that the reader is gone, and
 * from a leave byte that it detaches.
 *
 * Nothing the producer sends is trusted: the reply is checked field by
 * field, the record's file must be of the record's size and sealed against
 * shrinking (so writing it can never fault), and the socket must belong to
 * the segment's owner (a process of another user that bound the address
 * of a dead producer is not one).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "internal.h"

/* A live producer answers in microseconds; one stopped (SIGSTOP, a
 * debugger) or starved of CPU is waited for until the attach's deadline:
 * attach_timeout_ns from the attach's start, or, with 0 (do not wait for
 * the channel), this long from the join's start. */
#define JOIN_GRACE_NS 2000000000ll
/* How long detach waits for the producer to free its entry. */
#define LEAVE_WAIT_MS 1000

/* The join's deadline (CLOCK_MONOTONIC ns; 0: none) for an attach that
 * started at attach_start with attach_timeout_ns (tsock.h). */
static uint64_t join_deadline(uint64_t attach_start, int64_t attach_timeout_ns) {
  if (attach_timeout_ns < 0) return 0;
  if (attach_timeout_ns == 0) return tsock__now_ns() + JOIN_GRACE_NS;
  return attach_start + (uint64_t)attach_timeout_ns;
}

/* Nanoseconds left until deadline (at least 1; -1: no deadline). */
static int64_t join_left_ns(uint64_t deadline) {
  if (deadline == 0) return -1;
  uint64_t now = tsock__now_ns();
  return now >= deadline ? 1 : (int64_t)(deadline - now);
}

static int join_connect(const tsock_header *h, int sock, uint32_t owner, uint64_t deadline,
                        const char *name) {
  /* Bounds connect (a full backlog) and the request's send; 0: none. */
  int64_t left = join_left_ns(deadline);
  struct timeval tv = {0};
  if (left > 0) {
    left += 999; /* a timeval of 0 would mean "no timeout": round up */
    tv.tv_sec = (time_t)(left / 1000000000);
    tv.tv_usec = (suseconds_t)(left % 1000000000 / 1000);
  }
  if (setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0 ||
      setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0)
    return tsock__fail_errno(TSOCK_ESYS, errno, "channel '%s': join socket options", name);
  struct sockaddr_un sun;
  memset(&sun, 0, sizeof sun);
  sun.sun_family = AF_UNIX;
  char path[TSOCK_JOIN_ADDR_MAX];
  uint32_t n = tsock_layout_join_address(h->join_key, path);
  memcpy(sun.sun_path, path, n);
  socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
  int rc;
  do rc = connect(sock, (const struct sockaddr *)&sun, len);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int err = errno;
    if (err == ECONNREFUSED || err == ENOENT)
      return tsock__fail(TSOCK_EPRODUCER_GONE,
                         "channel '%s': its producer (pid %d) does not accept readers: it is "
                         "closing or gone, or this process is in another network namespace (the "
                         "join socket is an abstract Unix address)", name, h->producer_pid);
    if (err == EAGAIN || err == ETIMEDOUT || err == EINPROGRESS)
      return tsock__fail(TSOCK_EAGAIN, "channel '%s': the producer's join socket is busy", name);
    return tsock__fail_errno(TSOCK_ESYS, err, "channel '%s': connect to the producer", name);
  }
  struct ucred cred;
  socklen_t cl = sizeof cred;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0)
    return tsock__fail_errno(TSOCK_ESYS, errno, "channel '%s': the producer's credentials", name);
  if (cred.uid != owner)
    return tsock__fail(TSOCK_EPERM, "channel '%s': its join socket belongs to uid %u, not to the "
                                    "channel's owner (uid %u); not its producer", name,
                       (unsigned)cred.uid, (unsigned)owner);
  return TSOCK_OK;
}

static int join_send_request(int sock, int seg_fd, uint32_t start_mode, const char *name) {
  tsock_join_request req = {.magic = TSOCK_JOIN_MAGIC, .layout_version = TSOCK_LAYOUT_VERSION,
                            .start_mode = start_mode};
  struct iovec iov = {.iov_base = &req, .iov_len = sizeof req};
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int))];
  } ctl;
  memset(&ctl, 0, sizeof ctl);
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                       .msg_controllen = sizeof ctl.buf};
  struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &seg_fd, sizeof seg_fd);
  ssize_t n;
  do n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  while (n < 0 && errno == EINTR);
  if (n == (ssize_t)sizeof req) return TSOCK_OK;
  if (n < 0 && (errno == EPIPE || errno == ECONNRESET))
    return tsock__fail(TSOCK_EAGAIN, "channel '%s': the producer closed the join connection", name);
  return tsock__fail_errno(TSOCK_ESYS, n < 0 ? errno : EIO, "channel '%s': send the join request",
                           name);
}

/* Receives the reply and the descriptors that came with it (*fd: the one
 * expected, or -1; any other is closed). */
static int join_receive(int sock, tsock_join_reply *rep, int *fd, uint64_t deadline,
                        const char *name) {
  *fd = -1;
  char buf[sizeof *rep + 1];
  struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf};
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(4 * sizeof(int))];
  } ctl;
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                       .msg_controllen = sizeof ctl.buf};
  /* Wait for the reply, then take it with fork() held off: the record's
   * descriptor is known to the fork guard from its first instant. */
  struct pollfd p = {.fd = sock, .events = POLLIN};
  int ready;
  do {
    int64_t left = join_left_ns(deadline);
    ready = poll(&p, 1, left < 0 ? -1 : (int)((left + 999999) / 1000000));
  } while ((ready < 0 && errno == EINTR) || (ready == 0 && join_left_ns(deadline) > 1));
  if (ready == 0)
    return tsock__fail(TSOCK_ETIMEDOUT, "channel '%s': the producer did not answer the join "
                                        "within the attach timeout (stopped, or starved of CPU)",
                       name);
  ssize_t n;
  do n = tsock__fork_recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
    return tsock__fail(TSOCK_ETIMEDOUT, "channel '%s': the producer did not answer the join", name);
  if (n < 0 && errno == ECONNRESET) n = 0;
  if (n < 0) return tsock__fail_errno(TSOCK_ESYS, errno, "channel '%s': receive the join reply", name);
  int nfd = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t j = 0; j < k; j++, nfd++) {
      int got;
      memcpy(&got, CMSG_DATA(c) + j * sizeof(int), sizeof got);
      if (*fd < 0)
        *fd = got;
      else
        tsock__fork_close(got);
    }
  }
  if (n == 0)
    return tsock__fail(TSOCK_EAGAIN, "channel '%s': the producer turned the join away (busy, or "
                                     "closing)", name);
  if ((size_t)n != sizeof *rep || nfd > 1 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0)
    return tsock__fail(TSOCK_ECORRUPT, "channel '%s': malformed join reply (%zd bytes, %d "
                                       "descriptors)", name, n, nfd);
  memcpy(rep, buf, sizeof *rep);
  if (rep->magic != TSOCK_JOIN_MAGIC || rep->layout_version != TSOCK_LAYOUT_VERSION)
    return tsock__fail(TSOCK_ECORRUPT, "channel '%s': malformed join reply", name);
  return TSOCK_OK;
}

/* The producer's refusal, with a message. */
static int join_refused(const tsock_header *h, int status, const char *name) {
  switch (status) {
  case TSOCK_EFULL:
    return tsock__fail(status, "channel '%s': all %u reader records are taken", name,
                       h->reader_capacity);
  case TSOCK_ECLOSED:
    return tsock__fail(status, "channel '%s': closed by the producer", name);
  case TSOCK_EPERM:
    return tsock__fail(status, "channel '%s': the producer refused the segment descriptor", name);
  case TSOCK_EVERSION:
    return tsock__fail(status, "channel '%s': the producer speaks another layout version", name);
  case TSOCK_ENOMEM:
    return tsock__fail(status, "channel '%s': the producer is out of memory", name);
  case TSOCK_EAGAIN: /* retried until the attach timeout */
    return tsock__fail(status, "channel '%s': the producer has no descriptor free for the join",
                       name);
  default:
    return tsock__fail(TSOCK_ECORRUPT, "channel '%s': the producer refused the join (status %d)",
                       name, status);
  }
}

/* Maps the record file fd, after checking it cannot fault under us. */
static int join_map_record(int fd, tsock_join *out, const char *name) {
  struct stat st;
  int seals = fcntl(fd, F_GET_SEALS);
  if (fstat(fd, &st) != 0 || st.st_size != (off_t)TSOCK_RECORD_FILE_BYTES || seals < 0 ||
      (seals & (F_SEAL_SHRINK | F_SEAL_SEAL)) != (F_SEAL_SHRINK | F_SEAL_SEAL))
    return tsock__fail(TSOCK_ECORRUPT, "channel '%s': the reader record the producer sent is not a "
                                       "sealed file of %u bytes", name, TSOCK_RECORD_FILE_BYTES);
  void *m = mmap(NULL, TSOCK_RECORD_FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED)
    return tsock__fail_errno(TSOCK_ESYS, errno, "channel '%s': map the reader record", name);
  out->rec = m;
  return TSOCK_OK;
}

int tsock__join(const tsock_header *h, int seg_fd, uint32_t owner, uint32_t start_mode,
                uint64_t attach_start, int64_t attach_timeout_ns, const char *name,
                tsock_join *out) {
  memset(out, 0, sizeof *out);
  uint64_t deadline = join_deadline(attach_start, attach_timeout_ns);
  out->sock = tsock__fork_socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (out->sock < 0) return tsock__fail_errno(TSOCK_ESYS, errno, "channel '%s': socket", name);
  int fd = -1;
  tsock_join_reply rep = {0};
  int rc = join_connect(h, out->sock, owner, deadline, name);
  if (rc == TSOCK_OK) rc = join_send_request(out->sock, seg_fd, start_mode, name);
  if (rc == TSOCK_OK) rc = join_receive(out->sock, &rep, &fd, deadline, name);
  if (rc == TSOCK_OK && rep.status != TSOCK_OK) rc = join_refused(h, rep.status, name);
  if (rc == TSOCK_OK &&
      (fd < 0 || rep.index >= h->reader_capacity ||
       TSOCK_CLAIM_STATE(rep.claim) != TSOCK_READER_ACTIVE ||
       (rep.flags & ~TSOCK_JOIN_IN_WINDOW) != 0))
    rc = tsock__fail(TSOCK_ECORRUPT, "channel '%s': invalid join reply (entry %u of %u)", name,
                     rep.index, h->reader_capacity);
  if (rc == TSOCK_OK) rc = join_map_record(fd, out, name);
  tsock__fork_close(fd); /* the mapping keeps the file */
  if (rc != TSOCK_OK) {
    if (rc == TSOCK_ETIMEDOUT) { /* it does not answer: no waiting for it to free an entry */
      tsock__fork_close(out->sock);
      out->sock = -1;
    }
    tsock__join_leave(out);
    return rc;
  }
  out->index = rep.index;
  out->claim = rep.claim;
  out->start = rep.start;
  out->in_window = (rep.flags & TSOCK_JOIN_IN_WINDOW) != 0;
  return TSOCK_OK;
}

/* Waits (at most LEAVE_WAIT_MS) for the producer to close the connection,
 * which it does once it has freed our entry: after detach, the entry is
 * free for the next reader. A producer that is gone closed it already. */
static void join_wait_closed(int sock) {
  struct timeval tv = {.tv_sec = LEAVE_WAIT_MS / 1000, .tv_usec = (LEAVE_WAIT_MS % 1000) * 1000};
  if (setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0) return;
  char buf[64];
  uint64_t deadline = tsock__now_ns() + LEAVE_WAIT_MS * 1000000ull;
  for (;;) {
    ssize_t n = recv(sock, buf, sizeof buf, 0);
    if (n == 0 || (n < 0 && errno != EINTR) || tsock__now_ns() > deadline) return;
  }
}

void tsock__join_leave(tsock_join *j) {
  if (j->rec != NULL) munmap(j->rec, TSOCK_RECORD_FILE_BYTES);
  j->rec = NULL;
  if (j->sock >= 0) {
    char leave = TSOCK_MSG_LEAVE; /* never blocks (the producer reads), never SIGPIPE */
    if (send(j->sock, &leave, 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1) join_wait_closed(j->sock);
    tsock__fork_close(j->sock);
  }
  j->sock = -1;
}
