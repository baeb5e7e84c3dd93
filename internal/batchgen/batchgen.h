/*
 * batchgen.h - the test batch format in C, the twin of batchgen.go: data
 * batch i (counting data batches from 0) has tensor 0, UINT8 [L] at offset 0
 * with L = 1 + (i*7919) % 60000 and byte j = (i*31 + j*7) ^ (j >> 8);
 * tensor 1, INT64 [2] = {i, L} at offset (L+7)/8*8; and 8 bytes of metadata,
 * the little-endian FNV-1a 64 of tensor 0. Used by the C test and soak
 * readers (tests/c/check_reader.c, tests/soak/creader/soak_reader.c) and
 * the C soak producer (tests/soak/cproducer/soak_producer.c).
 */
#ifndef TSOCK_BATCHGEN_H
#define TSOCK_BATCHGEN_H

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "tsock.h"

#define BATCHGEN_FNV_BASIS 14695981039346656037ull
#define BATCHGEN_FNV_PRIME 1099511628211ull
#define BATCHGEN_MAX_LEN 60000

/* L, the length of tensor 0 of data batch i. */
static inline uint64_t batchgen_len(uint64_t i) { return 1 + (i * 7919) % BATCHGEN_MAX_LEN; }

/* The byte offset of tensor 1 for a tensor 0 of length len. */
static inline uint64_t batchgen_offset1(uint64_t len) { return (len + 7) / 8 * 8; }

/* The payload bytes of data batch i. */
static inline uint64_t batchgen_payload_bytes(uint64_t i) { return batchgen_offset1(batchgen_len(i)) + 16; }

/* Writes data batch i into payload (batchgen_payload_bytes(i) long) and
 * fills its two tensors and 8 bytes of metadata, ready for
 * tsock_producer_publish(p, t, 2, meta, 8). The twin of batchgen.Write. */
static inline void batchgen_write(void *payload, uint64_t i, tsock_tensor_t t[2], uint8_t meta[8]) {
  uint8_t *p = payload;
  uint64_t len = batchgen_len(i), off = batchgen_offset1(len);
  uint64_t h = BATCHGEN_FNV_BASIS;
  for (uint64_t j = 0; j < len; j++) {
    p[j] = (uint8_t)((i * 31 + j * 7) ^ (j >> 8));
    h = (h ^ p[j]) * BATCHGEN_FNV_PRIME;
  }
  for (uint64_t j = len; j < off; j++) p[j] = 0;
  int64_t v[2] = {(int64_t)i, (int64_t)len};
  memcpy(p + off, v, sizeof v);
  for (int k = 0; k < 8; k++) meta[k] = (uint8_t)(h >> (8 * k));
  memset(t, 0, 2 * sizeof *t);
  t[0].dtype = TSOCK_DTYPE_UINT8;
  t[0].ndim = 1;
  t[0].shape[0] = (int64_t)len;
  t[0].strides[0] = 1;
  t[0].offset = 0;
  t[0].nbytes = len;
  t[1].dtype = TSOCK_DTYPE_INT64;
  t[1].ndim = 1;
  t[1].shape[0] = 2;
  t[1].strides[0] = 1;
  t[1].offset = off;
  t[1].nbytes = sizeof v;
}

/* Checks data batch b. On success returns 0 and sets *i_out (its counter)
 * and *hash_out (FNV-1a of tensor 0); on a mismatch returns -1 with the
 * reason in why. */
static inline int batchgen_verify(const tsock_batch_t *b, uint64_t *i_out, uint64_t *hash_out,
                                  char *why, size_t why_len) {
  if (b->n_tensors != 2) return snprintf(why, why_len, "tensor count is not 2"), -1;
  const tsock_tensor_t *t0 = &b->tensors[0], *t1 = &b->tensors[1];
  if (t0->dtype != TSOCK_DTYPE_UINT8 || t0->ndim != 1 || t0->offset != 0 || t0->strides[0] != 1)
    return snprintf(why, why_len, "tensor 0 is not UINT8 [L] at offset 0"), -1;
  if (t1->dtype != TSOCK_DTYPE_INT64 || t1->ndim != 1 || t1->shape[0] != 2 || t1->nbytes != 16)
    return snprintf(why, why_len, "tensor 1 is not INT64 [2]"), -1;
  const int64_t *v = t1->data;
  uint64_t i = (uint64_t)v[0], len = (uint64_t)t0->shape[0];
  if (len != batchgen_len(i) || (uint64_t)v[1] != len || t0->nbytes != len)
    return snprintf(why, why_len, "i=%" PRIu64 ": L=%" PRIu64 ", tensor 1 says L=%" PRId64, i, len,
                    v[1]),
           -1;
  if (t1->offset != batchgen_offset1(len))
    return snprintf(why, why_len, "tensor 1 offset is not (L+7)/8*8"), -1;
  const uint8_t *p = t0->data;
  uint64_t h = BATCHGEN_FNV_BASIS;
  for (uint64_t j = 0; j < len; j++) {
    if (p[j] != (uint8_t)((i * 31 + j * 7) ^ (j >> 8)))
      return snprintf(why, why_len, "i=%" PRIu64 ": byte %" PRIu64 " is %u", i, j, p[j]), -1;
    h = (h ^ p[j]) * BATCHGEN_FNV_PRIME;
  }
  if (b->meta_len != 8) return snprintf(why, why_len, "meta is not 8 bytes"), -1;
  const uint8_t *m = b->meta;
  uint64_t meta = 0;
  for (int k = 7; k >= 0; k--) meta = meta << 8 | m[k];
  if (meta != h)
    return snprintf(why, why_len, "i=%" PRIu64 ": meta %016" PRIx64 ", FNV of tensor 0 %016" PRIx64,
                    i, meta, h),
           -1;
  *i_out = i;
  *hash_out = h;
  return 0;
}

#endif
