/*
 * fake_cuda.c - a stand-in for libcuda.so.1 on machines without a GPU.
 *
 * Implements, on the CPU, the driver entry points tsock resolves
 * (cuda/driver.c) and records what it was asked: host registrations with
 * their address, length and flags, unregistrations, primary-context
 * retains and releases, the context current at each call. Tests point
 * TSOCK_LIBCUDA at it and read the record with fake_cuda_query().
 *
 * Knobs, read at each call: FAKE_CUDA_INIT_RESULT (cuInit's result),
 * FAKE_CUDA_REGISTER_RESULT (cuMemHostRegister's result), FAKE_CUDA_DEVICES
 * (device count, default 2), FAKE_CUDA_UUIDS (comma-separated number per
 * ordinal that makes its UUID: another process with other numbers sees
 * other GPUs, as a MIG instance does; default the ordinal),
 * FAKE_CUDA_ALLOC_RESULT, FAKE_CUDA_IPC_RESULT (cuMemAlloc's and
 * cuIpcOpenMemHandle's results), FAKE_CUDA_COPY_NS (how long a
 * host-to-device copy keeps its stream busy), FAKE_CUDA_FAIL (comma-separated
 * entry points, e.g. "cuEventRecord,cuCtxSynchronize", that fail with
 * FAKE_CUDA_FAIL_RESULT, default CUDA_ERROR_LAUNCH_FAILED: a broken context;
 * a test sets it in its own process to break the driver mid-run).
 *
 * The device path is modelled on the CPU, across processes: device memory
 * is a shared-memory file (/dev/shm/tsockfake.<pid>.<n>) mapped at the
 * "device address", so IPC handles open in another process and tests read
 * what a kernel would. Each stream has the time at which its queued work
 * ends; events take that time when recorded, a stream that waits on an
 * event moves its end past the event's. Handles 0 and 1 name the legacy
 * default stream, shared by the threads; 2 names the calling thread's own
 * per-thread default stream. Interprocess events live in their
 * own shared page. Copies move the bytes at once.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "fake_cuda.h"

typedef int CUresult;
typedef int CUdevice;
typedef struct fake_ctx {
  int dev;
} *CUcontext;

#define SUCCESS 0
#define INVALID_VALUE 1
#define NOT_INITIALIZED 3
#define NO_DEVICE 100
#define INVALID_DEVICE 101
#define INVALID_CONTEXT 201
#define ALREADY_REGISTERED 712
#define NOT_REGISTERED 713
#define NOT_SUPPORTED 801
#define OUT_OF_MEMORY 2
#define NOT_READY 600
#define LAUNCH_FAILED 719
#define MAX_DEVICES 8
#define MAX_RANGES 64

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static fake_cuda_stats st;
static int initialized;
static struct fake_ctx primary[MAX_DEVICES];
static int primary_refs[MAX_DEVICES];
static struct {
  void *addr;
  size_t len;
} ranges[MAX_RANGES];
static __thread CUcontext current;

static int env_int(const char *name, int dflt) {
  const char *v = getenv(name);
  return v && *v ? atoi(v) : dflt;
}

static int devices(void) {
  int n = env_int("FAKE_CUDA_DEVICES", 2);
  return n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

/* FAKE_CUDA_FAIL's result for entry point fn: SUCCESS unless listed. */
static CUresult injected(const char *fn) {
  const char *p = getenv("FAKE_CUDA_FAIL");
  size_t n = strlen(fn);
  while (p != NULL && *p) {
    const char *comma = strchr(p, ',');
    size_t len = comma ? (size_t)(comma - p) : strlen(p);
    if (len == n && strncmp(p, fn, n) == 0) {
      pthread_mutex_lock(&mu);
      st.injected_failures++;
      pthread_mutex_unlock(&mu);
      return env_int("FAKE_CUDA_FAIL_RESULT", LAUNCH_FAILED);
    }
    p = comma ? comma + 1 : NULL;
  }
  return SUCCESS;
}
#define INJECT(fn)                                                                         \
  do {                                                                                     \
    CUresult inj_ = injected(fn);                                                          \
    if (inj_ != SUCCESS) return inj_;                                                      \
  } while (0)

void fake_cuda_query(fake_cuda_stats *out) {
  pthread_mutex_lock(&mu);
  *out = st;
  pthread_mutex_unlock(&mu);
}

