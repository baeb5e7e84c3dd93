/* fake_cuda.h - what the fake CUDA driver (fake_cuda.c) records. Tests
 * dlopen the same file tsock loaded (TSOCK_LIBCUDA) and call
 * fake_cuda_query through dlsym. */
#ifndef TSOCK_FAKE_CUDA_H
#define TSOCK_FAKE_CUDA_H

#include <stddef.h>

typedef struct fake_cuda_stats {
  int init_calls;
  int registers;            /* successful cuMemHostRegister */
  int register_failures;
  int registered_now;       /* ranges registered and not yet unregistered */
  void *last_register_addr;
  size_t last_register_len;
  unsigned last_register_flags;
  int last_register_device; /* device of the context current at registration */
  int unregisters;          /* successful cuMemHostUnregister */
  int unregister_failures;
  void *last_unregister_addr;
  int unregistered_after_unmap; /* the range was already unmapped: a bug */
  int calls_without_context;    /* (un)register with no current context */
  int retains, releases, release_underflows;
  int primary_refs;         /* primary-context references held now */
} fake_cuda_stats;

typedef void (*fake_cuda_query_fn)(fake_cuda_stats *out);
typedef void *(*fake_cuda_current_fn)(void);

#endif
