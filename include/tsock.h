/*
 * tsock.h - the C ABI of tsock: one producer publishes batches of tensors
 * into a shared-memory ring in /dev/shm, any number of reader processes on
 * the same node read every batch zero-copy.
 *
 * Two libraries implement this header:
 *   libtsock.so         producer and reader (Go runtime inside, c-shared).
 *   libtsock_reader.so  reader only, plain C, no Go runtime. Trainers should
 *                       link this one: it is fork-safe and installs no signal
 *                       handlers.
 *
 * Conventions
 *   - Every function named tsock_<noun>_<verb> returns 0 (TSOCK_OK) or a
 *     negative tsock_status. tsock_status_str() gives a static string for a
 *     status; tsock_last_error() gives the calling thread's detailed message
 *     for the last failed call.
 *   - Out-parameters are written only on success.
 *   - Handles are opaque. Using a closed handle returns TSOCK_EHANDLE; it
 *     never crashes. Handles do not survive fork(): in a child process every
 *     call on a handle of the parent returns TSOCK_EFORKED.
 *   - Timeouts are in nanoseconds: 0 means "do not wait", a negative value
 *     means "wait forever" (a dead peer still ends the wait).
 *   - Options structs start with a size field; call the _init() function
 *     first, then change what you need.
 *
 * Thread safety is stated per function. "One thread at a time" means the
 * handle may move between threads but calls on it must not overlap, except
 * that tsock_reader_detach may overlap any call taking the reader handle (it
 * waits for them); calls taking a batch need the batch held.
 */
#ifndef TSOCK_H
#define TSOCK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TSOCK_VERSION_MAJOR 0
#define TSOCK_VERSION_MINOR 1

/* ---- Limits --------------------------------------------------------- */

#define TSOCK_NAME_MAX 64     /* channel names: 1..64 of [A-Za-z0-9._-] */
#define TSOCK_MAX_DIMS 8      /* dimensions per tensor */
#define TSOCK_MAX_TENSORS 16  /* tensors per batch */
#define TSOCK_META_MAX 256    /* bytes of user metadata per batch */
#define TSOCK_MAX_HELD 64     /* batches a reader may hold (max_held) */

/* ---- Status codes ----------------------------------------------------- */

typedef enum tsock_status {
  TSOCK_OK = 0,
  TSOCK_EAGAIN = -1,          /* nothing available within the timeout; not an error */
  TSOCK_EINVAL = -2,          /* invalid argument (NULL pointer, bad size field, ...) */
  TSOCK_EHANDLE = -3,         /* handle invalid, already closed, or from another process */
  TSOCK_ENAME = -4,           /* channel name is not 1..64 of [A-Za-z0-9._-] */
  TSOCK_ENOENT = -5,          /* no channel of that name */
  TSOCK_EEXIST = -6,          /* a live producer already owns that name */
  TSOCK_EVERSION = -7,        /* segment has another layout version */
  TSOCK_ECORRUPT = -8,        /* segment is truncated, foreign or inconsistent */
  TSOCK_EPRODUCER_GONE = -9,  /* the producer process died */
  TSOCK_ECLOSED = -10,        /* the producer closed the channel; all batches were read */
  TSOCK_EFULL = -11,          /* no free reader record in the channel */
  TSOCK_EBACKPRESSURE = -12,  /* the ring is full and the caller asked not to wait */
  TSOCK_ETIMEDOUT = -13,      /* the wait ran out (reserve, attach, wait for readers) */
  TSOCK_ETOOBIG = -14,        /* batch, tensor count or metadata exceeds the channel */
  TSOCK_EDTYPE = -15,         /* unsupported dtype, or shape/strides do not fit */
  TSOCK_EEVICTED = -16,       /* this reader was evicted by the producer's policy */
  TSOCK_ESTATE = -17,         /* call out of order (publish without reserve, ...) */
  TSOCK_EPERM = -18,          /* permission denied on the segment */
  TSOCK_ESYS = -19,           /* a system call failed; see tsock_last_error() */
  TSOCK_EFORKED = -20,        /* handle used in a child after fork() */
  TSOCK_ENOMEM = -21,         /* out of memory */
  TSOCK_ENOCUDA = -22,        /* no usable CUDA driver (libcuda.so.1 missing, or cuInit failed) */
  TSOCK_ENODEVICE = -23       /* no device path here: the producer has no device pool, or its
                                 GPU is not this process's (another GPU, a MIG instance) */
} tsock_status;

