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
  /* the device path */
  int allocs, frees;        /* cuMemAlloc / cuMemFree */
  int ipc_opens, ipc_closes; /* cuIpcOpenMemHandle / cuIpcCloseMemHandle */
  int copies;               /* cuMemcpyHtoDAsync */
  unsigned long long copy_bytes;
  int stream_waits;         /* cuStreamWaitEvent */
  int events_recorded;      /* cuEventRecord */
  int ctx_syncs;            /* cuCtxSynchronize */
  int events_live;          /* events created or opened, not destroyed */
  int streams_live;
  int injected_failures;    /* calls failed by FAKE_CUDA_FAIL */
} fake_cuda_stats;

typedef void (*fake_cuda_query_fn)(fake_cuda_stats *out);
typedef void *(*fake_cuda_current_fn)(void);
/* Queues a "kernel" on `stream` that runs `ns` after the stream's queued
 * work and then stores the FNV-1a hash of [dptr, dptr + n) in *out (0
 * until it ran). It runs when a later driver call of this process finds it
 * due (cuEventQuery, any synchronize), or in fake_cuda_run_due(). */
typedef void (*fake_cuda_launch_read_fn)(void *stream, const void *dptr, size_t n,
                                         unsigned long long ns, unsigned long long *out);
typedef void (*fake_cuda_run_due_fn)(void);
/* When the stream's queued work ends, CLOCK_MONOTONIC ns. */
typedef unsigned long long (*fake_cuda_stream_end_fn)(void *stream);

#endif
