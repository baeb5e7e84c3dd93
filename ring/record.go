package ring

import (
	"fmt"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A reader's record lives in a memfd of its own (layout.h, "Reader
// record"): the producer creates it, sealed, hands it to that reader at
// the join and keeps a mapping to read the reader's cursor and sleeping
// flag (and to sleep on the cursor). No other process gets it.

// recordSeals fix the record file's size for ever, and that: the reader
// may write its record, but it can neither shrink it (the producer's
// mapping would fault) nor grow it, nor add or remove a seal.
const recordSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// NewRecordFile creates a record's memfd, sized and sealed. The caller
// registers it with its fork guard (it is a descriptor like any other).
func NewRecordFile() (*os.File, error) {
	fd, err := unix.MemfdCreate("tsock-reader-record", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "tsock-reader-record")
	if err := unix.Ftruncate(fd, RecordFileBytes); err != nil {
		f.Close()
		return nil, fmt.Errorf("size the reader record: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, recordSeals); err != nil {
		f.Close()
		return nil, fmt.Errorf("seal the reader record: %w", err)
	}
	return f, nil
}

// RecordFileOK reports whether fd is a record file a mapping can trust
// not to fault: of the record size, and sealed so that it stays so.
func RecordFileOK(fd int) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if st.Size != RecordFileBytes {
		return fmt.Errorf("record file is %d bytes, not %d", st.Size, RecordFileBytes)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return fmt.Errorf("record file seals: %w", err)
	}
	if seals&(unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL) != unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL {
		return fmt.Errorf("record file is not sealed against shrinking (seals %#x)", seals)
	}
	return nil
}

// Record is a reader record mapped from its file.
type Record struct {
	mem []byte
	r   *ReaderRecord
}

// MapRecord maps the record file fd (checked with RecordFileOK first by
// the caller when it does not come from NewRecordFile).
func MapRecord(fd int, writable bool) (*Record, error) {
	prot := unix.PROT_READ
	if writable {
		prot |= unix.PROT_WRITE
	}
	mem, err := unix.Mmap(fd, 0, int(RecordFileBytes), prot, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap the reader record: %w", err)
	}
	return &Record{mem: mem, r: (*ReaderRecord)(unsafe.Pointer(&mem[0]))}, nil
}

// Unmap releases the mapping.
func (r *Record) Unmap() error {
	if r.mem == nil {
		return nil
	}
	err := unix.Munmap(r.mem)
	r.mem, r.r = nil, nil
	return err
}

// SetStart stores seq as the record's cursor and acquired (atomic: the
// producer's gating scan may read the cursor at the same time).
func (r *Record) SetStart(seq uint64) {
	atomic.StoreUint64(u64(&r.r.acquired), seq)
	atomic.StoreUint64(u64(&r.r.cursor), seq)
}

// Cursor is the reader's cursor: every seq below it is released.
func (r *Record) Cursor() uint64 { return atomic.LoadUint64(u64(&r.r.cursor)) }

// CursorWord is the low half of the cursor: the futex word a producer
// waiting for this reader sleeps on (the reader wakes it after storing its
// cursor, which changes the word: no wake-up can be lost in between).
func (r *Record) CursorWord() *uint32 { return (*uint32)(unsafe.Pointer(&r.r.cursor)) }

// Unblock changes the cursor word of a reader that is gone and wakes a
// producer asleep on it (the reader can no longer do either).
func (r *Record) Unblock() {
	atomic.AddUint32(r.CursorWord(), 1)
	FutexWakeAll(r.CursorWord())
}

// Sleeping reports whether the reader may be asleep on published.
func (r *Record) Sleeping() bool { return atomic.LoadUint32(u32(&r.r.sleeping)) != 0 }

// Attached reports whether the reader says its attach has completed.
func (r *Record) Attached() bool { return atomic.LoadUint32(u32(&r.r.attached)) != 0 }

// Progress reads what the reader wrote about its progress and placement.
func (r *Record) Progress() Progress {
	x := r.r
	return Progress{
		Cursor:      atomic.LoadUint64(u64(&x.cursor)),
		Acquired:    atomic.LoadUint64(u64(&x.acquired)),
		HeartbeatNs: atomic.LoadUint64(u64(&x.heartbeat_ns)),
		WaitNs:      atomic.LoadUint64(u64(&x.wait_ns)),
		Batches:     atomic.LoadUint64(u64(&x.batches)),
		Placement:   atomic.LoadUint32(u32(&x.placement)),
		CUDAOrdinal: int32(atomic.LoadUint32(u32((*C32)(unsafe.Pointer(&x.cuda_ordinal))))),
		GPUUUID:     *(*[16]byte)(unsafe.Pointer(&x.gpu_uuid[0])),
	}
}

// Bytes is the whole record file as mapped (writable only if mapped so):
// for tests that write a record as a buggy or hostile reader would.
func (r *Record) Bytes() []byte { return r.mem }