/* Static, never-NULL description of a status ("unknown status" for others).
 * Thread-safe. */
const char *tsock_status_str(int status);

/* Detailed message of the calling thread's last failed call ("" if none).
 * Valid until the thread's next tsock call. Thread-safe (per thread). */
const char *tsock_last_error(void);

/* ---- Tensors ---------------------------------------------------------- */

typedef enum tsock_dtype {
  TSOCK_DTYPE_BOOL = 1,
  TSOCK_DTYPE_INT8 = 2,
  TSOCK_DTYPE_INT16 = 3,
  TSOCK_DTYPE_INT32 = 4,
  TSOCK_DTYPE_INT64 = 5,
  TSOCK_DTYPE_UINT8 = 6,
  TSOCK_DTYPE_UINT16 = 7,
  TSOCK_DTYPE_UINT32 = 8,
  TSOCK_DTYPE_UINT64 = 9,
  TSOCK_DTYPE_FLOAT16 = 10,
  TSOCK_DTYPE_BFLOAT16 = 11,
  TSOCK_DTYPE_FLOAT32 = 12,
  TSOCK_DTYPE_FLOAT64 = 13
} tsock_dtype;

/* Bytes per element of a dtype, 0 if the dtype is unknown. Thread-safe. */
size_t tsock_dtype_size(int dtype);

/*
 * One tensor of a batch. Strides are in elements (as DLPack), never
 * negative. The tensor occupies bytes [offset, offset + nbytes) of the
 * batch payload; every element it addresses lies inside that range.
 *
 * Producer: fill dtype, ndim, shape, strides, offset, nbytes; data is
 * ignored. tsock_tensor_init() fills a C-contiguous tensor.
 * Reader: every field is filled, data points at the first element, in
 * read-only shared memory.
 */
typedef struct tsock_tensor {
  int32_t dtype;
  int32_t ndim;
  int64_t shape[TSOCK_MAX_DIMS];
  int64_t strides[TSOCK_MAX_DIMS];
  uint64_t offset;
  uint64_t nbytes;
  const void *data;
} tsock_tensor_t;

/* Fills a C-contiguous tensor of the given dtype and shape at a payload
 * offset; computes strides and nbytes. Returns TSOCK_EDTYPE for an unknown
 * dtype or ndim outside 0..TSOCK_MAX_DIMS or a negative extent. Thread-safe. */
int tsock_tensor_init(tsock_tensor_t *t, int dtype, int ndim,
                      const int64_t *shape, uint64_t offset);

/* ---- Producer (libtsock.so only) --------------------------------------- */

typedef struct tsock_producer tsock_producer_t;

typedef struct tsock_producer_options {
  uint32_t size;           /* sizeof(tsock_producer_options_t) */
  uint32_t slot_count;     /* ring depth, a power of two in 2..65536; default 16 */
  uint64_t slot_bytes;     /* payload bytes per batch; default 1 MiB */
  uint32_t max_readers;    /* reader records, 1..1024; default 64 */
  uint32_t mode;           /* file permission bits; default 0600 (user only).
                              0640 (or 0660) lets the group of `gid` attach:
                              readers only read the segment, and group and
                              others never get a write bit. */
  int64_t gid;             /* group for the segment, -1 keeps the default */
  int64_t evict_after_ns;  /* evict a reader that holds the producer back this
                              long; 0 (default) never evicts: slow readers
                              apply back-pressure. With eviction on, a batch
                              a reader held is only known intact if its
                              release returns 0 (an evicted reader's batch
                              may be overwritten while in use). */
  uint32_t join_window;    /* late-join window: a reader that attaches while
                              at most this many batches of the current epoch
                              are published still gets the whole epoch (the
                              producer keeps them); 0 (default) = none;
                              less than slot_count */
  uint32_t reserved;       /* must be 0 */
  int32_t cuda_device;     /* CUDA device of a device pool, -1 (default) none.
                              With one, every batch is also copied once into
                              GPU memory on that device, which readers on the
                              same GPU read zero-copy through CUDA IPC
                              (tsock_reader_open_device). Needs the CUDA
                              driver (TSOCK_ENOCUDA without it). */
  uint32_t reserved2;      /* must be 0 */
} tsock_producer_options_t;

/* Thread-safe. */
void tsock_producer_options_init(tsock_producer_options_t *opts);

