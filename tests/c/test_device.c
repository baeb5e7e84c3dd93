/* test_device.c - the device path end to end against the fake CUDA driver
 * (fake_cuda.c, loaded through TSOCK_LIBCUDA): a producer process with a
 * device pool, this process as the reader.
 *
 * Usage: test_device MODE
 *   fake       zero-copy device batches with the right bytes; the reader's
 *              stream waits for the producer's copy; a slow "kernel" queued
 *              before release still reads its batch intact (the producer
 *              is held back until its fence fires); detach waits for
 *              pending work; placement refusals (no pool, the producer's
 *              own process, another GPU or a MIG instance, IPC refused);
 *              killed readers and producers behave as on the CPU; the
 *              producer frees its pool only once no reader has it open,
 *              nor maps it through a DLPack descriptor after detach;
 *              fences fail closed (FAKE_CUDA_FAIL); a batch used on one
 *              thread's per-thread default stream and released from
 *              another is fenced on the device;
 *   nodriver   a producer asking for a device without a driver fails with
 *              TSOCK_ENOCUDA and leaves no channel behind.
 *   producer NAME N SLOTS   (internal) the producer process;
 *   device-reader NAME      (internal) a reader killed with GPU work queued.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <sys/wait.h>

#include "fake_cuda.h"
#include "layout.h"
#include "test_util.h"

extern char **environ;

#define ROWS 4096 /* uint32 per batch: 16 KiB */

static uint32_t value(uint64_t batch, uint32_t k) { return (uint32_t)(batch * 100003u + k); }

static uint64_t fnv(const void *p, size_t n) {
  const unsigned char *b = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t k = 0; k < n; k++) h = (h ^ b[k]) * 1099511628211ull;
  return h;
}

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- the fake driver's extras (below) ---- */
static int load_fake(void);
static uint64_t published(const char *name);
static tsock_reader_t *attach(const char *name);
static fake_cuda_launch_read_fn launch_read;
static fake_cuda_run_due_fn run_due;
static fake_cuda_stream_end_fn stream_end;
typedef int (*stream_create_fn)(void **s, unsigned flags);
static stream_create_fn stream_create;

/* ---- the producer process ---- */

/* A reader process on the device path that queues a 60 s read of each of
 * its first two batches, releases them, says "ready" on stdout and waits
 * to be killed. (60 s: far above the bound test_killed_peers puts on the
 * producer going on once it is killed, and above the producer's 10 s
 * reserve timeout, so a producer that waits for these fences fails.) */
static int run_device_reader(const char *name) {
  if (load_fake() != 0) return 2;
  tsock_reader_t *r = attach(name);
  int32_t ordinal;
  if (r == NULL || tsock_reader_open_device(r, &ordinal) != TSOCK_OK) return 3;
  void *stream = NULL;
  if (stream_create(&stream, 1) != 0) return 4;
  static unsigned long long sums[2];
  for (int i = 0; i < 2; i++) {
    const tsock_batch_t *b;
    uint64_t dptr;
    if (tsock_reader_acquire(r, &b, 10000000000ll) != TSOCK_OK) return 5;
    if (tsock_batch_cuda_use(b, (uintptr_t)stream, 0) != TSOCK_OK) return 6;
    if (tsock_batch_cuda_ptr(b, 0, &dptr) != TSOCK_OK) return 7;
    launch_read(stream, (const void *)(uintptr_t)dptr, ROWS * 4, 60000000000ull, &sums[i]);
    if (tsock_reader_release(r, b) != TSOCK_OK) return 8;
  }
  printf("ready\n");
  fflush(stdout);
  for (;;) pause();
}

static int run_producer(const char *name, int n, int slots) {
  tsock_producer_options_t po;
  tsock_producer_options_init(&po);
  po.slot_count = (uint32_t)slots;
  po.slot_bytes = ROWS * 4;
  po.cuda_device = 0;
  tsock_producer_t *p;
  int rc = tsock_producer_create(name, &po, &p);
  if (rc != TSOCK_OK) {
    fprintf(stderr, "producer: %s: %s\n", tsock_status_str(rc), tsock_last_error());
    return 2;
  }
  rc = tsock_producer_wait_readers(p, 1, 10000000000ll);
  for (int b = 0; rc == TSOCK_OK && b < n; b++) {
    void *buf;
    rc = tsock_producer_reserve(p, ROWS * 4, 10000000000ll, &buf);
    if (rc != TSOCK_OK) break;
    for (uint32_t k = 0; k < ROWS; k++) ((uint32_t *)buf)[k] = value((uint64_t)b, k);
    tsock_tensor_t t;
    int64_t shape[1] = {ROWS};
    tsock_tensor_init(&t, TSOCK_DTYPE_UINT32, 1, shape, 0);
    rc = tsock_producer_publish(p, &t, 1, NULL, 0);
  }
  if (rc == TSOCK_OK) rc = tsock_producer_end_epoch(p, 10000000000ll);
  if (rc != TSOCK_OK) fprintf(stderr, "producer: %s: %s\n", tsock_status_str(rc), tsock_last_error());
  tsock_producer_close(p);
  return rc == TSOCK_OK ? 0 : 3;
}

static pid_t spawn_producer(const char *name, int n, int slots) {
  char ns[16], ss[16];
  snprintf(ns, sizeof ns, "%d", n);
  snprintf(ss, sizeof ss, "%d", slots);
  char *argv[] = {"/proc/self/exe", "producer", (char *)name, ns, ss, NULL};
  pid_t pid;
  if (posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ) != 0) return -1;
  return pid;
}

