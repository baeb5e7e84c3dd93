/*
 * layout.h - the one definition of tsock's shared-memory segment.
 *
 * The producer (Go, through cgo) and the reader (C) both compile against
 * these structs, so the two sides cannot drift. docs/ARCHITECTURE.md
 * explains who writes each field and in which order.
 *
 * Rules for this file:
 *   - fixed-width fields only, explicit padding, no pointers (offsets only);
 *   - every struct size and every hot field offset is pinned by a static
 *     assert; change one and bump TSOCK_LAYOUT_VERSION;
 *   - fields written by more than one party are atomic words.
 *
 * Segment: /dev/shm/tsock.<name>, one file, written by the producer only
 * (group and other never get a write bit; readers open it O_RDONLY and map
 * it PROT_READ):
 *
 *   [0, 4096)                 tsock_header
 *   [roster_offset, ...)      tsock_roster_entry[reader_capacity]: who reads, the producer's verdicts
 *   [slots_offset, ...)       tsock_slot[slot_count]
 *   [payload_offset, ...)     payload, slot_payload_bytes per slot
 *
 * What a reader writes lives elsewhere: its own tsock_reader_record, one
 * page in a sealed memfd the producer made for it alone and handed over at
 * the join (tsock_join_request / tsock_join_reply on the channel's join
 * socket, an abstract Unix address derived from header.join_key).
 *
 * OFD locks on the segment file: the producer holds a write lock on byte
 * TSOCK_LOCK_PRODUCER (its liveness: a read lock there is never the
 * producer's); the reader of roster entry i a read lock on byte
 * TSOCK_LOCK_READER0 + i (presence, for tools and dead-channel reclaim);
 * readers that map the device pool a read lock on TSOCK_LOCK_DEVICE_MAP.
 * The kernel drops them when the process dies.
 */
#ifndef TSOCK_RING_LAYOUT_H
#define TSOCK_RING_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "tsock.h"

#define TSOCK_MAGIC 0x4d48534b434f5354ull /* "TSOCKSHM" in a little-endian word */
#define TSOCK_LAYOUT_VERSION 4u

#define TSOCK_PAGE 4096u
#define TSOCK_CACHE_LINE 64u
#define TSOCK_SHM_DIR "/dev/shm"
#define TSOCK_SHM_PREFIX "tsock."

#define TSOCK_MIN_SLOTS 2u
#define TSOCK_MAX_SLOTS 65536u
#define TSOCK_MAX_READERS 1024u
#define TSOCK_MAX_SLOT_BYTES (1ull << 34) /* 16 GiB per slot */

/* Byte offsets used for OFD locks (advisory; unrelated to the data there).
 * Anyone who may read the file may take a read lock on any byte, so only a
 * write lock on TSOCK_LOCK_PRODUCER means "a producer lives"; the reader
 * bytes and TSOCK_LOCK_DEVICE_MAP only ever say "someone may be there". */
#define TSOCK_LOCK_PRODUCER 0
#define TSOCK_LOCK_READER0 1
/* A shared (read) lock held by every reader process that has the device
 * pool mapped (cuIpcOpenMemHandle), from before the open until after its
 * close, which may be long after detach (DLPack tensors keep the pool
 * mapped). The producer frees the pool only while nobody holds it: CUDA
 * leaves freeing exported memory an importer still maps undefined. */
#define TSOCK_LOCK_DEVICE_MAP (TSOCK_LOCK_READER0 + TSOCK_MAX_READERS)

/* Producer states (tsock_header.state). */
#define TSOCK_STATE_OPEN 1u
#define TSOCK_STATE_CLOSED 2u

/* Roster entry states: low 8 bits of tsock_roster_entry.claim; the upper
 * 56 bits are a generation that grows on every change of owner. Written by
 * the producer only. */
