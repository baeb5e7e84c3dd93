/* test_cuda.c - tsock_reader_register_host without a GPU.
 *
 * Usage: test_cuda MODE, linked against either library, with the
 * environment ctest sets per mode:
 *   fake     TSOCK_LIBCUDA = the fake driver (fake_cuda.c): the payload
 *            range is registered exactly once, read-only and portable, in a
 *            primary context, and unregistered once, before it is unmapped,
 *            when the last holder of the mapping (reader, pin, DLPack
 *            tensor) lets go;
 *   noinit   the fake driver whose cuInit fails: TSOCK_ENOCUDA;
 *   missing  TSOCK_LIBCUDA = a file that does not exist: TSOCK_ENOCUDA;
 *   none     no TSOCK_LIBCUDA: TSOCK_ENOCUDA where libcuda.so.1 is absent
 *            (skipped where a driver is installed).
 * The segment is crafted by hand with this process as its producer, so no
 * Go is needed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>

#include "fake_cuda.h"
#include "fake_join.h"
#include "layout.h"
#include "test_util.h"

/* ---- a hand-made segment whose producer is this process ---- */

typedef struct seg {
  int fd;
  uint8_t *map;
  tsock_header *h;
  fake_join join; /* readers join here */
} seg;

static int seg_open(seg *s, const char *name) {
  tsock_geometry g;
  if (tsock_layout_geometry(4, 4, 8192, &g) != 0) return -1;
  char path[128];
  snprintf(path, sizeof path, "/dev/shm/tsock.%s", name);
  s->fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (s->fd < 0 || ftruncate(s->fd, (off_t)g.total_bytes) != 0) return -1;
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = TSOCK_LOCK_PRODUCER,
                     .l_len = 1};
  if (fcntl(s->fd, F_OFD_SETLK, &fl) != 0) return -1;
  s->map = mmap(NULL, g.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
  if (s->map == MAP_FAILED) return -1;
  tsock_header *h = s->h = (tsock_header *)s->map;
  h->magic = TSOCK_MAGIC;
  h->header_size = sizeof(tsock_header);
  h->slot_size = sizeof(tsock_slot);
  h->roster_entry_size = sizeof(tsock_roster_entry);
  h->slot_count = 4;
  h->reader_capacity = 4;
  h->slot_payload_bytes = g.slot_payload_bytes;
  h->roster_offset = g.roster_offset;
  h->slots_offset = g.slots_offset;
  h->payload_offset = g.payload_offset;
  h->total_bytes = g.total_bytes;
  h->producer_pid = (int32_t)getpid();
  h->state = TSOCK_STATE_OPEN;
  __atomic_store_n(&h->layout_version, TSOCK_LAYOUT_VERSION, __ATOMIC_RELEASE);
  return fake_join_start(&s->join, s->map);
}

/* Publishes batch `seq`: one uint8 [16] tensor. */
static void seg_publish(seg *s, uint64_t seq) {
  tsock_slot *sl = (tsock_slot *)(s->map + s->h->slots_offset) + (seq % s->h->slot_count);
  uint8_t *payload =
      s->map + s->h->payload_offset + (seq % s->h->slot_count) * s->h->slot_payload_bytes;
  __atomic_store_n(&sl->stamp, 0, __ATOMIC_RELEASE);
  memset((uint8_t *)sl + 8, 0, sizeof *sl - 8);
  sl->index = seq;
  sl->n_tensors = 1;
  sl->payload_bytes = 16;
  tsock_shm_tensor *t = &sl->tensors[0];
  t->dtype = TSOCK_DTYPE_UINT8;
  t->ndim = 1;
  t->shape[0] = 16;
  t->strides[0] = 1;
  t->nbytes = 16;
  memset(payload, (int)seq, 16);
  __atomic_store_n(&sl->stamp, seq + 1, __ATOMIC_RELEASE);
  __atomic_store_n(&s->h->published, seq + 1, __ATOMIC_SEQ_CST);
}

static tsock_reader_t *attach_now(const char *name) {
  tsock_reader_options_t o;
  tsock_reader_options_init(&o);
  o.start = TSOCK_START_NOW;
  tsock_reader_t *r = NULL;
  CHECK_RC(tsock_reader_attach(name, &o, &r), TSOCK_OK);
  return r;
}

static int contains(const char *hay, const char *needle) {
  if (strstr(hay, needle) != NULL) return 1;
  fprintf(stderr, "message '%s' lacks '%s'\n", hay, needle);
  return 0;
}

/* ---- fake driver ---- */

static fake_cuda_query_fn query;
static fake_cuda_stats now(void) {
  fake_cuda_stats s;
  query(&s);
  return s;
}