static int reap(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static tsock_reader_t *attach(const char *name) {
  tsock_reader_options_t ro;
  tsock_reader_options_init(&ro);
  ro.attach_timeout_ns = 10000000000ll;
  ro.start = TSOCK_START_NOW;
  tsock_reader_t *r = NULL;
  CHECK_RC(tsock_reader_attach(name, &ro, &r), TSOCK_OK);
  return r;
}

/* Acquires batches until the stream ends, passing each (markers too) to
 * fn and then releasing it; returns the status that ended the stream. */
typedef void (*batch_fn)(const tsock_batch_t *b, void *ctx);
static int drain(tsock_reader_t *r, batch_fn fn, void *ctx) {
  for (;;) {
    const tsock_batch_t *b;
    int rc = tsock_reader_acquire(r, &b, 10000000000ll);
    if (rc != TSOCK_OK) return rc;
    fn(b, ctx);
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  }
}

/* ---- the fake driver's extras ---- */

static fake_cuda_query_fn query;

static int load_fake(void) {
  const char *path = getenv("TSOCK_LIBCUDA");
  void *fake = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
  if (fake == NULL) return -1;
  query = (fake_cuda_query_fn)dlsym(fake, "fake_cuda_query");
  launch_read = (fake_cuda_launch_read_fn)dlsym(fake, "fake_cuda_launch_read");
  stream_end = (fake_cuda_stream_end_fn)dlsym(fake, "fake_cuda_stream_end");
  run_due = (fake_cuda_run_due_fn)dlsym(fake, "fake_cuda_run_due");
  stream_create = (stream_create_fn)dlsym(fake, "cuStreamCreate");
  /* A trainer's framework has a context current; so does this test. */
  typedef int (*retain_fn)(void **ctx, int dev);
  typedef int (*set_fn)(void *ctx);
  typedef int (*init_fn)(unsigned);
  init_fn init = (init_fn)dlsym(fake, "cuInit");
  retain_fn retain = (retain_fn)dlsym(fake, "cuDevicePrimaryCtxRetain");
  set_fn set_current = (set_fn)dlsym(fake, "cuCtxSetCurrent");
  void *ctx = NULL;
  if (!init || !retain || !set_current || init(0) != 0 || retain(&ctx, 0) != 0 ||
      set_current(ctx) != 0)
    return -1;
  return query && launch_read && stream_end && stream_create && run_due ? 0 : -1;
}

static fake_cuda_stats stats(void) {
  fake_cuda_stats s;
  query(&s);
  return s;
}

/* ---- the cases ---- */

/* A reader of channel name on the device path, and a stream of its own. */
static tsock_reader_t *attach_device(const char *name, void **stream) {
  tsock_reader_t *r = attach(name);
  int32_t ordinal = -1;
  if (r == NULL) return NULL;
  CHECK_RC(tsock_reader_open_device(r, &ordinal), TSOCK_OK);
  CHECK(stream_create(stream, 1) == 0);
  return r;
}

/* tsock_batch_dlpack_export of the device copy (dev): rows narrow it at
 * the pool address, in legacy and versioned structs; refusals take no
 * reference on the pool (the final primary_refs check sees one left). */
static void check_device_export(const tsock_batch_t *b, const uint32_t *dev) {
  struct { void *data; int32_t device_type, device_id, ndim; uint8_t code, bits; uint16_t lanes;
           int64_t *shape, *strides; } *t;
  void *dl = NULL;
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_DEVICE | TSOCK_DLPACK_ROWS, 1, 4, &dl),
           TSOCK_OK);
  if (dl != NULL) { /* legacy: the DLTensor first */
    t = dl;
    CHECK(t->data == dev + 1 && t->device_type == 2 && t->device_id == 0 && t->ndim == 1);
    CHECK(t->shape[0] == 3 && t->strides[0] == 1 && t->code == 1 && t->bits == 32);
    CHECK(b->dlpack_live[0] == 1);
    CHECK_RC(tsock_dlpack_delete(dl, 0), TSOCK_OK);
    CHECK(b->dlpack_live[0] == 0);
  }
  dl = NULL;
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_DEVICE | TSOCK_DLPACK_VERSIONED |
                                               TSOCK_DLPACK_ROWS,
                                     ROWS - 2, ROWS, &dl),
           TSOCK_OK);
  if (dl != NULL) { /* versioned: the DLTensor at 32 */
    t = (void *)((char *)dl + 32);
    CHECK(t->data == dev + ROWS - 2 && t->device_type == 2 && t->shape[0] == 2);
    CHECK(*(const uint32_t *)t->data == value(b->index, ROWS - 2));
    CHECK_RC(tsock_dlpack_delete(dl, 1), TSOCK_OK);
  }
  void *untouched = (void *)&untouched, *out = untouched;
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_DEVICE | TSOCK_DLPACK_ROWS, 0, ROWS + 1,
                                     &out),
           TSOCK_EINVAL);
  CHECK_RC(tsock_batch_dlpack_export(b, 1, TSOCK_DLPACK_DEVICE, 0, 0, &out), TSOCK_EINVAL);
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_DEVICE, 0, 0, NULL), TSOCK_EINVAL);
  CHECK(out == untouched && b->dlpack_live[TSOCK_MAX_TENSORS] == 0);
}