void *fake_cuda_current(void) { return current; }

CUresult cuInit(unsigned flags) {
  pthread_mutex_lock(&mu);
  st.init_calls++;
  CUresult rc = flags != 0 ? INVALID_VALUE : env_int("FAKE_CUDA_INIT_RESULT", SUCCESS);
  if (rc == SUCCESS) initialized = 1;
  pthread_mutex_unlock(&mu);
  return rc;
}

CUresult cuDriverGetVersion(int *v) {
  if (v == NULL) return INVALID_VALUE;
  *v = 12040;
  return SUCCESS;
}

CUresult cuDeviceGetCount(int *n) {
  if (!initialized) return NOT_INITIALIZED;
  if (n == NULL) return INVALID_VALUE;
  *n = devices();
  return SUCCESS;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
  if (!initialized) return NOT_INITIALIZED;
  if (d == NULL) return INVALID_VALUE;
  if (ordinal < 0 || ordinal >= devices()) return INVALID_DEVICE;
  *d = ordinal;
  return SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *c) {
  if (!initialized) return NOT_INITIALIZED;
  INJECT("cuCtxGetCurrent");
  if (c == NULL) return INVALID_VALUE;
  *c = current;
  return SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext c) {
  if (!initialized) return NOT_INITIALIZED;
  INJECT("cuCtxSetCurrent");
  current = c;
  return SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *d) {
  if (!initialized) return NOT_INITIALIZED;
  if (current == NULL) return INVALID_CONTEXT;
  *d = current->dev;
  return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
  if (!initialized) return NOT_INITIALIZED;
  if (c == NULL) return INVALID_VALUE;
  if (d < 0 || d >= devices()) return INVALID_DEVICE;
  pthread_mutex_lock(&mu);
  primary[d].dev = d;
  primary_refs[d]++;
  st.retains++;
  st.primary_refs = 0;
  for (int i = 0; i < MAX_DEVICES; i++) st.primary_refs += primary_refs[i];
  pthread_mutex_unlock(&mu);
  *c = &primary[d];
  return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  if (!initialized) return NOT_INITIALIZED;
  if (d < 0 || d >= devices()) return INVALID_DEVICE;
  CUresult rc = SUCCESS;
  pthread_mutex_lock(&mu);
  if (primary_refs[d] == 0) {
    st.release_underflows++;
    rc = INVALID_CONTEXT;
  } else {
    primary_refs[d]--;
    st.releases++;
  }
  st.primary_refs = 0;
  for (int i = 0; i < MAX_DEVICES; i++) st.primary_refs += primary_refs[i];
  pthread_mutex_unlock(&mu);
  return rc;
}

/* 1 if every page of [p, p+len) is mapped. */
static int mapped(void *p, size_t len) {
  uintptr_t page = 4096, a = (uintptr_t)p & ~(page - 1);
  return msync((void *)a, (uintptr_t)p + len - a, MS_ASYNC) == 0;
}