/* Creates channel `name` and becomes its producer. A segment left by a dead
 * producer is reclaimed; a live producer on the name gives TSOCK_EEXIST.
 * opts may be NULL for defaults. Thread-safe. */
int tsock_producer_create(const char *name, const tsock_producer_options_t *opts,
                          tsock_producer_t **out);

/* Reserves the next slot's payload buffer for `nbytes` bytes and returns its
 * address: write the batch there directly, then tsock_producer_publish().
 * Waits up to timeout_ns for the slowest live reader; with timeout_ns == 0
 * it returns TSOCK_EBACKPRESSURE at once when the ring is full.
 * One thread at a time per producer. */
int tsock_producer_reserve(tsock_producer_t *p, uint64_t nbytes, int64_t timeout_ns,
                           void **payload);

/* Publishes the reserved batch: `n` tensors laid out in the payload, and
 * `meta_len` bytes of metadata (may be 0). On error the reservation stays
 * and may be published again. One thread at a time per producer. */
int tsock_producer_publish(tsock_producer_t *p, const tsock_tensor_t *tensors, uint32_t n,
                           const void *meta, uint32_t meta_len);

/* Drops the reserved batch without publishing it. One thread at a time. */
int tsock_producer_abort(tsock_producer_t *p);

/* Publishes an epoch-end marker (a batch with no tensors, flag
 * TSOCK_BATCH_EPOCH_END, index = number of batches in the epoch) and starts
 * the next epoch. Waits like reserve. One thread at a time per producer. */
int tsock_producer_end_epoch(tsock_producer_t *p, int64_t timeout_ns);

/* Waits until at least `n` readers are attached. Thread-safe. */
int tsock_producer_wait_readers(tsock_producer_t *p, uint32_t n, int64_t timeout_ns);

typedef struct tsock_producer_stats {
  uint32_t size;            /* sizeof(tsock_producer_stats_t) */
  uint32_t readers;         /* live readers now */
  uint64_t published;       /* batches published, epoch markers included */
  uint64_t epoch;           /* current epoch */
  uint64_t backpressure_ns; /* total time reserve waited for readers */
  uint64_t readers_reclaimed; /* records freed after a reader died */
  uint64_t readers_evicted; /* readers evicted by the policy */
} tsock_producer_stats_t;

/* Fills *stats (set stats->size first). Thread-safe. */
int tsock_producer_stats(tsock_producer_t *p, tsock_producer_stats_t *stats);

/* The readers attached now (evicted ones left out: they read nothing
 * more), by who they are: fills pids[0 .. min(cap, *count)) with each one's
 * pid as the kernel told it at the join (SO_PEERCRED, in the producer's pid
 * namespace; 0 when not visible there) and sets *count to how many are
 * attached (call again with a larger array when *count > cap). pids may be
 * NULL when cap is 0. Thread-safe. */
int tsock_producer_reader_pids(tsock_producer_t *p, int32_t *pids, uint32_t cap, uint32_t *count);

/* Marks the channel closed (readers drain what is published, then get
 * TSOCK_ECLOSED), removes its name and frees the handle. Thread-safe;
 * a second close returns TSOCK_EHANDLE. A batch still reserved is
 * dropped, but its payload stays writable (another thread may be writing
 * it) until tsock_producer_publish or tsock_producer_abort with this
 * handle, which then return TSOCK_EHANDLE and free it. */
int tsock_producer_close(tsock_producer_t *p);

/* One published batch of a channel, read without attaching
 * (tsock_producer_peek). */
typedef struct tsock_peek {
  uint32_t size;           /* sizeof(tsock_peek_t) */
  uint32_t flags;          /* TSOCK_BATCH_* of the batch */
  uint64_t published;      /* batches published on the channel, epoch markers included */
  uint64_t seq;            /* the batch's position in the stream */
  uint64_t epoch;          /* its epoch, as the producer counted them */
  uint64_t index;          /* its index in that epoch (a marker: batches in the epoch) */
  uint32_t producer_alive; /* 1 while a live producer holds the channel */
  uint32_t meta_len;       /* bytes of meta in use */
  uint8_t meta[TSOCK_META_MAX]; /* copy of the batch's metadata */
} tsock_peek_t;