/* One batch of test_zero_copy (ctx: struct zc). */
struct zc {
  void *stream;
  int got;
};
static void check_device_batch(const tsock_batch_t *b, void *ctx) {
  struct zc *z = ctx;
  uintptr_t stream = (uintptr_t)z->stream;
  if (b->flags & TSOCK_BATCH_EPOCH_END) {
    CHECK_RC(tsock_batch_cuda_use(b, stream, 0), TSOCK_ENODEVICE);
    return;
  }
  uint64_t dptr = 0;
  CHECK_RC(tsock_batch_cuda_use(b, stream, 0), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_use(b, stream, 0), TSOCK_OK); /* same stream: fine */
  CHECK_RC(tsock_batch_cuda_use(b, stream, 0x80), TSOCK_EINVAL);
  CHECK_RC(tsock_batch_cuda_ptr(b, 0, &dptr), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_ptr(b, 1, &dptr), TSOCK_EINVAL);
  const uint32_t *dev = (const uint32_t *)(uintptr_t)dptr; /* fake device memory is mapped */
  CHECK(dev != b->tensors[0].data);
  CHECK(memcmp(dev, b->tensors[0].data, ROWS * 4) == 0);
  CHECK(dev[0] == value(b->index, 0) && dev[ROWS - 1] == value(b->index, ROWS - 1));
  void *dl = NULL;
  CHECK_RC(tsock_batch_dlpack_cuda(b, 0, 1, &dl), TSOCK_OK);
  if (dl != NULL) {
    /* DLManagedTensorVersioned: version, ctx, deleter, flags, then the DLTensor. */
    struct { uint32_t major, minor; void *ctx; void (*deleter)(void *); uint64_t flags;
             void *data; int32_t device_type, device_id; } *m = dl;
    CHECK(m->data == dev && m->device_type == 2 && m->device_id == 0 && (m->flags & 1));
    m->deleter(dl);
  }
  check_device_export(b, dev);
  z->got++;
}

/* Every batch: the device copy holds the producer's bytes, DLPack says
 * kDLCUDA at the pool address; the stream waited for the copy. */
static void test_zero_copy(void) {
  const char *name = test_name("tdev", "zc");
  const int n = 20;
  pid_t pid = spawn_producer(name, n, 4);
  tsock_reader_t *r = attach(name);
  if (r == NULL) return;
  int32_t ordinal = -1;
  CHECK_RC(tsock_reader_open_device(r, &ordinal), TSOCK_OK);
  CHECK(ordinal == 0);
  CHECK_RC(tsock_reader_open_device(r, &ordinal), TSOCK_OK); /* again: same answer */
  void *stream = NULL;
  CHECK(stream_create(&stream, 1) == 0);
  fake_cuda_stats before = stats();
  struct zc z = {stream, 0};
  CHECK_RC(drain(r, check_device_batch, &z), TSOCK_ECLOSED);
  int got = z.got;
  fake_cuda_stats after = stats();
  CHECK(got == n);
  CHECK(after.ipc_opens == before.ipc_opens); /* the pool was opened once, at open_device */
  CHECK(after.stream_waits - before.stream_waits == n);
  CHECK(after.events_recorded - before.events_recorded == n); /* a fence per batch */
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK(stats().ipc_closes >= 1);
  CHECK(reap(pid) == 0);
}

/* Queues a slow read of a batch's device copy (ctx: struct fq). */
struct fq {
  void *stream;
  unsigned long long kernel_ns;
  int max, got;
  unsigned long long *sums;
  uint64_t *want;
};
static void queue_read(const tsock_batch_t *b, void *ctx) {
  struct fq *q = ctx;
  if ((b->flags & TSOCK_BATCH_EPOCH_END) || q->got >= q->max) return;
  uint64_t dptr = 0;
  CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)q->stream, 0), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_ptr(b, 0, &dptr), TSOCK_OK);
  q->want[q->got] = fnv(b->tensors[0].data, ROWS * 4);
  launch_read(q->stream, (const void *)(uintptr_t)dptr, ROWS * 4, q->kernel_ns, &q->sums[q->got]);
  q->got++;
}

/* The trainer queues a slow read of each batch and releases it at once:
 * the producer (2 slots) must not overwrite a slot before the read ran. */
static void test_fences_hold_slots(void) {
  const char *name = test_name("tdev", "fence");
  enum { N = 12 };
  const unsigned long long kernel_ns = 20000000ull; /* 20 ms */
  pid_t pid = spawn_producer(name, N, 2);
  void *stream = NULL;
  tsock_reader_t *r = attach_device(name, &stream);
  if (r == NULL) return;
  unsigned long long sums[N];
  uint64_t want[N];
  memset(sums, 0, sizeof sums);
  uint64_t t0 = mono_ns();
  struct fq q = {stream, kernel_ns, N, 0, sums, want};
  CHECK_RC(drain(r, queue_read, &q), TSOCK_ECLOSED); /* each released at once: its read has not run */
  int got = q.got;
  uint64_t took = mono_ns() - t0;
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK); /* waits for what is still queued */
  CHECK(got == N);
  int intact = 0;
  for (int i = 0; i < got; i++) intact += sums[i] == want[i];
  if (intact != got) fprintf(stderr, "fences: %d of %d reads saw their batch\n", intact, got);
  CHECK(intact == got);
  /* the stream's reads are serial: N * 20 ms at least, minus the ones detach waited for */
  CHECK(took >= (uint64_t)(N - 2) * kernel_ns);
  CHECK(reap(pid) == 0);
}

/* How many device-memory files the fake driver has for process pid. */
static int fake_allocations(pid_t pid) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "tsockfake.mem.%d.", (int)pid);
  DIR *d = opendir("/dev/shm");
  int n = 0;
  for (struct dirent *e; d != NULL && (e = readdir(d)) != NULL;)
    n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
  if (d != NULL) closedir(d);
  return n;
}

/* The producer's close frees the pool only once no reader has it open
 * (freeing exported memory an importer still maps is undefined in CUDA). */