CUresult cuMemHostRegister_v2(void *p, size_t len, unsigned flags) {
  if (!initialized) return NOT_INITIALIZED;
  pthread_mutex_lock(&mu);
  CUresult rc = SUCCESS;
  if (current == NULL) {
    st.calls_without_context++;
    rc = INVALID_CONTEXT;
  } else if (p == NULL || len == 0 || (flags & ~0x0fu) != 0 || !mapped(p, len)) {
    rc = INVALID_VALUE;
  } else {
    rc = env_int("FAKE_CUDA_REGISTER_RESULT", SUCCESS);
  }
  for (int i = 0; rc == SUCCESS && i < MAX_RANGES; i++) {
    uintptr_t a = (uintptr_t)ranges[i].addr, b = (uintptr_t)p;
    if (ranges[i].addr != NULL && b < a + ranges[i].len && a < b + len) rc = ALREADY_REGISTERED;
  }
  if (rc == SUCCESS) {
    int i = 0;
    while (i < MAX_RANGES && ranges[i].addr != NULL) i++;
    if (i == MAX_RANGES) abort();
    ranges[i].addr = p;
    ranges[i].len = len;
    st.registers++;
    st.registered_now++;
    st.last_register_addr = p;
    st.last_register_len = len;
    st.last_register_flags = flags;
    st.last_register_device = current->dev;
  } else {
    st.register_failures++;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

CUresult cuMemHostUnregister(void *p) {
  if (!initialized) return NOT_INITIALIZED;
  pthread_mutex_lock(&mu);
  CUresult rc = NOT_REGISTERED;
  if (current == NULL) {
    st.calls_without_context++;
    rc = INVALID_CONTEXT;
  } else {
    for (int i = 0; i < MAX_RANGES; i++) {
      if (ranges[i].addr == p) {
        if (!mapped(p, ranges[i].len)) st.unregistered_after_unmap++;
        ranges[i].addr = NULL;
        st.unregisters++;
        st.registered_now--;
        st.last_unregister_addr = p;
        rc = SUCCESS;
        break;
      }
    }
  }
  if (rc != SUCCESS) st.unregister_failures++;
  pthread_mutex_unlock(&mu);
  return rc;
}

static const char *err_name(CUresult rc) {
  switch (rc) {
  case SUCCESS: return "CUDA_SUCCESS";
  case INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
  case NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
  case NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
  case INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
  case INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
  case ALREADY_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
  case NOT_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
  case NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
  case OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
  case NOT_READY: return "CUDA_ERROR_NOT_READY";
  case LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
  default: return NULL;
  }
}

static const char *err_string(CUresult rc) {
  switch (rc) {
  case SUCCESS: return "no error";
  case INVALID_VALUE: return "invalid argument";
  case NOT_INITIALIZED: return "initialization error";
  case NO_DEVICE: return "no CUDA-capable device is detected";
  case INVALID_DEVICE: return "invalid device ordinal";
  case INVALID_CONTEXT: return "invalid device context";
  case ALREADY_REGISTERED: return "part or all of the requested memory range is already mapped";
  case NOT_REGISTERED: return "pointer does not correspond to a registered memory region";
  case NOT_SUPPORTED: return "operation not supported";
  case OUT_OF_MEMORY: return "out of memory";
  case NOT_READY: return "device not ready";
  case LAUNCH_FAILED: return "unspecified launch failure";
  default: return NULL;
  }
}

/* As the driver: usable before cuInit; an unknown code is an error. */
CUresult cuGetErrorName(CUresult rc, const char **s) {
  *s = err_name(rc);
  return *s ? SUCCESS : INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult rc, const char **s) {
  *s = err_string(rc);
  return *s ? SUCCESS : INVALID_VALUE;
}

/* ---- the device path ---------------------------------------------------- */

typedef unsigned long long CUdeviceptr;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { char reserved[64]; } CUipcHandle; /* mem and event handles alike */

#define MAX_MAPS 64
#define MAX_STREAMS 64
#define MAX_KERNELS 256
#define IPC_MAGIC 0x6b616665u /* "fake" */

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t) {
  for (uint64_t n = now_ns(); n < t; n = now_ns()) {
    uint64_t d = t - n;
    struct timespec ts = {(time_t)(d / 1000000000ull), (long)(d % 1000000000ull)};
    nanosleep(&ts, NULL);
  }
}

/* Device memory: allocations (owned) and IPC mappings (opened). */
static struct {
  void *addr;
  size_t len;
  int owned;
  char name[48];
} maps[MAX_MAPS];

typedef struct fake_stream {
  uint64_t end_ns;
} fake_stream;
static fake_stream legacy_stream; /* stream 0 and 1 (CU_STREAM_LEGACY): one per context */
static fake_stream *streams[MAX_STREAMS];
/* Stream 2 (CU_STREAM_PER_THREAD) names each thread's own default stream:
 * made on first use, kept for the process (cuCtxSynchronize waits for all). */
#define MAX_PER_THREAD 256
static __thread fake_stream *per_thread_stream;
static fake_stream *per_thread[MAX_PER_THREAD];

/* An event: in its own shared page when interprocess. */
typedef struct fake_event {
  uint32_t magic;
  uint32_t ipc;
  uint64_t done_ns;
  char name[48];
} fake_event;

static struct {
  uint64_t due;
  const unsigned char *p;
  size_t n;
  unsigned long long *out;
} kernels[MAX_KERNELS];

/* The stream a handle names on the calling thread; with mu held. */
static fake_stream *stream_of(void *s) {
  if ((uintptr_t)s == 2) {
    if (per_thread_stream == NULL) {
      int i = 0;
      while (i < MAX_PER_THREAD && per_thread[i] != NULL) i++;
      if (i == MAX_PER_THREAD) abort(); /* a test bug: that many threads */
      per_thread_stream = per_thread[i] = calloc(1, sizeof(fake_stream));
      if (per_thread_stream == NULL) abort();
    }
    return per_thread_stream;
  }
  return (uintptr_t)s <= 1 ? &legacy_stream : (fake_stream *)s;
}

static uint64_t max64(uint64_t a, uint64_t b) { return a > b ? a : b; }

static int in_device_memory(const void *p, size_t n) {
  for (int i = 0; i < MAX_MAPS; i++) {
    uintptr_t a = (uintptr_t)maps[i].addr, b = (uintptr_t)p;
    if (maps[i].addr != NULL && b >= a && b + n <= a + maps[i].len) return 1;
  }
  return 0;
}

/* Runs the kernels due by `now`. */
static void run_due_locked(uint64_t now) {
  for (int i = 0; i < MAX_KERNELS; i++) {
    if (kernels[i].out == NULL || kernels[i].due > now) continue;
    unsigned long long h = 1469598103934665603ull;
    for (size_t k = 0; k < kernels[i].n; k++) h = (h ^ kernels[i].p[k]) * 1099511628211ull;
    *kernels[i].out = h;
    kernels[i].out = NULL;
  }
}

/* Runs the kernels due by now; returns that now, so that a caller that
 * then reports an event complete has run every kernel before the event
 * (one clock reading for both, or a kernel due between two readings would
 * be skipped by one and counted done by the other). */
static uint64_t run_due(void) {
  pthread_mutex_lock(&mu);
  uint64_t now = now_ns();
  run_due_locked(now);
  pthread_mutex_unlock(&mu);
  return now;
}

void fake_cuda_run_due(void) { run_due(); }

void fake_cuda_launch_read(void *stream, const void *dptr, size_t n, unsigned long long ns,
                           unsigned long long *out) {
  pthread_mutex_lock(&mu);
  fake_stream *s = stream_of(stream);
  s->end_ns = max64(s->end_ns, now_ns()) + ns;
  int i = 0;
  while (i < MAX_KERNELS && kernels[i].out != NULL) i++;
  if (i == MAX_KERNELS || !in_device_memory(dptr, n)) abort(); /* a test bug */
  *out = 0;
  kernels[i].due = s->end_ns;
  kernels[i].p = dptr;
  kernels[i].n = n;
  kernels[i].out = out;
  pthread_mutex_unlock(&mu);
}

unsigned long long fake_cuda_stream_end(void *stream) {
  pthread_mutex_lock(&mu);
  unsigned long long t = stream_of(stream)->end_ns;
  pthread_mutex_unlock(&mu);
  return t;
}

CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) {
  if (!initialized) return NOT_INITIALIZED;
  if (u == NULL) return INVALID_VALUE;
  if (d < 0 || d >= devices()) return INVALID_DEVICE;
  int tag = d;
  const char *list = getenv("FAKE_CUDA_UUIDS");
  for (int i = 0; list != NULL && *list; i++) {
    if (i == d) {
      tag = atoi(list);
      break;
    }
    list = strchr(list, ',');
    if (list != NULL) list++;
    else break;
  }
  memset(u, 0, sizeof *u);
  memcpy(u->bytes, "fakegpu", 7);
  u->bytes[15] = (char)tag;
  return SUCCESS;
}

