package ring

import (
	"errors"
	"fmt"
	"math/bits"
	"os"
	"strconv"
	"sync/atomic"
	"unsafe"

	mmap "github.com/edsrzf/mmap-go"
)

// Segment is a mapped channel segment. The producer maps it read-write and
// writes through it; tools map it read-only to inspect it. Every access to
// a word another process writes goes through sync/atomic.
type Segment struct {
	File      *os.File
	mem       mmap.MMap
	base      unsafe.Pointer
	Geometry  Geometry
	SlotCount uint32
	Readers   uint32
	mask      uint64
}

// MapSegment maps an open segment file whose header is already valid (or,
// for the producer, whose geometry is g). writable maps it read-write.
//
// The mapping is made through a second open of the file (Reopen), closed
// once mapped, never through f itself: a mapping holds the open file
// description it was made from, and f's description carries the liveness
// lock. A child forked without exec inherits every mapping; had it been
// made from f, the child would keep a dead parent's lock held for as long
// as it lives (a DataLoader worker: the whole epoch), although the fork
// guard closed every tsock descriptor in it.
func MapSegment(f *os.File, g Geometry, slots, readers uint32, writable bool) (*Segment, error) {
	prot := mmap.RDONLY
	if writable {
		prot = mmap.RDWR
	}
	mf, err := Reopen(f, writable)
	if err != nil {
		return nil, err
	}
	m, err := mmap.MapRegion(mf, int(g.TotalBytes), prot, 0, 0)
	mf.Close() // the mapping keeps the file; it needs no descriptor
	if err != nil {
		return nil, fmt.Errorf("mmap %s: %w", f.Name(), err)
	}
	return &Segment{File: f, mem: m, base: unsafe.Pointer(&m[0]), Geometry: g,
		SlotCount: slots, Readers: readers, mask: uint64(slots) - 1}, nil
}

// Reopen opens the file of f again, as a new open file description (not a
// dup: a lock on f's description is not shared with it), through
// /proc/self/fd, which works for a file without a name too (O_TMPFILE).
// The result is checked to be the same file.
func Reopen(f *os.File, writable bool) (*os.File, error) {
	flags := os.O_RDONLY
	if writable {
		flags = os.O_RDWR
	}
	sc, err := f.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("reopen %s: %w", f.Name(), err)
	}
	var fd uintptr
	if err := sc.Control(func(d uintptr) { fd = d }); err != nil {
		return nil, fmt.Errorf("reopen %s: %w", f.Name(), err)
	}
	r, err := os.OpenFile("/proc/self/fd/"+strconv.FormatUint(uint64(fd), 10), flags, 0)
	if err != nil {
		return nil, fmt.Errorf("reopen %s through /proc/self/fd (is /proc mounted?): %w", f.Name(), err)
	}
	a, err1 := f.Stat()
	b, err2 := r.Stat()
	if err1 != nil || err2 != nil || !os.SameFile(a, b) {
		r.Close()
		return nil, fmt.Errorf("reopen %s: /proc/self/fd gave another file", f.Name())
	}
	return r, nil
}

// Unmap releases the mapping (the file stays open).
func (s *Segment) Unmap() error {
	if s.mem == nil {
		return nil
	}
	err := s.mem.Unmap()
	s.mem, s.base = nil, nil
	return err
}

// Header is the segment's header page.
func (s *Segment) Header() *Header { return (*Header)(s.base) }

func (s *Segment) shared() *ReaderShared {
	return (*ReaderShared)(unsafe.Add(s.base, s.Geometry.ReadersOffset))
}

// Record is reader record i.
func (s *Segment) Record(i uint32) *ReaderRecord {
	off := s.Geometry.ReadersOffset + uint64(ReaderSharedSize) + uint64(i)*uint64(ReaderRecordSize)
	return (*ReaderRecord)(unsafe.Add(s.base, off))
}

// SlotIndex is the ring position of a sequence number.
func (s *Segment) SlotIndex(seq uint64) uint64 { return seq & s.mask }

// SlotAt is the slot that holds sequence number seq.
func (s *Segment) SlotAt(seq uint64) *Slot {
	off := s.Geometry.SlotsOffset + s.SlotIndex(seq)*uint64(SlotSize)
	return (*Slot)(unsafe.Add(s.base, off))
}

// Payload is the payload buffer bound to the slot of seq.
func (s *Segment) Payload(seq uint64) []byte {
	off := s.Geometry.PayloadOffset + s.SlotIndex(seq)*s.Geometry.SlotPayloadBytes
	return s.mem[off : off+s.Geometry.SlotPayloadBytes : off+s.Geometry.SlotPayloadBytes]
}

