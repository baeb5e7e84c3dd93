/*
 * cuda_driver.c - the reader's handle on the CUDA driver (see
 * cuda_driver.h): the reader's copy of the loader (cuda/load.h).
 */
#include "cuda_driver.h"

#include "../cuda/load.h"

int tsock__cuda_driver(const tsock_cuda_driver **out) {
  const char *why = NULL;
  const tsock_cuda_driver *d = cuda_driver(&why);
  if (d == NULL) return tsock__fail(TSOCK_ENOCUDA, "%s", why);
  *out = d;
  return TSOCK_OK;
}

int tsock__cuda_fail(const tsock_cuda_driver *d, tsock_CUresult rc, const char *what) {
  char buf[512];
  cuda_describe(d, rc, what, buf, sizeof buf);
  return tsock__fail(TSOCK_ESYS, "%s", buf);
}

tsock_CUresult tsock__cuda_push_ctx(const tsock_cuda_driver *d, tsock_CUcontext ctx,
                                    tsock_CUcontext *prev) {
  return cuda_push_ctx(d, ctx, prev);
}

void tsock__cuda_pop_ctx(const tsock_cuda_driver *d, tsock_CUcontext ctx, tsock_CUcontext prev) {
  cuda_pop_ctx(d, ctx, prev);
}
