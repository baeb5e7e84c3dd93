/*
 * pool.h - the producer's device pool (internal, not installed).
 *
 * One CUDA allocation holds a copy of every slot's payload (slot s at
 * s * slot_bytes), exported once with cuIpcGetMemHandle. Each slot has an
 * interprocess event, recorded after the slot's host-to-device copy:
 * readers make their stream wait on it. The copies run on one stream of
 * the producer's, out of the host payload mapping, registered as pinned.
 *
 * Every function returns 0 or a negative tsock status, with a message in
 * err (errn bytes) on failure. The calling thread's current CUDA context is
 * left as it was: each call makes the pool's primary context current for
 * itself only.
 */
#ifndef TSOCK_PRODUCER_POOL_H
#define TSOCK_PRODUCER_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef struct tsock_pool tsock_pool;

/* What readers need to open the pool, written into the segment header. */
typedef struct tsock_pool_export {
  int32_t ordinal;
  uint64_t pool_bytes;
  uint8_t uuid[16];
  uint8_t mem_handle[64];
} tsock_pool_export;

/* Allocates the pool on device `ordinal` (slots * slot_bytes bytes),
 * registers [host, host + slots * slot_bytes) as pinned memory, creates the
 * stream and one interprocess event per slot; writes each event's handle
 * to event_handles + 64 * s. TSOCK_ENOCUDA without a driver, TSOCK_EINVAL
 * for an ordinal the process cannot see, TSOCK_ESYS when CUDA fails. */
int tsock_pool_open(int ordinal, uint32_t slots, uint64_t slot_bytes, void *host,
                    uint8_t *event_handles, tsock_pool_export *out, tsock_pool **pool, char *err,
                    size_t errn);

/* Queues the copy of slot's first nbytes host bytes to its device part and
 * records the slot's event after it. Asynchronous. */
int tsock_pool_copy(tsock_pool *p, uint32_t slot, uint64_t nbytes, char *err, size_t errn);

/* Waits until the slot's last copy has finished reading the host payload,
 * so the producer may write the slot again. */
int tsock_pool_wait_slot(tsock_pool *p, uint32_t slot, char *err, size_t errn);

/* Finishes the queued copies and unregisters the host range (before the
 * caller unmaps it); the device memory and events stay. */
void tsock_pool_quiesce(tsock_pool *p);

/* tsock_pool_quiesce, then frees everything. Only once no other process has
 * the pool open: freeing exported memory an importer still has open is
 * undefined behaviour in CUDA. */
void tsock_pool_close(tsock_pool *p);

#endif