static void *unpin_thread(void *token) {
  tsock_mapping_unpin(token);
  return NULL;
}

static void test_fake(seg *sg, const char *name) {
  const char *path = getenv("TSOCK_LIBCUDA");
  void *fake = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
  query = fake ? (fake_cuda_query_fn)dlsym(fake, "fake_cuda_query") : NULL;
  fake_cuda_current_fn current =
      fake ? (fake_cuda_current_fn)dlsym(fake, "fake_cuda_current") : NULL;
  if (query == NULL || current == NULL) {
    fprintf(stderr, "fake driver %s: %s\n", path ? path : "(TSOCK_LIBCUDA unset)", dlerror());
    test_failures++;
    return;
  }

  /* One registration of exactly the payload range, then a no-op. */
  tsock_reader_t *r = attach_now(name);
  const void *base = NULL;
  uint64_t len = 0;
  CHECK_RC(tsock_reader_payload_range(r, &base, &len), TSOCK_OK);
  CHECK_RC(tsock_reader_register_host(r), TSOCK_OK);
  fake_cuda_stats s = now();
  CHECK(s.init_calls == 1);
  CHECK(s.registers == 1 && s.registered_now == 1 && s.register_failures == 0);
  CHECK(s.last_register_addr == base && s.last_register_len == len);
  CHECK(s.last_register_flags == (0x01u | 0x08u)); /* PORTABLE | READ_ONLY */
  CHECK(s.last_register_device == 0);               /* no current context: device 0 */
  CHECK(s.retains == 1 && s.primary_refs == 1 && s.calls_without_context == 0);
  CHECK(current() == NULL); /* the thread's context is left as it was */
  CHECK_RC(tsock_reader_register_host(r), TSOCK_OK);
  s = now();
  CHECK(s.registers == 1 && s.retains == 1 && s.init_calls == 1);

  /* Detach with a pin out: still registered until the pin goes, which
   * unregisters once, before the unmap, from another thread (no context
   * current there). */
  void *token = NULL;
  CHECK_RC(tsock_reader_pin_mapping(r, &token), TSOCK_OK);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  s = now();
  CHECK(s.unregisters == 0 && s.registered_now == 1);
  pthread_t t;
  CHECK(pthread_create(&t, NULL, unpin_thread, token) == 0);
  pthread_join(t, NULL);
  s = now();
  CHECK(s.unregisters == 1 && s.registered_now == 0 && s.unregister_failures == 0);
  CHECK(s.last_unregister_addr == base && s.unregistered_after_unmap == 0);
  CHECK(s.releases == 1 && s.primary_refs == 0 && s.calls_without_context == 0);
  CHECK_RC(tsock_reader_register_host(r), TSOCK_EHANDLE);

  /* The framework's context on device 1 is current: registration uses
   * device 1 and leaves that context current. A DLPack tensor keeps the
   * mapping (and the registration) past release and detach. */
  typedef int (*retain_fn)(void **, int);
  typedef int (*set_fn)(void *);
  typedef int (*release_fn)(int);
  retain_fn retain = (retain_fn)dlsym(fake, "cuDevicePrimaryCtxRetain");
  set_fn set_current = (set_fn)dlsym(fake, "cuCtxSetCurrent");
  release_fn release_primary = (release_fn)dlsym(fake, "cuDevicePrimaryCtxRelease_v2");
  void *app_ctx = NULL;
  CHECK(retain != NULL && set_current != NULL && release_primary != NULL);
  if (retain == NULL || set_current == NULL || release_primary == NULL) return;
  CHECK(retain(&app_ctx, 1) == 0 && set_current(app_ctx) == 0);
  r = attach_now(name);
  CHECK_RC(tsock_reader_payload_range(r, &base, &len), TSOCK_OK);
  CHECK_RC(tsock_reader_register_host(r), TSOCK_OK);
  s = now();
  CHECK(s.registers == 2 && s.last_register_device == 1 && current() == app_ctx);
  CHECK(s.last_register_addr == base && s.primary_refs == 2); /* the framework's and ours */
  seg_publish(sg, 0);
  const tsock_batch_t *b = NULL;
  CHECK_RC(tsock_reader_acquire(r, &b, 1000 * MS), TSOCK_OK);
  void *dl = NULL;
  if (b != NULL) CHECK_RC(tsock_batch_dlpack(b, 0, 0, &dl), TSOCK_OK);
  if (b != NULL) CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK(now().unregisters == 1);
  if (dl != NULL) {
    /* DLManagedTensor: the deleter is at byte 56 (see reader/dlpack.c). */
    void (*deleter)(void *);
    memcpy(&deleter, (uint8_t *)dl + 56, sizeof deleter);
    deleter(dl);
  }
  s = now();
  CHECK(s.unregisters == 2 && s.registered_now == 0 && s.last_unregister_addr == base);
  CHECK(s.unregistered_after_unmap == 0 && s.primary_refs == 1 && current() == app_ctx);
  CHECK(release_primary(1) == 0 && set_current(NULL) == 0);

  /* A failing registration: TSOCK_ESYS with the driver's words, nothing
   * kept, and a later call may try again. */
  r = attach_now(name);
  setenv("FAKE_CUDA_REGISTER_RESULT", "801", 1);
  CHECK_RC(tsock_reader_register_host(r), TSOCK_ESYS);
  CHECK(contains(tsock_last_error(), "cuMemHostRegister"));
  CHECK(contains(tsock_last_error(), "CUDA_ERROR_NOT_SUPPORTED: operation not supported"));
  s = now();
  CHECK(s.registers == 2 && s.register_failures == 1 && s.primary_refs == 0);
  unsetenv("FAKE_CUDA_REGISTER_RESULT");
  CHECK_RC(tsock_reader_register_host(r), TSOCK_OK);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK); /* no pin, no tensor: unregistered here */
  s = now();
  CHECK(s.registers == 3 && s.unregisters == 3 && s.registered_now == 0);
  CHECK(s.primary_refs == 0 && s.release_underflows == 0 && s.calls_without_context == 0);
  CHECK(s.unregistered_after_unmap == 0 && s.init_calls == 1);

  /* Kept batches and pinned memory exclude each other: the driver pinned
   * the registered pages, which a keep would swap; and once a batch was
   * kept the payload is no longer the one range there is to register. */
  r = attach_now(name);
  CHECK_RC(tsock_reader_register_host(r), TSOCK_OK);
  seg_publish(sg, 1);
  b = NULL;
  CHECK_RC(tsock_reader_acquire(r, &b, 1000 * MS), TSOCK_OK);
  if (b != NULL) {
    const tsock_batch_t *kept = NULL;
    CHECK_RC(tsock_batch_keep(r, b, 1, &kept), TSOCK_ESTATE);
    CHECK(contains(tsock_last_error(), "registered with CUDA") && kept == NULL);
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  }
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  r = attach_now(name);
  seg_publish(sg, 2);
  b = NULL;
  CHECK_RC(tsock_reader_acquire(r, &b, 1000 * MS), TSOCK_OK);
  if (b != NULL) {
    const tsock_batch_t *kept = NULL;
    CHECK_RC(tsock_batch_keep(r, b, 1, &kept), TSOCK_OK);
    CHECK_RC(tsock_reader_register_host(r), TSOCK_ESTATE);
    CHECK(contains(tsock_last_error(), "kept"));
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
    CHECK_RC(tsock_batch_free(kept), TSOCK_OK);
  }
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK(now().registers == 4 && now().registered_now == 0);
}