#define TSOCK_READER_FREE 0u
#define TSOCK_READER_ACTIVE 1u  /* attached, gating the producer */
#define TSOCK_READER_EVICTED 2u /* still attached, no longer gating: its next call fails */
#define TSOCK_CLAIM_STATE(c) ((uint32_t)((c) & 0xffu))
#define TSOCK_CLAIM_GEN(c) ((c) >> 8)
#define TSOCK_CLAIM(gen, state) (((uint64_t)(gen) << 8) | (uint64_t)(state))

/* Slot payload kinds (tsock_slot.payload_kind). */
#define TSOCK_PAYLOAD_HOST 0u        /* in the host payload only */
#define TSOCK_PAYLOAD_HOST_DEVICE 1u /* in the host payload and copied to the slot's
                                        part of the device pool; the copy is done
                                        when the slot's CUDA event has fired */

/* Where a reader reads batches from (tsock_reader_record.placement). */
#define TSOCK_PLACEMENT_HOST 0u   /* host payload, not registered with CUDA */
#define TSOCK_PLACEMENT_PINNED 1u /* host payload, registered as pinned memory */
#define TSOCK_PLACEMENT_DEVICE 2u /* the producer's device pool, through CUDA IPC */

#define TSOCK_CUDA_HANDLE_BYTES 64u /* CUipcMemHandle, CUipcEventHandle */
#define TSOCK_CUDA_UUID_BYTES 16u   /* CUuuid */
#define TSOCK_JOIN_KEY_BYTES 16u    /* tsock_header.join_key */

/* ---- Header page ---------------------------------------------------------
 * Written by the producer only. Identity fields are written once before
 * layout_version, which is stored last with release semantics: a reader
 * that loads layout_version with acquire semantics and finds the expected
 * value sees a complete header. */
typedef struct tsock_header {
  /* line 0: identity and geometry (written once) */
  uint64_t magic;                /* TSOCK_MAGIC */
  uint32_t layout_version;       /* TSOCK_LAYOUT_VERSION, stored last */
  uint32_t header_size;          /* sizeof(tsock_header) */
  uint32_t slot_size;            /* sizeof(tsock_slot) */
  uint32_t roster_entry_size;    /* sizeof(tsock_roster_entry) */
  uint32_t slot_count;           /* power of two */
  uint32_t reader_capacity;      /* entries in the roster */
  uint64_t slot_payload_bytes;   /* payload bytes per slot, multiple of 4096 */
  uint64_t roster_offset;        /* byte offsets from the segment start */
  uint64_t slots_offset;
  uint64_t payload_offset;
  /* line 1 */
  uint64_t total_bytes;          /* size of the file */
  int32_t producer_pid;
  uint32_t pad0;
  uint64_t producer_start_time;  /* /proc/<pid>/stat field 22, guards pid reuse */
  uint64_t created_ns;           /* CLOCK_REALTIME at creation */
  char name[32];                 /* informational prefix of the channel name */
  /* lines 2-3: producer state */
  uint32_t state;                /* TSOCK_STATE_*, atomic */
  uint32_t producer_waiting;     /* 1 while reserve waits; a releasing reader then
                                    wakes its record's cursor word (futex) */
  uint64_t heartbeat_ns;         /* CLOCK_MONOTONIC, informational only */
  uint64_t epoch;                /* current epoch (informational) */
  uint64_t epoch_start;          /* seq of the current epoch's first batch */
  uint64_t join_window;          /* batches of each epoch kept for late joiners */
  uint8_t pad1[88];
  /* lines 4-5: the published sequence, alone on its own two cache lines
   * (adjacent-line prefetch pairs lines) */
  uint64_t published;            /* batches published; seq < published are readable.
                                    Readers sleep on its low 32-bit word (futex). */
  uint8_t pad3[120];
  /* lines 6-7: producer statistics (informational) */
  uint64_t stat_backpressure_ns;
  uint64_t stat_readers_reclaimed;
  uint64_t stat_readers_evicted;
  uint64_t stat_payload_bytes;
  uint8_t pad4[96];
  /* lines 8-9: the device pool (written once, before layout_version).
   * gpu_pool = 1 when the producer copies each batch into one CUDA
   * allocation of gpu_pool_bytes (slot s at s * slot_payload_bytes),
   * exported once as gpu_mem_handle. */
  uint32_t gpu_pool;             /* 0 or 1 */
  int32_t gpu_ordinal;           /* the producer's CUDA ordinal (informational) */
  uint64_t gpu_pool_bytes;       /* slot_count * slot_payload_bytes */
  uint8_t gpu_uuid[TSOCK_CUDA_UUID_BYTES]; /* the pool's GPU; readers match on it */
  uint8_t pad5[32];
  uint8_t gpu_mem_handle[TSOCK_CUDA_HANDLE_BYTES]; /* CUipcMemHandle of the pool */
  /* line 10: the join socket (written once, before layout_version). The
   * producer listens on the abstract Unix address that
   * tsock_layout_join_address() derives from this random key, bound
   * before the segment is named, so nobody can take it first while the
   * producer lives. Not a secret: /proc/net/unix lists the address to
   * everyone in the network namespace; who may join is decided by the
   * descriptor a request carries (docs/ARCHITECTURE.md, "Threat model"). */
  uint8_t join_key[TSOCK_JOIN_KEY_BYTES];
  uint8_t pad6[48];
  uint8_t pad_page[TSOCK_PAGE - 704];
} tsock_header;