static void test_close_waits_for_device_readers(void) {
  const char *name = test_name("tdev", "close");
  pid_t pid = spawn_producer(name, 2, 2);
  void *stream = NULL;
  tsock_reader_t *r = attach_device(name, &stream);
  if (r == NULL) return;
  CHECK(fake_allocations(pid) == 1);
  const tsock_batch_t *b;
  int rc;
  while ((rc = tsock_reader_acquire(r, &b, 10000000000ll)) == TSOCK_OK)
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK_RC(rc, TSOCK_ECLOSED); /* the producer is closing... */
  usleep(300000);
  CHECK(waitpid(pid, NULL, WNOHANG) == 0); /* ...and waits for us */
  CHECK(fake_allocations(pid) == 1);        /* the pool is still there */
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK(reap(pid) == 0);
  CHECK(fake_allocations(pid) == 0); /* freed once we had closed it */
}

/* A DLPack descriptor of device memory keeps the pool mapped after detach
 * (tsock.h): the producer's close must not free the pool under it. It
 * waits for the last mapping of the pool to go, then frees it (rather than
 * leave it to its process's exit). */
static void test_dlpack_keeps_pool_after_detach(void) {
  const char *name = test_name("tdev", "dlkeep");
  pid_t pid = spawn_producer(name, 2, 2);
  void *stream = NULL;
  tsock_reader_t *r = attach_device(name, &stream);
  if (r == NULL) return;
  const tsock_batch_t *b;
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)stream, 0), TSOCK_OK);
  struct { uint32_t major, minor; void *ctx; void (*deleter)(void *); } *dl = NULL;
  CHECK_RC(tsock_batch_dlpack_cuda(b, 0, 1, (void **)&dl), TSOCK_OK);
  if (dl == NULL) return;
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  int rc;
  while ((rc = tsock_reader_acquire(r, &b, 10000000000ll)) == TSOCK_OK)
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK_RC(rc, TSOCK_ECLOSED);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK); /* no record says "device" any more */
  usleep(300000);
  CHECK(waitpid(pid, NULL, WNOHANG) == 0); /* the producer waits for our mapping... */
  CHECK(fake_allocations(pid) == 1);        /* ...with the pool still allocated */
  uint64_t t0 = mono_ns();
  dl->deleter(dl); /* the last user of the mapping: the pool is closed */
  /* Timed up to the free alone (not the producer's whole exit, which a
   * loaded machine stretches): freed well before its 5 s drain timeout.
   * A producer that waited that out leaves the pool to its exit (the
   * check just below) or frees it after 5 s; 3 s for the free alone
   * leaves room for a starved producer. */
  int exited = 0, status = 0;
  while (fake_allocations(pid) != 0 && mono_ns() - t0 < 20000000000ull &&
         !(exited = waitpid(pid, &status, WNOHANG) == pid))
    usleep(2000);
  uint64_t freed = mono_ns() - t0;
  CHECK(fake_allocations(pid) == 0); /* freed by the producer, not left to its exit */
  CHECK(freed < 3000000000ull);
  CHECK(exited ? WIFEXITED(status) && WEXITSTATUS(status) == 0 : reap(pid) == 0);
  CHECK(mono_ns() - t0 < 20000000000ull); /* and exits soon after (room for a starved exit) */
}

/* A batch released with queued GPU work is waited for at detach. */
static void test_detach_waits(void) {
  const char *name = test_name("tdev", "detach");
  /* Two batches in two slots: the epoch-end marker waits for our release of
   * batch 0, so the producer cannot close (and refuse the device path)
   * before we have opened it. */
  pid_t pid = spawn_producer(name, 2, 2);
  void *stream = NULL;
  tsock_reader_t *r = attach_device(name, &stream);
  if (r == NULL) return;
  const tsock_batch_t *b;
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
  unsigned long long sum = 0;
  uint64_t dptr = 0;
  CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)stream, 0), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_ptr(b, 0, &dptr), TSOCK_OK);
  uint64_t want = fnv(b->tensors[0].data, ROWS * 4);
  launch_read(stream, (const void *)(uintptr_t)dptr, ROWS * 4, 500000000ull, &sum); /* 0.5 s */
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)stream, 0), TSOCK_ESTATE); /* released */
  CHECK(sum == 0); /* still queued */
  uint64_t t0 = mono_ns();
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK(mono_ns() - t0 >= 100000000ull);
  CHECK(sum == want);
  CHECK(reap(pid) == 0);
}

/* Fail closed: when the fence of a released batch cannot be established
 * or confirmed (FAKE_CUDA_FAIL breaks the driver from release on), its slot
 * stays held from the producer until CUDA proves it free, and the read
 * queued before the release sees its batch intact. With ctx_sync_works,
 * only the stream's calls fail: release synchronizes the device instead. */
static void fence_failure_case(const char *tag, const char *fail, int ctx_sync_works) {
  const char *name = test_name("tdev", tag);
  pid_t pid = spawn_producer(name, 6, 2);
  void *stream = NULL;
  tsock_reader_t *r = attach_device(name, &stream);
  if (r == NULL) return;
  const tsock_batch_t *b;
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
  uint64_t dptr = 0;
  unsigned long long sum = 0;
  CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)stream, 0), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_ptr(b, 0, &dptr), TSOCK_OK);
  uint64_t want = fnv(b->tensors[0].data, ROWS * 4);
  launch_read(stream, (const void *)(uintptr_t)dptr, ROWS * 4, 600000000ull, &sum); /* 0.6 s */
  int injected = stats().injected_failures;
  setenv("FAKE_CUDA_FAIL", fail, 1);
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK(stats().injected_failures > injected); /* the failure did hit the release */
  if (ctx_sync_works) {
    CHECK(sum == want); /* release waited for the device */
  } else {
    /* Batch 0 is held: batch 1 comes, batch 2 cannot be published (2 slots). */
    CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
    CHECK(b->seq == 1);
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
    /* Both slots of the ring are ours (max_held is clamped to it), the
     * oldest behind a fence CUDA cannot confirm: acquire says so at once. */
    CHECK_RC(tsock_reader_acquire(r, &b, 200000000ll), TSOCK_ESYS);
    CHECK(strstr(tsock_last_error(), "stays held") != NULL);
    CHECK(published(name) == 2);
    CHECK(sum == 0); /* the read has not run yet: its slot was held for it */
  }
  unsetenv("FAKE_CUDA_FAIL"); /* CUDA recovers: the next poll proves the slot free */
  int rc;
  while ((rc = tsock_reader_acquire(r, &b, 10000000000ll)) == TSOCK_OK)
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK_RC(rc, TSOCK_ECLOSED);
  CHECK(sum == want);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK(reap(pid) == 0);
}

