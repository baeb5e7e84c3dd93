/* test_api.c - the C ABI of libtsock.so (producer and reader), in one process. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <stdint.h>

#include "test_util.h"

static tsock_producer_t *make_producer(const char *name, uint32_t slots, uint64_t slot_bytes) {
  tsock_producer_options_t o;
  tsock_producer_options_init(&o);
  o.slot_count = slots;
  o.slot_bytes = slot_bytes;
  tsock_producer_t *p = NULL;
  CHECK_RC(tsock_producer_create(name, &o, &p), TSOCK_OK);
  return p;
}

static tsock_reader_t *make_reader(const char *name, int start) {
  tsock_reader_options_t o;
  tsock_reader_options_init(&o);
  o.start = start;
  tsock_reader_t *r = NULL;
  CHECK_RC(tsock_reader_attach(name, &o, &r), TSOCK_OK);
  return r;
}

/* Publishes one batch: a uint32 [1] tensor holding `value`. */
static void publish_value(tsock_producer_t *p, uint32_t value) {
  void *buf = NULL;
  CHECK_RC(tsock_producer_reserve(p, 4, 1000 * MS, &buf), TSOCK_OK);
  if (buf == NULL) return;
  memcpy(buf, &value, 4);
  tsock_tensor_t t;
  const int64_t shape[1] = {1};
  CHECK_RC(tsock_tensor_init(&t, TSOCK_DTYPE_UINT32, 1, shape, 0), TSOCK_OK);
  CHECK_RC(tsock_producer_publish(p, &t, 1, NULL, 0), TSOCK_OK);
}

static uint32_t batch_value(const tsock_batch_t *b) {
  uint32_t v = UINT32_MAX;
  if (b->n_tensors == 1 && b->tensors[0].dtype == TSOCK_DTYPE_UINT32) memcpy(&v, b->tensors[0].data, 4);
  return v;
}

static void test_options_init(void) {
  tsock_producer_options_t po;
  memset(&po, 0xff, sizeof po);
  tsock_producer_options_init(&po);
  CHECK(po.size == sizeof po);
  CHECK(po.slot_count == 16 && po.slot_bytes == 1u << 20 && po.max_readers == 64);
  CHECK(po.mode == 0600 && po.gid == -1 && po.evict_after_ns == 0);
  tsock_reader_options_t ro;
  memset(&ro, 0xff, sizeof ro);
  tsock_reader_options_init(&ro);
  CHECK(ro.size == sizeof ro);
  CHECK(ro.start == TSOCK_START_NEXT_EPOCH && ro.attach_timeout_ns == 0 && ro.max_held == 4);
  CHECK(ro.reserved == 0 && ro.spin_ns == 20000);
  tsock_producer_options_init(NULL); /* no crash */
  tsock_reader_options_init(NULL);
}

static void test_status_strings(void) {
  const char *seen[1 - TSOCK_ENODEVICE];
  for (int s = 0; s >= TSOCK_ENODEVICE; s--) {
    const char *str = tsock_status_str(s);
    CHECK(str != NULL && str[0] != '\0' && strcmp(str, "unknown status") != 0);
    seen[-s] = str;
    for (int k = 0; k < -s; k++) CHECK(strcmp(seen[k], str) != 0);
  }
  CHECK(strcmp(tsock_status_str(TSOCK_ENODEVICE - 1), "unknown status") == 0);
  CHECK(strcmp(tsock_status_str(TSOCK_ENOCUDA), "CUDA driver not available") == 0);
  CHECK(strcmp(tsock_status_str(1), "unknown status") == 0);
  CHECK(strcmp(tsock_status_str(-1000), "unknown status") == 0);
  CHECK(strcmp(tsock_status_str(TSOCK_OK), "ok") == 0);
}

static void test_names(void) {
  char long65[66];
  memset(long65, 'a', 65);
  long65[65] = '\0';
  const char *bad[] = {"", long65, "a/b", "..", ".", "a b", "x\xc3\xa9", NULL};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    tsock_producer_t *p = (tsock_producer_t *)1;
    tsock_reader_t *r = (tsock_reader_t *)1;
    CHECK_RC(tsock_producer_create(bad[i], NULL, &p), TSOCK_ENAME);
    CHECK(p == (tsock_producer_t *)1); /* out-parameters untouched on error */
    CHECK_RC(tsock_reader_attach(bad[i], NULL, &r), TSOCK_ENAME);
    CHECK(r == (tsock_reader_t *)1);
  }
  /* 64 characters, with every allowed punctuation, is fine. */
  char buf[80];
  snprintf(buf, sizeof buf, "._-%053d%08d", 0, (int)getpid() % 100000000);
  const char *name = test_keep(buf);
  CHECK(strlen(name) == TSOCK_NAME_MAX);
  tsock_producer_t *p = NULL;
  CHECK_RC(tsock_producer_create(name, NULL, &p), TSOCK_OK);
  if (p != NULL) {
    tsock_reader_t *r = NULL;
    CHECK_RC(tsock_reader_attach(name, NULL, &r), TSOCK_OK);
    if (r != NULL) CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
    CHECK_RC(tsock_producer_close(p), TSOCK_OK);
  }
}

