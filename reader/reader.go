// Package reader is tsock's reader side for Go programs and tools. It is a
// thin cgo layer over the C reader (reader/*.c), the same code that
// libtsock_reader.so exports, so Go and C readers behave identically.
//
// A Reader is used by one goroutine at a time. Tensor data are slices of
// read-only shared memory: writing to them faults.
package reader

/*
#cgo CFLAGS: -I${SRCDIR}/../include -I${SRCDIR}/../ring -Wall -Wextra -Werror
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "tsock.h"

// The detailed message is per thread, and a goroutine may change threads
// between two cgo calls: every wrapper copies it (on failure only) within
// the same call, into *msg, which the Go side frees.
static inline void rd_msg(int rc, char **msg) {
	if (rc != 0 && rc != TSOCK_EAGAIN) *msg = strdup(tsock_last_error());
}
static inline int rd_attach(const char *name, const tsock_reader_options_t *o, uintptr_t *out, char **msg) {
	tsock_reader_t *r;
	int rc = tsock_reader_attach(name, o, &r);
	if (rc == 0) *out = (uintptr_t)r;
	rd_msg(rc, msg);
	return rc;
}
static inline int rd_acquire(uintptr_t r, const tsock_batch_t **b, int64_t t, char **msg) {
	int rc = tsock_reader_acquire((tsock_reader_t *)r, b, t);
	rd_msg(rc, msg);
	return rc;
}
static inline int rd_release(uintptr_t r, const tsock_batch_t *b, char **msg) {
	int rc = tsock_reader_release((tsock_reader_t *)r, b);
	rd_msg(rc, msg);
	return rc;
}
static inline int rd_detach(uintptr_t r, char **msg) {
	int rc = tsock_reader_detach((tsock_reader_t *)r);
	rd_msg(rc, msg);
	return rc;
}
static inline int rd_keep(uintptr_t r, const tsock_batch_t *b, uint32_t mask, const tsock_batch_t **kept, char **msg) {
	int rc = tsock_batch_keep((tsock_reader_t *)r, b, mask, kept);
	rd_msg(rc, msg);
	return rc;
}
static inline int rd_free(const tsock_batch_t *b, char **msg) {
	int rc = tsock_batch_free(b);
	rd_msg(rc, msg);
	return rc;
}
static inline const tsock_tensor_t *rd_tensor(const tsock_batch_t *b, uint32_t i) { return &b->tensors[i]; }
static inline int rd_open_device(uintptr_t r, int32_t *ordinal, char **msg) {
	int rc = tsock_reader_open_device((tsock_reader_t *)r, ordinal);
	rd_msg(rc, msg);
	return rc;
}
static inline int rd_register_host(uintptr_t r, char **msg) {
	int rc = tsock_reader_register_host((tsock_reader_t *)r);
	rd_msg(rc, msg);
	return rc;
}
static inline int rd_cuda_use(const tsock_batch_t *b, uintptr_t stream, uint32_t flags, char **msg) {
	int rc = tsock_batch_cuda_use(b, stream, flags);
	rd_msg(rc, msg);
	return rc;
}
static inline int rd_cuda_ptr(const tsock_batch_t *b, uint32_t i, uint64_t *ptr, char **msg) {
	int rc = tsock_batch_cuda_ptr(b, i, ptr);
	rd_msg(rc, msg);
	return rc;
}
*/
import "C"

import (
	"strings"
	"time"
	"unsafe"

	"github.com/tsock/tsock/ring"
)

// Start says where a reader that joins a running channel begins.
type Start int32

const (
	// StartNextEpoch begins at the first batch of the next epoch (default);
	// a reader attached before the first batch gets epoch 0.
	StartNextEpoch Start = C.TSOCK_START_NEXT_EPOCH
	// StartNow begins at the next batch published after attaching.
	StartNow Start = C.TSOCK_START_NOW
	// StartOldest begins at the oldest batch another reader has not
	// released yet (the slowest reader's next), or as StartNow with none.
	StartOldest Start = C.TSOCK_START_OLDEST
)

// Options of Attach; the zero value means defaults.
type Options struct {
	Start         Start
	AttachTimeout time.Duration // wait this long for the channel and the join; 0 fails at once (tsock.h)
	MaxHeld       int           // batches held at once; default 4
	Spin          time.Duration // busy-poll before sleeping; default 20µs, negative: none
}