/* ---- Roster ----------------------------------------------------------------
 * One entry per reader, in the segment, written by the producer only: the
 * claim word (a reader learns there that it was evicted), who the reader
 * is (from the kernel: SO_PEERCRED of its join socket), and, for tools,
 * the reader's progress and placement as last mirrored from its record
 * (the producer copies them every TSOCK_MIRROR_MS; reader-written values,
 * so tools treat them as untrusted). */
typedef struct tsock_roster_entry {
  /* line 0 */
  uint64_t claim;          /* generation << 8 | TSOCK_READER_* */
  int32_t pid;             /* in the producer's pid namespace; 0 when not visible there */
  uint32_t uid;
  uint64_t start_time;     /* /proc/<pid>/stat field 22, guards pid reuse; 0 unknown */
  uint32_t start_mode;     /* tsock_start, as the reader asked */
  uint32_t gid;
  uint64_t cursor;         /* mirrored from the record */
  uint64_t acquired;
  uint64_t heartbeat_ns;
  uint64_t batches;
  /* line 1 */
  uint64_t wait_ns;
  uint32_t placement;      /* TSOCK_PLACEMENT_* as the reader wrote it (any value) */
  int32_t cuda_ordinal;
  uint8_t gpu_uuid[TSOCK_CUDA_UUID_BYTES];
  uint64_t attach_ns;      /* CLOCK_MONOTONIC when the producer admitted the reader
                              (written by the producer, with its identity); 0: not
                              known (a producer from before the field: it was padding) */
  uint8_t pad[24];
} tsock_roster_entry;

/* How often the producer mirrors records into the roster. */
#define TSOCK_MIRROR_MS 20u

/* ---- Reader record ---------------------------------------------------------
 * The only memory a reader writes, one per reader: the first bytes of a
 * memfd of TSOCK_RECORD_FILE_BYTES that the producer creates for that
 * reader alone, sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL: its size
 * never changes, so the producer's mapping can never fault) and handed over
 * at the join. Its cursor and acquired fields hold the reader's start when
 * it gets it. From then on only the reader writes it (the producer, once
 * more, when the reader is gone: it changes and wakes the cursor word it
 * may sleep on), and the producer treats every field as untrusted input
 * (a cursor is clamped into the ring, anything else is informational). */