CUresult cuCtxSynchronize(void) {
  if (!initialized) return NOT_INITIALIZED;
  INJECT("cuCtxSynchronize");
  if (current == NULL) return INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  uint64_t end = legacy_stream.end_ns;
  for (int i = 0; i < MAX_STREAMS; i++)
    if (streams[i] != NULL) end = max64(end, streams[i]->end_ns);
  for (int i = 0; i < MAX_PER_THREAD; i++)
    if (per_thread[i] != NULL) end = max64(end, per_thread[i]->end_ns);
  st.ctx_syncs++;
  pthread_mutex_unlock(&mu);
  sleep_until(end);
  fake_cuda_run_due();
  return SUCCESS;
}

/* Maps a shared-memory file as device memory. */
static void *map_file(const char *name, size_t len, int create) {
  char path[300];
  snprintf(path, sizeof path, "/dev/shm/%s", name);
  int fd = open(path, create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
  if (fd < 0) return NULL;
  if (create && ftruncate(fd, (off_t)len) != 0) {
    close(fd);
    unlink(path);
    return NULL;
  }
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  return p == MAP_FAILED ? NULL : p;
}

static void unlink_name(const char *name) {
  char path[300];
  snprintf(path, sizeof path, "/dev/shm/%s", name);
  unlink(path);
}

/* Removes what processes of the fake that were killed left in /dev/shm
 * (a real driver frees device memory with the process). */
static void sweep_dead(void) {
  DIR *d = opendir("/dev/shm");
  if (d == NULL) return;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    int pid = 0;
    if (sscanf(e->d_name, "tsockfake.mem.%d.", &pid) != 1 &&
        sscanf(e->d_name, "tsockfake.ev.%d.", &pid) != 1)
      continue;
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) unlink_name(e->d_name);
  }
  closedir(d);
}

