package ring

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"unsafe"

	mmap "github.com/edsrzf/mmap-go"
	"golang.org/x/sys/unix"
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
// The result is checked to be the same file. The C reader's twin is
// tsock__fork_reopen (reader/platform.c).
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

// Kept is what UnmapKeeping left mapped: private anonymous memory where a
// payload was, until Free.
type Kept struct {
	addr unsafe.Pointer
	n    uintptr
}

// Free unmaps it (once; a zero Kept does nothing).
func (k *Kept) Free() {
	if k.addr != nil {
		_ = unix.MunmapPtr(k.addr, k.n)
		k.addr, k.n = nil, 0
	}
}

// UnmapKeeping unmaps the segment except the pages of bytes [off, off+n),
// which become private anonymous memory at the same address (in one step,
// MAP_FIXED): a thread that still writes there (a reserved payload that C
// holds a pointer to) writes on, into memory nobody reads, instead of
// faulting. Where that cannot be done, the whole segment stays mapped and
// is what is kept.
func (s *Segment) UnmapKeeping(off, n uint64) (Kept, error) {
	if s.mem == nil {
		return Kept{}, nil
	}
	page := uint64(os.Getpagesize())
	total := (uint64(len(s.mem)) + page - 1) &^ (page - 1)
	lo, hi := off&^(page-1), min((off+n+page-1)&^(page-1), total)
	base := unsafe.Pointer(unsafe.SliceData(s.mem))
	s.mem, s.base = nil, nil
	_, err := unix.MmapPtr(-1, 0, unsafe.Add(base, lo), uintptr(hi-lo), unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED)
	if err != nil {
		return Kept{addr: base, n: uintptr(total)}, nil
	}
	if lo > 0 {
		err = unix.MunmapPtr(base, uintptr(lo))
	}
	if hi < total {
		err = errors.Join(err, unix.MunmapPtr(unsafe.Add(base, hi), uintptr(total-hi)))
	}
	return Kept{addr: unsafe.Add(base, lo), n: uintptr(hi - lo)}, err
}

// PayloadOffset is where the payload of sequence number seq starts in the
// segment.
func (s *Segment) PayloadOffset(seq uint64) uint64 {
	return s.Geometry.PayloadOffset + s.SlotIndex(seq)*s.Geometry.SlotPayloadBytes
}

// Header is the segment's header page.
func (s *Segment) Header() *Header { return (*Header)(s.base) }

// Entry is roster entry i.
func (s *Segment) Entry(i uint32) *RosterEntry {
	off := s.Geometry.RosterOffset + uint64(i)*uint64(RosterEntrySize)
	return (*RosterEntry)(unsafe.Add(s.base, off))
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
// consistent: pairs with the sleeping flags of the readers' records).
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

// Claim is roster entry i's claim word: generation << 8 | state.
func (s *Segment) Claim(i uint32) uint64 { return atomic.LoadUint64(u64(&s.Entry(i).claim)) }

// SetClaim stores roster entry i's claim word (the producer only: it is
// the entry's one writer).
func (s *Segment) SetClaim(i uint32, v uint64) { atomic.StoreUint64(u64(&s.Entry(i).claim), v) }

// ClaimState and ClaimGen split a claim word; MakeClaim joins them.
func ClaimState(c uint64) uint32             { return uint32(c & 0xff) }
func ClaimGen(c uint64) uint64               { return c >> 8 }
func MakeClaim(gen uint64, st uint32) uint64 { return gen<<8 | uint64(st) }

// Identity is who a reader is, as the kernel told the producer at the
// join (SO_PEERCRED), and how it asked to start.
type Identity struct {
	Pid       int32 // in the producer's pid namespace; 0 when not visible there
	Uid, Gid  uint32
	StartTime uint64 // /proc/<pid>/stat field 22; 0 unknown
	StartMode uint32
	// AttachNs is CLOCK_MONOTONIC (MonotonicNs) when the producer admitted
	// the reader: the start of the time its wait_ns counts against; 0 not
	// known (a segment of a producer from before the field).
	AttachNs uint64
}

// Progress is what a reader writes in its record: how far it got and
// where it reads from. Every value comes from the reader: untrusted.
type Progress struct {
	Cursor      uint64
	Acquired    uint64
	HeartbeatNs uint64
	WaitNs      uint64
	Batches     uint64
	Placement   uint32 // PlacementHost, PlacementPinned, PlacementDevice (reader-written: validate)
	CUDAOrdinal int32  // the reader's device in its own numbering, -1 none
	GPUUUID     [16]byte
}

// RecordSnapshot is roster entry i: the producer's claim word, the
// reader's identity and its progress as last mirrored.
type RecordSnapshot struct {
	Claim uint64
	Identity
	Progress
}

// SetIdentity writes who the reader of entry i is (the producer, before
// it stores the entry's claim).
func (s *Segment) SetIdentity(i uint32, id Identity) {
	e := s.Entry(i)
	atomic.StoreUint32(u32((*C32)(unsafe.Pointer(&e.pid))), uint32(id.Pid))
	atomic.StoreUint32(u32(&e.uid), id.Uid)
	atomic.StoreUint32(u32(&e.gid), id.Gid)
	atomic.StoreUint64(u64(&e.start_time), id.StartTime)
	atomic.StoreUint32(u32(&e.start_mode), id.StartMode)
	atomic.StoreUint64(u64(&e.attach_ns), id.AttachNs)
}

// Mirror copies a reader's progress into entry i, for tools.
func (s *Segment) Mirror(i uint32, p Progress) {
	e := s.Entry(i)
	atomic.StoreUint64(u64(&e.cursor), p.Cursor)
	atomic.StoreUint64(u64(&e.acquired), p.Acquired)
	atomic.StoreUint64(u64(&e.heartbeat_ns), p.HeartbeatNs)
	atomic.StoreUint64(u64(&e.wait_ns), p.WaitNs)
	atomic.StoreUint64(u64(&e.batches), p.Batches)
	atomic.StoreUint32(u32((*C32)(unsafe.Pointer(&e.cuda_ordinal))), uint32(p.CUDAOrdinal))
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&e.gpu_uuid[0])), CUDAUUIDBytes), p.GPUUUID[:])
	atomic.StoreUint32(u32(&e.placement), p.Placement)
}