typedef struct tsock_reader_record {
  /* line 0: progress, written at every acquire and release */
  uint64_t cursor;         /* every seq below is released: the producer gates on it,
                              and sleeps on its low half (futex) while it waits for it */
  uint64_t acquired;       /* every seq below was acquired */
  uint64_t heartbeat_ns;   /* CLOCK_MONOTONIC of last acquire/release */
  uint64_t wait_ns;        /* total time spent waiting for data (data stall) */
  uint64_t batches;        /* batches acquired */
  uint8_t pad0[24];
  /* line 1: where the reader reads from, informational (tsock gpus) */
  uint32_t placement;      /* TSOCK_PLACEMENT_* */
  int32_t cuda_ordinal;    /* the reader's device, in its own process's numbering; -1 none */
  uint8_t gpu_uuid[TSOCK_CUDA_UUID_BYTES]; /* that device's UUID */
  uint32_t attached;       /* 1 once its attach has completed: what the producer's
                              reader count (wait_readers) counts */
  uint8_t pad1[36];
  /* lines 2-3, alone (the adjacent-line prefetcher pairs lines): 1 while
   * the reader may be asleep on header.published. The producer loads it
   * after each publish and wakes sleepers when any attached reader's is
   * set. Stored before the reader's last look at published, cleared after. */
  uint32_t sleeping;
  uint8_t pad2[124];
} tsock_reader_record;

#define TSOCK_RECORD_FILE_BYTES TSOCK_PAGE

/* ---- The join --------------------------------------------------------------
 * A reader attaches over the channel's join socket (SOCK_SEQPACKET): it
 * sends a tsock_join_request carrying, as SCM_RIGHTS, one descriptor of the
 * segment opened for reading, which proves it may read the channel (the
 * producer checks it is its segment's inode, opened for reading, not
 * O_PATH: the file's permission bits decide who may attach). The producer
 * answers with a tsock_join_reply carrying the record's memfd. The
 * connection then stays open while the reader is attached: its end of file
 * tells the producer that the reader is gone. (A producer waiting for
 * releases sleeps on the low half of the gating reader's cursor, a futex
 * word in its record that the reader changes and wakes.) */
#define TSOCK_JOIN_MAGIC 0x4e494f4a4b434f53ull /* "SOCKJOIN" in a little-endian word */
#define TSOCK_JOIN_ADDR_MAX 64u

typedef struct tsock_join_request {
  uint64_t magic;          /* TSOCK_JOIN_MAGIC */
  uint32_t layout_version; /* TSOCK_LAYOUT_VERSION */
  uint32_t start_mode;     /* tsock_start */
  uint64_t reserved;       /* 0 */
} tsock_join_request;

typedef struct tsock_join_reply {
  uint64_t magic;          /* TSOCK_JOIN_MAGIC */
  uint32_t layout_version; /* TSOCK_LAYOUT_VERSION */
  int32_t status;          /* TSOCK_OK, or why the producer refused (no memfd then) */
  uint64_t claim;          /* the roster entry's claim word while this reader owns it */
  uint64_t start;          /* first seq to read; the record's cursor already says so */
  uint32_t index;          /* roster entry */
  uint32_t flags;          /* TSOCK_JOIN_* */
} tsock_join_reply;

/* The reader starts at the first batch of the current epoch (late join
 * window): it must not skip to the next one. */
#define TSOCK_JOIN_IN_WINDOW 1u

/* After the join, the reader sends one byte, when it detaches (end of file
 * without it: it died); the producer then frees its entry and closes. */
#define TSOCK_MSG_LEAVE 'l'

/* The abstract Unix socket address (sun_path, starting with its NUL) of
 * the join socket of a header with this key; returns its length. */
static inline uint32_t tsock_layout_join_address(const uint8_t key[TSOCK_JOIN_KEY_BYTES],
                                                 char path[TSOCK_JOIN_ADDR_MAX]) {
  static const char prefix[] = "tsock-join-";
  static const char hex[] = "0123456789abcdef";
  uint32_t n = 0;
  path[n++] = '\0';
  for (uint32_t i = 0; prefix[i] != '\0'; i++) path[n++] = prefix[i];
  for (uint32_t i = 0; i < TSOCK_JOIN_KEY_BYTES; i++) {
    path[n++] = hex[key[i] >> 4];
    path[n++] = hex[key[i] & 15];
  }
  return n;
}

