package producer

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "pool.h"
*/
import "C"

import (
	"fmt"
	"strconv"
	"strings"
	"unsafe"

	"github.com/tsock/tsock/ring"
)

// devicePool is the producer's copy of every slot in GPU memory
// (pool.c): one CUDA allocation exported once through CUDA IPC, one
// interprocess event per slot that fires when the slot's copy has landed.
type devicePool struct {
	p *C.tsock_pool
}

// ParseDevice reads a device name: "" or "cpu" for none (-1), "cuda" for
// device 0, "cuda:N" for device N.
func ParseDevice(s string) (int, error) {
	switch {
	case s == "" || s == "cpu":
		return -1, nil
	case s == "cuda":
		return 0, nil
	case strings.HasPrefix(s, "cuda:"):
		n, err := strconv.Atoi(s[len("cuda:"):])
		if err == nil && n >= 0 {
			return n, nil
		}
	}
	return 0, ring.Errorf(ring.StatusInval, "device %q: want \"cpu\", \"cuda\" or \"cuda:N\"", s)
}

// poolError turns a pool status and its message into a ring error.
func poolError(st C.int, msg []C.char) error {
	return ring.Errorf(int(st), "%s", C.GoString(&msg[0]))
}

// openPool creates the device pool on CUDA device ordinal for seg's slots
// and writes what readers need into the segment being built: the pool's
// handle and GPU in the header, each slot's event handle in the slot.
func openPool(ordinal int, seg *ring.Segment) (*devicePool, error) {
	host := seg.PayloadBase()
	handles := make([]byte, int(seg.SlotCount)*ring.CUDAHandleBytes)
	var exp C.tsock_pool_export
	var pool *C.tsock_pool
	var msg [512]C.char
	st := C.tsock_pool_open(C.int(ordinal), C.uint32_t(seg.SlotCount),
		C.uint64_t(seg.Geometry.SlotPayloadBytes), unsafe.Pointer(&host[0]),
		(*C.uint8_t)(unsafe.Pointer(&handles[0])), &exp, &pool, &msg[0], C.size_t(len(msg)))
	if st != 0 {
		return nil, fmt.Errorf("device pool on cuda:%d: %w", ordinal, poolError(st, msg[:]))
	}
	gp := ring.GPUPool{Ordinal: int32(exp.ordinal), PoolBytes: uint64(exp.pool_bytes)}
	copy(gp.UUID[:], unsafe.Slice((*byte)(unsafe.Pointer(&exp.uuid[0])), len(gp.UUID)))
	copy(gp.MemHandle[:], unsafe.Slice((*byte)(unsafe.Pointer(&exp.mem_handle[0])), len(gp.MemHandle)))
	seg.SetGPUPool(&gp)
	for i := uint32(0); i < seg.SlotCount; i++ {
		copy(seg.SlotEventHandle(i), handles[int(i)*ring.CUDAHandleBytes:])
	}
	return &devicePool{p: pool}, nil
}

// copySlot queues the copy of the slot's first n payload bytes to the
// device and records the slot's event after it.
func (d *devicePool) copySlot(slot uint32, n uint64) error {
	var msg [512]C.char
	if st := C.tsock_pool_copy(d.p, C.uint32_t(slot), C.uint64_t(n), &msg[0], C.size_t(len(msg))); st != 0 {
		return poolError(st, msg[:])
	}
	return nil
}

// waitSlot returns once the slot's last copy has read the host payload.
func (d *devicePool) waitSlot(slot uint32) error {
	var msg [512]C.char
	if st := C.tsock_pool_wait_slot(d.p, C.uint32_t(slot), &msg[0], C.size_t(len(msg))); st != 0 {
		return poolError(st, msg[:])
	}
	return nil
}

// quiesce finishes the queued copies and unregisters the host range; the
// device memory stays for readers that have it open.
func (d *devicePool) quiesce() {
	if d != nil && d.p != nil {
		C.tsock_pool_quiesce(d.p)
	}
}

// close finishes the queued copies and frees the pool.
func (d *devicePool) close() {
	if d != nil && d.p != nil {
		C.tsock_pool_close(d.p)
		d.p = nil
	}
}