// Snapshot reads roster entry i.
func (s *Segment) Snapshot(i uint32) RecordSnapshot {
	e := s.Entry(i)
	return RecordSnapshot{
		Claim: atomic.LoadUint64(u64(&e.claim)),
		Identity: Identity{
			Pid:       int32(atomic.LoadUint32(u32((*C32)(unsafe.Pointer(&e.pid))))),
			Uid:       atomic.LoadUint32(u32(&e.uid)),
			Gid:       atomic.LoadUint32(u32(&e.gid)),
			StartTime: atomic.LoadUint64(u64(&e.start_time)),
			StartMode: atomic.LoadUint32(u32(&e.start_mode)),
			AttachNs:  atomic.LoadUint64(u64(&e.attach_ns)),
		},
		Progress: Progress{
			Cursor:      atomic.LoadUint64(u64(&e.cursor)),
			Acquired:    atomic.LoadUint64(u64(&e.acquired)),
			HeartbeatNs: atomic.LoadUint64(u64(&e.heartbeat_ns)),
			WaitNs:      atomic.LoadUint64(u64(&e.wait_ns)),
			Batches:     atomic.LoadUint64(u64(&e.batches)),
			Placement:   atomic.LoadUint32(u32(&e.placement)),
			CUDAOrdinal: int32(atomic.LoadUint32(u32((*C32)(unsafe.Pointer(&e.cuda_ordinal))))),
			GPUUUID:     *(*[16]byte)(unsafe.Pointer(&e.gpu_uuid[0])),
		},
	}
}

// Cursor is roster entry i's cursor as last mirrored from the reader's
// record (for tools; the producer gates on the record itself).
func (s *Segment) Cursor(i uint32) uint64 { return atomic.LoadUint64(u64(&s.Entry(i).cursor)) }

// JoinKey is the key of the channel's join socket (see JoinAddress).
func (s *Segment) JoinKey() [16]byte {
	return *(*[16]byte)(unsafe.Pointer(&s.Header().join_key[0]))
}

// SetJoinKey records the join socket's key in a header being built, before
// InitHeader publishes it.
func (s *Segment) SetJoinKey(key [16]byte) {
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&s.Header().join_key[0])), JoinKeyBytes), key[:])
}

// ReaderLocked reports whether a live process holds a lock on roster entry
// i's byte: the reader of that entry holds a read lock there while it is
// attached (anyone who may read the file could, too: for tools only).
func (s *Segment) ReaderLocked(i uint32) (bool, error) {
	return ByteLocked(s.File, LockReader0+int64(i))
}

// ProducerLocked reports whether a live producer holds the producer lock:
// a write lock, which only a process that may write the file can take.
func (s *Segment) ProducerLocked() (bool, error) { return ByteWriteLocked(s.File, LockProducer) }

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