/* ---- Slots ---------------------------------------------------------------
 * Written by the producer only, while no live reader can be reading it
 * (gating). stamp is the seqlock: 0 while the slot is being written, seq+1
 * once complete (release store). A reader checks it before and after
 * copying the descriptors. */
typedef struct tsock_shm_tensor {
  int32_t dtype;
  int32_t ndim;
  uint64_t offset;                  /* bytes from the slot payload start */
  uint64_t nbytes;
  int64_t shape[TSOCK_MAX_DIMS];
  int64_t strides[TSOCK_MAX_DIMS];  /* elements */
} tsock_shm_tensor;

typedef struct tsock_slot {
  uint64_t stamp;           /* seqlock: 0 = being written, else seq + 1 */
  uint64_t epoch;
  uint64_t index;
  uint32_t flags;           /* TSOCK_BATCH_* */
  uint32_t n_tensors;
  uint64_t payload_bytes;   /* bytes of the slot payload in use */
  uint32_t meta_len;
  uint32_t payload_kind;    /* TSOCK_PAYLOAD_* */
  uint64_t publish_ns;      /* CLOCK_MONOTONIC */
  uint32_t reserved0;
  uint32_t reserved1;
  tsock_shm_tensor tensors[TSOCK_MAX_TENSORS];
  uint8_t meta[TSOCK_META_MAX];
  /* Written once, before layout_version, when the header has a device
   * pool: the CUipcEventHandle of the event the producer records after
   * copying this slot to the pool. Outside the seqlock: it never changes. */
  uint8_t cuda_event[TSOCK_CUDA_HANDLE_BYTES];
} tsock_slot;

/* ---- Pinned sizes and offsets ----------------------------------------------- */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tsock's segment layout is little-endian (the futex word is the low half of published)"
#endif
#define TSOCK_STATIC_ASSERT(c, m) _Static_assert(c, m)
#ifdef __cplusplus
#undef TSOCK_STATIC_ASSERT
#define TSOCK_STATIC_ASSERT(c, m) static_assert(c, m)
#endif

TSOCK_STATIC_ASSERT(sizeof(tsock_header) == TSOCK_PAGE, "header is one page");
TSOCK_STATIC_ASSERT(offsetof(tsock_header, layout_version) == 8, "layout_version");
TSOCK_STATIC_ASSERT(offsetof(tsock_header, total_bytes) == 64, "line 1");
TSOCK_STATIC_ASSERT(offsetof(tsock_header, state) == 128, "state line");
TSOCK_STATIC_ASSERT(offsetof(tsock_header, published) == 256, "published line");
TSOCK_STATIC_ASSERT(offsetof(tsock_header, stat_backpressure_ns) == 384, "stats line");
TSOCK_STATIC_ASSERT(offsetof(tsock_header, join_key) == 640, "join line");
TSOCK_STATIC_ASSERT(sizeof(tsock_roster_entry) == 128, "roster entry");
TSOCK_STATIC_ASSERT(offsetof(tsock_roster_entry, wait_ns) == 64, "roster entry line 1");
TSOCK_STATIC_ASSERT(offsetof(tsock_roster_entry, attach_ns) == 96, "attach_ns in line 1");
TSOCK_STATIC_ASSERT(sizeof(tsock_reader_record) == 256, "reader record");
TSOCK_STATIC_ASSERT(sizeof(tsock_reader_record) <= TSOCK_RECORD_FILE_BYTES, "record fits its file");
TSOCK_STATIC_ASSERT(offsetof(tsock_reader_record, cursor) == 0, "cursor");
TSOCK_STATIC_ASSERT(offsetof(tsock_reader_record, sleeping) == 128, "sleeping lines");
TSOCK_STATIC_ASSERT(sizeof(tsock_join_request) == 24, "join request");
TSOCK_STATIC_ASSERT(sizeof(tsock_join_reply) == 40, "join reply");
TSOCK_STATIC_ASSERT(1 + 11 + 2 * TSOCK_JOIN_KEY_BYTES <= TSOCK_JOIN_ADDR_MAX, "join address");
TSOCK_STATIC_ASSERT(sizeof(tsock_shm_tensor) == 152, "tensor descriptor");
TSOCK_STATIC_ASSERT(offsetof(tsock_slot, tensors) == 64, "slot head");
TSOCK_STATIC_ASSERT(offsetof(tsock_header, gpu_pool) == 512, "gpu line");
TSOCK_STATIC_ASSERT(offsetof(tsock_header, gpu_mem_handle) == 576, "gpu handle line");
TSOCK_STATIC_ASSERT(offsetof(tsock_reader_record, placement) == 64, "record line 1");
TSOCK_STATIC_ASSERT(sizeof(tsock_slot) == 64 + TSOCK_MAX_TENSORS * 152 + TSOCK_META_MAX + 64,
                    "slot size");
