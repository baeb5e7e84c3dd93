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
 * (device count, default 2).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

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
  if (c == NULL) return INVALID_VALUE;
  *c = current;
  return SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext c) {
  if (!initialized) return NOT_INITIALIZED;
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