func u64(p *C64) *uint64 { return (*uint64)(unsafe.Pointer(p)) }
func u32(p *C32) *uint32 { return (*uint32)(unsafe.Pointer(p)) }

// Published is the number of batches published (atomic).
func (s *Segment) Published() uint64 { return atomic.LoadUint64(u64(&s.Header().published)) }

// StorePublished makes every seq below v readable (atomic, sequentially
// consistent: pairs with the readers' sleepers bits).
func (s *Segment) StorePublished(v uint64) { atomic.StoreUint64(u64(&s.Header().published), v) }

// PublishedWord is the futex word readers sleep on: the low half of
// published.
func (s *Segment) PublishedWord() *uint32 { return (*uint32)(unsafe.Pointer(&s.Header().published)) }

// State is the producer state (StateOpen, StateClosed).
func (s *Segment) State() uint32 { return atomic.LoadUint32(u32(&s.Header().state)) }

// SetState stores the producer state.
func (s *Segment) SetState(v uint32) { atomic.StoreUint32(u32(&s.Header().state), v) }

// SetProducerWaiting tells releasing readers to wake the producer.
func (s *Segment) SetProducerWaiting(on bool) {
	var v uint32
	if on {
		v = 1
	}
	atomic.StoreUint32(u32(&s.Header().producer_waiting), v)
}

// AnySleeper reports whether any reader may sleep on the published word
// (its sleepers bit is set): the producer then wakes them after a publish.
// One word per 64 records: one load at the default 64 readers.
func (s *Segment) AnySleeper() bool {
	words := &s.shared().sleepers
	for w := uint32(0); w < (s.Readers+63)/64; w++ {
		if atomic.LoadUint64(u64(&words[w])) != 0 {
			return true
		}
	}
	return false
}

// ClearSleeper clears record i's sleepers bit: the producer does this when
// it reclaims or evicts the record, whose owner can no longer clear it.
func (s *Segment) ClearSleeper(i uint32) {
	atomic.AndUint64(u64(&s.shared().sleepers[i/64]), ^(uint64(1) << (i % 64)))
}

// Sleepers counts the records whose sleepers bit is set (for tools).
func (s *Segment) Sleepers() int {
	n := 0
	for w := uint32(0); w < (s.Readers+63)/64; w++ {
		n += bits.OnesCount64(atomic.LoadUint64(u64(&s.shared().sleepers[w])))
	}
	return n
}

// ReleaseWord is the futex word the producer sleeps on; readers bump it.
func (s *Segment) ReleaseWord() *uint32 { return u32(&s.shared().release_notify) }

// Claim is reader record i's claim word: generation << 8 | state.
func (s *Segment) Claim(i uint32) uint64 { return atomic.LoadUint64(u64(&s.Record(i).claim)) }

// CASClaim changes record i's claim word from old to new.
func (s *Segment) CASClaim(i uint32, old, new uint64) bool {
	return atomic.CompareAndSwapUint64(u64(&s.Record(i).claim), old, new)
}

// ClaimState and ClaimGen split a claim word; MakeClaim joins them.
func ClaimState(c uint64) uint32             { return uint32(c & 0xff) }
func ClaimGen(c uint64) uint64               { return c >> 8 }
func MakeClaim(gen uint64, st uint32) uint64 { return gen<<8 | uint64(st) }

// RecordSnapshot is what a reader last wrote in its record. The values come
// from another process: validate before use.
type RecordSnapshot struct {
	Claim       uint64
	Pid         int32
	StartTime   uint64
	StartMode   uint32
	Cursor      uint64
	Acquired    uint64
	HeartbeatNs uint64
	WaitNs      uint64
	Batches     uint64
	Placement   uint32 // PlacementHost, PlacementPinned, PlacementDevice (reader-written: validate)
	CUDAOrdinal int32  // the reader's device in its own numbering, -1 none
	GPUUUID     [16]byte
}

