// Command cabi is built with -buildmode=c-shared into libtsock.so: the
// producer half of include/tsock.h, implemented by package producer, plus
// the C reader linked in from package reader.
//
// The public C functions are in shim.c; the functions exported here are
// its private back end. Producer handles are ids, never reused, so a
// stale or closed handle is reported, not dereferenced.
package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include -I${SRCDIR}/../ring -I${SRCDIR}/../reader -Wall -Wextra -Werror
#include <stdint.h>
#include <stdlib.h>
#include "tsock.h"
void tsockgo_set_error(const char *msg);
int tsockgo_fork_hold(void);
int tsockgo_fork_unhold(void);
int tsockgo_fork_track_held(int fd);
void tsockgo_fork_untrack_held(int fd);
*/
import "C"

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tsock/tsock/internal/readers"
	"github.com/tsock/tsock/producer"
	_ "github.com/tsock/tsock/reader" // links the C reader into libtsock.so
	"github.com/tsock/tsock/ring"
)

func main() {}

// forkGuard keeps the producer's lock descriptors out of children that the
// host process forks without exec (shim.c, "the producer's fork guard").
type forkGuard struct{}

// Open runs open with fork() held off and registers its descriptor before
// letting fork() run again. The pthread mutex is taken and released by the
// same OS thread, hence LockOSThread.
func (forkGuard) Open(open func() (*os.File, error)) (*os.File, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	C.tsockgo_fork_hold()
	defer C.tsockgo_fork_unhold()
	f, err := open()
	if err != nil {
		return nil, err
	}
	if C.tsockgo_fork_track_held(C.int(readers.RawFD(f))) != 0 {
		closeDetached(f)
		return nil, ring.Errorf(ring.StatusNoMem, "out of memory registering a descriptor with the fork guard")
	}
	return f, nil
}

// closeDetached closes f without waiting, under the fork guard's hold,
// for its last close: f may be a connection a peer just made, holding the
// peer's descriptors, whose release can block (internal/readers,
// discard.go). It is shut down and duplicated, f closed (not the last),
// and the duplicate closed on a goroutine nothing waits for.
func closeDetached(f *os.File) {
	if fd := readers.RawFD(f); fd >= 0 {
		if d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0); err == nil {
			_ = unix.Shutdown(fd, unix.SHUT_RDWR)
			_ = f.Close()
			go unix.Close(d)
			return
		}
	}
	_ = f.Close()
}

// Close unregisters and closes f with fork() held off.
func (forkGuard) Close(f *os.File) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	C.tsockgo_fork_hold()
	defer C.tsockgo_fork_unhold()
	if fd := readers.RawFD(f); fd >= 0 {
		C.tsockgo_fork_untrack_held(C.int(fd))
	}
	return f.Close()
}

func init() { producer.SetForkGuard(forkGuard{}) }

// entry is one open producer handle and its scratch space, so publishing
// from C allocates nothing.
type entry struct {
	p       *producer.Producer
	tensors [ring.MaxTensors]ring.Tensor
	dims    [ring.MaxTensors][2][ring.MaxDims]int64
}

var (
	handlesMu sync.Mutex
	handles           = map[uintptr]*entry{}
	nextID    uintptr = 0x1000
	// closedReserved are handles closed while a batch was reserved: the
	// payload's pages stay mapped (another thread may write them) until
	// publish or abort with that handle reports the close and frees them.
	closedReserved = map[uintptr]*entry{}
)

// endClosedReservation answers publish and abort on a handle that is not
// open: one closed with a batch reserved has it dropped (and its pages
// freed), with the close reported.
func endClosedReservation(h C.uintptr_t) (C.int, bool) {
	handlesMu.Lock()
	e := closedReserved[uintptr(h)]
	delete(closedReserved, uintptr(h))
	handlesMu.Unlock()
	if e == nil {
		return 0, false
	}
	return fail(e.p.Abort()), true
}

func lookup(h C.uintptr_t) (*entry, C.int) {
	handlesMu.Lock()
	e := handles[uintptr(h)]
	handlesMu.Unlock()
	if e == nil {
		return nil, fail(ring.Errorf(ring.StatusHandle, "producer handle %#x is not open", uintptr(h)))
	}
	return e, 0
}