TSOCK_STATIC_ASSERT(sizeof(tsock_slot) % TSOCK_CACHE_LINE == 0, "slots are whole lines");

/* ---- Rules both sides apply ----------------------------------------------- */

static inline uint64_t tsock_align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

/* Bytes per element; 0 for an unknown dtype. */
static inline uint32_t tsock_layout_dtype_size(int32_t dtype) {
  switch (dtype) {
  case TSOCK_DTYPE_BOOL: case TSOCK_DTYPE_INT8: case TSOCK_DTYPE_UINT8: return 1;
  case TSOCK_DTYPE_INT16: case TSOCK_DTYPE_UINT16:
  case TSOCK_DTYPE_FLOAT16: case TSOCK_DTYPE_BFLOAT16: return 2;
  case TSOCK_DTYPE_INT32: case TSOCK_DTYPE_UINT32: case TSOCK_DTYPE_FLOAT32: return 4;
  case TSOCK_DTYPE_INT64: case TSOCK_DTYPE_UINT64: case TSOCK_DTYPE_FLOAT64: return 8;
  default: return 0;
  }
}

/* Checks one tensor descriptor against a payload of `payload_bytes`:
 * known dtype, ndim in range, non-negative shape and strides, offset aligned
 * to the element size, and every addressed element inside
 * [offset, offset + nbytes) inside the payload. Overflow-safe.
 * Returns 0 or TSOCK_EDTYPE / TSOCK_ETOOBIG. Used by the producer before
 * publishing and by readers before trusting a slot. */
static inline int tsock_layout_check_tensor(int32_t dtype, int32_t ndim, const int64_t *shape,
                                            const int64_t *strides, uint64_t offset,
                                            uint64_t nbytes, uint64_t payload_bytes) {
  uint64_t item = tsock_layout_dtype_size(dtype);
  if (item == 0 || ndim < 0 || ndim > (int32_t)TSOCK_MAX_DIMS) return TSOCK_EDTYPE;
  if (offset % item != 0) return TSOCK_EDTYPE;
  if (offset > payload_bytes || nbytes > payload_bytes - offset) return TSOCK_ETOOBIG;
  /* last = index of the furthest element, in elements; empty tensors need no bytes */
  uint64_t last = 0;
  int empty = 0;
  for (int32_t i = 0; i < ndim; i++) {
    if (shape[i] < 0 || strides[i] < 0) return TSOCK_EDTYPE;
    if (shape[i] == 0) { empty = 1; continue; }
    uint64_t span = (uint64_t)(shape[i] - 1);
    uint64_t st = (uint64_t)strides[i];
    if (st != 0 && span > (UINT64_MAX - last) / st) return TSOCK_ETOOBIG;
    last += span * st;
  }
  if (empty) return 0;
  if (last >= UINT64_MAX / item) return TSOCK_ETOOBIG;
  if ((last + 1) * item > nbytes) return TSOCK_ETOOBIG;
  return 0;
}

