/* dlpack.c - DLPack descriptors for batch tensors: the one place that knows
 * the DLPack structs (bindings only pass flags and a row range, and hand
 * an unconsumed descriptor back to tsock_dlpack_delete).
 *
 * The structs below follow the DLPack 1.0 ABI (dlpack.h). They are
 * declared here rather than included so the libraries build without that
 * header; the static asserts pin the sizes both sides of the ABI agree on. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

enum { DL_CPU = 1, DL_CUDA = 2 };
enum { DL_INT = 0, DL_UINT = 1, DL_FLOAT = 2, DL_BFLOAT = 4, DL_BOOL = 6 };
#define DL_FLAG_READ_ONLY 1ull

typedef struct { int32_t device_type, device_id; } dl_device;
typedef struct { uint8_t code, bits; uint16_t lanes; } dl_dtype;
typedef struct {
  void *data;
  dl_device device;
  int32_t ndim;
  dl_dtype dtype;
  int64_t *shape;
  int64_t *strides;
  uint64_t byte_offset;
} dl_tensor;
typedef struct dl_managed {
  dl_tensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct dl_managed *self);
} dl_managed;
typedef struct dl_managed_versioned {
  struct { uint32_t major, minor; } version;
  void *manager_ctx;
  void (*deleter)(struct dl_managed_versioned *self);
  uint64_t flags;
  dl_tensor dl_tensor;
} dl_managed_versioned;

_Static_assert(sizeof(dl_tensor) == 48, "DLTensor");
_Static_assert(sizeof(dl_managed) == 64, "DLManagedTensor");
_Static_assert(sizeof(dl_managed_versioned) == 80, "DLManagedTensorVersioned");

#define DLPACK_FLAGS \
  (TSOCK_DLPACK_VERSIONED | TSOCK_DLPACK_DEVICE | TSOCK_DLPACK_BOOL_AS_UINT8 | TSOCK_DLPACK_ROWS)

/* One allocation: the managed struct, then shape and strides. */
typedef struct {
  union { dl_managed legacy; dl_managed_versioned versioned; } m;
  int64_t shape[TSOCK_MAX_DIMS];
  int64_t strides[TSOCK_MAX_DIMS];
  /* Counted in lease->live[tensor] and keeps the lease (the host mapping)
   * while it lives; `ref`, if any, keeps the device pool mapped. */
  tsock_lease *lease;
  uint32_t tensor;
  void (*unref)(void *);
  void *ref;
} dl_block;

/* May run on any thread, without the GIL, after the reader is gone. */
static void delete_block(void *self) {
  dl_block *blk = self;
  if (blk->lease != NULL) {
    __atomic_sub_fetch(&blk->lease->live[blk->tensor], 1, __ATOMIC_RELEASE);
    __atomic_sub_fetch(&blk->lease->live[TSOCK_LIVE_TOTAL], 1, __ATOMIC_RELEASE);
    tsock__lease_unref(blk->lease);
  }
  if (blk->ref != NULL) blk->unref(blk->ref);
  free(blk);
}
static void delete_legacy(dl_managed *self) { delete_block(self); }
static void delete_versioned(dl_managed_versioned *self) { delete_block(self); }