static void test_fence_failures_hold_slots(void) {
  /* the context cannot be made current at release */
  fence_failure_case("ffctx", "cuCtxGetCurrent", 0);
  /* no event can be recorded, and nothing can be synchronized */
  fence_failure_case("ffrec", "cuEventRecord,cuStreamSynchronize,cuCtxSynchronize", 0);
  /* the fence was recorded, but it cannot be queried nor waited for */
  fence_failure_case("ffqry", "cuEventQuery,cuEventSynchronize,cuCtxSynchronize", 0);
  /* no event, the stream cannot be synchronized: the device can */
  fence_failure_case("ffsync", "cuEventRecord,cuStreamSynchronize", 1);
}

/* A fence that stays unconfirmed through detach: detach says so and the
 * record keeps the slots from the producer until this process exits. */
static void test_detach_with_unconfirmed_fence(void) {
  const char *name = test_name("tdev", "ffdet");
  pid_t pid = spawn_producer(name, 6, 2);
  void *stream = NULL;
  tsock_reader_t *r = attach_device(name, &stream);
  if (r == NULL) return;
  const tsock_batch_t *b;
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
  uint64_t dptr = 0;
  static unsigned long long sum; /* the read outlives this function */
  CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)stream, 0), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_ptr(b, 0, &dptr), TSOCK_OK);
  launch_read(stream, (const void *)(uintptr_t)dptr, ROWS * 4, 600000000ull, &sum);
  setenv("FAKE_CUDA_FAIL", "cuEventRecord,cuStreamSynchronize,cuCtxSynchronize", 1);
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK); /* batch 1 */
  /* 2 is never published; both slots held (max_held = ring), one unconfirmed */
  CHECK_RC(tsock_reader_acquire(r, &b, 100000000ll), TSOCK_ESYS);
  /* The fake's read runs here, while the pool is mapped: detach drops this
   * process's mapping of it (the fence stays unconfirmable all the same).
   * A read left queued would later hash unmapped memory (or whatever the
   * next pool mapped there). */
  for (int w = 0; w < 400 && sum == 0; w++) {
    usleep(5000);
    run_due();
  }
  CHECK(sum != 0);
  CHECK_RC(tsock_reader_detach(r), TSOCK_ESYS);
  CHECK(strstr(tsock_last_error(), "stay held") != NULL);
  unsetenv("FAKE_CUDA_FAIL");
  usleep(200000);
  CHECK(published(name) == 2);              /* batch 0's slot was not given back */
  CHECK(waitpid(pid, NULL, WNOHANG) == 0); /* the producer waits on our record */
  kill(pid, SIGKILL);
  reap(pid);
  char path[128];
  snprintf(path, sizeof path, "/dev/shm/tsock.%s", name);
  unlink(path);
}

/* With max_held batches held behind an unconfirmed fence, acquire says why. */
static void test_max_held_behind_unconfirmed_fence(void) {
  const char *name = test_name("tdev", "ffmax");
  pid_t pid = spawn_producer(name, 6, 4);
  tsock_reader_options_t ro;
  tsock_reader_options_init(&ro);
  ro.attach_timeout_ns = 10000000000ll;
  ro.start = TSOCK_START_NOW;
  ro.max_held = 2;
  tsock_reader_t *r = NULL;
  CHECK_RC(tsock_reader_attach(name, &ro, &r), TSOCK_OK);
  if (r == NULL) return;
  int32_t ordinal;
  void *stream = NULL;
  CHECK_RC(tsock_reader_open_device(r, &ordinal), TSOCK_OK);
  CHECK(stream_create(&stream, 1) == 0);
  const tsock_batch_t *b;
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)stream, 0), TSOCK_OK);
  setenv("FAKE_CUDA_FAIL", "cuCtxGetCurrent", 1);
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_ESYS);
  CHECK(strstr(tsock_last_error(), "cannot confirm") != NULL);
  unsetenv("FAKE_CUDA_FAIL");
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  int rc;
  while ((rc = tsock_reader_acquire(r, &b, 10000000000ll)) == TSOCK_OK)
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK_RC(rc, TSOCK_ECLOSED);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK(reap(pid) == 0);
}

/* A batch used on the per-thread default stream (CU_STREAM_PER_THREAD,
 * handle 2) of thread A (ctx: struct ptu): queues a slow read there. */
struct ptu {
  const tsock_batch_t *b;
  unsigned long long *sum;
  int rc;
  uint64_t stream_end; /* when A's per-thread stream is done */
};
static void *use_per_thread(void *arg) {
  struct ptu *u = arg;
  uint64_t dptr = 0;
  u->rc = tsock_batch_cuda_use(u->b, 2, 0);
  if (u->rc == TSOCK_OK) u->rc = tsock_batch_cuda_ptr(u->b, 0, &dptr);
  if (u->rc == TSOCK_OK) {
    launch_read((void *)2, (const void *)(uintptr_t)dptr, ROWS * 4, 300000000ull, u->sum);
    u->stream_end = stream_end((void *)2);
  }
  return NULL;
}