/* Reads published batch `back` of channel `name`, counted back from the
 * newest (0), whether its producer is alive or dead, without attaching (no
 * reader record, no lock): how a successor producer finds where a dead one
 * stopped, from the metadata it published with its last batches. The copy
 * is seqlock-checked like a reader's. TSOCK_ENOENT without such a channel;
 * TSOCK_EAGAIN when the ring no longer holds that batch (back >= batches
 * published or >= the slot count, or overwritten meanwhile by a live
 * producer); TSOCK_ECORRUPT for a slot that cannot be one. Set out->size
 * first; *out is written only on success. Thread-safe. */
int tsock_producer_peek(const char *name, uint64_t back, tsock_peek_t *out);

/* ---- Reader (libtsock.so and libtsock_reader.so) ------------------------ */

typedef struct tsock_reader tsock_reader_t;

/* Where a reader that attaches to a running channel starts. */
typedef enum tsock_start {
  TSOCK_START_NEXT_EPOCH = 0, /* the current epoch from its first batch if the
                                 reader attaches inside the producer's join
                                 window, else the first batch of the next epoch
                                 (default); a reader attached before any batch
                                 gets epoch 0 */
  TSOCK_START_NOW = 1,        /* the next batch published after attaching */
  TSOCK_START_OLDEST = 2      /* the oldest batch still in the ring that an
                                 attached reader has not released (the
                                 slowest reader's next one); as
                                 TSOCK_START_NOW when no reader holds one */
} tsock_start;

typedef struct tsock_reader_options {
  uint32_t size;              /* sizeof(tsock_reader_options_t) */
  int32_t start;              /* tsock_start; default TSOCK_START_NEXT_EPOCH */
  int64_t attach_timeout_ns;  /* wait this long for the channel to appear
                                 and its producer to answer the join
                                 (TSOCK_ETIMEDOUT after it); 0 (default)
                                 fails at once with TSOCK_ENOENT when there
                                 is no channel, and waits at most 2 s for a
                                 producer that does not answer (stopped);
                                 < 0 waits without limit */
  uint32_t max_held;          /* batches held at once (acquired, not released),
                                 1..TSOCK_MAX_HELD; default 4. Clamped at attach, silently,
                                 to the channel's slot count: a reader holding
                                 the whole ring cannot get another batch until
                                 it releases one, so acquire then returns
                                 TSOCK_ESTATE instead of waiting for a batch
                                 the producer cannot publish */
  uint32_t reserved;          /* must be 0 */
  int64_t spin_ns;            /* busy-poll this long before sleeping on the
                                 futex; default 20000 (20 us); 0 never spins */
} tsock_reader_options_t;

/* Thread-safe. */
void tsock_reader_options_init(tsock_reader_options_t *opts);

/* Attaches to channel `name`. opts may be NULL for defaults. Thread-safe.
 * The segment is opened read-only (read permission on it is what lets a
 * process attach); the producer hands the reader its record over a Unix
 * socket at an abstract address, so the reader must share the producer's
 * network namespace. TSOCK_EFULL: every reader record is taken;
 * TSOCK_ECLOSED: the producer is closing the channel. */
int tsock_reader_attach(const char *name, const tsock_reader_options_t *opts,
                        tsock_reader_t **out);

#define TSOCK_BATCH_EPOCH_END 0x1u /* epoch-end marker: no tensors */

/* A batch as a reader sees it. Owned by the reader; valid until it is
 * released or the reader is detached (a kept batch: until
 * tsock_batch_free). Fields may be appended in later versions; never
 * allocate or copy this struct by value. */
typedef struct tsock_batch {
  uint64_t seq;       /* position in the stream, from 0 */
  uint64_t epoch;     /* epoch number, from 0 */
  uint64_t index;     /* batch index within the epoch, from 0 */
  uint32_t flags;     /* TSOCK_BATCH_* */
  uint32_t n_tensors;
  const tsock_tensor_t *tensors;
  const void *meta;   /* copy of the metadata; meta_len bytes */
  uint32_t meta_len;
  uint32_t reserved;
  uint64_t publish_ns; /* CLOCK_MONOTONIC time of publication */
  /* Since 0.2. Where the tensors lie in this process: the batch's slot as
   * mapped here, tensors[i].data == payload + tensors[i].offset. Later
   * batches of the same slot lie at the same address, unless a batch of it
   * was kept (tsock_batch_keep), which moves the slot elsewhere. */
  const void *payload;
  uint64_t payload_capacity; /* its length: the channel's payload bytes per slot */
  /* TSOCK_MAX_TENSORS + 1 counters: the DLPack descriptors of each tensor
   * of this batch still alive (tsock_batch_dlpack, _cuda), then their sum.
   * Read them atomically: deleters decrement them on any thread. Valid
   * while the batch is held (or kept). */
  const uint32_t *dlpack_live;
} tsock_batch_t;