void fake_cuda_sweep(void) { sweep_dead(); }

static int new_name(char *out, size_t n, const char *kind) {
  static int counter;
  if (counter == 0) sweep_dead();
  return snprintf(out, n, "tsockfake.%s.%d.%d", kind, (int)getpid(), ++counter);
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t len) {
  if (!initialized) return NOT_INITIALIZED;
  if (current == NULL) return INVALID_CONTEXT;
  if (dptr == NULL || len == 0) return INVALID_VALUE;
  CUresult rc = env_int("FAKE_CUDA_ALLOC_RESULT", SUCCESS);
  if (rc != SUCCESS) return rc;
  pthread_mutex_lock(&mu);
  int i = 0;
  while (i < MAX_MAPS && maps[i].addr != NULL) i++;
  if (i == MAX_MAPS) rc = OUT_OF_MEMORY;
  void *p = NULL;
  if (rc == SUCCESS) {
    new_name(maps[i].name, sizeof maps[i].name, "mem");
    p = map_file(maps[i].name, len, 1);
    if (p == NULL) rc = OUT_OF_MEMORY;
  }
  if (rc == SUCCESS) {
    maps[i].addr = p;
    maps[i].len = len;
    maps[i].owned = 1;
    st.allocs++;
    *dptr = (CUdeviceptr)(uintptr_t)p;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

static int find_map(CUdeviceptr d, int owned) {
  for (int i = 0; i < MAX_MAPS; i++)
    if (maps[i].addr != NULL && (CUdeviceptr)(uintptr_t)maps[i].addr == d && maps[i].owned == owned)
      return i;
  return -1;
}

static CUresult drop_map(CUdeviceptr d, int owned) {
  if (!initialized) return NOT_INITIALIZED;
  if (current == NULL) return INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  int i = find_map(d, owned);
  if (i >= 0) {
    munmap(maps[i].addr, maps[i].len);
    if (owned) unlink_name(maps[i].name);
    maps[i].addr = NULL;
    if (owned) st.frees++;
    else st.ipc_closes++;
  }
  pthread_mutex_unlock(&mu);
  return i >= 0 ? SUCCESS : INVALID_VALUE;
}

CUresult cuMemFree_v2(CUdeviceptr d) { return drop_map(d, 1); }
CUresult cuIpcCloseMemHandle(CUdeviceptr d) { return drop_map(d, 0); }

/* Handle layout: magic, owner pid, length, name. */
typedef struct {
  uint32_t magic;
  int32_t pid;
  uint64_t len;
  char name[48];
} ipc_body;
_Static_assert(sizeof(ipc_body) <= sizeof(CUipcHandle), "handle");

CUresult cuIpcGetMemHandle(CUipcHandle *h, CUdeviceptr d) {
  if (!initialized) return NOT_INITIALIZED;
  if (current == NULL) return INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  int i = find_map(d, 1);
  if (i >= 0) {
    ipc_body b = {IPC_MAGIC, (int32_t)getpid(), maps[i].len, {0}};
    memcpy(b.name, maps[i].name, sizeof b.name);
    memset(h, 0, sizeof *h);
    memcpy(h, &b, sizeof b);
  }
  pthread_mutex_unlock(&mu);
  return i >= 0 ? SUCCESS : INVALID_VALUE;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *d, CUipcHandle h, unsigned flags) {
  if (!initialized) return NOT_INITIALIZED;
  if (current == NULL) return INVALID_CONTEXT;
  CUresult rc = env_int("FAKE_CUDA_IPC_RESULT", SUCCESS);
  if (rc != SUCCESS) return rc;
  ipc_body b;
  memcpy(&b, &h, sizeof b);
  if (d == NULL || flags > 1 || b.magic != IPC_MAGIC || b.name[sizeof b.name - 1] != '\0')
    return INVALID_VALUE;
  if (b.pid == (int32_t)getpid()) return INVALID_CONTEXT; /* as the driver: not in the exporter */
  pthread_mutex_lock(&mu);
  int i = 0;
  while (i < MAX_MAPS && maps[i].addr != NULL) i++;
  void *p = i < MAX_MAPS ? map_file(b.name, b.len, 0) : NULL;
  if (p != NULL) {
    maps[i].addr = p;
    maps[i].len = b.len;
    maps[i].owned = 0;
    memcpy(maps[i].name, b.name, sizeof b.name);
    st.ipc_opens++;
    *d = (CUdeviceptr)(uintptr_t)p;
  }
  pthread_mutex_unlock(&mu);
  return p != NULL ? SUCCESS : INVALID_VALUE;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
  if (!initialized) return NOT_INITIALIZED;
  if (current == NULL) return INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  CUresult rc = in_device_memory((void *)(uintptr_t)dst, n) ? SUCCESS : INVALID_VALUE;
  if (rc == SUCCESS) {
    memcpy((void *)(uintptr_t)dst, src, n);
    fake_stream *s = stream_of(stream);
    s->end_ns = max64(s->end_ns, now_ns()) + (uint64_t)env_int("FAKE_CUDA_COPY_NS", 0);
    st.copies++;
    st.copy_bytes += n;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

/* Synchronous, on the legacy stream: waits for the work queued there. */
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  if (!initialized) return NOT_INITIALIZED;
  if (current == NULL) return INVALID_CONTEXT;
  sleep_until(fake_cuda_stream_end(NULL));
  fake_cuda_run_due();
  pthread_mutex_lock(&mu);
  CUresult rc = in_device_memory((void *)(uintptr_t)src, n) ? SUCCESS : INVALID_VALUE;
  if (rc == SUCCESS) memcpy(dst, (const void *)(uintptr_t)src, n);
  pthread_mutex_unlock(&mu);
  return rc;
}

CUresult cuStreamCreate(void **out, unsigned flags) {
  if (!initialized) return NOT_INITIALIZED;
  if (current == NULL) return INVALID_CONTEXT;
  if (out == NULL || flags > 1) return INVALID_VALUE;
  fake_stream *s = calloc(1, sizeof *s);
  pthread_mutex_lock(&mu);
  int i = 0;
  while (i < MAX_STREAMS && streams[i] != NULL) i++;
  if (i < MAX_STREAMS && s != NULL) {
    streams[i] = s;
    st.streams_live++;
  }
  pthread_mutex_unlock(&mu);
  if (i == MAX_STREAMS || s == NULL) {
    free(s);
    return OUT_OF_MEMORY;
  }
  *out = s;
  return SUCCESS;
}

CUresult cuStreamDestroy_v2(void *stream) {
  if (!initialized) return NOT_INITIALIZED;
  pthread_mutex_lock(&mu);
  int found = 0;
  for (int i = 0; i < MAX_STREAMS; i++)
    if (streams[i] == stream && stream != NULL) streams[i] = NULL, found = 1;
  if (found) st.streams_live--;
  pthread_mutex_unlock(&mu);
  if (!found) return INVALID_VALUE;
  free(stream);
  return SUCCESS;
}

CUresult cuStreamSynchronize(void *stream) {
  if (!initialized) return NOT_INITIALIZED;
  INJECT("cuStreamSynchronize");
  sleep_until(fake_cuda_stream_end(stream));
  fake_cuda_run_due();
  return SUCCESS;
}

CUresult cuStreamWaitEvent(void *stream, fake_event *ev, unsigned flags) {
  if (!initialized) return NOT_INITIALIZED;
  INJECT("cuStreamWaitEvent");
  if (ev == NULL || ev->magic != IPC_MAGIC || flags != 0) return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  fake_stream *s = stream_of(stream);
  s->end_ns = max64(s->end_ns, __atomic_load_n(&ev->done_ns, __ATOMIC_ACQUIRE));
  st.stream_waits++;
  pthread_mutex_unlock(&mu);
  return SUCCESS;
}

CUresult cuEventCreate(fake_event **out, unsigned flags) {
  if (!initialized) return NOT_INITIALIZED;
  INJECT("cuEventCreate");
  if (current == NULL) return INVALID_CONTEXT;
  if (out == NULL || (flags & ~0x7u) != 0) return INVALID_VALUE;
  int ipc = (flags & 0x4u) != 0;
  if (ipc && !(flags & 0x2u)) return INVALID_VALUE; /* as the driver: IPC needs DISABLE_TIMING */
  fake_event *ev;
  char name[48] = {0};
  if (ipc) {
    new_name(name, sizeof name, "ev");
    ev = map_file(name, 4096, 1);
  } else {
    ev = calloc(1, sizeof *ev);
  }
  if (ev == NULL) return OUT_OF_MEMORY;
  ev->magic = IPC_MAGIC;
  ev->ipc = (uint32_t)ipc;
  memcpy(ev->name, name, sizeof ev->name);
  pthread_mutex_lock(&mu);
  st.events_live++;
  pthread_mutex_unlock(&mu);
  *out = ev;
  return SUCCESS;
}

CUresult cuEventDestroy_v2(fake_event *ev) {
  if (!initialized) return NOT_INITIALIZED;
  if (ev == NULL || ev->magic != IPC_MAGIC) return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  st.events_live--;
  pthread_mutex_unlock(&mu);
  if (ev->ipc) {
    /* The creator's name goes with its process's handle; an opener only unmaps. */
    char path[48];
    memcpy(path, ev->name, sizeof path);
    int creator = strstr(path, "tsockfake.ev.") == path &&
                  atoi(path + strlen("tsockfake.ev.")) == (int)getpid();
    munmap(ev, 4096);
    if (creator) unlink_name(path);
  } else {
    free(ev);
  }
  return SUCCESS;
}

CUresult cuEventRecord(fake_event *ev, void *stream) {
  if (!initialized) return NOT_INITIALIZED;
  INJECT("cuEventRecord");
  if (ev == NULL || ev->magic != IPC_MAGIC) return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  __atomic_store_n(&ev->done_ns, max64(stream_of(stream)->end_ns, now_ns()), __ATOMIC_RELEASE);
  st.events_recorded++;
  pthread_mutex_unlock(&mu);
  return SUCCESS;
}

CUresult cuEventQuery(fake_event *ev) {
  if (!initialized) return NOT_INITIALIZED;
  INJECT("cuEventQuery");
  if (ev == NULL || ev->magic != IPC_MAGIC) return INVALID_VALUE;
  uint64_t now = run_due();
  return now >= __atomic_load_n(&ev->done_ns, __ATOMIC_ACQUIRE) ? SUCCESS : NOT_READY;
}

CUresult cuEventSynchronize(fake_event *ev) {
  if (!initialized) return NOT_INITIALIZED;
  INJECT("cuEventSynchronize");
  if (ev == NULL || ev->magic != IPC_MAGIC) return INVALID_VALUE;
  sleep_until(__atomic_load_n(&ev->done_ns, __ATOMIC_ACQUIRE));
  fake_cuda_run_due();
  return SUCCESS;
}

CUresult cuIpcGetEventHandle(CUipcHandle *h, fake_event *ev) {
  if (!initialized) return NOT_INITIALIZED;
  if (h == NULL || ev == NULL || ev->magic != IPC_MAGIC || !ev->ipc) return INVALID_VALUE;
  ipc_body b = {IPC_MAGIC, (int32_t)getpid(), 4096, {0}};
  memcpy(b.name, ev->name, sizeof b.name);
  memset(h, 0, sizeof *h);
  memcpy(h, &b, sizeof b);
  return SUCCESS;
}

CUresult cuIpcOpenEventHandle(fake_event **out, CUipcHandle h) {
  if (!initialized) return NOT_INITIALIZED;
  if (current == NULL) return INVALID_CONTEXT;
  ipc_body b;
  memcpy(&b, &h, sizeof b);
  if (out == NULL || b.magic != IPC_MAGIC || b.name[sizeof b.name - 1] != '\0')
    return INVALID_VALUE;
  fake_event *ev = map_file(b.name, 4096, 0);
  if (ev == NULL || ev->magic != IPC_MAGIC) return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  st.events_live++;
  pthread_mutex_unlock(&mu);
  *out = ev;
  return SUCCESS;
}