/* CU_STREAM_PER_THREAD names another stream in each thread: a batch used on
 * it in thread A and released in thread B must be fenced on A's stream (the
 * device is synchronized); released in A, an event on A's stream does. */
static void test_per_thread_stream(void) {
  const char *name = test_name("tdev", "ptds");
  pid_t pid = spawn_producer(name, 8, 2);
  void *stream = NULL;
  tsock_reader_t *r = attach_device(name, &stream);
  if (r == NULL) return;
  static unsigned long long sum; /* the read may outlive this function */
  sum = 0;
  const tsock_batch_t *b;
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
  uint64_t want = fnv(b->tensors[0].data, ROWS * 4);
  struct ptu u = {b, &sum, -1, 0};
  pthread_t a;
  CHECK(pthread_create(&a, NULL, use_per_thread, &u) == 0);
  pthread_join(a, NULL);
  CHECK_RC(u.rc, TSOCK_OK);
  /* here handle 2 is this thread's stream, not the one the batch is on:
   * ordered too, and fenced with the device as before */
  int waits = stats().stream_waits, syncs = stats().ctx_syncs;
  CHECK_RC(tsock_batch_cuda_use(b, 2, 0), TSOCK_OK);
  CHECK(stats().stream_waits == waits + 1);
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK); /* in B, this thread */
  CHECK(stats().ctx_syncs == syncs + 1);
  int rc, n = 0;
  while ((rc = tsock_reader_acquire(r, &b, 10000000000ll)) == TSOCK_OK) {
    if (n++ == 0) {
      /* used and released in the same thread: an event on its own stream */
      fake_cuda_stats before = stats();
      if (b->n_tensors == 1) {
        CHECK_RC(tsock_batch_cuda_use(b, 2, 0), TSOCK_OK);
        CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
        fake_cuda_stats after = stats();
        CHECK(after.ctx_syncs == before.ctx_syncs);
        CHECK(after.events_recorded == before.events_recorded + 1);
        continue;
      }
    }
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  }
  CHECK_RC(rc, TSOCK_ECLOSED);
  /* whenever the read ran, it must have seen batch 0 */
  while (mono_ns() < u.stream_end) usleep(10000);
  run_due();
  CHECK(sum == want);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK(reap(pid) == 0);
}

/* TSOCK_CUDA_SYNC: the host waits for the copy; release waits for the device.
 * So does a batch used on two streams. */
static void test_sync_mode(void) {
  const char *name = test_name("tdev", "sync");
  setenv("FAKE_CUDA_COPY_NS", "500000000", 1); /* the producer's copies take 0.5 s */
  pid_t pid = spawn_producer(name, 4, 4);
  unsetenv("FAKE_CUDA_COPY_NS");
  void *stream = NULL;
  tsock_reader_t *r = attach_device(name, &stream);
  if (r == NULL) return;
  const tsock_batch_t *b;
  /* first batch on a stream: the stream's work now ends after the copy */
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
  /* Waiting for the copy would return after it ends (publish + 0.5 s, to
   * the 1 ms of the check below): called before that, cuda_use must
   * return before it. (Not "within 250 ms": a loaded machine can stall
   * this thread that long without any waiting in cuda_use.) */
  uint64_t copy_end = b->publish_ns + 500000000ull - 1000000ull;
  uint64_t t = mono_ns();
  CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)stream, 0), TSOCK_OK);
  CHECK(t >= copy_end || mono_ns() < copy_end);        /* did not block */
  CHECK(stream_end(stream) + 1000000ull >= b->publish_ns + 500000000ull); /* but ordered */
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  /* second batch, SYNC: this thread waits for the copy */
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_use(b, 0, TSOCK_CUDA_SYNC), TSOCK_OK);
  CHECK(mono_ns() + 1000000ull >= b->publish_ns + 500000000ull);
  int syncs = stats().ctx_syncs;
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK(stats().ctx_syncs == syncs + 1);
  /* third batch on two streams: each waits for the copy; no one event at
   * release covers both, so the release waits for the device */
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)stream, 0), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)stream, 0), TSOCK_OK); /* again: nothing */
  fake_cuda_stats before = stats();
  CHECK_RC(tsock_batch_cuda_use(b, 1, 0), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_use(b, 1, 0), TSOCK_OK); /* only the first stream is remembered */
  CHECK(stats().stream_waits == before.stream_waits + 2);
  CHECK(stream_end((void *)1) + 1000000ull >= b->publish_ns + 500000000ull); /* ordered */
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK(stats().ctx_syncs == before.ctx_syncs + 1);
  CHECK(stats().events_recorded == before.events_recorded);
  /* fourth batch on one stream again: an event, as for the first */
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
  CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)stream, 0), TSOCK_OK);
  before = stats();
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK(stats().ctx_syncs == before.ctx_syncs);
  CHECK(stats().events_recorded == before.events_recorded + 1);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK(reap(pid) == 0);
}

/* A channel that is already closed has no device path: its producer may be
 * freeing the pool. The reader must see CLOSED on the live header page, not
 * on its private copy of the header (taken while the channel was open). */
static void test_closed_channel_refuses_device(void) {
  const char *name = test_name("tdev", "closed");
  pid_t pid = spawn_producer(name, 2, 4);
  tsock_reader_t *r = attach(name);
  if (r == NULL) return;
  const tsock_batch_t *b;
  int rc;
  while ((rc = tsock_reader_acquire(r, &b, 10000000000ll)) == TSOCK_OK)
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK_RC(rc, TSOCK_ECLOSED);
  int32_t ordinal = 7;
  CHECK_RC(tsock_reader_open_device(r, &ordinal), TSOCK_ENODEVICE);
  CHECK(strstr(tsock_last_error(), "closed") != NULL);
  CHECK(ordinal == 7);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK(reap(pid) == 0);
}

