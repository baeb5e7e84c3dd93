/* dlpack.c - DLPack descriptors for batch tensors.
 *
 * The structs below follow the DLPack 1.0 ABI (dlpack.h). They are
 * declared here rather than included so the libraries build without that
 * header; the static asserts pin the sizes both sides of the ABI agree on. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

enum { DL_CPU = 1 };
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

static int dl_dtype_of(int32_t dtype, dl_dtype *out) {
  uint32_t item = tsock_layout_dtype_size(dtype);
  uint8_t code;
  switch (dtype) {
  case TSOCK_DTYPE_BOOL: code = DL_BOOL; break;
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

int tsock__dlpack_make(const tsock_batch_t *b, uint32_t i, int versioned, void *data,
                       int32_t device_type, int32_t device_id, tsock_lease *lease,
                       void (*unref)(void *), void *ref, void **out) {
  const tsock_tensor_t *t = &b->tensors[i];
  dl_dtype dt;
  if (dl_dtype_of(t->dtype, &dt) != TSOCK_OK)
    return tsock__fail(TSOCK_EDTYPE, "tsock_batch_dlpack: dtype %d has no DLPack form", t->dtype);
  dl_block *blk = calloc(1, sizeof *blk);
  if (blk == NULL) return tsock__fail(TSOCK_ENOMEM, "tsock_batch_dlpack: out of memory");
  blk->unref = unref;
  blk->ref = ref;
  if (lease != NULL) {
    tsock__lease_ref(lease);
    __atomic_add_fetch(&lease->live[i], 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&lease->live[TSOCK_LIVE_TOTAL], 1, __ATOMIC_RELAXED);
    blk->lease = lease;
    blk->tensor = i;
  }
  memcpy(blk->shape, t->shape, sizeof blk->shape);
  memcpy(blk->strides, t->strides, sizeof blk->strides);
  dl_tensor dl = {
      .data = data,
      .device = {device_type, device_id},
      .ndim = t->ndim,
      .dtype = dt,
      .shape = blk->shape,
      .strides = blk->strides,
      .byte_offset = 0,
  };
  if (versioned) {
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

int tsock_batch_dlpack(const tsock_batch_t *b, uint32_t i, int versioned, void **out) {
  tsock__clear_error();
  if (b == NULL || out == NULL) return tsock__fail(TSOCK_EINVAL, "tsock_batch_dlpack: NULL argument");
  if (i >= b->n_tensors)
    return tsock__fail(TSOCK_EINVAL, "tsock_batch_dlpack: tensor %u of a batch of %u", i,
                       b->n_tensors);
  /* The batch came from tsock_reader_acquire or tsock_batch_keep, so it
   * heads a held batch. */
  tsock_lease *lease = ((const tsock_held_batch *)b)->lease;
  return tsock__dlpack_make(b, i, versioned, (void *)b->tensors[i].data, DL_CPU, 0, lease, NULL,
                            NULL, out);
}