static void test_null_pointers(void) {
  const char *name = test_name("tapi", "null");
  tsock_producer_t *p = NULL;
  tsock_reader_t *r = NULL;
  CHECK_RC(tsock_producer_create(name, NULL, NULL), TSOCK_EINVAL);
  CHECK_RC(tsock_reader_attach(name, NULL, NULL), TSOCK_EINVAL);
  CHECK_RC(tsock_tensor_init(NULL, TSOCK_DTYPE_INT8, 0, NULL, 0), TSOCK_EINVAL);
  tsock_tensor_t t;
  CHECK_RC(tsock_tensor_init(&t, TSOCK_DTYPE_INT8, 1, NULL, 0), TSOCK_EINVAL);

  /* NULL handles */
  void *buf = NULL;
  const tsock_batch_t *b = NULL;
  tsock_producer_stats_t st = {.size = sizeof st};
  CHECK_RC(tsock_producer_reserve(NULL, 1, 0, &buf), TSOCK_EHANDLE);
  CHECK_RC(tsock_producer_publish(NULL, NULL, 0, NULL, 0), TSOCK_EHANDLE);
  CHECK_RC(tsock_producer_abort(NULL), TSOCK_EHANDLE);
  CHECK_RC(tsock_producer_end_epoch(NULL, 0), TSOCK_EHANDLE);
  CHECK_RC(tsock_producer_wait_readers(NULL, 1, 0), TSOCK_EHANDLE);
  CHECK_RC(tsock_producer_stats(NULL, &st), TSOCK_EHANDLE);
  CHECK_RC(tsock_producer_close(NULL), TSOCK_EHANDLE);
  CHECK_RC(tsock_reader_acquire(NULL, &b, 0), TSOCK_EHANDLE);
  CHECK_RC(tsock_reader_release(NULL, b), TSOCK_EHANDLE);
  CHECK_RC(tsock_reader_payload_range(NULL, NULL, NULL), TSOCK_EHANDLE);
  CHECK_RC(tsock_reader_detach(NULL), TSOCK_EHANDLE);

  /* NULL out-parameters on live handles */
  p = make_producer(name, 4, 4096);
  r = make_reader(name, TSOCK_START_NEXT_EPOCH);
  if (p == NULL || r == NULL) return;
  CHECK_RC(tsock_producer_reserve(p, 1, 0, NULL), TSOCK_EINVAL);
  CHECK_RC(tsock_producer_stats(p, NULL), TSOCK_EINVAL);
  CHECK_RC(tsock_producer_reserve(p, 8, 0, &buf), TSOCK_OK);
  CHECK_RC(tsock_producer_publish(p, NULL, 1, NULL, 0), TSOCK_EINVAL);
  CHECK_RC(tsock_producer_publish(p, NULL, 0, NULL, 4), TSOCK_EINVAL);
  CHECK_RC(tsock_producer_publish(p, NULL, 0, NULL, 0), TSOCK_OK); /* an empty batch is fine */
  CHECK_RC(tsock_reader_acquire(r, NULL, 0), TSOCK_EINVAL);
  CHECK_RC(tsock_reader_release(r, NULL), TSOCK_EINVAL);
  const void *base = NULL;
  uint64_t len = 0;
  CHECK_RC(tsock_reader_payload_range(r, NULL, &len), TSOCK_EINVAL);
  CHECK_RC(tsock_reader_payload_range(r, &base, NULL), TSOCK_EINVAL);
  CHECK_RC(tsock_reader_payload_range(r, &base, &len), TSOCK_OK);
  CHECK(base != NULL && len == 4 * 4096);
  CHECK_RC(tsock_reader_acquire(r, &b, 1000 * MS), TSOCK_OK);
  if (b != NULL) {
    CHECK(b->n_tensors == 0 && b->meta_len == 0 && b->flags == 0);
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
    CHECK_RC(tsock_reader_release(r, b), TSOCK_ESTATE); /* released already */
  }
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

static void test_closed_handles(void) {
  const char *name = test_name("tapi", "closed");
  tsock_producer_t *p = make_producer(name, 4, 4096);
  tsock_reader_t *r = make_reader(name, TSOCK_START_NEXT_EPOCH);
  if (p == NULL || r == NULL) return;
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK_RC(tsock_reader_detach(r), TSOCK_EHANDLE);
  const tsock_batch_t *b = NULL;
  CHECK_RC(tsock_reader_acquire(r, &b, 0), TSOCK_EHANDLE);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
  CHECK_RC(tsock_producer_close(p), TSOCK_EHANDLE);
  void *buf = NULL;
  CHECK_RC(tsock_producer_reserve(p, 1, 0, &buf), TSOCK_EHANDLE);
  CHECK_RC(tsock_producer_publish(p, NULL, 0, NULL, 0), TSOCK_EHANDLE);
  CHECK_RC(tsock_producer_end_epoch(p, 0), TSOCK_EHANDLE);
  CHECK_RC(tsock_producer_abort(p), TSOCK_EHANDLE);
  CHECK_RC(tsock_producer_wait_readers(p, 0, 0), TSOCK_EHANDLE);
  tsock_producer_stats_t st = {.size = sizeof st};
  CHECK_RC(tsock_producer_stats(p, &st), TSOCK_EHANDLE);
  /* Made-up handles are refused, never dereferenced. */
  CHECK_RC(tsock_producer_close((tsock_producer_t *)(uintptr_t)0xdeadbeef0), TSOCK_EHANDLE);
  CHECK_RC(tsock_reader_acquire((tsock_reader_t *)(uintptr_t)0xdeadbeef0, &b, 0), TSOCK_EHANDLE);
  CHECK_RC(tsock_reader_detach((tsock_reader_t *)(uintptr_t)0x80003), TSOCK_EHANDLE);
}

static void test_bad_options(void) {
  const char *name = test_name("tapi", "opts");
  tsock_producer_options_t po;
  tsock_producer_t *p = NULL;
  tsock_producer_options_init(&po);
  po.size = 4;
  CHECK_RC(tsock_producer_create(name, &po, &p), TSOCK_EINVAL);
  tsock_producer_options_init(&po);
  po.slot_count = 3;
  CHECK_RC(tsock_producer_create(name, &po, &p), TSOCK_EINVAL);
  tsock_producer_options_init(&po);
  po.max_readers = 2000;
  CHECK_RC(tsock_producer_create(name, &po, &p), TSOCK_EINVAL);
  tsock_producer_options_init(&po);
  po.mode = 01777;
  CHECK_RC(tsock_producer_create(name, &po, &p), TSOCK_EINVAL);
  CHECK(p == NULL);

  p = make_producer(name, 4, 4096);
  tsock_reader_options_t ro;
  tsock_reader_t *r = NULL;
  tsock_reader_options_init(&ro);
  ro.size = sizeof ro + 8;
  CHECK_RC(tsock_reader_attach(name, &ro, &r), TSOCK_EINVAL);
  tsock_reader_options_init(&ro);
  ro.max_held = 0;
  CHECK_RC(tsock_reader_attach(name, &ro, &r), TSOCK_EINVAL);
  ro.max_held = TSOCK_MAX_HELD + 1; /* the public bound is the one applied */
  CHECK_RC(tsock_reader_attach(name, &ro, &r), TSOCK_EINVAL);
  char why[64];
  snprintf(why, sizeof why, "max_held %d outside 1..%d", TSOCK_MAX_HELD + 1, TSOCK_MAX_HELD);
  CHECK(strstr(tsock_last_error(), why) != NULL);
  tsock_reader_options_init(&ro);
  ro.start = 7;
  CHECK_RC(tsock_reader_attach(name, &ro, &r), TSOCK_EINVAL);
  tsock_reader_options_init(&ro);
  ro.reserved = 1;
  CHECK_RC(tsock_reader_attach(name, &ro, &r), TSOCK_EINVAL);
  CHECK(r == NULL);
  if (p != NULL) {
    tsock_producer_stats_t st;
    st.size = 8;
    CHECK_RC(tsock_producer_stats(p, &st), TSOCK_EINVAL);
    CHECK_RC(tsock_producer_close(p), TSOCK_OK);
  }
}

static void test_producer_errors(void) {
  const char *name = test_name("tapi", "perr");
  tsock_producer_t *p = make_producer(name, 4, 4096);
  if (p == NULL) return;
  tsock_producer_t *p2 = NULL;
  CHECK_RC(tsock_producer_create(name, NULL, &p2), TSOCK_EEXIST);
  CHECK(p2 == NULL);

  void *buf = NULL;
  tsock_tensor_t t;
  const int64_t shape[1] = {16};
  CHECK_RC(tsock_tensor_init(&t, TSOCK_DTYPE_FLOAT32, 1, shape, 0), TSOCK_OK);
  CHECK_RC(tsock_producer_publish(p, &t, 1, NULL, 0), TSOCK_ESTATE); /* nothing reserved */
  CHECK_RC(tsock_producer_abort(p), TSOCK_ESTATE);
  CHECK_RC(tsock_producer_reserve(p, 4097, 0, &buf), TSOCK_ETOOBIG);
  CHECK(buf == NULL);
  CHECK_RC(tsock_producer_reserve(p, 64, 0, &buf), TSOCK_OK);
  CHECK_RC(tsock_producer_reserve(p, 64, 0, &buf), TSOCK_ESTATE); /* reserved twice */
  CHECK_RC(tsock_producer_end_epoch(p, 0), TSOCK_ESTATE);        /* while reserved */

  tsock_tensor_t bad = t;
  bad.dtype = 99;
  CHECK_RC(tsock_producer_publish(p, &bad, 1, NULL, 0), TSOCK_EDTYPE);
  bad = t;
  bad.ndim = 9;
  CHECK_RC(tsock_producer_publish(p, &bad, 1, NULL, 0), TSOCK_EDTYPE);
  bad = t;
  bad.ndim = -1;
  CHECK_RC(tsock_producer_publish(p, &bad, 1, NULL, 0), TSOCK_EDTYPE);
  bad = t;
  bad.offset = 2; /* not a multiple of 4 */
  CHECK_RC(tsock_producer_publish(p, &bad, 1, NULL, 0), TSOCK_EDTYPE);
  bad = t;
  bad.strides[0] = -1;
  CHECK_RC(tsock_producer_publish(p, &bad, 1, NULL, 0), TSOCK_EDTYPE);
  const int64_t big[1] = {17}; /* 68 bytes, 64 reserved */
  CHECK_RC(tsock_tensor_init(&bad, TSOCK_DTYPE_FLOAT32, 1, big, 0), TSOCK_OK);
  CHECK_RC(tsock_producer_publish(p, &bad, 1, NULL, 0), TSOCK_ETOOBIG);
  CHECK_RC(tsock_tensor_init(&bad, TSOCK_DTYPE_FLOAT32, 1, shape, 8), TSOCK_OK); /* [8, 72) */
  CHECK_RC(tsock_producer_publish(p, &bad, 1, NULL, 0), TSOCK_ETOOBIG);
  bad = t;
  bad.strides[0] = 2; /* elements up to byte 124 */
  CHECK_RC(tsock_producer_publish(p, &bad, 1, NULL, 0), TSOCK_ETOOBIG);
  tsock_tensor_t many[TSOCK_MAX_TENSORS + 1];
  for (int i = 0; i <= TSOCK_MAX_TENSORS; i++) many[i] = t;
  CHECK_RC(tsock_producer_publish(p, many, TSOCK_MAX_TENSORS + 1, NULL, 0), TSOCK_ETOOBIG);
  uint8_t meta[TSOCK_META_MAX + 1] = {0};
  CHECK_RC(tsock_producer_publish(p, &t, 1, meta, TSOCK_META_MAX + 1), TSOCK_ETOOBIG);
  /* The reservation survived every failed publish. */
  CHECK_RC(tsock_producer_publish(p, many, TSOCK_MAX_TENSORS, meta, TSOCK_META_MAX), TSOCK_OK);
  CHECK_RC(tsock_producer_reserve(p, 64, 0, &buf), TSOCK_OK);
  CHECK_RC(tsock_producer_abort(p), TSOCK_OK);
  CHECK_RC(tsock_producer_abort(p), TSOCK_ESTATE);

  /* tsock_tensor_init's own checks */
  CHECK_RC(tsock_tensor_init(&bad, 0, 1, shape, 0), TSOCK_EDTYPE);
  CHECK_RC(tsock_tensor_init(&bad, 14, 1, shape, 0), TSOCK_EDTYPE);
  const int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  CHECK_RC(tsock_tensor_init(&bad, TSOCK_DTYPE_INT8, 9, nine, 0), TSOCK_EDTYPE);
  const int64_t neg[2] = {2, -1};
  CHECK_RC(tsock_tensor_init(&bad, TSOCK_DTYPE_INT8, 2, neg, 0), TSOCK_EDTYPE);
  CHECK(tsock_dtype_size(0) == 0 && tsock_dtype_size(14) == 0);

  CHECK_RC(tsock_producer_wait_readers(p, 1, 10 * MS), TSOCK_ETIMEDOUT);
  tsock_producer_stats_t st = {.size = sizeof st};
  CHECK_RC(tsock_producer_stats(p, &st), TSOCK_OK);
  CHECK(st.published == 1 && st.readers == 0 && st.epoch == 0);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

static void test_attach_missing(void) {
  const char *name = test_name("tapi", "missing");
  tsock_reader_t *r = NULL;
  CHECK_RC(tsock_reader_attach(name, NULL, &r), TSOCK_ENOENT);
  CHECK(strstr(tsock_last_error(), name) != NULL);
  tsock_reader_options_t o;
  tsock_reader_options_init(&o);
  o.attach_timeout_ns = 50 * MS;
  int64_t t0 = test_now_ns();
  CHECK_RC(tsock_reader_attach(name, &o, &r), TSOCK_ENOENT);
  int64_t waited = test_now_ns() - t0;
  /* The bound tells the 50 ms honoured from a wait without limit (or one
   * taken for seconds); 10 s leaves room for a starved test thread. */
  CHECK(waited >= 50 * MS && waited < 10000 * MS);
  CHECK(r == NULL);
}

static void *create_later(void *arg) {
  struct timespec ts = {0, 30 * MS};
  nanosleep(&ts, NULL);
  tsock_producer_t *p = NULL;
  tsock_producer_create((const char *)arg, NULL, &p);
  return p;
}

static void test_attach_timeout_waits(void) {
  const char *name = test_name("tapi", "later");
  pthread_t th;
  CHECK(pthread_create(&th, NULL, create_later, (void *)name) == 0);
  tsock_reader_options_t o;
  tsock_reader_options_init(&o);
  o.attach_timeout_ns = 5000 * MS;
  tsock_reader_t *r = NULL;
  CHECK_RC(tsock_reader_attach(name, &o, &r), TSOCK_OK);
  void *p = NULL;
  pthread_join(th, &p);
  CHECK(p != NULL);
  if (r != NULL) CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  if (p != NULL) CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

/* One batch with a tensor of every dtype, plus a strided, a scalar and an
 * empty tensor, read back and compared byte for byte. */
static void test_roundtrip_dtypes(void) {
  const char *name = test_name("tapi", "dtypes");
  tsock_producer_t *p = make_producer(name, 4, 8192);
  tsock_reader_t *r = make_reader(name, TSOCK_START_NEXT_EPOCH);
  if (p == NULL || r == NULL) return;
  enum { NT = 16, STRIDE = 128, N = 4 };
  uint8_t *buf = NULL;
  CHECK_RC(tsock_producer_reserve(p, NT * STRIDE, 0, (void **)&buf), TSOCK_OK);
  if (buf == NULL) return;
  tsock_tensor_t t[NT];
  const int64_t shape[1] = {N};
  for (int d = TSOCK_DTYPE_BOOL; d <= TSOCK_DTYPE_FLOAT64; d++) {
    int k = d - 1;
    size_t item = tsock_dtype_size(d);
    CHECK(item == (d == 1 || d == 2 || d == 6 ? 1 : d == 3 || d == 7 || d == 10 || d == 11 ? 2
                   : d == 4 || d == 8 || d == 12                                   ? 4
                                                                                   : 8));
    CHECK_RC(tsock_tensor_init(&t[k], d, 1, shape, (uint64_t)k * STRIDE), TSOCK_OK);
    CHECK(t[k].nbytes == N * item && t[k].strides[0] == 1);
    uint8_t *dst = buf + k * STRIDE;
    switch (d) {
    case TSOCK_DTYPE_BOOL: { const uint8_t v[N] = {1, 0, 1, 1}; memcpy(dst, v, sizeof v); break; }
    case TSOCK_DTYPE_INT8: { const int8_t v[N] = {-128, -1, 0, 127}; memcpy(dst, v, sizeof v); break; }
    case TSOCK_DTYPE_INT16: { const int16_t v[N] = {-32768, -2, 3, 32767}; memcpy(dst, v, sizeof v); break; }
    case TSOCK_DTYPE_INT32: { const int32_t v[N] = {INT32_MIN, -3, 4, INT32_MAX}; memcpy(dst, v, sizeof v); break; }
    case TSOCK_DTYPE_INT64: { const int64_t v[N] = {INT64_MIN, -4, 5, INT64_MAX}; memcpy(dst, v, sizeof v); break; }
    case TSOCK_DTYPE_UINT8: { const uint8_t v[N] = {0, 1, 200, 255}; memcpy(dst, v, sizeof v); break; }
    case TSOCK_DTYPE_UINT16: { const uint16_t v[N] = {0, 2, 40000, 65535}; memcpy(dst, v, sizeof v); break; }
    case TSOCK_DTYPE_UINT32: { const uint32_t v[N] = {0, 3, 3000000000u, UINT32_MAX}; memcpy(dst, v, sizeof v); break; }
    case TSOCK_DTYPE_UINT64: { const uint64_t v[N] = {0, 4, 1ull << 63, UINT64_MAX}; memcpy(dst, v, sizeof v); break; }
    case TSOCK_DTYPE_FLOAT16: { const uint16_t v[N] = {0x3c00, 0xc000, 0x7bff, 0x0001}; memcpy(dst, v, sizeof v); break; }
    case TSOCK_DTYPE_BFLOAT16: { const uint16_t v[N] = {0x3f80, 0xc040, 0x7f7f, 0x0080}; memcpy(dst, v, sizeof v); break; }
    case TSOCK_DTYPE_FLOAT32: { const float v[N] = {1.5f, -2.25f, 3.0e38f, 1.0e-38f}; memcpy(dst, v, sizeof v); break; }
    case TSOCK_DTYPE_FLOAT64: { const double v[N] = {1.5, -2.25, 1.0e300, 5.0e-324}; memcpy(dst, v, sizeof v); break; }
    }
  }
  /* 13: int32 [3, 4] in column-major order (strides {1, 3}) */
  const int64_t s2[2] = {3, 4};
  CHECK_RC(tsock_tensor_init(&t[13], TSOCK_DTYPE_INT32, 2, s2, 13 * STRIDE), TSOCK_OK);
  CHECK(t[13].strides[0] == 4 && t[13].strides[1] == 1 && t[13].nbytes == 48);
  t[13].strides[0] = 1;
  t[13].strides[1] = 3;
  for (int32_t i = 0; i < 12; i++) memcpy(buf + 13 * STRIDE + 4 * i, &i, 4);
  /* 14: a scalar; 15: an empty tensor */
  CHECK_RC(tsock_tensor_init(&t[14], TSOCK_DTYPE_FLOAT64, 0, NULL, 14 * STRIDE), TSOCK_OK);
  CHECK(t[14].nbytes == 8);
  const double pi = 3.14159;
  memcpy(buf + 14 * STRIDE, &pi, 8);
  const int64_t s0[2] = {5, 0};
  CHECK_RC(tsock_tensor_init(&t[15], TSOCK_DTYPE_INT16, 2, s0, 15 * STRIDE), TSOCK_OK);
  CHECK(t[15].nbytes == 0);
  const char meta[] = "every dtype";
  CHECK_RC(tsock_producer_publish(p, t, NT, meta, sizeof meta), TSOCK_OK);

  const tsock_batch_t *b = NULL;
  CHECK_RC(tsock_reader_acquire(r, &b, 1000 * MS), TSOCK_OK);
  if (b == NULL) return;
  CHECK(b->seq == 0 && b->epoch == 0 && b->index == 0 && b->flags == 0);
  CHECK(b->publish_ns > 0);
  CHECK(b->meta_len == sizeof meta && memcmp(b->meta, meta, sizeof meta) == 0);
  CHECK(b->n_tensors == NT);
  const void *base = NULL;
  uint64_t len = 0;
  CHECK_RC(tsock_reader_payload_range(r, &base, &len), TSOCK_OK);
  for (int k = 0; k < NT && k < (int)b->n_tensors; k++) {
    const tsock_tensor_t *g = &b->tensors[k];
    CHECK(g->dtype == t[k].dtype && g->ndim == t[k].ndim);
    CHECK(g->offset == t[k].offset && g->nbytes == t[k].nbytes);
    for (int i = 0; i < t[k].ndim; i++) CHECK(g->shape[i] == t[k].shape[i] && g->strides[i] == t[k].strides[i]);
    const uint8_t *data = g->data;
    CHECK(data >= (const uint8_t *)base && data + g->nbytes <= (const uint8_t *)base + len);
    if (k < 15) CHECK(memcmp(data, buf + k * STRIDE, g->nbytes) == 0); /* same shared memory, read back */
  }
  const int32_t *m = b->tensors[13].data; /* element (i, j) at i*1 + j*3 */
  CHECK(m[2 * 1 + 3 * 3] == 11);
  double scalar;
  memcpy(&scalar, b->tensors[14].data, 8);
  CHECK(scalar == pi);
  float f[N];
  memcpy(f, b->tensors[TSOCK_DTYPE_FLOAT32 - 1].data, sizeof f);
  CHECK(f[0] == 1.5f && f[1] == -2.25f && f[2] == 3.0e38f);
  int64_t i64[N];
  memcpy(i64, b->tensors[TSOCK_DTYPE_INT64 - 1].data, sizeof i64);
  CHECK(i64[0] == INT64_MIN && i64[3] == INT64_MAX);
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

static void test_epochs_and_close(void) {
  const char *name = test_name("tapi", "epochs");
  tsock_producer_t *p = make_producer(name, 16, 4096);
  tsock_reader_t *r = make_reader(name, TSOCK_START_NEXT_EPOCH);
  if (p == NULL || r == NULL) return;
  for (uint32_t i = 0; i < 3; i++) publish_value(p, i);
  CHECK_RC(tsock_producer_end_epoch(p, 0), TSOCK_OK);
  for (uint32_t i = 0; i < 2; i++) publish_value(p, 10 + i);
  CHECK_RC(tsock_producer_end_epoch(p, 0), TSOCK_OK);
  CHECK_RC(tsock_producer_end_epoch(p, 0), TSOCK_OK); /* an empty epoch */
  publish_value(p, 20);
  tsock_producer_stats_t st = {.size = sizeof st};
  CHECK_RC(tsock_producer_stats(p, &st), TSOCK_OK);
  CHECK(st.published == 9 && st.epoch == 3 && st.readers == 1);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);

  /* expected: epoch, index, marker?, value */
  const struct { uint64_t epoch, index; int marker; uint32_t value; } want[] = {
      {0, 0, 0, 0}, {0, 1, 0, 1}, {0, 2, 0, 2}, {0, 3, 1, 0},  {1, 0, 0, 10},
      {1, 1, 0, 11}, {1, 2, 1, 0}, {2, 0, 1, 0}, {3, 0, 0, 20},
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const tsock_batch_t *b = NULL;
    CHECK_RC(tsock_reader_acquire(r, &b, 1000 * MS), TSOCK_OK);
    if (b == NULL) return;
    CHECK(b->seq == i && b->epoch == want[i].epoch && b->index == want[i].index);
    if (want[i].marker) {
      CHECK(b->flags == TSOCK_BATCH_EPOCH_END && b->n_tensors == 0);
    } else {
      CHECK(b->flags == 0 && batch_value(b) == want[i].value);
    }
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  }
  /* Drained and closed: TSOCK_ECLOSED at once and on every later call. */
  const tsock_batch_t *b = NULL;
  int64_t t0 = test_now_ns();
  /* "At once" against a 30 s timeout: a reader that waited for it would
   * return TSOCK_EAGAIN after 30 s; 10 s leaves room for a starved thread. */
  CHECK_RC(tsock_reader_acquire(r, &b, 30000 * MS), TSOCK_ECLOSED);
  CHECK(test_now_ns() - t0 < 10000 * MS);
  CHECK_RC(tsock_reader_acquire(r, &b, 0), TSOCK_ECLOSED);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  /* The name is gone with the producer, and free for a new one. */
  CHECK_RC(tsock_reader_attach(name, NULL, &r), TSOCK_ENOENT);
  p = make_producer(name, 4, 4096);
  if (p != NULL) CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

static void test_backpressure(void) {
  const char *name = test_name("tapi", "bp");
  tsock_producer_t *p = make_producer(name, 4, 4096);
  tsock_reader_t *r = make_reader(name, TSOCK_START_NEXT_EPOCH);
  if (p == NULL || r == NULL) return;
  for (uint32_t i = 0; i < 4; i++) publish_value(p, i);
  const tsock_batch_t *held[4] = {0};
  for (int i = 0; i < 4; i++) CHECK_RC(tsock_reader_acquire(r, &held[i], 1000 * MS), TSOCK_OK);
  const tsock_batch_t *b = NULL;
  CHECK_RC(tsock_reader_acquire(r, &b, 0), TSOCK_ESTATE); /* max_held (4) batches held */

  void *buf = NULL;
  CHECK_RC(tsock_producer_reserve(p, 4, 0, &buf), TSOCK_EBACKPRESSURE);
  int64_t t0 = test_now_ns();
  CHECK_RC(tsock_producer_reserve(p, 4, 20 * MS, &buf), TSOCK_ETIMEDOUT);
  int64_t waited = test_now_ns() - t0;
  /* The 20 ms honoured, not a wait without limit (or one taken for
   * seconds); 10 s leaves room for a starved test thread. */
  CHECK(waited >= 20 * MS && waited < 10000 * MS);
  CHECK_RC(tsock_producer_end_epoch(p, 0), TSOCK_EBACKPRESSURE);
  CHECK(buf == NULL);

  if (held[0] == NULL || held[3] == NULL) return;
  CHECK(batch_value(held[0]) == 0 && batch_value(held[3]) == 3);
  CHECK_RC(tsock_reader_release(r, held[0]), TSOCK_OK); /* frees exactly one slot */
  CHECK_RC(tsock_producer_reserve(p, 4, 0, &buf), TSOCK_OK);
  CHECK_RC(tsock_producer_abort(p), TSOCK_OK);
  publish_value(p, 4);
  CHECK_RC(tsock_producer_reserve(p, 4, 0, &buf), TSOCK_EBACKPRESSURE);
  CHECK_RC(tsock_reader_release(r, held[3]), TSOCK_OK); /* releases 1..3 too */
  CHECK_RC(tsock_reader_release(r, held[2]), TSOCK_ESTATE);
  for (uint32_t i = 5; i < 8; i++) publish_value(p, i);
  tsock_producer_stats_t st = {.size = sizeof st};
  CHECK_RC(tsock_producer_stats(p, &st), TSOCK_OK);
  CHECK(st.published == 8 && st.backpressure_ns >= 20 * MS);

  /* A reader that detaches no longer holds the producer back. */
  CHECK_RC(tsock_producer_reserve(p, 4, 0, &buf), TSOCK_EBACKPRESSURE);
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK_RC(tsock_producer_reserve(p, 4, 0, &buf), TSOCK_OK);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

/* max_held larger than the ring (issue 17, item 2): the default max_held of
 * 4 on a 2-slot ring let a reader wait in acquire for a batch the producer
 * could never publish (it held the whole ring), stalling everyone. The
 * reader clamps max_held to the slot count: holding the whole ring, acquire
 * says so at once (TSOCK_ESTATE) instead of waiting for ever. */
static void test_max_held_clamped(void) {
  const uint32_t asked[] = {4 /* the default */, 64};
  for (int k = 0; k < 2; k++) {
    const char *name = test_name("tapi", k == 0 ? "held4" : "held64");
    tsock_producer_t *p = make_producer(name, 2, 4096);
    tsock_reader_options_t o;
    tsock_reader_options_init(&o);
    o.max_held = asked[k];
    tsock_reader_t *r = NULL;
    CHECK_RC(tsock_reader_attach(name, &o, &r), TSOCK_OK);
    if (p == NULL || r == NULL) return;
    publish_value(p, 0);
    publish_value(p, 1);
    const tsock_batch_t *b0 = NULL, *b1 = NULL, *b2 = NULL;
    CHECK_RC(tsock_reader_acquire(r, &b0, 1000 * MS), TSOCK_OK);
    CHECK_RC(tsock_reader_acquire(r, &b1, 1000 * MS), TSOCK_OK);
    /* The reader holds both slots: batch 2 cannot come until it releases. */
    void *buf = NULL;
    CHECK_RC(tsock_producer_reserve(p, 4, 0, &buf), TSOCK_EBACKPRESSURE);
    int64_t t0 = test_now_ns();
    /* Refused, not waited for: a reader that waited would return
     * TSOCK_EAGAIN after the 30 s; 10 s leaves room for a starved thread. */
    CHECK_RC(tsock_reader_acquire(r, &b2, 30000 * MS), TSOCK_ESTATE);
    CHECK(test_now_ns() - t0 < 10000 * MS);
    CHECK(strstr(tsock_last_error(), "2 slots") != NULL);
    if (b1 != NULL) CHECK_RC(tsock_reader_release(r, b1), TSOCK_OK);
    publish_value(p, 2); /* the ring moves again */
    CHECK_RC(tsock_reader_acquire(r, &b2, 1000 * MS), TSOCK_OK);
    CHECK(b2 != NULL && batch_value(b2) == 2);
    CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
    CHECK_RC(tsock_producer_close(p), TSOCK_OK);
  }
}

static void test_late_join(void) {
  const char *name = test_name("tapi", "late");
  tsock_producer_t *p = make_producer(name, 16, 4096);
  if (p == NULL) return;
  for (uint32_t i = 0; i < 3; i++) publish_value(p, i); /* epoch 0, nobody reading */
  tsock_reader_t *next = make_reader(name, TSOCK_START_NEXT_EPOCH);
  tsock_reader_t *now = make_reader(name, TSOCK_START_NOW);
  if (next == NULL || now == NULL) return;
  const tsock_batch_t *b = NULL;
  CHECK_RC(tsock_reader_acquire(next, &b, 0), TSOCK_EAGAIN);
  CHECK_RC(tsock_reader_acquire(now, &b, 0), TSOCK_EAGAIN);
  CHECK_RC(tsock_reader_acquire(now, &b, 10 * MS), TSOCK_EAGAIN);
  for (uint32_t i = 3; i < 5; i++) publish_value(p, i);
  CHECK_RC(tsock_producer_end_epoch(p, 0), TSOCK_OK);
  publish_value(p, 100);

  b = NULL;
  CHECK_RC(tsock_reader_acquire(now, &b, 1000 * MS), TSOCK_OK);
  if (b != NULL) {
    CHECK(b->seq == 3 && b->epoch == 0 && b->index == 3 && batch_value(b) == 3);
    CHECK_RC(tsock_reader_release(now, b), TSOCK_OK);
  }
  b = NULL;
  CHECK_RC(tsock_reader_acquire(next, &b, 1000 * MS), TSOCK_OK);
  if (b != NULL) {
    CHECK(b->seq == 6 && b->epoch == 1 && b->index == 0 && b->flags == 0);
    CHECK(batch_value(b) == 100);
    CHECK_RC(tsock_reader_release(next, b), TSOCK_OK);
  }
  CHECK_RC(tsock_reader_detach(next), TSOCK_OK);
  CHECK_RC(tsock_reader_detach(now), TSOCK_OK);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

/* A reader attached before anything was published gets the first
 * publication whatever it is: a successor producer's stream can begin with
 * the end marker of an epoch whose batches its predecessor published. */
static void test_leading_marker(void) {
  const char *name = test_name("tapi", "lead");
  tsock_producer_t *p = make_producer(name, 16, 4096);
  if (p == NULL) return;
  tsock_reader_t *r = make_reader(name, TSOCK_START_NEXT_EPOCH);
  if (r == NULL) return;
  CHECK_RC(tsock_producer_end_epoch(p, 0), TSOCK_OK);
  publish_value(p, 7);
  const tsock_batch_t *b = NULL;
  CHECK_RC(tsock_reader_acquire(r, &b, 1000 * MS), TSOCK_OK);
  if (b != NULL) {
    CHECK(b->seq == 0 && (b->flags & TSOCK_BATCH_EPOCH_END));
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  }
  b = NULL;
  CHECK_RC(tsock_reader_acquire(r, &b, 1000 * MS), TSOCK_OK);
  if (b != NULL) {
    CHECK(b->seq == 1 && b->epoch == 1 && b->index == 0 && batch_value(b) == 7);
    CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  }
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

static void test_wait_readers(void) {
  const char *name = test_name("tapi", "wait");
  tsock_producer_t *p = make_producer(name, 4, 4096);
  if (p == NULL) return;
  tsock_reader_t *r1 = make_reader(name, TSOCK_START_NOW);
  tsock_reader_t *r2 = make_reader(name, TSOCK_START_NOW);
  CHECK_RC(tsock_producer_wait_readers(p, 2, 1000 * MS), TSOCK_OK);
  CHECK_RC(tsock_producer_wait_readers(p, 3, 10 * MS), TSOCK_ETIMEDOUT);
  if (r1 != NULL) CHECK_RC(tsock_reader_detach(r1), TSOCK_OK);
  tsock_producer_stats_t st = {.size = sizeof st};
  CHECK_RC(tsock_producer_stats(p, &st), TSOCK_OK);
  CHECK(st.readers == 1);
  if (r2 != NULL) CHECK_RC(tsock_reader_detach(r2), TSOCK_OK);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

/* Memory handed out past a batch's life (DLPack descriptors, pinned views)
 * stays mapped after detach: reading it gives bytes, never a fault. */
typedef struct {
  void *data;
  int32_t device_type, device_id, ndim;
  uint8_t code, bits;
  uint16_t lanes;
  int64_t *shape, *strides;
  uint64_t byte_offset;
} dl_tensor_view;
typedef struct dl_versioned_view {
  uint32_t major, minor;
  void *ctx;
  void (*deleter)(struct dl_versioned_view *);
  uint64_t flags;
  dl_tensor_view t;
} dl_versioned_view;

static void test_mapping_outlives_detach(void) {
  const char *name = test_name("api-pin", "");
  tsock_producer_t *p = make_producer(name, 4, 4096);
  tsock_reader_t *r = make_reader(name, TSOCK_START_NOW);
  publish_value(p, 0xC0FFEEu);
  const tsock_batch_t *b = NULL;
  CHECK_RC(tsock_reader_acquire(r, &b, 1000 * MS), TSOCK_OK);
  if (b == NULL) return;
  void *dl = NULL, *pin = NULL;
  CHECK_RC(tsock_batch_dlpack(b, 0, 1, &dl), TSOCK_OK);
  CHECK_RC(tsock_batch_dlpack(b, 1, 1, &dl), TSOCK_EINVAL); /* no tensor 1; dl untouched */
  CHECK_RC(tsock_reader_pin_mapping(r, &pin), TSOCK_OK);
  dl_versioned_view *v = dl;
  CHECK(v != NULL && v->major == 1 && (v->flags & 1u) && v->t.device_type == 1 && v->t.ndim == 1 &&
        v->t.shape[0] == 1 && v->t.code == 1 && v->t.bits == 32);
  const uint32_t *data = v ? v->t.data : NULL;
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK(data != NULL && *data == 0xC0FFEEu); /* still mapped after detach */
  if (v) v->deleter(v);
  CHECK(*data == 0xC0FFEEu); /* still pinned */
  tsock_mapping_unpin(pin);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

/* A legacy DLManagedTensor: the DLTensor first, then context and deleter. */
typedef struct dl_legacy_view {
  dl_tensor_view t;
  void *ctx;
  void (*deleter)(struct dl_legacy_view *);
} dl_legacy_view;

enum { KDL_INT = 0, KDL_UINT = 1, KDL_BOOL = 6 };

/* Publishes the batch test_dlpack_export reads: tensor 0 int16 [5, 2] with
 * a row stride of 3 (rows are 6 bytes apart, one element unused each),
 * element (r, c) = 10 r + c; tensor 1 bool [4] = 1, 0, 1, 1; tensor 2 a
 * 0-d float32 = 2.5. */
static void publish_dlpack_batch(tsock_producer_t *p) {
  uint8_t *buf = NULL;
  CHECK_RC(tsock_producer_reserve(p, 64, 1000 * MS, (void **)&buf), TSOCK_OK);
  if (buf == NULL) return;
  int16_t rows[5][3];
  for (int r = 0; r < 5; r++)
    for (int c = 0; c < 3; c++) rows[r][c] = (int16_t)(c < 2 ? 10 * r + c : -1);
  memcpy(buf, rows, sizeof rows); /* 30 bytes at 0 */
  const uint8_t flags[4] = {1, 0, 1, 1};
  memcpy(buf + 32, flags, 4);
  const float scalar = 2.5f;
  memcpy(buf + 36, &scalar, 4);
  tsock_tensor_t t[3];
  const int64_t shape0[2] = {5, 2}, shape1[1] = {4};
  CHECK_RC(tsock_tensor_init(&t[0], TSOCK_DTYPE_INT16, 2, shape0, 0), TSOCK_OK);
  t[0].strides[0] = 3;
  t[0].nbytes = sizeof rows;
  CHECK_RC(tsock_tensor_init(&t[1], TSOCK_DTYPE_BOOL, 1, shape1, 32), TSOCK_OK);
  CHECK_RC(tsock_tensor_init(&t[2], TSOCK_DTYPE_FLOAT32, 0, NULL, 36), TSOCK_OK);
  CHECK_RC(tsock_producer_publish(p, t, 3, NULL, 0), TSOCK_OK);
}

/* tsock_batch_dlpack_export (issue 11, item 4: the DLPack layout lives in
 * C alone): rows narrow the first dimension in place by its stride, bool
 * can be described as uint8, versioned and legacy structs, and every bad
 * input is refused with a message, writing nothing and counting nothing. */
static void test_dlpack_export(void) {
  const char *name = test_name("tapi", "dlexport");
  tsock_producer_t *p = make_producer(name, 4, 4096);
  tsock_reader_t *r = make_reader(name, TSOCK_START_NOW);
  if (p == NULL || r == NULL) return;
  publish_dlpack_batch(p);
  const tsock_batch_t *b = NULL;
  CHECK_RC(tsock_reader_acquire(r, &b, 1000 * MS), TSOCK_OK);
  CHECK(b != NULL && b->n_tensors == 3);
  if (b == NULL || b->n_tensors != 3) return;
  const uint8_t *base = b->tensors[0].data;
  const uint32_t *live = b->dlpack_live;

  /* The whole tensor, legacy, as tsock_batch_dlpack describes it. */
  dl_legacy_view *lg = NULL;
  CHECK_RC(tsock_batch_dlpack_export(b, 0, 0, 0, 0, (void **)&lg), TSOCK_OK);
  if (lg != NULL) {
    CHECK(lg->t.data == base && lg->t.device_type == 1 && lg->t.ndim == 2);
    CHECK(lg->t.code == KDL_INT && lg->t.bits == 16 && lg->t.lanes == 1);
    CHECK(lg->t.shape[0] == 5 && lg->t.shape[1] == 2 && lg->t.strides[0] == 3 && lg->t.strides[1] == 1);
    CHECK(lg->deleter != NULL && live[0] == 1 && live[TSOCK_MAX_TENSORS] == 1);
    CHECK_RC(tsock_dlpack_delete(lg, 0), TSOCK_OK);
    CHECK(live[0] == 0 && live[TSOCK_MAX_TENSORS] == 0);
  }

  /* Rows [1, 4), versioned: shape[0] 3, data at row 1 (one row stride, 3
   * elements of 2 bytes, on), the rest unchanged. */
  dl_versioned_view *v = NULL;
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_VERSIONED | TSOCK_DLPACK_ROWS, 1, 4,
                                     (void **)&v),
           TSOCK_OK);
  if (v != NULL) {
    CHECK(v->major == 1 && v->minor == 0 && (v->flags & 1u) && v->deleter != NULL);
    CHECK(v->t.data == base + 6 && v->t.ndim == 2 && v->t.shape[0] == 3 && v->t.shape[1] == 2);
    CHECK(v->t.strides[0] == 3 && v->t.strides[1] == 1 && v->t.code == KDL_INT && v->t.bits == 16);
    const int16_t *row = v->t.data;
    CHECK(row[0] == 10 && row[1] == 11 && row[2 * 3] == 30 && row[2 * 3 + 1] == 31);
    CHECK(live[0] == 1);
    CHECK_RC(tsock_dlpack_delete(v, 1), TSOCK_OK);
    CHECK(live[0] == 0);
  }
  /* The last row alone, and an empty range (its address stays). */
  v = NULL;
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_VERSIONED | TSOCK_DLPACK_ROWS, 4, 5,
                                     (void **)&v),
           TSOCK_OK);
  if (v != NULL) {
    CHECK(v->t.data == base + 24 && v->t.shape[0] == 1 && *(const int16_t *)v->t.data == 40);
    tsock_dlpack_delete(v, 1);
  }
  lg = NULL;
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_ROWS, 5, 5, (void **)&lg), TSOCK_OK);
  if (lg != NULL) {
    CHECK(lg->t.data == base && lg->t.shape[0] == 0 && lg->t.shape[1] == 2);
    tsock_dlpack_delete(lg, 0);
  }

  /* Booleans: kDLBool, or kDLUInt 8 bits when asked; other dtypes keep theirs. */
  lg = NULL;
  CHECK_RC(tsock_batch_dlpack_export(b, 1, 0, 0, 0, (void **)&lg), TSOCK_OK);
  if (lg != NULL) {
    CHECK(lg->t.code == KDL_BOOL && lg->t.bits == 8 && lg->t.shape[0] == 4);
    tsock_dlpack_delete(lg, 0);
  }
  v = NULL;
  CHECK_RC(tsock_batch_dlpack_export(b, 1, TSOCK_DLPACK_VERSIONED | TSOCK_DLPACK_BOOL_AS_UINT8 |
                                               TSOCK_DLPACK_ROWS,
                                     2, 4, (void **)&v),
           TSOCK_OK);
  if (v != NULL) {
    CHECK(v->t.code == KDL_UINT && v->t.bits == 8 && v->t.lanes == 1 && v->t.shape[0] == 2);
    CHECK(v->t.data == (const uint8_t *)b->tensors[1].data + 2);
    tsock_dlpack_delete(v, 1);
  }
  lg = NULL;
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_BOOL_AS_UINT8, 0, 0, (void **)&lg), TSOCK_OK);
  if (lg != NULL) {
    CHECK(lg->t.code == KDL_INT && lg->t.bits == 16);
    tsock_dlpack_delete(lg, 0);
  }
  lg = NULL;
  CHECK_RC(tsock_batch_dlpack_export(b, 2, 0, 0, 0, (void **)&lg), TSOCK_OK); /* 0-d, whole */
  if (lg != NULL) {
    CHECK(lg->t.ndim == 0 && *(const float *)lg->t.data == 2.5f);
    tsock_dlpack_delete(lg, 0);
  }

  /* Refusals: nothing written to out, no descriptor counted. */
  void *untouched = (void *)&untouched, *out = untouched;
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_ROWS, 0, 6, &out), TSOCK_EINVAL);
  CHECK(strstr(tsock_last_error(), "rows [0, 6) of tensor 0, which has 5") != NULL);
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_ROWS, -1, 2, &out), TSOCK_EINVAL);
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_ROWS, 3, 2, &out), TSOCK_EINVAL);
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_ROWS, 6, 6, &out), TSOCK_EINVAL);
  CHECK_RC(tsock_batch_dlpack_export(b, 2, TSOCK_DLPACK_ROWS, 0, 0, &out), TSOCK_EINVAL);
  CHECK(strstr(tsock_last_error(), "rows of tensor 2, which has no dimensions") != NULL);
  CHECK_RC(tsock_batch_dlpack_export(b, 0, 0, 1, 4, &out), TSOCK_EINVAL); /* rows, no flag */
  CHECK(strstr(tsock_last_error(), "without TSOCK_DLPACK_ROWS") != NULL);
  CHECK_RC(tsock_batch_dlpack_export(b, 0, 0x10, 0, 0, &out), TSOCK_EINVAL);
  CHECK(strstr(tsock_last_error(), "unknown flags 0x10") != NULL);
  CHECK_RC(tsock_batch_dlpack_export(b, 0, 0x80000001u, 0, 0, &out), TSOCK_EINVAL);
  CHECK_RC(tsock_batch_dlpack_export(b, 3, 0, 0, 0, &out), TSOCK_EINVAL); /* no tensor 3 */
  CHECK_RC(tsock_batch_dlpack_export(NULL, 0, 0, 0, 0, &out), TSOCK_EINVAL);
  CHECK_RC(tsock_batch_dlpack_export(b, 0, 0, 0, 0, NULL), TSOCK_EINVAL);
  /* The device copy of a reader without the device path. */
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_DEVICE, 0, 0, &out), TSOCK_ENODEVICE);
  CHECK(out == untouched);
  CHECK(live[0] == 0 && live[1] == 0 && live[2] == 0 && live[TSOCK_MAX_TENSORS] == 0);
  CHECK_RC(tsock_dlpack_delete(NULL, 0), TSOCK_EINVAL);

  /* A deleter runs whenever a binding's garbage collector frees a capsule,
   * possibly between a failing call and its caller's read of the message:
   * it leaves the message alone (it erased it, review 25). */
  lg = NULL;
  CHECK_RC(tsock_batch_dlpack_export(b, 0, 0, 0, 0, (void **)&lg), TSOCK_OK);
  CHECK_RC(tsock_batch_dlpack_export(b, 3, 0, 0, 0, &out), TSOCK_EINVAL);
  if (lg != NULL) CHECK_RC(tsock_dlpack_delete(lg, 0), TSOCK_OK);
  CHECK(strstr(tsock_last_error(), "tensor 3") != NULL);

  /* A descriptor handed back as the other kind, or one tsock did not make,
   * is refused and left alone: its deleter word is not the one the caller
   * named (each jumped through a word of the tensor, review 25 L3). */
  lg = NULL;
  v = NULL;
  CHECK_RC(tsock_batch_dlpack_export(b, 0, 0, 0, 0, (void **)&lg), TSOCK_OK);
  CHECK_RC(tsock_batch_dlpack_export(b, 0, TSOCK_DLPACK_VERSIONED, 0, 0, (void **)&v), TSOCK_OK);
  if (lg != NULL) CHECK_RC(tsock_dlpack_delete(lg, 1), TSOCK_EINVAL);
  if (v != NULL) CHECK_RC(tsock_dlpack_delete(v, 0), TSOCK_EINVAL);
  CHECK(live[0] == 2);
  uint64_t foreign[10] = {0};
  CHECK_RC(tsock_dlpack_delete(foreign, 0), TSOCK_EINVAL);
  CHECK_RC(tsock_dlpack_delete(foreign, 1), TSOCK_EINVAL);
  if (lg != NULL) CHECK_RC(tsock_dlpack_delete(lg, 0), TSOCK_OK);
  if (v != NULL) CHECK_RC(tsock_dlpack_delete(v, 1), TSOCK_OK);
  CHECK(live[0] == 0 && live[TSOCK_MAX_TENSORS] == 0);

  /* After the release the producer may rewrite the slot: an export of the
   * released batch is refused (it succeeded, review 25 L4); a kept copy
   * exports. */
  const tsock_batch_t *kept = NULL;
  CHECK_RC(tsock_batch_keep(r, b, 1u, &kept), TSOCK_OK);
  CHECK_RC(tsock_reader_release(r, b), TSOCK_OK);
  out = untouched;
  CHECK_RC(tsock_batch_dlpack_export(b, 0, 0, 0, 0, &out), TSOCK_ESTATE);
  CHECK(strstr(tsock_last_error(), "is not held") != NULL && out == untouched);
  if (kept != NULL) {
    lg = NULL;
    CHECK_RC(tsock_batch_dlpack_export(kept, 0, 0, 0, 0, (void **)&lg), TSOCK_OK);
    if (lg != NULL) {
      CHECK(((const int16_t *)lg->t.data)[0] == 0 && lg->t.shape[0] == 5);
      CHECK_RC(tsock_dlpack_delete(lg, 0), TSOCK_OK);
    }
    CHECK_RC(tsock_batch_free(kept), TSOCK_OK);
  }
  CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