/* Where the device path is refused, the reader says why and reads host memory. */
static void test_placement_refusals(void) {
  /* a producer without a pool */
  const char *name = test_name("tdev", "nopool");
  tsock_producer_t *p;
  CHECK_RC(tsock_producer_create(name, NULL, &p), TSOCK_OK);
  tsock_reader_t *r = attach(name);
  int32_t ordinal = 7;
  CHECK_RC(tsock_reader_open_device(r, &ordinal), TSOCK_ENODEVICE);
  CHECK(strstr(tsock_last_error(), "no device pool") != NULL);
  CHECK(ordinal == 7);
  CHECK_RC(tsock_reader_open_device(r, NULL), TSOCK_EINVAL);
  void *buf;
  CHECK_RC(tsock_producer_reserve(p, 64, 0, &buf), TSOCK_OK);
  tsock_tensor_t t;
  int64_t shape[1] = {16};
  tsock_tensor_init(&t, TSOCK_DTYPE_FLOAT32, 1, shape, 0);
  CHECK_RC(tsock_producer_publish(p, &t, 1, NULL, 0), TSOCK_OK);
  const tsock_batch_t *b;
  CHECK_RC(tsock_reader_acquire(r, &b, 1000000000ll), TSOCK_OK);
  uint64_t dptr;
  CHECK_RC(tsock_batch_cuda_use(b, 0, 0), TSOCK_ENODEVICE);
  CHECK_RC(tsock_batch_cuda_ptr(b, 0, &dptr), TSOCK_ENODEVICE);
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);

  /* a reader in the producer's own process: the driver refuses the handle */
  name = test_name("tdev", "self");
  tsock_producer_options_t po;
  tsock_producer_options_init(&po);
  po.cuda_device = 1;
  CHECK_RC(tsock_producer_create(name, &po, &p), TSOCK_OK);
  r = attach(name);
  CHECK_RC(tsock_reader_open_device(r, &ordinal), TSOCK_ENODEVICE);
  CHECK(strstr(tsock_last_error(), "cuIpcOpenMemHandle") != NULL);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);

  /* another GPU, or a MIG instance: no device of ours has the pool's UUID */
  setenv("FAKE_CUDA_UUIDS", "7,8", 1);
  r = attach(name);
  CHECK_RC(tsock_reader_open_device(r, &ordinal), TSOCK_ENODEVICE);
  CHECK(strstr(tsock_last_error(), "MIG") != NULL);
  CHECK(strstr(tsock_last_error(), "GPU-66616b65") != NULL); /* the pool's UUID, "fake..." */
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  unsetenv("FAKE_CUDA_UUIDS");
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);

  /* a bad ordinal, and a negative one other than -1 */
  po.cuda_device = 5;
  CHECK_RC(tsock_producer_create(test_name("tdev", "ord"), &po, &p), TSOCK_EINVAL);
  CHECK(strstr(tsock_last_error(), "cuda:5") != NULL);
  po.cuda_device = -2;
  CHECK_RC(tsock_producer_create(test_name("tdev", "neg"), &po, &p), TSOCK_EINVAL);
  /* the driver fails the allocation: a clear error, no channel left */
  setenv("FAKE_CUDA_ALLOC_RESULT", "2", 1);
  po.cuda_device = 0;
  name = test_name("tdev", "oom");
  CHECK_RC(tsock_producer_create(name, &po, &p), TSOCK_ESYS);
  CHECK(strstr(tsock_last_error(), "CUDA_ERROR_OUT_OF_MEMORY") != NULL);
  unsetenv("FAKE_CUDA_ALLOC_RESULT");
  char path[128];
  snprintf(path, sizeof path, "/dev/shm/tsock.%s", name);
  CHECK(access(path, F_OK) != 0);
}

/* Reads a device batch; kills the producer at the tenth (ctx: struct kp). */
struct kp {
  void *stream;
  pid_t producer;
  const char *name;
  int got, host_reads;
};

/* The channel's published count, read from its header. */
static uint64_t published(const char *name) {
  char path[128];
  snprintf(path, sizeof path, "/dev/shm/tsock.%s", name);
  FILE *f = fopen(path, "rb");
  uint64_t v = 0;
  if (f != NULL) {
    if (fseek(f, (long)offsetof(tsock_header, published), SEEK_SET) != 0 || fread(&v, sizeof v, 1, f) != 1)
      v = 0;
    fclose(f);
  }
  return v;
}
static void read_then_kill(const tsock_batch_t *b, void *ctx) {
  struct kp *k = ctx;
  if (!(b->flags & TSOCK_BATCH_EPOCH_END)) {
    uint64_t dptr;
    if (k->got < 10) {
      CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)k->stream, 0), TSOCK_OK);
      CHECK_RC(tsock_batch_cuda_ptr(b, 0, &dptr), TSOCK_OK);
      CHECK(((const uint32_t *)(uintptr_t)dptr)[1] == value(b->index, 1));
    } else {
      /* Dead producer: its pool is not to be used; the host copy is. */
      CHECK_RC(tsock_batch_cuda_use(b, (uintptr_t)k->stream, 0), TSOCK_EPRODUCER_GONE);
      CHECK(strstr(tsock_last_error(), "host memory") != NULL);
      k->host_reads++;
    }
    CHECK(((const uint32_t *)b->tensors[0].data)[1] == value(b->index, 1));
  }
  if (++k->got == 10) {
    /* Once batches after this one are published (the ring fills behind
     * the batch we hold): the dead producer's batches are then read. */
    for (int w = 0; w < 2000 && published(k->name) < b->seq + 3; w++) usleep(5000);
    kill(k->producer, SIGKILL);
    reap(k->producer); /* its locks are gone once it is reaped */
  }
}