// Sentinel errors; errors.Is matches them against reader errors.
var (
	ErrProducerGone = ring.Status(ring.StatusProducerGone)
	ErrClosed       = ring.Status(ring.StatusClosed)
	ErrNoChannel    = ring.Status(ring.StatusNoEnt)
	ErrEvicted      = ring.Status(ring.StatusEvicted)
	ErrVersion      = ring.Status(ring.StatusVersion)
	ErrCorrupt      = ring.Status(ring.StatusCorrupt)
	// ErrNoDevice: no device path (the producer has no device pool, or its
	// GPU is not this process's); read host memory.
	ErrNoDevice = ring.Status(ring.StatusNoDevice)
	// ErrNoCUDA: no usable CUDA driver.
	ErrNoCUDA = ring.Status(ring.StatusNoCUDA)
)

// Reader is an attached reader.
type Reader struct {
	h uintptr
}

// Tensor is one tensor of a batch; Data spans its bytes in shared memory.
type Tensor struct {
	Dtype   int32
	Shape   []int64
	Strides []int64 // elements
	Data    []byte  // read-only shared memory, valid until the batch is released
}

// Batch is an acquired batch, valid until released.
type Batch struct {
	Seq, Epoch, Index uint64
	Flags             uint32
	PublishNs         uint64 // CLOCK_MONOTONIC
	Tensors           []Tensor
	Meta              []byte
	c                 *C.tsock_batch_t
}

// EpochEnd reports whether the batch is an epoch-end marker.
func (b *Batch) EpochEnd() bool { return b.Flags&ring.FlagEpochEnd != 0 }

// lastError builds the error of a failed call from the message its
// wrapper copied (and frees the copy).
func lastError(rc C.int, cmsg *C.char) error {
	msg := ""
	if cmsg != nil {
		msg = C.GoString(cmsg)
		C.free(unsafe.Pointer(cmsg))
	}
	if msg == "" {
		msg = C.GoString(C.tsock_status_str(rc))
	}
	return &ring.Error{Status: ring.Status(rc), Detail: msg}
}

func nanos(d time.Duration) C.int64_t { return C.int64_t(d) }

// Attach attaches to channel name.
func Attach(name string, o Options) (*Reader, error) {
	var co C.tsock_reader_options_t
	C.tsock_reader_options_init(&co)
	co.start = C.int32_t(o.Start)
	co.attach_timeout_ns = nanos(o.AttachTimeout)
	if o.MaxHeld > 0 {
		co.max_held = C.uint32_t(o.MaxHeld)
	}
	if o.Spin < 0 {
		co.spin_ns = 0
	} else if o.Spin > 0 {
		co.spin_ns = nanos(o.Spin)
	}
	if strings.IndexByte(name, 0) >= 0 { // C.CString would cut the name at the NUL
		return nil, ring.Errorf(ring.StatusName, "channel name %q contains a NUL byte", name)
	}
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	var h C.uintptr_t
	var msg *C.char
	if rc := C.rd_attach(cs, &co, &h, &msg); rc != 0 {
		return nil, lastError(rc, msg)
	}
	return &Reader{h: uintptr(h)}, nil
}

// Acquire takes the next batch, waiting up to timeout (negative: no limit).
// It returns (nil, nil) when no batch arrived in time; ErrProducerGone or
// ErrClosed once the stream has ended and everything was read.
func (r *Reader) Acquire(timeout time.Duration) (*Batch, error) {
	var out struct { // one allocation for both out-parameters
		cb  *C.tsock_batch_t
		msg *C.char
	}
	rc := C.rd_acquire(C.uintptr_t(r.h), &out.cb, nanos(timeout), &out.msg)
	if rc == C.TSOCK_EAGAIN {
		return nil, nil
	}
	if rc != 0 {
		return nil, lastError(rc, out.msg)
	}
	return fromC(out.cb), nil
}

// fromC is the Go view of a batch of the C reader.
func fromC(cb *C.tsock_batch_t) *Batch {
	b := &Batch{Seq: uint64(cb.seq), Epoch: uint64(cb.epoch), Index: uint64(cb.index),
		Flags: uint32(cb.flags), PublishNs: uint64(cb.publish_ns), c: cb}
	if cb.meta_len > 0 {
		b.Meta = unsafe.Slice((*byte)(cb.meta), int(cb.meta_len))
	}
	b.Tensors = make([]Tensor, int(cb.n_tensors))
	for i := range b.Tensors {
		t := C.rd_tensor(cb, C.uint32_t(i))
		nd := int(t.ndim)
		bt := &b.Tensors[i]
		bt.Dtype = int32(t.dtype)
		bt.Shape = make([]int64, nd)
		bt.Strides = make([]int64, nd)
		for d := 0; d < nd; d++ {
			bt.Shape[d], bt.Strides[d] = int64(t.shape[d]), int64(t.strides[d])
		}
		if t.nbytes > 0 {
			bt.Data = unsafe.Slice((*byte)(t.data), int(t.nbytes))
		}
	}
	return b
}