// fail records err as the calling thread's message and returns its status.
func fail(err error) C.int {
	if err == nil {
		return 0
	}
	msg := C.CString(err.Error())
	C.tsockgo_set_error(msg)
	C.free(unsafe.Pointer(msg))
	return C.int(ring.StatusOf(err))
}

func duration(ns C.int64_t) time.Duration {
	if ns < 0 {
		return -1
	}
	return time.Duration(ns)
}

//export tsockgo_producer_create
func tsockgo_producer_create(name *C.char, o *C.tsock_producer_options_t, out *C.uintptr_t) C.int {
	opts := producer.Options{Slots: uint32(o.slot_count), SlotBytes: uint64(o.slot_bytes),
		MaxReaders: uint32(o.max_readers), Mode: fileMode(uint32(o.mode)), Gid: int(o.gid),
		EvictAfter: time.Duration(o.evict_after_ns), JoinWindow: uint32(o.join_window)}
	if o.reserved != 0 || o.reserved2 != 0 {
		return fail(ring.Errorf(ring.StatusInval, "producer options: reserved must be 0"))
	}
	switch {
	case o.cuda_device >= 0:
		opts.Device = fmt.Sprintf("cuda:%d", int32(o.cuda_device))
	case o.cuda_device != -1:
		return fail(ring.Errorf(ring.StatusInval, "producer options: cuda_device %d (-1 for none)", int32(o.cuda_device)))
	}
	if o.evict_after_ns < 0 || uint32(o.mode)&^0o777 != 0 || o.mode == 0 {
		return fail(ring.Errorf(ring.StatusInval, "producer options: mode %o or evict_after_ns %d out of range",
			uint32(o.mode), int64(o.evict_after_ns)))
	}
	p, err := producer.Create(C.GoString(name), opts)
	if err != nil {
		return fail(err)
	}
	handlesMu.Lock()
	nextID += 16
	id := nextID
	handles[id] = &entry{p: p}
	handlesMu.Unlock()
	*out = C.uintptr_t(id)
	return 0
}

//export tsockgo_producer_reserve
func tsockgo_producer_reserve(h C.uintptr_t, nbytes C.uint64_t, timeout C.int64_t, payload *unsafe.Pointer) C.int {
	e, rc := lookup(h)
	if e == nil {
		return rc
	}
	buf, err := e.p.Reserve(uint64(nbytes), duration(timeout))
	if err != nil {
		return fail(err)
	}
	// The buffer is shared memory, not Go memory: C may keep the pointer.
	*payload = unsafe.Pointer(unsafe.SliceData(buf[:cap(buf)]))
	return 0
}

//export tsockgo_producer_publish
func tsockgo_producer_publish(h C.uintptr_t, ts *C.tsock_tensor_t, n C.uint32_t, meta unsafe.Pointer, metaLen C.uint32_t) C.int {
	if rc, ok := endClosedReservation(h); ok {
		return rc
	}
	e, rc := lookup(h)
	if e == nil {
		return rc
	}
	if int(n) > ring.MaxTensors {
		return fail(ring.Errorf(ring.StatusTooBig, "batch has %d tensors, at most %d", int(n), ring.MaxTensors))
	}
	var in []C.tsock_tensor_t
	if n > 0 {
		in = unsafe.Slice(ts, int(n))
	}
	for i := range in {
		nd := int(in[i].ndim)
		if nd < 0 || nd > ring.MaxDims {
			return fail(ring.Errorf(ring.StatusDtype, "tensor %d: ndim %d outside 0..%d", i, nd, ring.MaxDims))
		}
		shape, strides := e.dims[i][0][:nd], e.dims[i][1][:nd]
		for d := 0; d < nd; d++ {
			shape[d], strides[d] = int64(in[i].shape[d]), int64(in[i].strides[d])
		}
		e.tensors[i] = ring.Tensor{Dtype: int32(in[i].dtype), Shape: shape, Strides: strides,
			Offset: uint64(in[i].offset), Nbytes: uint64(in[i].nbytes)}
	}
	var m []byte
	if metaLen > 0 {
		m = unsafe.Slice((*byte)(meta), int(metaLen))
	}
	return fail(e.p.Publish(e.tensors[:n], m))
}