/* ---- no driver ---- */

static void expect_nocuda(const char *name, const char *needle) {
  tsock_reader_t *r = attach_now(name);
  for (int i = 0; i < 2; i++) { /* the answer is kept, and given again */
    CHECK_RC(tsock_reader_register_host(r), TSOCK_ENOCUDA);
    CHECK(contains(tsock_last_error(), "CUDA driver not available"));
    CHECK(contains(tsock_last_error(), needle));
  }
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK_RC(tsock_reader_register_host(r), TSOCK_EHANDLE);
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "";
  CHECK(strcmp(tsock_status_str(TSOCK_ENOCUDA), "CUDA driver not available") == 0);
  CHECK_RC(tsock_reader_register_host(NULL), TSOCK_EHANDLE);
  seg sg;
  const char *name = test_name("tcuda", mode);
  if (seg_open(&sg, name) != 0) {
    perror("crafted segment");
    return 1;
  }
  if (strcmp(mode, "fake") == 0) {
    test_fake(&sg, name);
  } else if (strcmp(mode, "noinit") == 0) {
    expect_nocuda(name, "cuInit");
    expect_nocuda(name, "CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected");
  } else if (strcmp(mode, "missing") == 0) {
    expect_nocuda(name, getenv("TSOCK_LIBCUDA") ? getenv("TSOCK_LIBCUDA") : "(unset)");
  } else if (strcmp(mode, "none") == 0) {
    unsetenv("TSOCK_LIBCUDA"); /* before the first call loads the driver */
    void *real = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (real != NULL) {
      printf("test_cuda none: a CUDA driver (libcuda.so.1) is installed; skipped\n");
    } else {
      expect_nocuda(name, "libcuda.so.1");
    }
  } else {
    fprintf(stderr, "usage: %s fake|noinit|missing|none\n", argv[0]);
    return 2;
  }
  fake_join_stop(&sg.join);
  return test_report("test_cuda");
}