/* Takes the next batch. Returns 0 and sets *batch; TSOCK_EAGAIN when none
 * arrived within timeout_ns (not an error); TSOCK_EPRODUCER_GONE when the
 * producer died and everything it published has been read; TSOCK_ECLOSED
 * after a clean close, likewise; TSOCK_ESTATE when max_held batches are
 * already held; TSOCK_EHANDLE when another thread detached r meanwhile
 * (tsock_reader_detach). Spins briefly, then sleeps on a futex.
 * One thread at a time per reader (detach excepted). */
int tsock_reader_acquire(tsock_reader_t *r, const tsock_batch_t **batch, int64_t timeout_ns);

/* Releases `batch` and every batch acquired before it, so the producer may
 * reuse their slots. One thread at a time per reader. */
int tsock_reader_release(tsock_reader_t *r, const tsock_batch_t *batch);

/* Base address and length of the read-only payload mapping (every tensor
 * pointer lies inside it). One thread at a time per reader. */
int tsock_reader_payload_range(tsock_reader_t *r, const void **base, uint64_t *len);

/* TSOCK_OK while the batches r holds are intact: r still holds its roster
 * entry. TSOCK_EEVICTED once the producer's eviction policy (evict_after)
 * took it: from then on the producer may rewrite what r holds. Reads one
 * word of shared memory: cheap enough to call before handing out a batch
 * held a long time (acquired ahead). Thread-safe. */
int tsock_reader_check(tsock_reader_t *r);

/* Keeps the reader's read-only payload mapping in place until
 * tsock_mapping_unpin(token), even after tsock_reader_detach(), so memory a
 * caller still points into never becomes unmapped (its contents may change
 * once the batch is released). One thread at a time per reader. */
int tsock_reader_pin_mapping(tsock_reader_t *r, void **token);

/* Drops a pin taken with tsock_reader_pin_mapping(). Tokens are handles,
 * not pointers: a token already unpinned, or anything that is not a token
 * in use (NULL, another pointer), returns TSOCK_EHANDLE and changes
 * nothing. Thread-safe. */
int tsock_mapping_unpin(void *token);

/* Registers the reader's read-only payload mapping (the range
 * tsock_reader_payload_range() returns) as pinned host memory with the CUDA
 * driver, so host-to-device copies out of batches run at pinned speed and
 * truly asynchronously (cudaMemcpyAsync, torch non_blocking=True).
 *
 * The driver is loaded at run time, on the first call: libcuda.so.1, or the
 * file named by the environment variable TSOCK_LIBCUDA. Neither library
 * links CUDA; without a driver this returns TSOCK_ENOCUDA ("CUDA driver not
 * available"), also when cuInit fails (no device visible), and
 * tsock_last_error() says why. Registration uses
 * cuMemHostRegister(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY)
 * (the mapping is read-only; the device needs
 * CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED) in the primary
 * context of the device of the calling thread's current context, device 0
 * if none is current; the calling thread's current context is left as it
 * was. A failing CUDA call returns TSOCK_ESYS with the function's name and
 * the driver's cuGetErrorName / cuGetErrorString text in tsock_last_error().
 *
 * Once per reader: a second call returns 0 and does nothing. The range is
 * unregistered when the mapping is finally unmapped: at
 * tsock_reader_detach(), or later when the last pin (tsock_mapping_unpin)
 * or DLPack tensor of it is dropped; never in a forked child.
 * One thread at a time per reader. */
int tsock_reader_register_host(tsock_reader_t *r);

/* ---- GPU: the device path (both libraries) ------------------------------ */

/* Opens the producer's device pool (tsock_producer_options_t.cuda_device)
 * for zero-copy device reads: the pool is mapped once per reader with
 * cuIpcOpenMemHandle, in the primary context of this process's device
 * whose UUID is the pool's. On success *cuda_ordinal is that device's
 * ordinal as this process numbers it (CUDA_VISIBLE_DEVICES applies).
 *
 * TSOCK_ENODEVICE, with tsock_last_error() saying which, when this reader
 * must take the pinned host path instead: the producer has no device pool;
 * its GPU is not one this process sees (another GPU, or a MIG instance:
 * CUDA IPC does not cross MIG instances, and a MIG instance has its own
 * UUID); or the driver refused to open the handle (the producer's own
 * process, no peer access). TSOCK_ENOCUDA without a driver. The outcome is
 * recorded in the reader's record (`tsock gpus` shows it). A second call
 * after success returns 0 again. One thread at a time per reader. */