/* Geometry of a segment, derived from its three parameters. */
typedef struct tsock_geometry {
  uint64_t roster_offset, slots_offset, payload_offset, total_bytes, slot_payload_bytes;
} tsock_geometry;

/* Computes the geometry; returns 0, or TSOCK_EINVAL for parameters outside
 * the limits. The producer lays the segment out with it and a reader checks
 * the header against it, so both agree on every offset. */
static inline int tsock_layout_geometry(uint32_t slot_count, uint32_t reader_capacity,
                                        uint64_t slot_payload_bytes, tsock_geometry *g) {
  if (slot_count < TSOCK_MIN_SLOTS || slot_count > TSOCK_MAX_SLOTS ||
      (slot_count & (slot_count - 1)) != 0)
    return TSOCK_EINVAL;
  if (reader_capacity < 1 || reader_capacity > TSOCK_MAX_READERS) return TSOCK_EINVAL;
  if (slot_payload_bytes < 1 || slot_payload_bytes > TSOCK_MAX_SLOT_BYTES) return TSOCK_EINVAL;
  g->slot_payload_bytes = tsock_align_up(slot_payload_bytes, TSOCK_PAGE);
  g->roster_offset = TSOCK_PAGE;
  g->slots_offset = tsock_align_up(
      g->roster_offset + (uint64_t)reader_capacity * sizeof(tsock_roster_entry), TSOCK_PAGE);
  g->payload_offset =
      tsock_align_up(g->slots_offset + (uint64_t)slot_count * sizeof(tsock_slot), TSOCK_PAGE);
  g->total_bytes = g->payload_offset + (uint64_t)slot_count * g->slot_payload_bytes;
  return 0;
}

/* Which rule of tsock_layout_check_header a corrupt header broke. */
typedef enum tsock_header_fault {
  TSOCK_HEADER_SOUND = 0,        /* no rule broken */
  TSOCK_HEADER_BAD_MAGIC = 1,    /* not a tsock segment */
  TSOCK_HEADER_STRUCT_SIZES = 2, /* header, slot or roster entry of another size */
  TSOCK_HEADER_GEOMETRY = 3,     /* offsets and sizes not those of its parameters */
  TSOCK_HEADER_FILE_SIZE = 4,    /* the file is not as long as the header says */
  TSOCK_HEADER_DEVICE_POOL = 5   /* device pool fields out of range */
} tsock_header_fault;

/* What a tsock_header_fault means, for messages (the C reader's and Go's). */
static inline const char *tsock_layout_header_fault_str(int why) {
  switch (why) {
  case TSOCK_HEADER_SOUND: return "no fault";
  case TSOCK_HEADER_BAD_MAGIC: return "not a tsock segment (bad magic)";
  case TSOCK_HEADER_STRUCT_SIZES: return "inconsistent struct sizes in header";
  case TSOCK_HEADER_GEOMETRY: return "inconsistent geometry in header";
  case TSOCK_HEADER_FILE_SIZE: return "the file's size differs from the header's";
  case TSOCK_HEADER_DEVICE_POOL: return "inconsistent device pool in header";
  default: return "unknown fault";
  }
}

/* Checks a mapped header against this layout and a file of `file_size`
 * bytes. Returns 0; TSOCK_EAGAIN while layout_version is still 0 (being
 * built); TSOCK_ECORRUPT for a foreign or inconsistent header, with the
 * rule it broke in *why (a tsock_header_fault); TSOCK_EVERSION for another
 * layout version. */