// Release gives back b and every batch acquired before it.
func (r *Reader) Release(b *Batch) error {
	if b == nil || b.c == nil {
		return ring.Errorf(ring.StatusInval, "release of a nil batch")
	}
	var msg *C.char
	if rc := C.rd_release(C.uintptr_t(r.h), b.c, &msg); rc != 0 {
		return lastError(rc, msg)
	}
	return nil
}

// Keep keeps the tensors of held batch b named in mask (bit i: tensor i),
// and those with live DLPack descriptors, valid past b's release, at their
// addresses (tsock_batch_keep: their pages are copied into private memory
// swapped in under the same addresses). It returns the kept batch, whose
// Data stay valid (and unchanged) until its Free, after the release and
// after Detach; nil when nothing was to be kept. Release b as usual.
func (r *Reader) Keep(b *Batch, mask uint32) (*Batch, error) {
	if b == nil || b.c == nil {
		return nil, ring.Errorf(ring.StatusInval, "keep of a nil batch")
	}
	var kept *C.tsock_batch_t
	var msg *C.char
	if rc := C.rd_keep(C.uintptr_t(r.h), b.c, C.uint32_t(mask), &kept, &msg); rc != 0 {
		return nil, lastError(rc, msg)
	}
	if kept == nil {
		return nil, nil
	}
	return fromC(kept), nil
}

// Free frees a batch returned by Keep; its Data must not be used afterwards.
// Any other batch, or a second Free, returns an error (ErrHandle status).
func (b *Batch) Free() error {
	if b == nil || b.c == nil {
		return ring.Errorf(ring.StatusInval, "free of a nil batch")
	}
	var msg *C.char
	if rc := C.rd_free(b.c, &msg); rc != 0 {
		return lastError(rc, msg)
	}
	return nil
}

// Detach frees the reader record; the Reader must not be used afterwards.
func (r *Reader) Detach() error {
	var msg *C.char
	if rc := C.rd_detach(C.uintptr_t(r.h), &msg); rc != 0 {
		return lastError(rc, msg)
	}
	return nil
}

// OpenDevice opens the producer's device pool, so that batches can be read
// on the GPU zero-copy (tsock_reader_open_device). It returns the GPU's
// CUDA ordinal in this process, ErrNoDevice (with the reason) where this
// reader must read host memory instead, ErrNoCUDA without a driver.
func (r *Reader) OpenDevice() (int, error) {
	var ordinal C.int32_t
	var msg *C.char
	if rc := C.rd_open_device(C.uintptr_t(r.h), &ordinal, &msg); rc != 0 {
		return -1, lastError(rc, msg)
	}
	return int(ordinal), nil
}

// RegisterHost registers the reader's payload mapping as pinned memory
// for fast copies to a GPU (tsock_reader_register_host).
func (r *Reader) RegisterHost() error {
	var msg *C.char
	if rc := C.rd_register_host(C.uintptr_t(r.h), &msg); rc != 0 {
		return lastError(rc, msg)
	}
	return nil
}

// CUDAUse orders the batch's device copy on stream (a CUstream; 0 is the
// legacy default stream): the stream waits for the producer's copy, and
// the batch's slot is held back after Release until the work queued on the
// stream has run (tsock_batch_cuda_use). With hostWait the calling thread
// waits for the copy instead and Release waits for the device.
// ErrProducerGone once the producer's process is gone: read Tensors[i].Data.
func (b *Batch) CUDAUse(stream uintptr, hostWait bool) error {
	flags := C.uint32_t(0)
	if hostWait {
		flags = C.TSOCK_CUDA_SYNC
	}
	var msg *C.char
	if rc := C.rd_cuda_use(b.c, C.uintptr_t(stream), flags, &msg); rc != 0 {
		return lastError(rc, msg)
	}
	return nil
}

// CUDAPtr is the device address (a CUdeviceptr) of tensor i's copy in the
// producer's device pool; read it in work ordered by CUDAUse.
func (b *Batch) CUDAPtr(i int) (uintptr, error) {
	var p C.uint64_t
	var msg *C.char
	if rc := C.rd_cuda_ptr(b.c, C.uint32_t(i), &p, &msg); rc != 0 {
		return 0, lastError(rc, msg)
	}
	return uintptr(p), nil
}
