/*
 * internal.h - private declarations shared by the C files of the reader
 * (and by the producer's C shim in cabi/). Not installed.
 */
#ifndef TSOCK_READER_INTERNAL_H
#define TSOCK_READER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "layout.h"
#include "tsock.h"

/* Hidden: internal symbols stay out of the libraries' exported ABI. */
#define TSOCK_INTERNAL __attribute__((visibility("hidden")))

/* ---- errors (status.c) ---- */

/* Records a detailed message for the calling thread and returns `status`,
 * so failures read `return tsock__fail(TSOCK_EINVAL, "...", ...)`. */
TSOCK_INTERNAL int tsock__fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Like tsock__fail, appending ": strerror(errno)" and mapping errno. */
TSOCK_INTERNAL int tsock__fail_errno(int status, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
TSOCK_INTERNAL void tsock__clear_error(void);

/* ---- platform (platform.c) ----
 * The Linux primitives, one C copy. Their Go twins are in ring/platform.go
 * (futex, OFD byte locks, /proc/<pid>/stat) and ring/segment.go (Reopen):
 * the two libraries cannot share one body (libtsock_reader.so has no Go
 * runtime), so both follow one contract, which docs/ARCHITECTURE.md
 * ("Liveness", "Acquire and release") and ring/layout.h (the lock bytes)
 * state: change a twin together with its other half. */

TSOCK_INTERNAL uint64_t tsock__now_ns(void); /* CLOCK_MONOTONIC */
/* futex on a word of a MAP_SHARED mapping; timeout_ns < 0 waits forever. */
TSOCK_INTERNAL void tsock__futex_wait(const uint32_t *word, uint32_t expected, int64_t timeout_ns);
TSOCK_INTERNAL void tsock__futex_wake_all(uint32_t *word);
/* OFD read lock on one byte (needs a descriptor open for reading): 0 on
 * success, -1 if another description holds a write lock on it, -2 on
 * another error (errno set). */
TSOCK_INTERNAL int tsock__lock_byte_shared(int fd, uint64_t byte);
/* 1 if some other open file description holds a write lock on `byte` (a
 * producer's liveness lock), 0 if not (read locks do not count: anyone
 * who may read the file can take one), -1 on error. */
TSOCK_INTERNAL int tsock__byte_write_locked(int fd, uint64_t byte);
TSOCK_INTERNAL uint64_t tsock__proc_start_time(int pid); /* 0 if unknown */

/* Fork guard: descriptors registered here are closed in a child process
 * right after fork(), so a child never keeps a parent's liveness lock;
 * tsock__fork_generation() changes in the child. Any number of them.
 * tsock__fork_open/tsock__fork_close open and close a descriptor and
 * register it in one step that no fork() can split: the reader's way.
 * tsock__fork_track (0, or -1 out of memory) / _untrack register a
 * descriptor opened elsewhere (the Go producer's). */
TSOCK_INTERNAL int tsock__fork_open(const char *path, int flags); /* open(2)'s result */
TSOCK_INTERNAL int tsock__fork_socket(int domain, int type, int protocol); /* socket(2)'s */
/* recvmsg(2) that never waits (MSG_DONTWAIT), registering every descriptor
 * received (SCM_RIGHTS) before any fork() can copy it: close each with
 * tsock__fork_close. One that cannot be registered (out of memory) is
 * closed and reads -1. */
struct msghdr;
TSOCK_INTERNAL ssize_t tsock__fork_recvmsg(int sock, struct msghdr *msg, int flags);
TSOCK_INTERNAL void tsock__fork_close(int fd);
/* A new open file description of the file open at fd, read-only, through
 * /proc/self/fd (the same file even when its name is gone or names another
 * file since), registered like tsock__fork_open's. -1 with errno. */
TSOCK_INTERNAL int tsock__fork_reopen(int fd);
TSOCK_INTERNAL int tsock__fork_track(int fd);
TSOCK_INTERNAL void tsock__fork_untrack(int fd);
TSOCK_INTERNAL uint64_t tsock__fork_generation(void);

/* ---- the join (join.c) ----
 * A reader attaches over the producer's join socket (layout.h, "The
 * join"). What it gets: */
typedef struct tsock_join {
  int sock;                 /* the connection, kept open while attached (fork-guarded) */
  tsock_reader_record *rec; /* its record, mapped read-write (TSOCK_RECORD_FILE_BYTES) */
  uint32_t index;           /* its roster entry, < the header's reader_capacity */
  uint64_t claim;           /* the entry's claim word while it owns it */
  uint64_t start;           /* first seq to read */
  int in_window;            /* starts at the epoch's first batch (late join window) */
} tsock_join;

/* Joins the channel of the validated header copy h: seg_fd is a
 * descriptor of the segment open for reading (sent as the proof; not the
 * one holding locks), owner the segment file's uid (the producer's must
 * match); the attach started at attach_start (tsock__now_ns) with
 * attach_timeout_ns, which bounds the join too. Returns TSOCK_OK, or a
 * status with a message: TSOCK_EAGAIN when the producer turned the
 * connection away (busy: retry), TSOCK_ETIMEDOUT when it did not answer
 * in time, and otherwise the producer's refusal or the failure. */
TSOCK_INTERNAL int tsock__join(const tsock_header *h, int seg_fd, uint32_t owner, uint32_t start_mode,
                               uint64_t attach_start, int64_t attach_timeout_ns, const char *name,
                               tsock_join *out);
/* Unmaps j's record and closes its connection (after TSOCK_MSG_LEAVE,
 * and once the producer has freed the entry, 1 s at most). */
TSOCK_INTERNAL void tsock__join_leave(tsock_join *j);

/* ---- the read-only mapping (attach.c) ----
 * Tensor memory handed out (DLPack descriptors, pinned views) points into
 * the reader's read-only mapping; each such holder keeps a reference, so the
 * mapping outlives a detached reader until the last one is dropped. */
typedef struct tsock_map_ref {
  void *addr;
  size_t len;
  uint32_t refs;
  /* Called once, just before the mapping is unmapped, when set (the CUDA
   * host registration of cuda_host.c undoes itself there). */
  void (*on_unmap)(struct tsock_map_ref *m);
  void *cuda; /* owned by cuda_host.c */
  /* Slot ranges handed over to kept batches (lease.c): NULL until the
   * first; the final unmap leaves them to their new owners. */
  struct tsock_carve *carve;
} tsock_map_ref;

TSOCK_INTERNAL void tsock__map_ref(tsock_map_ref *m);
TSOCK_INTERNAL void tsock__map_unref(tsock_map_ref *m);

/* ---- leases (lease.c) ----
 * A lease is one slot's payload as this process maps it: an address range
 * that batches of the slot are read at, with the references that keep it
 * mapped (the reader's, while it is the slot's current lease; each held
 * batch of it; each pin; each DLPack descriptor into it) and, per tensor
 * of the batch it carries, the number of live DLPack descriptors.
 * At attach a slot's lease is its range inside the reader's mapping of the
 * whole segment (`parent`, which it holds a reference on). Keeping a batch
 * (tsock_batch_keep) retires its lease: the range becomes private memory
 * the lease owns (parent NULL) and unmaps at its last reference, and the
 * slot gets a fresh lease, a mapping of its own at another address. */
#define TSOCK_LIVE_TOTAL TSOCK_MAX_TENSORS /* live[] index of the sum */
typedef struct tsock_lease {
  uint32_t refs;
  uint32_t slot;
  uint8_t *addr;
  size_t len;
  tsock_map_ref *parent; /* the whole-segment mapping holding the range, or NULL: owned */
  uint32_t retired;      /* kept: the range holds private copies */
  uint32_t kept;         /* mask of the tensors copied (retired leases) */
  uint32_t live[TSOCK_MAX_TENSORS + 1]; /* atomic: DLPack descriptors alive, then the sum */
} tsock_lease;

typedef struct tsock_leases tsock_leases; /* a reader's current lease of each slot */

TSOCK_INTERNAL void tsock__lease_ref(tsock_lease *l);
TSOCK_INTERNAL void tsock__lease_unref(tsock_lease *l);
/* Makes *held (a reference, or NULL) refer to l, moving the reference. */
TSOCK_INTERNAL void tsock__lease_hold(tsock_lease **held, tsock_lease *l);
/* The table of a reader whose mapping is m, payload at `payload` (file
 * offset payload_offset), and whose segment descriptor is fd; NULL when out
 * of memory. Each lease holds a reference on m. */
TSOCK_INTERNAL tsock_leases *tsock__leases_open(tsock_map_ref *m, const uint8_t *payload,
                                                uint64_t payload_offset, uint32_t slot_count,
                                                uint64_t slot_bytes, int fd);
TSOCK_INTERNAL void tsock__leases_close(tsock_leases *t);
/* munmap of a whole-segment mapping at its last reference, leaving out the
 * slot ranges retired leases own. */
TSOCK_INTERNAL void tsock__map_unmap(tsock_map_ref *m);
/* The slot's current lease (the table's reference: take one to keep it). */
TSOCK_INTERNAL tsock_lease *tsock__leases_current(const tsock_leases *t, uint32_t slot);

/* The mapping and payload range of an open reader handle (fails like any
 * call on a bad handle). For cuda_host.c, so that the reader's core knows
 * no CUDA. */
TSOCK_INTERNAL int tsock__reader_map(tsock_reader_t *h, tsock_map_ref **m, const void **base,
                                     uint64_t *len);

/* What a reader keeps per held batch; tsock_batch_t is its first member, so
 * a batch pointer leads back to it. */
typedef struct tsock_held_batch {
  tsock_batch_t batch;
  tsock_tensor_t tensors[TSOCK_MAX_TENSORS];
  uint8_t meta[TSOCK_META_MAX];
  int handed;        /* handed out to the caller (not skipped or rejected) */
  int user_released; /* the caller released it (GPU work may still read it) */
  int kept;          /* a copy made by tsock_batch_keep: valid after its release */
  tsock_lease *lease; /* where its tensors lie (a reference), NULL before the first batch */
  uint32_t slot;         /* slot index of the batch */
  uint32_t payload_kind; /* TSOCK_PAYLOAD_*, checked */
  /* GPU use, owned by cuda_device.c; acquire.c only resets them. */
  void *device;     /* the reader's device state, NULL before tsock_reader_open_device */
  uintptr_t stream; /* the stream of tsock_batch_cuda_use */
  int stream_set;
  uint32_t use_flags;
  uint64_t use_thread; /* the thread that called it (CU_STREAM_PER_THREAD is per thread) */
  int several_streams; /* used on more than one stream: only the device as a whole fences it */
  void *fence; /* armed at release: the slot goes back once it has fired */
} tsock_held_batch;

/* How the reader's core (release.c, acquire.c, attach.c), which knows no
 * CUDA, lets cuda_device.c hold released batches back while GPU work
 * queued before the release may read them. */
typedef struct tsock_device_hooks {
  /* At release of a batch with stream_set: arms hb->fence (may leave it
   * NULL when nothing is pending). */
  void (*arm)(tsock_held_batch *hb);
  /* 1 while hb->fence has not fired; on firing it clears hb->fence and
   * returns 0. With wait, blocks until it fires. */
  int (*pending)(tsock_held_batch *hb, int wait);
  /* At detach, once no fence is pending: drops the reader's reference. */
  void (*detach)(void *device);
} tsock_device_hooks;

/* ---- an open reader ----
 * Its state is split by mechanism: the handle table (handles.c), attach
 * and detach (attach.c), acquire and its wait (acquire.c), release and
 * its fences (release.c), what other parts see of it (reader.c). */
#define TSOCK_READER_HANDLES 1024u /* open readers per process */

struct reader_impl {
  int fd;
  uint64_t fork_gen;
  const uint8_t *map; /* whole segment, read-only */
  size_t map_len;
  tsock_map_ref *map_ref; /* owns `map` once attached */
  tsock_leases *leases; /* the current mapping of each slot's payload (lease.c) */
  int send_fd; /* the mapping's descriptor, sent as the join's proof, then closed */
  int sock;    /* connection to the producer (join.c), open while attached */
  /* The header as validated at attach, private: every value the reader
   * derives pointers, sizes or decisions from comes from here, never again
   * from the shared page, which the producer (or anyone who can write the
   * file) may change after the check. */
  tsock_header h;
  /* The live header page: only the words that change while the channel
   * runs (published, state, producer_waiting, epoch_start), each used in a
   * way a wrong value cannot turn into a bad address. */
  const tsock_header *live;
  const tsock_slot *slots;
  const uint8_t *payload;
  uint64_t mask;
  uint64_t slot_payload_bytes;
  uint32_t index;        /* our roster entry */
  const tsock_roster_entry *entry; /* in the read-only mapping: the producer's verdict */
  tsock_reader_record *rec; /* ours, read-write (a memfd of our own) */
  uint64_t claim;        /* our entry's claim word while active */
  uint64_t next;         /* next seq to acquire */
  uint64_t released;     /* every seq below is released (mirror of rec->cursor) */
  int skipping;          /* TSOCK_START_NEXT_EPOCH: drop batches until index 0 */
  int producer_dead;     /* the producer's lock was seen free */
  uint32_t max_held;       /* at most the slot count (see attach) */
  uint32_t max_held_asked; /* the option, for messages */
  int64_t spin_ns;
  uint64_t last_live_check;
  tsock_held_batch *held;      /* max_held entries, by seq % max_held */
  /* GPU (cuda_device.c): released batches held back by fences (release.c) */
  void *device;
  const tsock_device_hooks *hooks;
  uint32_t fenced; /* held batches with an armed fence */
  uint32_t closing; /* atomic: detached by another thread (tsock__handle_take) */
};

/* The reader behind handle h, or NULL with *status set (TSOCK_EHANDLE for
 * a stale or unknown handle, TSOCK_EFORKED in a child of its process).
 * tsock__handle_new registers one (NULL when the table is full).
 * tsock__handle_get counts a use of it, which the caller drops with
 * tsock__handle_put(h) once it no longer touches the reader (every public
 * call on a handle holds one for its whole length; nested uses are fine).
 * tsock__handle_take unregisters it (detach), so later calls fail with
 * TSOCK_EHANDLE, and returns once no other thread's use is left: it sets
 * the reader's `closing` and wakes an acquire waiting in it, which then
 * returns TSOCK_EHANDLE. handles.c. */
TSOCK_INTERNAL tsock_reader_t *tsock__handle_new(struct reader_impl *impl);
TSOCK_INTERNAL struct reader_impl *tsock__handle_get(tsock_reader_t *h, int *status);
TSOCK_INTERNAL void tsock__handle_put(tsock_reader_t *h);
TSOCK_INTERNAL struct reader_impl *tsock__handle_take(tsock_reader_t *h, int *status);
/* TSOCK_OK while the reader's roster entry is still its own, else
 * TSOCK_EEVICTED with a message. acquire.c. */
TSOCK_INTERNAL int tsock__check_claim(struct reader_impl *r);
/* Whether the producer's liveness lock is held (an error counts as alive).
 * attach.c. */
TSOCK_INTERNAL int tsock__producer_alive(struct reader_impl *r);
/* Moves the cursor past every batch the producer may have back; with
 * wait_oldest, first waits for the oldest held batch's fence. release.c. */
TSOCK_INTERNAL void tsock__advance(struct reader_impl *r, int wait_oldest);

/* What the reader's CUDA files (cuda_host.c, cuda_device.c) need to see of
 * an open reader. */
typedef struct tsock_reader_view {
  /* The reader's private copy of the header, validated at attach: static
   * fields (gpu_pool, gpu_uuid, gpu_mem_handle, geometry) are read here,
   * never from the shared page, which may have changed since the check. */
  const tsock_header *hdr;
  /* The shared header page, for the words that change while attached
   * (state, published): atomic loads only, never a static field. */
  const tsock_header *live;
  const tsock_slot *slots;
  tsock_reader_record *rec; /* our record: placement fields */
  uint32_t slot_count;
  uint64_t slot_payload_bytes;
  int fd;       /* the segment: its producer lock tells whether the producer lives */
  void *device; /* set by tsock__reader_set_device, else NULL */
} tsock_reader_view;

TSOCK_INTERNAL int tsock__reader_view(tsock_reader_t *h, tsock_reader_view *v);
/* Installs the device state and hooks (once; every held batch points at it). */
TSOCK_INTERNAL int tsock__reader_set_device(tsock_reader_t *h, void *device,
                                            const tsock_device_hooks *hooks);

/* The held batch behind b when it is a batch of reader h that was handed
 * out and not released (TSOCK_ESTATE otherwise), and the reader's leases;
 * fails like any call on a bad handle, or TSOCK_EEVICTED once the reader
 * was evicted. For lease.c. */
TSOCK_INTERNAL int tsock__reader_held(tsock_reader_t *h, const tsock_batch_t *b, const char *fn,
                                      tsock_held_batch **hb, tsock_leases **leases);
/* TSOCK_OK while the reader's record is still its own (not evicted). */
TSOCK_INTERNAL int tsock__reader_claimed(tsock_reader_t *h);

/* Pin table (handles.c): tokens are handles. tsock__pin_add registers
 * `obj`, dropped by drop(obj) at tsock_mapping_unpin(token) (token may be
 * NULL: then only tsock__pin_take finds it); tsock__pin_take removes the
 * entry of obj with that drop and returns 1, or 0 if there is none (the
 * caller then must not touch obj). */
TSOCK_INTERNAL int tsock__pin_add(void (*drop)(void *), void *obj, void **token);
TSOCK_INTERNAL int tsock__pin_take(const void *obj, void (*drop)(void *));

/* Where the tensor a DLPack descriptor describes lies, and what keeps it
 * there (dlpack.c makes the descriptor; the device path fills `data`,
 * `device_id` and `ref`). */
typedef struct tsock_dlpack_where {
  uintptr_t data;      /* its first element: a host address or a CUdeviceptr */
  int32_t device_type; /* DLPack's kDLCPU or kDLCUDA (dlpack.c) */
  int32_t device_id;
  /* Counted in live[] and referenced while the descriptor lives (NULL:
   * none). */
  tsock_lease *lease;
  /* A reference the caller took (NULL: none), dropped by unref(ref) when
   * the descriptor is deleted. */
  void (*unref)(void *);
  void *ref;
} tsock_dlpack_where;

/* Where tensor i of b's device copy lies, for a DLPack descriptor (the
 * checks of tsock_batch_cuda_ptr, with fn in messages), and a reference on
 * the reader's device pool in at->ref. cuda_device.c. */
TSOCK_INTERNAL int tsock__dlpack_device_where(const char *fn, const tsock_batch_t *b, uint32_t i,
                                              tsock_dlpack_where *at);

#endif