int tsock_reader_open_device(tsock_reader_t *r, int32_t *cuda_ordinal);

/* The device pool's address range in this process (after a successful
 * tsock_reader_open_device): every tsock_batch_cuda_ptr lies inside it.
 * TSOCK_ENODEVICE before. One thread at a time per reader. */
int tsock_reader_device_range(tsock_reader_t *r, uint64_t *base, uint64_t *len);

/* The device address (a CUdeviceptr) of tensor `i` of a batch that has a
 * device copy, read after tsock_batch_cuda_use(). TSOCK_ENODEVICE when the
 * reader has no device path or the batch was published without a device
 * copy. Thread-safe. */
int tsock_batch_cuda_ptr(const tsock_batch_t *batch, uint32_t i, uint64_t *dptr);

#define TSOCK_CUDA_SYNC 0x1u /* tsock_batch_cuda_use: wait on the host instead */

/* Orders the use of a batch's device copy on `stream` (a CUstream; 0 and
 * CU_STREAM_LEGACY (1) are the legacy default stream, shared by the
 * threads; CU_STREAM_PER_THREAD (2) is the calling thread's own default
 * stream) in both directions:
 *   - the stream waits for the producer's copy (cuStreamWaitEvent on the
 *     slot's interprocess event), so kernels queued after this call read
 *     the batch's data;
 *   - when the batch is released, an event is recorded on the stream and
 *     the slot goes back to the producer only once it has fired, so work
 *     queued before the release is never overwritten under it. The reader
 *     polls that event while it waits for data; detach waits for it.
 *     This fails closed: where no event can be recorded the release waits
 *     for the stream, else for the device (cuCtxSynchronize); where none
 *     of that succeeds (a broken CUDA context), or the event can no longer
 *     be queried, the slot stays held and later calls try again. A reader
 *     whose max_held batches are held so gets TSOCK_ESYS from acquire, and
 *     detach then returns TSOCK_ESYS and leaves the reader's record (and
 *     its slots) held until the process exits.
 * The fence is recorded by the releasing thread, so CU_STREAM_PER_THREAD
 * names the batch's stream at release only in the thread that called this:
 * released from another thread, a batch used on it is fenced by waiting
 * until the device is idle (cuCtxSynchronize, blocking that release), and
 * a second call with CU_STREAM_PER_THREAD from another thread names another
 * stream (below). Name a created stream to avoid both.
 * With flags TSOCK_CUDA_SYNC the calling thread waits for the copy instead,
 * and release waits until the device is idle (cuCtxSynchronize): for a
 * caller that cannot name the stream its work runs on. Calls again with the
 * same stream and flags do nothing; a call with another stream or flags
 * orders the copy there too (or waits for it), and the batch's release then
 * waits until the device is idle, since no one event covers several streams.
 * TSOCK_ENODEVICE as tsock_batch_cuda_ptr. TSOCK_EPRODUCER_GONE once the
 * producer's process is gone: its device pool went with it (CUDA leaves
 * the use of an exporter's memory and events undefined then), but the
 * batch's host copy (tensors[i].data) is still valid to read.
 * One thread at a time per reader. */
int tsock_batch_cuda_use(const tsock_batch_t *batch, uintptr_t stream, uint32_t flags);

/* As tsock_batch_dlpack, for the device copy: device kDLCUDA with the
 * ordinal of tsock_reader_open_device. The descriptor keeps the pool
 * mapped (even after detach); call tsock_batch_cuda_use() first.
 * The same as tsock_batch_dlpack_export with TSOCK_DLPACK_DEVICE. */
int tsock_batch_dlpack_cuda(const tsock_batch_t *batch, uint32_t i, int versioned, void **out);

/* ---- DLPack export (both libraries) ------------------------------------- */