static inline int tsock_layout_check_header(const tsock_header *h, uint64_t file_size, int *why) {
  *why = TSOCK_HEADER_SOUND;
  if (h->magic != TSOCK_MAGIC) return *why = TSOCK_HEADER_BAD_MAGIC, TSOCK_ECORRUPT;
  uint32_t v = __atomic_load_n(&h->layout_version, __ATOMIC_ACQUIRE);
  if (v == 0) return TSOCK_EAGAIN;
  if (v != TSOCK_LAYOUT_VERSION) return TSOCK_EVERSION;
  if (h->header_size != sizeof(tsock_header) || h->slot_size != sizeof(tsock_slot) ||
      h->roster_entry_size != sizeof(tsock_roster_entry))
    return *why = TSOCK_HEADER_STRUCT_SIZES, TSOCK_ECORRUPT;
  tsock_geometry g;
  if (tsock_layout_geometry(h->slot_count, h->reader_capacity, h->slot_payload_bytes, &g) != 0 ||
      g.slot_payload_bytes != h->slot_payload_bytes || g.roster_offset != h->roster_offset ||
      g.slots_offset != h->slots_offset || g.payload_offset != h->payload_offset ||
      g.total_bytes != h->total_bytes)
    return *why = TSOCK_HEADER_GEOMETRY, TSOCK_ECORRUPT;
  if (file_size != h->total_bytes) return *why = TSOCK_HEADER_FILE_SIZE, TSOCK_ECORRUPT;
  if (h->gpu_pool > 1 ||
      (h->gpu_pool == 1 && h->gpu_pool_bytes != (uint64_t)h->slot_count * h->slot_payload_bytes))
    return *why = TSOCK_HEADER_DEVICE_POOL, TSOCK_ECORRUPT;
  return 0;
}

/* Static description of a status; the table behind tsock_status_str(). */
static inline const char *tsock_layout_status_str(int status) {
  switch (status) {
  case TSOCK_OK: return "ok";
  case TSOCK_EAGAIN: return "no batch available yet";
  case TSOCK_EINVAL: return "invalid argument";
  case TSOCK_EHANDLE: return "invalid or closed handle";
  case TSOCK_ENAME: return "invalid channel name";
  case TSOCK_ENOENT: return "no such channel";
  case TSOCK_EEXIST: return "channel already has a live producer";
  case TSOCK_EVERSION: return "segment layout version mismatch";
  case TSOCK_ECORRUPT: return "segment truncated, foreign or corrupt";
  case TSOCK_EPRODUCER_GONE: return "producer gone";
  case TSOCK_ECLOSED: return "channel closed by the producer";
  case TSOCK_EFULL: return "no free reader record";
  case TSOCK_EBACKPRESSURE: return "back-pressured: ring full";
  case TSOCK_ETIMEDOUT: return "timed out";
  case TSOCK_ETOOBIG: return "too big for the channel";
  case TSOCK_EDTYPE: return "unsupported dtype or bad shape";
  case TSOCK_EEVICTED: return "reader evicted";
  case TSOCK_ESTATE: return "call out of order";
  case TSOCK_EPERM: return "permission denied";
  case TSOCK_ESYS: return "system call failed";
  case TSOCK_EFORKED: return "handle used in a forked child";
  case TSOCK_ENOMEM: return "out of memory";
  case TSOCK_ENOCUDA: return "CUDA driver not available";
  case TSOCK_ENODEVICE: return "no device path to the producer's GPU";
  default: return "unknown status";
  }
}

/* Valid channel name: 1..TSOCK_NAME_MAX characters of [A-Za-z0-9._-], not
 * "." or "..". Returns 1 if valid. */
static inline int tsock_layout_name_ok(const char *name) {
  size_t n = 0;
  if (name == NULL) return 0;
  for (; name[n] != '\0'; n++) {
    char c = name[n];
    int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
             c == '.' || c == '_' || c == '-';
    if (!ok || n >= TSOCK_NAME_MAX) return 0;
  }
  if (n == 0) return 0;
  if ((n == 1 && name[0] == '.') || (n == 2 && name[0] == '.' && name[1] == '.')) return 0;
  return 1;
}

#endif /* TSOCK_RING_LAYOUT_H */