// Snapshot reads reader record i.
func (s *Segment) Snapshot(i uint32) RecordSnapshot {
	r := s.Record(i)
	return RecordSnapshot{
		Claim:       atomic.LoadUint64(u64(&r.claim)),
		Pid:         int32(atomic.LoadUint32(u32((*C32)(unsafe.Pointer(&r.pid))))),
		StartTime:   atomic.LoadUint64(u64(&r.start_time)),
		StartMode:   atomic.LoadUint32(u32(&r.start_mode)),
		Cursor:      atomic.LoadUint64(u64(&r.cursor)),
		Acquired:    atomic.LoadUint64(u64(&r.acquired)),
		HeartbeatNs: atomic.LoadUint64(u64(&r.heartbeat_ns)),
		WaitNs:      atomic.LoadUint64(u64(&r.wait_ns)),
		Batches:     atomic.LoadUint64(u64(&r.batches)),
		Placement:   atomic.LoadUint32(u32(&r.placement)),
		CUDAOrdinal: int32(atomic.LoadUint32(u32((*C32)(unsafe.Pointer(&r.cuda_ordinal))))),
		GPUUUID:     *(*[16]byte)(unsafe.Pointer(&r.gpu_uuid[0])),
	}
}

// Cursor is reader record i's cursor (every seq below is released).
func (s *Segment) Cursor(i uint32) uint64 { return atomic.LoadUint64(u64(&s.Record(i).cursor)) }

// ReaderLocked reports whether a live process holds reader record i.
func (s *Segment) ReaderLocked(i uint32) (bool, error) {
	return ByteLocked(s.File, LockReader0+int64(i))
}

// ProducerLocked reports whether a live process holds the producer lock.
func (s *Segment) ProducerLocked() (bool, error) { return ByteLocked(s.File, LockProducer) }

// ErrNotSegment and friends describe why a file is not a usable segment.
var (
	ErrNotSegment = errors.New("not a tsock segment")
	ErrVersion    = errors.New("layout version mismatch")
	ErrTruncated  = errors.New("segment truncated or inconsistent")
)

// Epoch is the producer's current epoch (informational).
func (s *Segment) Epoch() uint64 { return atomic.LoadUint64(u64(&s.Header().epoch)) }

// SetEpoch stores the producer's current epoch.
func (s *Segment) SetEpoch(v uint64) { atomic.StoreUint64(u64(&s.Header().epoch), v) }

// StillNamed reports whether path still names this segment's file.
func (s *Segment) StillNamed(path string) bool {
	a, err1 := s.File.Stat()
	b, err2 := os.Stat(path)
	return err1 == nil && err2 == nil && os.SameFile(a, b)
}

// HeaderStats are the producer's counters kept in the header, so tools
// can read them from another process.
type HeaderStats struct {
	BackpressureNs, ReadersReclaimed, ReadersEvicted, HeartbeatNs uint64
}

// Stats reads the header counters.
func (s *Segment) Stats() HeaderStats {
	h := s.Header()
	return HeaderStats{
		BackpressureNs:   atomic.LoadUint64(u64(&h.stat_backpressure_ns)),
		ReadersReclaimed: atomic.LoadUint64(u64(&h.stat_readers_reclaimed)),
		ReadersEvicted:   atomic.LoadUint64(u64(&h.stat_readers_evicted)),
		HeartbeatNs:      atomic.LoadUint64(u64(&h.heartbeat_ns)),
	}
}

// AddBackpressure, AddReclaimed and AddEvicted bump the header counters.
func (s *Segment) AddBackpressure(ns uint64) {
	atomic.AddUint64(u64(&s.Header().stat_backpressure_ns), ns)
}
func (s *Segment) AddReclaimed() { atomic.AddUint64(u64(&s.Header().stat_readers_reclaimed), 1) }
func (s *Segment) AddEvicted()   { atomic.AddUint64(u64(&s.Header().stat_readers_evicted), 1) }

// SetHeartbeat stores the producer's last activity (CLOCK_MONOTONIC).
func (s *Segment) SetHeartbeat(ns uint64) { atomic.StoreUint64(u64(&s.Header().heartbeat_ns), ns) }

// EpochStart is the seq of the current epoch's first batch.
func (s *Segment) EpochStart() uint64 { return atomic.LoadUint64(u64(&s.Header().epoch_start)) }

// SetEpochStart stores the seq of the current epoch's first batch.
func (s *Segment) SetEpochStart(v uint64) { atomic.StoreUint64(u64(&s.Header().epoch_start), v) }

// JoinWindow is how many batches of each epoch are kept for late joiners.
func (s *Segment) JoinWindow() uint64 { return atomic.LoadUint64(u64(&s.Header().join_window)) }

// SetJoinWindow stores the late-join window (set once, before readers).
func (s *Segment) SetJoinWindow(v uint64) { atomic.StoreUint64(u64(&s.Header().join_window), v) }