/* Describes tensor `i` of an acquired batch as a DLPack managed tensor
 * (https://dmlc.github.io/dlpack): a DLManagedTensorVersioned (DLPack 1.0)
 * with DLPACK_FLAG_BITMASK_READ_ONLY set when `versioned` is non-zero, else
 * a legacy DLManagedTensor. Device kDLCPU (pinned host memory is kDLCPU
 * too). The struct is allocated by the library; its deleter only frees it,
 * never needs the GIL and may run on any thread. It does not extend the
 * batch's lifetime: the data stay valid until the batch is released
 * (unless it is kept: tsock_batch_keep keeps every tensor with a live
 * descriptor); it does keep the memory mapped (even after the reader is
 * detached), so a late access reads stale bytes instead of faulting. The
 * batch's dlpack_live counts it while it lives.
 * Booleans are kDLBool, 8 bits. Thread-safe.
 * The same as tsock_batch_dlpack_export with flags TSOCK_DLPACK_VERSIONED
 * or 0. */
int tsock_batch_dlpack(const tsock_batch_t *batch, uint32_t i, int versioned, void **out);

/* Flags of tsock_batch_dlpack_export. */
#define TSOCK_DLPACK_VERSIONED 0x1u     /* a DLManagedTensorVersioned, read-only flag
                                           set; else a legacy DLManagedTensor */
#define TSOCK_DLPACK_DEVICE 0x2u        /* the device copy (kDLCUDA), as
                                           tsock_batch_dlpack_cuda; else host memory */
#define TSOCK_DLPACK_BOOL_AS_UINT8 0x4u /* a boolean tensor described as uint8
                                           (kDLUInt, 8 bits), for consumers that
                                           predate kDLBool; other dtypes unchanged */
#define TSOCK_DLPACK_ROWS 0x8u          /* only rows [row_start, row_stop) of the
                                           first dimension */

/* The one DLPack export, of which tsock_batch_dlpack and
 * tsock_batch_dlpack_cuda are two cases: tensor `i` of an acquired (or
 * kept) batch, as described there, shaped by `flags` (TSOCK_DLPACK_*).
 * With TSOCK_DLPACK_ROWS the tensor is narrowed to rows
 * [row_start, row_stop) of its first dimension, still in place: shape[0]
 * is row_stop - row_start and data points at row row_start (a range with
 * no element keeps the tensor's address); the descriptor counts for the
 * whole tensor in dlpack_live and tsock_batch_keep. Without it, row_start
 * and row_stop must be 0. TSOCK_EINVAL, with tsock_last_error() saying
 * which, for a NULL batch or out, a tensor the batch does not have,
 * unknown flags, rows of a tensor with no dimensions, or a row range not
 * within 0 <= row_start <= row_stop <= shape[0]; TSOCK_EDTYPE for a dtype
 * with no DLPack form; TSOCK_ESTATE for a batch already released that
 * was not kept (the producer may be rewriting its slot); with
 * TSOCK_DLPACK_DEVICE, TSOCK_ENODEVICE as tsock_batch_cuda_ptr. *out is
 * written only on success. Thread-safe, within the batch's lifetime: the
 * released check sees a batch pointer's held entry, so once a later
 * acquire reuses that entry (max_held acquires on) a stale pointer
 * describes the later batch, and an export racing its own reader's
 * release and next acquire may mix the two. Export a batch only while it
 * is held or kept. */
int tsock_batch_dlpack_export(const tsock_batch_t *batch, uint32_t i, uint32_t flags,
                              int64_t row_start, int64_t row_stop, void **out);

/* Calls the deleter of a DLPack managed tensor that no consumer took (a
 * DLManagedTensorVersioned when `versioned` is non-zero, else a legacy
 * DLManagedTensor), as its owner must: so that a binding (Python's capsule
 * destructor) frees one without knowing the struct's layout. Only tsock's
 * own descriptors: TSOCK_EINVAL, calling nothing, for a NULL managed, for
 * one of the other kind than `versioned` names, or for one tsock did not
 * make (a descriptor deleted twice is the caller's bug, as with any
 * deleter). On success it leaves tsock_last_error() as it was, unlike
 * most calls: it runs as a deleter, at any moment (a garbage collector
 * freeing a capsule), and must not erase the message of a failure its
 * thread has not read yet. Thread-safe;
 * never needs the GIL. */
int tsock_dlpack_delete(void *managed, int versioned);

/* ---- Kept batches (both libraries) --------------------------------------- */