int tsock_dlpack_delete(void *managed, int versioned) {
  /* No tsock__clear_error(): this runs as a deleter, from a capsule's
   * destructor whenever the garbage collector frees one, possibly between
   * a failing call and its caller's read of tsock_last_error(). Only a
   * refusal (misuse, which the bindings never commit) sets a message. */
  if (managed == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_dlpack_delete: managed is NULL");
  /* Only tsock's own descriptors, by the deleter each kind holds. The
   * deleter words of both kinds (offsets 16 and 56) lie inside either
   * struct, so a descriptor of the other kind is recognised, not called
   * through a word of its tensor. */
  dl_managed_versioned *v = managed;
  dl_managed *l = managed;
  if (versioned && v->deleter == delete_versioned) {
    delete_versioned(v);
    return TSOCK_OK;
  }
  if (!versioned && l->deleter == delete_legacy) {
    delete_legacy(l);
    return TSOCK_OK;
  }
  /* The other kind, or not tsock's: left alone. */
  return tsock__fail(TSOCK_EINVAL, "tsock_dlpack_delete: not a %s that tsock made (its deleter "
                                   "is not tsock's): left alone",
                     versioned ? "DLManagedTensorVersioned" : "DLManagedTensor");
}

/* The DLPack dtype of a tsock dtype; booleans as uint8 with bool_as_uint8. */
static int dl_dtype_of(int32_t dtype, int bool_as_uint8, dl_dtype *out) {
  uint32_t item = tsock_layout_dtype_size(dtype);
  uint8_t code;
  switch (dtype) {
  case TSOCK_DTYPE_BOOL: code = bool_as_uint8 ? DL_UINT : DL_BOOL; break;
  case TSOCK_DTYPE_INT8: case TSOCK_DTYPE_INT16: case TSOCK_DTYPE_INT32: case TSOCK_DTYPE_INT64:
    code = DL_INT; break;
  case TSOCK_DTYPE_UINT8: case TSOCK_DTYPE_UINT16: case TSOCK_DTYPE_UINT32: case TSOCK_DTYPE_UINT64:
    code = DL_UINT; break;
  case TSOCK_DTYPE_FLOAT16: case TSOCK_DTYPE_FLOAT32: case TSOCK_DTYPE_FLOAT64: code = DL_FLOAT; break;
  case TSOCK_DTYPE_BFLOAT16: code = DL_BFLOAT; break;
  default: return TSOCK_EDTYPE;
  }
  out->code = code;
  out->bits = (uint8_t)(item * 8);
  out->lanes = 1;
  return TSOCK_OK;
}

/* Checks an export's row range against tensor i (t: the held batch's
 * private, validated copy): [start, stop) within its first dimension with
 * TSOCK_DLPACK_ROWS, else both 0. */
static int check_rows(const char *fn, const tsock_tensor_t *t, uint32_t i, uint32_t flags,
                      int64_t start, int64_t stop) {
  if (!(flags & TSOCK_DLPACK_ROWS)) {
    if (start != 0 || stop != 0)
      return tsock__fail(TSOCK_EINVAL, "%s: row_start %lld and row_stop %lld without "
                                       "TSOCK_DLPACK_ROWS (must be 0)",
                         fn, (long long)start, (long long)stop);
    return TSOCK_OK;
  }
  if (t->ndim == 0)
    return tsock__fail(TSOCK_EINVAL, "%s: rows of tensor %u, which has no dimensions", fn, i);
  if (start < 0 || start > stop || stop > t->shape[0])
    return tsock__fail(TSOCK_EINVAL, "%s: rows [%lld, %lld) of tensor %u, which has %lld", fn,
                       (long long)start, (long long)stop, i, (long long)t->shape[0]);
  return TSOCK_OK;
}

/* Whether a tensor of this shape has any element. */
static int has_elements(int32_t ndim, const int64_t *shape) {
  for (int32_t d = 0; d < ndim; d++)
    if (shape[d] == 0) return 0;
  return 1;
}

/* The descriptor of tensor i of b at `at`; on failure the caller still
 * owns at->ref. */
static int dlpack_make(const char *fn, const tsock_batch_t *b, uint32_t i, uint32_t flags,
                       int64_t row_start, int64_t row_stop, const tsock_dlpack_where *at,
                       void **out) {
  const tsock_tensor_t *t = &b->tensors[i];
  dl_dtype dt;
  if (dl_dtype_of(t->dtype, (flags & TSOCK_DLPACK_BOOL_AS_UINT8) != 0, &dt) != TSOCK_OK)
    return tsock__fail(TSOCK_EDTYPE, "%s: dtype %d has no DLPack form", fn, t->dtype);
  int st = check_rows(fn, t, i, flags, row_start, row_stop);
  if (st != TSOCK_OK) return st;
  dl_block *blk = calloc(1, sizeof *blk);
  if (blk == NULL) return tsock__fail(TSOCK_ENOMEM, "%s: out of memory", fn);
  blk->unref = at->unref;
  blk->ref = at->ref;
  if (at->lease != NULL) {
    tsock__lease_ref(at->lease);
    __atomic_add_fetch(&at->lease->live[i], 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&at->lease->live[TSOCK_LIVE_TOTAL], 1, __ATOMIC_RELAXED);
    blk->lease = at->lease;
    blk->tensor = i;
  }
  memcpy(blk->shape, t->shape, sizeof blk->shape);
  memcpy(blk->strides, t->strides, sizeof blk->strides);
  uintptr_t data = at->data;
  if (flags & TSOCK_DLPACK_ROWS) {
    blk->shape[0] = row_stop - row_start;
    /* A range with elements starts at an element of the tensor, each of
     * which the acquire checked to lie in its bytes: no overflow here. An
     * empty one addresses nothing (and an empty tensor's strides were
     * never bounded): its address stays. */
    if (has_elements(t->ndim, blk->shape))
      data += (uintptr_t)row_start * (uintptr_t)t->strides[0] * (uintptr_t)(dt.bits / 8);
  }
  dl_tensor dl = {
      .data = (void *)data,
      .device = {at->device_type, at->device_id},
      .ndim = t->ndim,
      .dtype = dt,
      .shape = blk->shape,
      .strides = blk->strides,
      .byte_offset = 0,
  };
  if (flags & TSOCK_DLPACK_VERSIONED) {
    blk->m.versioned.version.major = 1;
    blk->m.versioned.version.minor = 0;
    blk->m.versioned.deleter = delete_versioned;
    blk->m.versioned.flags = DL_FLAG_READ_ONLY;
    blk->m.versioned.dl_tensor = dl;
  } else {
    blk->m.legacy.deleter = delete_legacy;
    blk->m.legacy.dl_tensor = dl;
  }
  *out = blk; /* the managed struct is the block's first member */
  return TSOCK_OK;
}

/* The export of every entry point: arguments checked, where the tensor
 * lies found (host memory here, the device copy in cuda_device.c), then
 * its descriptor made. */
static int dlpack_export(const char *fn, const tsock_batch_t *b, uint32_t i, uint32_t flags,
                         int64_t row_start, int64_t row_stop, void **out) {
  tsock__clear_error();
  if (b == NULL) return tsock__fail(TSOCK_EINVAL, "%s: batch is NULL", fn);
  if ((flags & ~DLPACK_FLAGS) != 0)
    return tsock__fail(TSOCK_EINVAL, "%s: unknown flags 0x%x", fn, flags & ~DLPACK_FLAGS);
  /* The batch came from tsock_reader_acquire or tsock_batch_keep, so it
   * heads a held batch. A released one that was not kept is refused: the
   * producer may already be writing its slot; so is one whose held entry
   * was taken by an acquire that rejected its batch (not handed out: its
   * descriptor is unchecked). */
  const tsock_held_batch *hb = (const tsock_held_batch *)b;
  if (!hb->handed || (__atomic_load_n(&hb->user_released, __ATOMIC_RELAXED) && !hb->kept))
    return tsock__fail(TSOCK_ESTATE, "%s: batch %llu is not held (released, and not kept)", fn,
                       (unsigned long long)b->seq);
  tsock_dlpack_where at = {0};
  if (flags & TSOCK_DLPACK_DEVICE) {
    int st = tsock__dlpack_device_where(fn, b, i, &at); /* takes a reference on the pool */
    if (st != TSOCK_OK) return st;
    at.device_type = DL_CUDA;
  } else {
    if (i >= b->n_tensors)
      return tsock__fail(TSOCK_EINVAL, "%s: tensor %u of a batch of %u", fn, i, b->n_tensors);
    at.data = (uintptr_t)b->tensors[i].data;
    at.device_type = DL_CPU;
  }
  at.lease = hb->lease;
  int st = out == NULL ? tsock__fail(TSOCK_EINVAL, "%s: out is NULL", fn)
                       : dlpack_make(fn, b, i, flags, row_start, row_stop, &at, out);
  if (st != TSOCK_OK && at.ref != NULL) at.unref(at.ref);
  return st;
}

int tsock_batch_dlpack_export(const tsock_batch_t *b, uint32_t i, uint32_t flags,
                              int64_t row_start, int64_t row_stop, void **out) {
  return dlpack_export("tsock_batch_dlpack_export", b, i, flags, row_start, row_stop, out);
}

int tsock_batch_dlpack(const tsock_batch_t *b, uint32_t i, int versioned, void **out) {
  return dlpack_export("tsock_batch_dlpack", b, i, versioned ? TSOCK_DLPACK_VERSIONED : 0, 0, 0,
                       out);
}

int tsock_batch_dlpack_cuda(const tsock_batch_t *b, uint32_t i, int versioned, void **out) {
  uint32_t flags = TSOCK_DLPACK_DEVICE | (versioned ? TSOCK_DLPACK_VERSIONED : 0);
  return dlpack_export("tsock_batch_dlpack_cuda", b, i, flags, 0, 0, out);
}
