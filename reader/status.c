/* status.c - status strings, the per-thread error message, dtype helpers. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

static _Thread_local char last_error[512];

const char *tsock_status_str(int status) { return tsock_layout_status_str(status); }

const char *tsock_last_error(void) { return last_error; }

void tsock__clear_error(void) { last_error[0] = '\0'; }

int tsock__fail(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return status;
}

int tsock__fail_errno(int status, int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  if (n >= 0 && (size_t)n < sizeof last_error)
    snprintf(last_error + n, sizeof last_error - (size_t)n, ": %s", strerror(err));
  if (status == TSOCK_ESYS) {
    if (err == EACCES || err == EPERM) return TSOCK_EPERM;
    if (err == ENOMEM) return TSOCK_ENOMEM;
  }
  return status;
}

size_t tsock_dtype_size(int dtype) { return tsock_layout_dtype_size(dtype); }

int tsock_tensor_init(tsock_tensor_t *t, int dtype, int ndim, const int64_t *shape,
                      uint64_t offset) {
  if (t == NULL || (ndim > 0 && shape == NULL))
    return tsock__fail(TSOCK_EINVAL, "tsock_tensor_init: NULL tensor or shape");
  size_t item = tsock_layout_dtype_size(dtype);
  if (item == 0) return tsock__fail(TSOCK_EDTYPE, "tsock_tensor_init: unknown dtype %d", dtype);
  if (ndim < 0 || ndim > TSOCK_MAX_DIMS)
    return tsock__fail(TSOCK_EDTYPE, "tsock_tensor_init: ndim %d outside 0..%d", ndim,
                       TSOCK_MAX_DIMS);
  memset(t, 0, sizeof *t);
  t->dtype = dtype;
  t->ndim = ndim;
  uint64_t count = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    if (shape[i] < 0)
      return tsock__fail(TSOCK_EDTYPE, "tsock_tensor_init: negative extent %lld in dim %d",
                         (long long)shape[i], i);
    t->shape[i] = shape[i];
    t->strides[i] = (int64_t)count;
    if (shape[i] != 0 && count > UINT64_MAX / 2 / (uint64_t)shape[i])
      return tsock__fail(TSOCK_ETOOBIG, "tsock_tensor_init: shape overflows");
    count *= (uint64_t)shape[i];
  }
  t->offset = offset;
  t->nbytes = count * item;
  return TSOCK_OK;
}