/* Keeps tensors of a held batch valid past its release, at their addresses:
 * those in tensor_mask (bit i: tensor i) and every tensor with a live
 * DLPack descriptor (tsock_batch_dlpack). Their bytes are copied into
 * private memory that replaces the slot's pages under the same addresses
 * in one step (mremap), so a thread reading them meanwhile sees the same
 * bytes throughout; the slot itself moves to a new address for later
 * batches, and once the batch is released (tsock_reader_release, as usual)
 * the producer may rewrite it without changing the kept tensors. Pages of
 * the batch that hold no kept tensor are given up: they read as zeros and
 * cost no memory. The kept memory is private to this process and is freed
 * when the last of *kept (see below), the pins (tsock_batch_pin) and the
 * DLPack descriptors of it is gone; it survives tsock_reader_detach.
 *
 * On success *kept (when kept is not NULL) is a batch of its own that
 * describes the kept batch (same fields, tensors at the same addresses):
 * valid until tsock_batch_free(*kept), after the release and after detach;
 * tsock_batch_dlpack works on it. NULL when nothing was to be kept (mask 0
 * and no live descriptor): then nothing was copied. Keeping a batch again
 * copies the tensors not yet kept and returns another kept batch.
 *
 * Cost: a copy of the kept tensors' pages (4 KiB granules) and a few
 * system calls (mmap, mremap); the slot's new mapping and each kept batch
 * take one memory map entry of the process (vm.max_map_count) while they
 * live. TSOCK_ESTATE when the batch is not held by r (released, or never
 * handed out), when r's mapping is registered with CUDA
 * (tsock_reader_register_host: the driver pinned its pages), when r has
 * opened the device path (device memory cannot be kept: copy it), or when
 * the system's page size does not divide the channel's slots; TSOCK_EINVAL
 * for a mask naming tensors the batch does not have; TSOCK_ENOMEM or
 * TSOCK_ESYS when memory or a mapping could not be had (nothing changed
 * then); TSOCK_ENOMEM too when the process already has a quarter of
 * vm.max_map_count kept batches alive (fewer with TSOCK_MAX_KEPT=n in the
 * environment), so that keeping never starves the rest of the process
 * (malloc, thread stacks) of map entries. TSOCK_EEVICTED when the reader was evicted: the slot may have been
 * rewritten while it was copied. One thread at a time per reader. */
int tsock_batch_keep(tsock_reader_t *r, const tsock_batch_t *batch, uint32_t tensor_mask,
                     const tsock_batch_t **kept);

/* Frees a batch returned by tsock_batch_keep; its memory stays while pins
 * and DLPack descriptors of it live. Free each kept batch once (it may be
 * freed after tsock_reader_detach, and in a forked child, which frees only
 * its own copy). Anything else (NULL, a batch of tsock_reader_acquire, one
 * already freed) returns TSOCK_EHANDLE and changes nothing; like free(),
 * a second free is told apart only while no later tsock_batch_keep has
 * returned the same address. Thread-safe. */
int tsock_batch_free(const tsock_batch_t *kept);

/* Keeps the memory a held batch's tensors lie in (its slot's mapping,
 * `payload`) mapped at its address until tsock_mapping_unpin(token), even
 * after the batch is released and the reader detached, so that memory a
 * caller still points into never becomes unmapped. Its contents change
 * once the batch is released, unless it was kept (tsock_batch_keep).
 * TSOCK_ESTATE when the batch is not held by r. One thread at a time per
 * reader. */
int tsock_batch_pin(tsock_reader_t *r, const tsock_batch_t *batch, void **token);

/* Releases everything, frees the reader record and the handle. Thread-safe
 * against other readers, and against calls on r in other threads: a call
 * already inside the reader finishes first (detach waits for it; an
 * acquire waiting for a batch is woken and returns TSOCK_EHANDLE), and
 * calls after it return TSOCK_EHANDLE. Batches (and pointers into them)
 * are invalid once it returns, unless kept or pinned. A second detach
 * returns TSOCK_EHANDLE. A detach from inside a call on r in the same
 * thread (a signal handler that interrupted it) would wait for itself: it
 * returns TSOCK_ESTATE and changes nothing. The
 * producer has freed the record when it returns (it waits up to 1 s for a
 * producer that does not answer, e.g. a stopped one). Waits for
 * the GPU work of released batches (tsock_batch_cuda_use); where CUDA cannot
 * confirm it finished, returns TSOCK_ESYS: the handle is gone, but the
 * record stays claimed, its slots held from the producer, until the
 * process exits. */
int tsock_reader_detach(tsock_reader_t *r);

#ifdef __cplusplus
}
#endif

#endif /* TSOCK_H */