/* A killed peer on the device path behaves as on the CPU: the producer
 * goes on after a reader dies with GPU work queued on its batches (the
 * work dies with it), and a reader drains what a killed producer
 * published, then gets TSOCK_EPRODUCER_GONE. */
static void test_killed_peers(void) {
  const char *name = test_name("tdev", "kill");
  const int n = 40;
  pid_t prod = spawn_producer(name, n, 2);
  int fds[2];
  CHECK(pipe(fds) == 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  char *argv[] = {"/proc/self/exe", "device-reader", (char *)name, NULL};
  pid_t rd;
  CHECK(posix_spawn(&rd, "/proc/self/exe", &fa, NULL, argv, environ) == 0);
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  char buf[16] = {0};
  CHECK(read(fds[0], buf, sizeof buf - 1) > 0 && strncmp(buf, "ready", 5) == 0);
  close(fds[0]);
  /* Its fences hold both slots for 60 s: the producer waits... */
  usleep(200000);
  CHECK(waitpid(prod, NULL, WNOHANG) == 0); /* held back by the fences */
  uint64_t t0 = mono_ns();
  kill(rd, SIGKILL);
  reap(rd);
  /* ...until the reader is gone; then it publishes all, reader-less. */
  CHECK(reap(prod) == 0);
  /* Gone on at the reader's death, not at its 60 s fences (a producer
   * still held back by the dead reader fails its 10 s reserve: exit 3,
   * above); 30 s leaves room for a starved producer process. */
  CHECK(mono_ns() - t0 < 30000000000ull);

  name = test_name("tdev", "kprod");
  prod = spawn_producer(name, 1000000, 4);
  void *stream = NULL;
  tsock_reader_t *r = attach_device(name, &stream);
  if (r == NULL) return;
  struct kp k = {stream, prod, name, 0, 0};
  int rc = drain(r, read_then_kill, &k);
  int got = k.got;
  CHECK(k.host_reads >= 1); /* the ring held batches published before the kill */
  CHECK_RC(rc, TSOCK_EPRODUCER_GONE);
  CHECK(got >= 10);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
}

/* The same GPU seen under another ordinal is still found by UUID. */
static void test_reordered_devices(void) {
  const char *name = test_name("tdev", "reorder");
  pid_t pid = spawn_producer(name, 2, 2); /* pool on ordinal 0 = UUID 0; open till our release */
  setenv("FAKE_CUDA_UUIDS", "1,0", 1);    /* here that GPU is ordinal 1 */
  tsock_reader_t *r = attach(name);
  int32_t ordinal = -1;
  CHECK_RC(tsock_reader_open_device(r, &ordinal), TSOCK_OK);
  CHECK(ordinal == 1);
  unsetenv("FAKE_CUDA_UUIDS");
  const tsock_batch_t *b;
  CHECK_RC(tsock_reader_acquire(r, &b, 10000000000ll), TSOCK_OK);
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK(reap(pid) == 0);
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "";
  if (strcmp(mode, "producer") == 0 && argc == 5)
    return run_producer(argv[2], atoi(argv[3]), atoi(argv[4]));
  if (strcmp(mode, "device-reader") == 0 && argc == 3) return run_device_reader(argv[2]);
  if (strcmp(mode, "nodriver") == 0) {
    tsock_producer_options_t po;
    tsock_producer_options_init(&po);
    CHECK(po.cuda_device == -1);
    po.cuda_device = 0;
    const char *name = test_name("tdev", "nodrv");
    tsock_producer_t *p;
    CHECK_RC(tsock_producer_create(name, &po, &p), TSOCK_ENOCUDA);
    CHECK(strstr(tsock_last_error(), "CUDA driver not available") != NULL);
    char path[128];
    snprintf(path, sizeof path, "/dev/shm/tsock.%s", name);
    CHECK(access(path, F_OK) != 0);
  } else if (strcmp(mode, "fake") == 0) {
    if (load_fake() != 0) {
      fprintf(stderr, "fake driver: TSOCK_LIBCUDA unset or not the fake\n");
      return 1;
    }
    test_zero_copy();
    test_fences_hold_slots();
    test_detach_waits();
    test_close_waits_for_device_readers();
    test_dlpack_keeps_pool_after_detach();
    test_sync_mode();
    test_per_thread_stream();
    test_fence_failures_hold_slots();
    test_detach_with_unconfirmed_fence();
    test_max_held_behind_unconfirmed_fence();
    test_placement_refusals();
    test_closed_channel_refuses_device();
    test_reordered_devices();
    test_killed_peers();
    void (*sweep)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "fake_cuda_sweep");
    if (sweep == NULL) {
      void *fake = dlopen(getenv("TSOCK_LIBCUDA"), RTLD_NOW | RTLD_LOCAL);
      sweep = fake ? (void (*)(void))dlsym(fake, "fake_cuda_sweep") : NULL;
    }
    CHECK(sweep != NULL);
    if (sweep) sweep(); /* the device memory of the killed producer */
    fake_cuda_stats s = stats();
    CHECK(s.allocs == s.frees); /* the producers of this process freed their pools */
    CHECK(s.primary_refs == 1); /* the test's own */
  } else {
    fprintf(stderr, "usage: test_device fake|nodriver\n");
    return 2;
  }
  if (test_failures == 0) printf("test_device %s: ok\n", mode);
  return test_failures == 0 ? 0 : 1;
}