/* tsock_producer_peek: argument checks, then a channel's newest batches
 * read back (metadata and epoch marker) without attaching. */
static void test_peek(void) {
  const char *name = test_name("tapi", "peek");
  tsock_peek_t pk;
  memset(&pk, 0, sizeof pk);
  CHECK_RC(tsock_producer_peek(NULL, 0, &pk), TSOCK_ENAME);
  CHECK_RC(tsock_producer_peek(name, 0, NULL), TSOCK_EINVAL);
  CHECK_RC(tsock_producer_peek(name, 0, &pk), TSOCK_EINVAL); /* size not set */
  pk.size = sizeof pk;
  CHECK_RC(tsock_producer_peek(name, 0, &pk), TSOCK_ENOENT);
  tsock_producer_t *p = make_producer(name, 4, 4096);
  if (p == NULL) return;
  CHECK_RC(tsock_producer_peek(name, 0, &pk), TSOCK_EAGAIN); /* nothing published */
  void *buf = NULL;
  CHECK_RC(tsock_producer_reserve(p, 8, 0, &buf), TSOCK_OK);
  CHECK_RC(tsock_producer_publish(p, NULL, 0, "where", 5), TSOCK_OK);
  CHECK_RC(tsock_producer_end_epoch(p, 0), TSOCK_OK);
  CHECK_RC(tsock_producer_peek(name, 0, &pk), TSOCK_OK);
  CHECK(pk.published == 2 && pk.seq == 1 && (pk.flags & TSOCK_BATCH_EPOCH_END) && pk.producer_alive == 1);
  CHECK_RC(tsock_producer_peek(name, 1, &pk), TSOCK_OK);
  CHECK(pk.seq == 0 && pk.epoch == 0 && pk.index == 0 && pk.flags == 0);
  CHECK(pk.meta_len == 5 && memcmp(pk.meta, "where", 5) == 0);
  CHECK_RC(tsock_producer_peek(name, 2, &pk), TSOCK_EAGAIN);
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

/* Detach from one thread while another waits in acquire (an interpreter's
 * exit finalizers detach under a daemon thread reading): the waiting
 * acquire returns TSOCK_EHANDLE at once, detach returns once it has left
 * the reader, and nothing runs in freed or unmapped memory. */
struct waiter {
  tsock_reader_t *r;
  pid_t tid;
  int calling; /* set just before the call to acquire */
  int rc;
  int64_t returned_ns;
  char why[256]; /* its tsock_last_error(), which is per thread */
};

static void *acquire_forever(void *arg) {
  struct waiter *w = arg;
  const tsock_batch_t *b = NULL;
  w->tid = (pid_t)syscall(SYS_gettid);
  __atomic_store_n(&w->calling, 1, __ATOMIC_RELEASE);
  w->rc = tsock_reader_acquire(w->r, &b, -1);
  w->returned_ns = test_now_ns();
  snprintf(w->why, sizeof w->why, "%s", tsock_last_error());
  return NULL;
}

/* The scheduler state of one of this process's threads ('R', 'S', ...). */
static char thread_state(pid_t tid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/self/task/%d/stat", (int)tid);
  FILE *f = fopen(path, "r");
  if (f == NULL) return '?';
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* after "tid (comm" */
  return p != NULL && p[1] == ' ' ? p[2] : '?';
}

static int64_t clock_ns(clockid_t c) {
  struct timespec ts;
  if (clock_gettime(c, &ts) != 0) return -1;
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Waits, 10 s at most, until the waiter is inside acquire's wait (not
 * about to call it): asleep there (state S: nothing else after its flag
 * sleeps), or, when it only spins, having burnt 5 ms of CPU since it set
 * its flag (the way into the spin takes microseconds). Returns whether it
 * is. (A sleep here, as before, was too short for a starved waiter: it
 * then called acquire after the detach and got another error.) */
static int wait_inside_acquire(struct waiter *w, pthread_t th, int spinning) {
  const struct timespec ms = {0, 1 * MS};
  const int64_t end = test_now_ns() + 10000 * MS;
  while (!__atomic_load_n(&w->calling, __ATOMIC_ACQUIRE)) {
    if (test_now_ns() > end) return 0;
    nanosleep(&ms, NULL);
  }
  clockid_t cpu = CLOCK_MONOTONIC;
  int64_t cpu0 = 0;
  if (spinning) {
    if (pthread_getcpuclockid(th, &cpu) != 0 || (cpu0 = clock_ns(cpu)) < 0) return 0;
  }
  for (;;) {
    if (spinning ? clock_ns(cpu) - cpu0 >= 5 * MS : thread_state(w->tid) == 'S') return 1;
    if (test_now_ns() > end) return 0;
    nanosleep(&ms, NULL);
  }
}

static void test_detach_under_acquire(void) {
  const char *name = test_name("tapi", "detachwait");
  tsock_producer_t *p = make_producer(name, 4, 4096);
  if (p == NULL) return;
  for (int round = 0; round < 3; round++) {
    tsock_reader_options_t o;
    tsock_reader_options_init(&o);
    o.start = TSOCK_START_NOW;
    o.spin_ns = round == 2 ? INT64_MAX / 2 : 20000; /* round 2: spinning, never asleep */
    tsock_reader_t *r = NULL;
    CHECK_RC(tsock_reader_attach(name, &o, &r), TSOCK_OK);
    if (r == NULL) break;
    struct waiter w = {.r = r, .rc = 1};
    pthread_t th;
    if (pthread_create(&th, NULL, acquire_forever, &w) != 0) {
      CHECK(!"pthread_create");
      CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
      break;
    }
    /* The waiter is asleep in acquire (rounds 0-1) or spinning there
     * (round 2) when detach runs, so the checks below are about a waiter
     * inside the call, whatever the load. */
    CHECK(wait_inside_acquire(&w, th, round == 2));
    int64_t t0 = test_now_ns();
    CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
    int64_t detached = test_now_ns();
    pthread_join(th, NULL);
    CHECK(w.rc == TSOCK_EHANDLE && strstr(w.why, "detached by another thread") != NULL);
    CHECK(w.returned_ns <= detached);     /* detach waited for it */
    /* Woken (or its spin stopped) and waited for. A waiter left waiting
     * (timeout -1) never returns: detach then waits for ever, or returns
     * before it (the check above). The bound only turns a detach stuck
     * behind something slow into a failure; 10 s leaves room for a starved
     * waiter thread, which detach must wait for. */
    CHECK(detached - t0 < 10000 * MS);
    CHECK_RC(tsock_reader_detach(r), TSOCK_EHANDLE);
    const tsock_batch_t *b = NULL;
    CHECK_RC(tsock_reader_acquire(r, &b, 0), TSOCK_EHANDLE);
  }
  /* The readers' entries are free again: a new reader reads as usual. */
  tsock_reader_t *r = make_reader(name, TSOCK_START_NOW);
  publish_value(p, 7);
  const tsock_batch_t *b = NULL;
  if (r != NULL) {
    CHECK_RC(tsock_reader_acquire(r, &b, 1000 * MS), TSOCK_OK);
    if (b != NULL) CHECK(batch_value(b) == 7);
    CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  }
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

/* A signal handler that detaches the reader its thread is inside a call on:
 * refused (TSOCK_ESTATE), not a wait for itself for ever (review 32, F5). */
static tsock_reader_t *self_detach_reader;
static volatile sig_atomic_t self_detach_rc = -1000;
static void self_detach(int sig) {
  (void)sig;
  self_detach_rc = tsock_reader_detach(self_detach_reader);
}

static void test_detach_from_inside_a_call(void) {
  const char *name = test_name("tapi", "selfdetach");
  tsock_producer_t *p = make_producer(name, 4, 4096);
  if (p == NULL) return;
  tsock_reader_t *r = make_reader(name, TSOCK_START_NOW);
  if (r != NULL) {
    self_detach_reader = r;
    struct sigaction sa = {.sa_handler = self_detach}, old;
    sigemptyset(&sa.sa_mask);
    CHECK(sigaction(SIGALRM, &sa, &old) == 0);
    struct itimerval it = {.it_value = {0, 50000}}; /* 50 ms into the acquire */
    CHECK(setitimer(ITIMER_REAL, &it, NULL) == 0);
    const tsock_batch_t *b = NULL;
    CHECK_RC(tsock_reader_acquire(r, &b, 300 * MS), TSOCK_EAGAIN);
    CHECK(self_detach_rc == TSOCK_ESTATE);
    CHECK(sigaction(SIGALRM, &old, NULL) == 0);
    /* Nothing changed: the reader still reads, then detaches. */
    publish_value(p, 9);
    CHECK_RC(tsock_reader_acquire(r, &b, 1000 * MS), TSOCK_OK);
    if (b != NULL) CHECK(batch_value(b) == 9);
    CHECK_RC(tsock_reader_detach(r), TSOCK_OK);
  }
  CHECK_RC(tsock_producer_close(p), TSOCK_OK);
}

int main(void) {
  test_options_init();
  test_status_strings();
  test_names();
  test_null_pointers();
  test_closed_handles();
  test_bad_options();
  test_producer_errors();
  test_attach_missing();
  test_attach_timeout_waits();
  test_roundtrip_dtypes();
  test_epochs_and_close();
  test_backpressure();
  test_max_held_clamped();
  test_late_join();
  test_leading_marker();
  test_wait_readers();
  test_mapping_outlives_detach();
  test_dlpack_export();
  test_peek();
  test_detach_under_acquire();
  test_detach_from_inside_a_call();
  return test_report("test_api");
}