//export tsockgo_producer_abort
func tsockgo_producer_abort(h C.uintptr_t) C.int {
	if rc, ok := endClosedReservation(h); ok {
		return rc
	}
	e, rc := lookup(h)
	if e == nil {
		return rc
	}
	return fail(e.p.Abort())
}

//export tsockgo_producer_end_epoch
func tsockgo_producer_end_epoch(h C.uintptr_t, timeout C.int64_t) C.int {
	e, rc := lookup(h)
	if e == nil {
		return rc
	}
	return fail(e.p.EndEpoch(duration(timeout)))
}

//export tsockgo_producer_wait_readers
func tsockgo_producer_wait_readers(h C.uintptr_t, n C.uint32_t, timeout C.int64_t) C.int {
	e, rc := lookup(h)
	if e == nil {
		return rc
	}
	return fail(e.p.WaitReaders(int(n), duration(timeout)))
}

//export tsockgo_producer_stats
func tsockgo_producer_stats(h C.uintptr_t, out *C.tsock_producer_stats_t) C.int {
	e, rc := lookup(h)
	if e == nil {
		return rc
	}
	s := e.p.Stats()
	out.readers = C.uint32_t(s.Readers)
	out.published = C.uint64_t(s.Published)
	out.epoch = C.uint64_t(s.Epoch)
	out.backpressure_ns = C.uint64_t(s.BackpressureNs)
	out.readers_reclaimed = C.uint64_t(s.ReadersReclaimed)
	out.readers_evicted = C.uint64_t(s.ReadersEvicted)
	return 0
}

//export tsockgo_producer_reader_pids
func tsockgo_producer_reader_pids(h C.uintptr_t, pids *C.int32_t, capacity C.uint32_t, count *C.uint32_t) C.int {
	e, rc := lookup(h)
	if e == nil {
		return rc
	}
	var live []int32
	for _, r := range e.p.Readers() {
		if !r.Evicted {
			live = append(live, r.Pid)
		}
	}
	*count = C.uint32_t(len(live))
	if capacity > 0 {
		out := unsafe.Slice((*int32)(unsafe.Pointer(pids)), int(capacity))
		copy(out, live)
	}
	return 0
}

//export tsockgo_producer_close
func tsockgo_producer_close(h C.uintptr_t) C.int {
	handlesMu.Lock()
	e := handles[uintptr(h)]
	delete(handles, uintptr(h))
	if e != nil {
		// From this moment publish and abort on h reach the producer
		// through closedReserved (they wait for Close and report it),
		// not "not open" with the reservation left behind.
		closedReserved[uintptr(h)] = e
	}
	handlesMu.Unlock()
	if e == nil {
		return fail(ring.Errorf(ring.StatusHandle, "producer handle %#x is not open", uintptr(h)))
	}
	err := e.p.Close()
	if !e.p.HoldsReservation() {
		handlesMu.Lock()
		if closedReserved[uintptr(h)] == e {
			delete(closedReserved, uintptr(h))
		}
		handlesMu.Unlock()
	}
	return fail(err)
}

//export tsockgo_producer_peek
func tsockgo_producer_peek(name *C.char, back C.uint64_t, out *C.tsock_peek_t) C.int {
	p, err := producer.Peek(C.GoString(name), uint64(back))
	if err != nil {
		return fail(err)
	}
	out.flags = C.uint32_t(p.Flags)
	out.published = C.uint64_t(p.Published)
	out.seq, out.epoch, out.index = C.uint64_t(p.Seq), C.uint64_t(p.Epoch), C.uint64_t(p.Index)
	out.producer_alive = 0
	if p.ProducerAlive {
		out.producer_alive = 1
	}
	out.meta_len = C.uint32_t(len(p.Meta))
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&out.meta[0])), len(out.meta)), p.Meta)
	return 0
}
