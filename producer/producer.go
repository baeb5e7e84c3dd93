// Package producer is tsock's writer side: it creates a channel in
// /dev/shm, publishes batches of tensors into its ring, gates on the
// slowest live reader, and frees the records of readers that die.
//
// A Producer is used by one goroutine at a time (Stats, Readers and
// WaitReaders may be called from any goroutine).
package producer

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tsock/tsock/internal/readers"
	"github.com/tsock/tsock/ring"
)

// Options choose a channel's geometry, permissions and reader policy. The
// zero value of each field means its default.
type Options struct {
	Slots      uint32        // ring depth, a power of two; default 16
	SlotBytes  uint64        // payload bytes per batch; default 1 MiB
	MaxReaders uint32        // reader records; default 64
	Mode       os.FileMode   // permission bits; default 0600 (user only)
	Gid        int           // group of the segment; -1 or 0 keeps the default
	EvictAfter time.Duration // evict a reader that gates this long; 0 never
	// JoinWindow keeps the first JoinWindow batches of each epoch in the
	// ring while no more of the epoch is published, so that a reader
	// attaching that early still gets the whole epoch. 0: none. Must be
	// less than Slots.
	JoinWindow uint32
	// Device, "cuda:N", adds a device pool on CUDA device N: every batch is
	// also copied once into GPU memory that readers on that GPU open
	// through CUDA IPC and read zero-copy. "" or "cpu": host memory only.
	// The CUDA driver is loaded at run time (TSOCK_LIBCUDA overrides the
	// library's path); without one, Create fails with a message saying so.
	Device string
}

// Defaults of Options.
const (
	DefaultSlots      = 16
	DefaultSlotBytes  = 1 << 20
	DefaultMaxReaders = 64
	DefaultMode       = 0o600
)

// Sentinel errors; errors.Is matches them against any producer error.
var (
	ErrBackpressure = ring.Status(ring.StatusBackpressure)
	ErrTimedOut     = ring.Status(ring.StatusTimedOut)
	ErrExist        = ring.Status(ring.StatusExist)
	ErrName         = ring.Status(ring.StatusName)
	ErrTooBig       = ring.Status(ring.StatusTooBig)
	ErrDtype        = ring.Status(ring.StatusDtype)
	ErrState        = ring.Status(ring.StatusState)
	ErrInvalid      = ring.Status(ring.StatusInval)
)

// Tensor places one tensor in a batch's payload (see ring.Tensor).
type Tensor = ring.Tensor

// ForkGuard keeps the descriptors that carry liveness locks out of
// children forked without exec. A Go program cannot fork without exec; a C
// or Python program that loads libtsock.so can, and does (DataLoader
// workers): the C ABI installs a guard whose fork handler closes them in
// the child. Open runs open, which makes one descriptor, so that no fork()
// can copy it before the guard knows it; Close closes one the same way.
type ForkGuard interface {
	Open(open func() (*os.File, error)) (*os.File, error)
	Close(f *os.File) error
}

var forkGuard ForkGuard

// SetForkGuard installs g; call it once, before any producer is created.
func SetForkGuard(g ForkGuard) { forkGuard = g }

// openLockable opens a descriptor that holds, or may come to hold, an OFD
// lock, under the fork guard if there is one.
func openLockable(open func() (*os.File, error)) (*os.File, error) {
	if forkGuard == nil {
		return open()
	}
	return forkGuard.Open(open)
}

// closeLockable closes a descriptor opened with openLockable.
func closeLockable(f *os.File) error {
	if forkGuard == nil {
		return f.Close()
	}
	return forkGuard.Close(f)
}

// guard is the fork guard the reader table uses for the join socket, the
// readers' connections and their records' memfds.
func guard() readers.Guard {
	if forkGuard == nil {
		return readers.NoGuard{}
	}
	return forkGuard
}

// Producer owns one channel.
type Producer struct {
	mu      sync.Mutex
	name    string
	path    string
	tmp     string // the segment's temporary name until installed; "" for an unnamed file
	seg     *ring.Segment
	opts    Options
	slots   uint64
	closing atomic.Bool

	next      uint64 // next seq to publish; equals the published count
	cachedMin uint64 // smallest live reader cursor at the last scan
	reserved  bool
	resBytes  uint64
	epoch     uint64
	index     uint64
	descs     [ring.MaxTensors]ring.ShmTensor
	pool      *devicePool    // nil without a device
	table     *readers.Table // the readers: join socket, records, liveness

	// live guards the mapping's lifetime against the calls that may come
	// from any goroutine (Stats, Readers, WaitReaders) and so do not take
	// mu, which Reserve holds while it waits: they read the segment under
	// the read lock, Close unmaps it under the write lock.
	live     sync.RWMutex
	unmapped bool      // under live
	kept     ring.Kept // the reserved payload's pages Close left mapped, under mu
	final    Stats     // the counters as Close left them, under live

	// gating reader watch, for the eviction policy
	gateCursor uint64
	gateSince  time.Time
}

func (o *Options) fill() error {
	if o.Slots == 0 {
		o.Slots = DefaultSlots
	}
	if o.SlotBytes == 0 {
		o.SlotBytes = DefaultSlotBytes
	}
	if o.MaxReaders == 0 {
		o.MaxReaders = DefaultMaxReaders
	}
	if o.Mode == 0 {
		o.Mode = DefaultMode
	}
	if o.Mode&^0o777 != 0 {
		return ring.Errorf(ring.StatusInval, "mode %o has bits outside 0777", o.Mode)
	}
	if o.EvictAfter < 0 {
		return ring.Errorf(ring.StatusInval, "negative EvictAfter")
	}
	if _, err := ParseDevice(o.Device); err != nil {
		return err
	}
	if o.JoinWindow >= o.Slots {
		return ring.Errorf(ring.StatusInval, "join window of %d batches needs more than %d slots", o.JoinWindow, o.Slots)
	}
	return nil
}

// Create makes channel name and becomes its producer. A segment left by a
// dead producer is replaced; a live producer on the name gives ErrExist.
func Create(name string, opts Options) (*Producer, error) {
	if !ring.NameOK(name) {
		return nil, ring.Errorf(ring.StatusName, "channel name %q is not 1..%d of [A-Za-z0-9._-]", name, ring.NameMax)
	}
	if err := opts.fill(); err != nil {
		return nil, err
	}
	g, ok := ring.ComputeGeometry(opts.Slots, opts.MaxReaders, opts.SlotBytes)
	if !ok {
		return nil, ring.Errorf(ring.StatusInval,
			"geometry out of range: slots %d (power of two, %d..%d), readers %d (1..%d), slot bytes %d (1..%d)",
			opts.Slots, ring.MinSlots, ring.MaxSlots, opts.MaxReaders, ring.MaxReaders, opts.SlotBytes, ring.MaxSlotBytes)
	}
	seg, tmp, pool, table, err := buildSegment(name, g, opts)
	if err != nil {
		return nil, err
	}
	p := &Producer{name: name, path: channelPath(name), tmp: tmp, seg: seg, opts: opts, slots: uint64(opts.Slots),
		pool: pool, table: table}
	if err := p.install(); err != nil {
		table.Close()
		pool.close()
		seg.Unmap()
		closeLockable(seg.File)
		return nil, err
	}
	table.Serve()
	// Now that this channel exists, remove those of this user that nobody
	// holds any more (best effort: reclaim.go).
	reclaimDead(name)
	return p, nil
}

// shmDir is where channels are made: ring.ShmDir, which readers and tools
// also use. Only tests point it elsewhere (a small tmpfs, export_test.go).
var shmDir = ring.ShmDir

// channelPath is the segment file of channel name.
func channelPath(name string) string { return shmDir + "/" + ring.ShmPrefix + name }

// checkFree is the early statfs check of reserveSpace; tests turn it off to
// reach the fallocate path.
var checkFree = true

// fallocChunk is how much reserveSpace allocates per fallocate call: a
// call interrupted by a signal (EINTR, on kernels that abort tmpfs
// fallocate on any signal, and the Go runtime preempts with signals) then
// repeats one chunk, not the whole segment.
const fallocChunk = 64 << 20

// reserveSpace sizes the segment file to size bytes and allocates every
// page of it now. A tmpfs file is sparse: a segment that does not fit
// would be created fine and kill the producer or a reader with SIGBUS at
// the first touch of a page the filesystem cannot supply (PyTorch's most
// reported shared-memory failure). Reserving makes the segment's memory
// committed from creation on, and turns "does not fit" into an error
// here, naming the sizes.
func reserveSpace(f *os.File, name string, size uint64) error {
	fd := int(f.Fd())
	if checkFree {
		if free, total, ok := fsFree(fd); ok && size > free {
			return spaceError(name, size, free, total, nil)
		}
	}
	if err := f.Truncate(int64(size)); err != nil {
		return sysError(err, "size channel %q to %d bytes", name, size)
	}
	for off := uint64(0); off < size; {
		n := min(size-off, fallocChunk)
		err := unix.Fallocate(fd, 0, int64(off), int64(n))
		switch {
		case err == nil:
			off += n
		case errors.Is(err, unix.EINTR):
			// retry the chunk
		case errors.Is(err, unix.EOPNOTSUPP):
			// Not tmpfs (tmpfs has fallocate since Linux 3.5): the file
			// stays sparse, and only the statfs check above stood
			// between a segment too big and SIGBUS.
			return nil
		case errors.Is(err, unix.ENOSPC):
			free, total, _ := fsFree(fd)
			return spaceError(name, size, free, total, err)
		default:
			return sysError(err, "reserve %d bytes for channel %q", size, name)
		}
	}
	return nil
}

// fsFree is the space an unprivileged user may still allocate in the
// filesystem of fd, and its size.
func fsFree(fd int) (free, total uint64, ok bool) {
	var st unix.Statfs_t
	if unix.Fstatfs(fd, &st) != nil {
		return 0, 0, false
	}
	return st.Bavail * uint64(st.Bsize), st.Blocks * uint64(st.Bsize), true
}

func spaceError(name string, size, free, total uint64, err error) error {
	why := ""
	if err != nil {
		why = fmt.Sprintf(" (%v)", err)
	}
	return ring.Errorf(ring.StatusNoMem,
		"channel %q needs %d bytes (%s) in %s, which has %d bytes (%s) free of %d (%s)%s: "+
			"lower Slots or SlotBytes, remove dead channels (tsock rm --all-dead), or enlarge %s (docker run --shm-size)",
		name, size, mib(size), shmDir, free, mib(free), total, mib(total), why, shmDir)
}

func mib(n uint64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// segmentMode is the file mode of a segment for the mode asked: readers
// only read it, so group and others never get write permission (a reader
// that could write the file could change descriptors and payload, or
// truncate it under the producer).
func segmentMode(asked os.FileMode) os.FileMode { return asked &^ 0o022 }

// buildSegment creates the segment as an unnamed file (createUnnamed),
// fully initialised and locked before install gives it its name, so that
// no reader can ever open a half-built channel and a producer killed while
// creating leaves nothing behind. With a device, the device pool is made
// and described in the segment before the header is published; the join
// socket is bound and its key written there too.
func buildSegment(name string, g ring.Geometry, opts Options) (*ring.Segment, string, *devicePool, *readers.Table, error) {
	f, tmp, err := createUnnamed()
	if err != nil {
		return nil, "", nil, nil, err
	}
	where := tmp
	if where == "" {
		where = "the new segment of " + name
	}
	fail := func(err error) (*ring.Segment, string, *devicePool, *readers.Table, error) {
		closeLockable(f)
		if tmp != "" {
			os.Remove(tmp)
		}
		return nil, "", nil, nil, err
	}
	if err := reserveSpace(f, name, g.TotalBytes); err != nil {
		return fail(err)
	}
	// Mapped while the file is still 0600: the mapping comes from a second
	// open (ring.MapSegment), which a mode without owner write would refuse.
	seg, err := ring.MapSegment(f, g, opts.Slots, opts.MaxReaders, true)
	if err != nil {
		return fail(sysError(err, "map %s", where))
	}
	failMapped := func(err error) (*ring.Segment, string, *devicePool, *readers.Table, error) {
		seg.Unmap()
		return fail(err)
	}
	if err := f.Chmod(segmentMode(opts.Mode)); err != nil { // the umask must not widen or narrow the choice
		return failMapped(sysError(err, "chmod %s", where))
	}
	if opts.Gid > 0 {
		if err := f.Chown(-1, opts.Gid); err != nil {
			return failMapped(sysError(err, "chown %s to group %d", where, opts.Gid))
		}
	}
	seg.SetJoinWindow(uint64(opts.JoinWindow))
	var pool *devicePool
	if ordinal, _ := ParseDevice(opts.Device); ordinal >= 0 {
		if pool, err = openPool(ordinal, seg); err != nil {
			return failMapped(err)
		}
	}
	table, err := readers.Listen(seg, guard())
	if err != nil {
		pool.close()
		return failMapped(sysError(err, "channel %q", name))
	}
	seg.InitHeader(name, os.Getpid(), uint64(time.Now().UnixNano()))
	if err := ring.LockByte(f, ring.LockProducer); err != nil {
		table.Close()
		pool.close()
		return failMapped(sysError(err, "lock %s", where))
	}
	return seg, tmp, pool, table, nil
}

// createUnnamed makes the segment's file in shmDir without a name
// (O_TMPFILE): it exists only through its descriptor until install links
// it, so if the producer dies first, the kernel frees it with the
// descriptor. Where O_TMPFILE is not supported (Linux before 3.11, or a
// filesystem without it; tmpfs has it) it falls back to a hidden temporary
// name, returned as tmp, which a producer killed before install leaves
// behind (tsock rm removes those of dead processes).
func createUnnamed() (f *os.File, tmp string, err error) {
	err = unix.EOPNOTSUPP
	if useTmpfile {
		f, err = openLockable(func() (*os.File, error) {
			return os.OpenFile(shmDir, os.O_RDWR|unix.O_TMPFILE, 0o600)
		})
	}
	if err == nil {
		return f, "", nil
	}
	if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.EISDIR) && !errors.Is(err, unix.EINVAL) {
		return nil, "", sysError(err, "create an unnamed file in %s", shmDir)
	}
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	tmp = fmt.Sprintf("%s/.tsock-tmp.%d.%s", shmDir, os.Getpid(), hex.EncodeToString(rnd[:]))
	f, err = openLockable(func() (*os.File, error) {
		return os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	})
	if err != nil {
		return nil, "", sysError(err, "create %s", tmp)
	}
	return f, tmp, nil
}

// useTmpfile is false only in tests of the fallback.
var useTmpfile = true

// link gives the built segment the channel's name; like link(2) it fails
// with EEXIST when the name exists. An unnamed file is linked through
// /proc/self/fd (linkat with AT_SYMLINK_FOLLOW: AT_EMPTY_PATH would need
// CAP_DAC_READ_SEARCH).
func (p *Producer) link() error {
	if p.tmp != "" {
		return os.Link(p.tmp, p.path)
	}
	src := "/proc/self/fd/" + strconv.Itoa(int(p.seg.File.Fd()))
	if err := unix.Linkat(unix.AT_FDCWD, src, unix.AT_FDCWD, p.path, unix.AT_SYMLINK_FOLLOW); err != nil {
		return &os.LinkError{Op: "linkat", Old: src, New: p.path, Err: err}
	}
	return nil
}

// install links the built segment at the channel's name. If a segment is
// already there, its producer lock tells whether its owner lives: a live
// owner is an error, a dead one's segment is removed (its readers then see
// "producer gone").
func (p *Producer) install() error {
	if p.tmp != "" {
		defer os.Remove(p.tmp)
	}
	for attempt := 0; attempt < 100; attempt++ {
		err := p.link()
		if err == nil {
			return nil
		}
		if !errors.Is(err, os.ErrExist) {
			return sysError(err, "link %s", p.path)
		}
		if err := reclaimStale(p.path); err != nil {
			return err
		}
	}
	return ring.Errorf(ring.StatusExist, "channel %q: kept losing the race to create it", p.name)
}

// reclaimStale removes the segment at path if its producer is dead. It
// returns nil when the path is free to try again.
func reclaimStale(path string) error {
	f, err := openLockable(func() (*os.File, error) { return os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW, 0) })
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if errors.Is(err, syscall.ELOOP) {
		return ring.Errorf(ring.StatusCorrupt, "%s is a symbolic link; not followed (remove it by hand)", path)
	}
	if err != nil {
		return sysError(err, "open existing %s", path)
	}
	defer closeLockable(f)
	if err := lockStale(f, path); err != nil {
		return err
	}
	// We hold the dead producer's lock. Make sure the path still names this
	// file (another producer may have replaced it meanwhile), then remove it.
	var a, b syscall.Stat_t
	if syscall.Fstat(int(f.Fd()), &a) != nil || syscall.Stat(path, &b) != nil || a.Ino != b.Ino || a.Dev != b.Dev {
		return nil
	}
	// Producers link only finished segments, so anything without the magic
	// is not ours: leave it for a person to look at.
	buf := make([]byte, 8)
	if n, _ := f.ReadAt(buf, 0); n < len(buf) || !looksLikeSegment(buf) {
		return ring.Errorf(ring.StatusCorrupt, "%s is not a tsock segment; remove it by hand", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return sysError(err, "remove stale %s", path)
	}
	return nil
}

// lockStale takes the producer lock of the segment f, opened at path. The
// lock is held either by a live producer, or for a moment by a process
// reclaiming this dead segment (reclaimDead, at another channel's Create),
// which then removes the name: so a held lock is given up to 50 ms to go
// away or the name to change (nil error, lock not taken: the caller's
// check that path still names f then sends it round again) before it
// counts as a live producer. The 50 ms run from the first look and end with
// a look taken after them: a Create descheduled between two looks (a
// loaded machine) still looks again rather than give up on a stale view.
// A read lock there (any reader of the file may take one) is no producer,
// but it keeps the write lock from us: the error says so, and that tsock
// rm removes the file.
func lockStale(f *os.File, path string) error {
	var deadline time.Time
	for {
		looked := time.Now()
		err := ring.LockByte(f, ring.LockProducer)
		if err == nil {
			return nil
		}
		if err != ring.ErrLocked {
			return sysError(err, "lock %s", path)
		}
		if st, err := os.Lstat(path); err != nil || !sameFile(f, st) {
			return nil
		}
		if staleLockedHook != nil {
			staleLockedHook()
		}
		if deadline.IsZero() {
			deadline = looked.Add(50 * time.Millisecond)
		}
		if looked.After(deadline) {
			if alive, err := ring.ByteWriteLocked(f, ring.LockProducer); err == nil && !alive {
				return ring.Errorf(ring.StatusExist, "%s: its producer is dead, but a reader process holds a read "+
					"lock on its producer byte (a broken or hostile reader); `tsock rm` removes the file", path)
			}
			return ring.Errorf(ring.StatusExist, "%s has a live producer", path)
		}
		time.Sleep(time.Millisecond)
	}
}

// staleLockedHook, set by tests only, runs each time lockStale has found
// the lock held, before it decides to look again or give up.
var staleLockedHook func()

// sameFile reports whether f is the file st describes.
func sameFile(f *os.File, st os.FileInfo) bool {
	fst, err := f.Stat()
	return err == nil && os.SameFile(fst, st)
}

func looksLikeSegment(hdr []byte) bool {
	var m uint64
	for i := 7; i >= 0; i-- {
		m = m<<8 | uint64(hdr[i])
	}
	return m == ring.Magic
}

func sysError(err error, format string, args ...any) error {
	st := ring.StatusSys
	if errors.Is(err, os.ErrPermission) {
		st = ring.StatusPerm
	}
	return ring.Errorf(st, "%s: %v", fmt.Sprintf(format, args...), err)
}

// Name is the channel name.
func (p *Producer) Name() string { return p.name }

// SlotBytes is the payload capacity of one batch.
func (p *Producer) SlotBytes() uint64 { return p.seg.Geometry.SlotPayloadBytes }

// Slots is the ring depth.
func (p *Producer) Slots() uint32 { return p.seg.SlotCount }

func (p *Producer) usable() error {
	if p.closing.Load() {
		return ring.Errorf(ring.StatusHandle, "producer of %q is closed", p.name)
	}
	return nil
}

// endReservation is Publish's and Abort's answer once closed: a batch
// still reserved is dropped, and the pages Close left mapped for it freed
// (under mu).
func (p *Producer) endReservation(err error) error {
	if p.closing.Load() && p.reserved {
		p.reserved = false
		p.kept.Free()
	}
	return err
}

// HoldsReservation reports whether a batch is reserved (and, once closed,
// its payload's pages still mapped until Publish or Abort).
func (p *Producer) HoldsReservation() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.reserved
}

// Reserve waits for the next slot and returns its payload buffer, nbytes
// long: write the batch there, then Publish. timeout 0 returns
// ErrBackpressure at once when the ring is full; a negative timeout waits
// without limit (dead readers are still freed).
func (p *Producer) Reserve(nbytes uint64, timeout time.Duration) ([]byte, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return nil, err
	}
	if p.reserved {
		return nil, ring.Errorf(ring.StatusState, "a batch is already reserved: publish or abort it first")
	}
	if nbytes > p.seg.Geometry.SlotPayloadBytes {
		return nil, ring.Errorf(ring.StatusTooBig, "batch of %d bytes exceeds the channel's %d bytes per slot",
			nbytes, p.seg.Geometry.SlotPayloadBytes)
	}
	if err := p.gate(p.next, timeout); err != nil {
		return nil, err
	}
	if err := p.slotIdle(p.next); err != nil {
		return nil, err
	}
	p.seg.BeginSlot(p.next)
	p.reserved, p.resBytes = true, nbytes
	return p.seg.Payload(p.next)[:nbytes], nil
}

// Publish makes the reserved batch visible to readers: tensors laid out in
// the payload, and up to 256 bytes of metadata. On error the reservation
// stays and may be published again.
func (p *Producer) Publish(tensors []Tensor, meta []byte) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return p.endReservation(err)
	}
	if !p.reserved {
		return ring.Errorf(ring.StatusState, "publish without a reserved batch")
	}
	if len(tensors) > ring.MaxTensors {
		return ring.Errorf(ring.StatusTooBig, "batch has %d tensors, at most %d", len(tensors), ring.MaxTensors)
	}
	if len(meta) > ring.MetaMax {
		return ring.Errorf(ring.StatusTooBig, "metadata of %d bytes, at most %d", len(meta), ring.MetaMax)
	}
	for i := range tensors {
		if st, err := tensors[i].Fill(&p.descs[i], p.resBytes); st != ring.StatusOK {
			return ring.Errorf(st, "tensor %d: %v", i, err)
		}
	}
	c := ring.SlotContents{Epoch: p.epoch, Index: p.index, Tensors: tensors, Meta: meta,
		PayloadBytes: p.resBytes, PayloadKind: ring.PayloadHost}
	if p.pool != nil {
		if err := p.pool.copySlot(uint32(p.seg.SlotIndex(p.next)), p.resBytes); err != nil {
			return fmt.Errorf("batch %d: copy to the device pool: %w", p.next, err)
		}
		c.PayloadKind = ring.PayloadHostDevice
	}
	p.write(c, len(tensors))
	p.index++
	return nil
}

// slotIdle returns once the device pool's last copy out of seq's slot has
// read the host payload, so that the slot may be written again.
func (p *Producer) slotIdle(seq uint64) error {
	if p.pool == nil {
		return nil
	}
	if err := p.pool.waitSlot(uint32(p.seg.SlotIndex(seq))); err != nil {
		return fmt.Errorf("slot of batch %d: %w", seq, err)
	}
	return nil
}

// Abort drops the reserved batch.
func (p *Producer) Abort() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return p.endReservation(err)
	}
	if !p.reserved {
		return ring.Errorf(ring.StatusState, "abort without a reserved batch")
	}
	p.reserved = false
	return nil
}

// EndEpoch publishes the epoch-end marker (no tensors, index = batches in
// the epoch) and starts the next epoch. It waits for a slot like Reserve.
func (p *Producer) EndEpoch(timeout time.Duration) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return err
	}
	if p.reserved {
		return ring.Errorf(ring.StatusState, "a batch is reserved: publish or abort it before ending the epoch")
	}
	if err := p.gate(p.next, timeout); err != nil {
		return err
	}
	if err := p.slotIdle(p.next); err != nil {
		return err
	}
	p.seg.BeginSlot(p.next)
	p.write(ring.SlotContents{Epoch: p.epoch, Index: p.index, Flags: ring.FlagEpochEnd}, 0)
	p.epoch++
	p.index = 0
	p.seg.SetEpoch(p.epoch)
	p.seg.SetEpochStart(p.next)
	return nil
}

// write fills the slot of p.next and publishes it.
func (p *Producer) write(c ring.SlotContents, n int) {
	seq := p.next
	c.PublishNs = ring.MonotonicNs()
	p.seg.SetHeartbeat(c.PublishNs)
	p.seg.WriteSlot(seq, &c, p.descs[:n])
	p.next = seq + 1
	p.reserved = false
	p.seg.StorePublished(p.next)
	// Sequentially consistent store above, loads here: pairs with a reader
	// that sets its sleeping flag and then re-reads published before
	// sleeping (docs/ARCHITECTURE.md, "Acquire and release").
	if p.table.AnySleeping() {
		ring.FutexWakeAll(p.seg.PublishedWord())
	}
}

// maxSleep bounds one sleep of the gate. The producer sleeps on the cursor
// word of the reader that holds it back, which that reader's release or
// death changes and wakes; only a Close that comes between the gate's last
// look and its sleep goes unseen, for at most this long.
const maxSleep = 50 * time.Millisecond

// gate returns once slot seq may be overwritten: every reader that gates
// has released seq - slots. A reader that dies is freed by its
// connection's goroutine (end of file), which wakes the gate.
func (p *Producer) gate(seq uint64, timeout time.Duration) error {
	if seq < p.cachedMin+p.slots {
		return nil
	}
	p.cachedMin, _, _ = p.scan(seq)
	if seq < p.cachedMin+p.slots {
		return nil
	}
	if timeout == 0 {
		// A caller that polls with timeout 0 is blocked by a stuck reader
		// as surely as one that waits: it may not escape the eviction
		// policy, whose clock runs across calls.
		if p.maybeEvict(p.cachedMin) {
			p.cachedMin, _, _ = p.scan(seq)
			if seq < p.cachedMin+p.slots {
				return nil
			}
		}
		return ring.Errorf(ring.StatusBackpressure, "ring full: the slowest reader is at batch %d, publishing %d", p.cachedMin, seq)
	}
	start := time.Now()
	defer func() { p.seg.AddBackpressure(uint64(time.Since(start))) }()
	defer p.seg.SetProducerWaiting(false)
	for {
		// Dekker pairing with a releasing reader: waiting is stored
		// before the scan loads cursors; a reader stores its cursor
		// before it loads waiting, and if it sees it, wakes its cursor
		// word. The sleep is on the gating reader's cursor word, with the
		// value the scan read: a release after the scan changed the word,
		// and the sleep does not begin (docs/ARCHITECTURE.md, "Publish").
		p.seg.SetProducerWaiting(true)
		var word *uint32
		var val uint32
		p.cachedMin, word, val = p.scan(seq)
		if seq < p.cachedMin+p.slots {
			return nil
		}
		if p.closing.Load() {
			return ring.Errorf(ring.StatusHandle, "producer of %q closed while waiting", p.name)
		}
		if p.maybeEvict(p.cachedMin) {
			continue
		}
		slice := maxSleep
		if p.opts.EvictAfter > 0 {
			slice = min(slice, p.opts.EvictAfter) // the policy's clock needs a look now and then
		}
		if timeout > 0 {
			left := timeout - time.Since(start)
			if left <= 0 {
				return ring.Errorf(ring.StatusTimedOut, "timed out after %v waiting for the slowest reader (at batch %d)", timeout, p.cachedMin)
			}
			slice = min(slice, left)
		}
		if word == nil { // held back by the join window alone: cannot happen (JoinWindow < Slots)
			time.Sleep(slice)
			continue
		}
		p.table.Wait(word, val, slice)
	}
}

// scan returns the smallest cursor of the readers that gate, or seq if
// none does, and where to sleep until it moves (Table.Gating). Cursors
// come from other processes: each is clamped into [seq-slots, seq].
func (p *Producer) scan(seq uint64) (uint64, *uint32, uint32) {
	least := seq
	// Late-join window: keep the epoch's first batch (and so every later
	// one) while no more than JoinWindow batches of the epoch are out.
	if start := p.seg.EpochStart(); p.opts.JoinWindow > 0 && seq-start <= uint64(p.opts.JoinWindow) {
		least = min(least, start)
	}
	return p.table.Gating(least, seq, p.slots)
}

// maybeEvict applies the opt-in eviction policy: readers whose cursor is
// the gating minimum and has not moved for EvictAfter are evicted. It
// reports whether it evicted any.
func (p *Producer) maybeEvict(least uint64) bool {
	if p.opts.EvictAfter <= 0 {
		return false
	}
	if least != p.gateCursor || p.gateSince.IsZero() {
		p.gateCursor, p.gateSince = least, time.Now()
		return false
	}
	if time.Since(p.gateSince) < p.opts.EvictAfter {
		return false
	}
	p.gateSince = time.Time{}
	return p.table.Evict(least, p.next, p.slots) > 0
}

// ReaderInfo describes one attached reader.
type ReaderInfo struct {
	Index    uint32
	Pid      int32  // in this process's pid namespace, from the kernel (0: not visible here)
	Uid      uint32 // from the kernel
	Cursor   uint64 // batches released
	Acquired uint64 // batches acquired
	Batches  uint64
	WaitNs   uint64 // time spent waiting for data
	Evicted  bool
	Sleeping bool // may be asleep waiting for the next batch
}

// Readers lists the attached readers: those whose attach has completed
// (they say so in their record; each gates the producer from a little
// earlier, its join). It may be called from any goroutine; once the
// producer is closed it returns nil.
func (p *Producer) Readers() []ReaderInfo {
	p.live.RLock()
	defer p.live.RUnlock()
	if p.unmapped {
		return nil
	}
	return p.readers()
}

// readers lists the live readers; the caller holds live and the segment is
// mapped. The values come from each reader's record: a reader writes what
// it likes there.
func (p *Producer) readers() []ReaderInfo {
	var out []ReaderInfo
	for _, r := range p.table.Readers() {
		if !r.Attached {
			continue
		}
		out = append(out, ReaderInfo{Index: r.Index, Pid: r.Pid, Uid: r.Uid, Cursor: r.Cursor, Acquired: r.Acquired,
			Batches: r.Batches, WaitNs: r.WaitNs, Evicted: r.Evicted, Sleeping: r.Sleeping})
	}
	return out
}

// WaitReaders waits until at least n readers are attached (timeout < 0:
// no limit). It may be called from any goroutine.
func (p *Producer) WaitReaders(n int, timeout time.Duration) error {
	start := time.Now()
	for {
		if err := p.usable(); err != nil {
			return err
		}
		if len(p.Readers()) >= n {
			return nil
		}
		if timeout >= 0 && time.Since(start) >= timeout {
			return ring.Errorf(ring.StatusTimedOut, "%d of %d readers attached after %v", len(p.Readers()), n, timeout)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// Stats are the producer's counters.
type Stats struct {
	Readers          int
	Published        uint64
	Epoch            uint64
	BackpressureNs   uint64
	ReadersReclaimed uint64
	ReadersEvicted   uint64
}

// Stats reads the counters. It may be called from any goroutine; once the
// producer is closed it returns the counters as Close left them.
func (p *Producer) Stats() Stats {
	p.live.RLock()
	defer p.live.RUnlock()
	if p.unmapped {
		return p.final
	}
	return p.stats()
}

// stats reads the counters; the caller holds live and the segment is mapped.
func (p *Producer) stats() Stats {
	h := p.seg.Stats()
	return Stats{Readers: len(p.readers()), Published: p.seg.Published(), Epoch: p.seg.Epoch(),
		BackpressureNs: h.BackpressureNs, ReadersReclaimed: h.ReadersReclaimed,
		ReadersEvicted: h.ReadersEvicted}
}

// Close marks the channel closed (readers drain what was published, then
// see "closed"), removes its name and releases the segment. A second Close
// returns an error.
func (p *Producer) Close() error {
	if p.closing.Swap(true) {
		return ring.Errorf(ring.StatusHandle, "producer of %q is already closed", p.name)
	}
	p.table.Poke() // a Reserve waiting for readers returns
	p.mu.Lock()
	defer p.mu.Unlock()
	p.seg.SetState(ring.StateClosed)
	ring.FutexWakeAll(p.seg.PublishedWord())
	// Remove the name only if it is still ours (an operator may have removed
	// it and another producer taken it).
	if p.seg.StillNamed(p.path) {
		_ = os.Remove(p.path)
	}
	p.table.StopJoins()
	p.releasePool()
	// Stats, Readers and WaitReaders may be reading the segment from other
	// goroutines right now: unmap only once none is, and leave them the
	// final counters.
	p.live.Lock()
	defer p.live.Unlock()
	p.final = p.stats()
	p.table.Close()
	p.unmapped = true
	var err error
	if p.reserved {
		// Another thread may still be writing the reserved payload (C
		// holds a pointer to it): its pages stay mapped, as memory of
		// our own, until Publish or Abort reports the close.
		p.kept, err = p.seg.UnmapKeeping(p.seg.PayloadOffset(p.next), p.seg.Geometry.SlotPayloadBytes)
	} else {
		err = p.seg.Unmap()
	}
	if cerr := closeLockable(p.seg.File); err == nil {
		err = cerr
	}
	return err
}

// poolDrainTimeout bounds how long Close waits for readers on the device
// path that make no progress (release nothing) and do not detach;
// poolDrainCap bounds the whole wait, progress or not.
const (
	poolDrainTimeout = 5 * time.Second
	poolDrainCap     = 30 * time.Second
)

// releasePool ends the device pool at Close. Its queued copies finish and
// the host range is unregistered first (the mapping is about to go). The
// device memory and events are freed only once no live reader has the pool
// open (CUDA: freeing exported memory that another process still has open
// is undefined behaviour): readers drain the closed channel, then detach,
// and Close waits for that as long as they release batches. A reader
// still attached after poolDrainTimeout without progress (stuck, or
// keeping its consumer open), or after poolDrainCap in all, leaves them to
// the driver, which frees them when this process exits.
//
// Progress is read from records the readers write, so it is counted so
// that a reader cannot fake it for ever: a reader's cursor counts only
// above the highest it reached before, and only up to what was published
// (fixed once closed): at most one ring of progress per reader.
func (p *Producer) releasePool() {
	if p.pool == nil {
		return
	}
	p.pool.quiesce()
	start := time.Now()
	deadline := start.Add(poolDrainTimeout)
	reached := map[uint32]uint64{} // per entry: the highest cursor seen
	attached, _ := p.deviceReaders(reached)
	for attached && time.Now().Before(deadline) && time.Since(start) < poolDrainCap {
		time.Sleep(time.Millisecond)
		var progressed bool
		attached, progressed = p.deviceReaders(reached)
		if progressed {
			deadline = time.Now().Add(poolDrainTimeout)
		}
	}
	if !attached {
		p.pool.close()
	}
	p.pool = nil
}

// deviceReaders reports whether an attached reader says it has the device
// pool open (a reader-written claim: a false one costs Close at most
// poolDrainTimeout), and whether one of them progressed: its cursor, at
// most the published count, above the highest in reached (which it
// updates). A reader process holds a read lock on LockDeviceMap from before
// it maps the pool until after it unmaps it, which may be long after
// detach (DLPack tensors keep the pool mapped): while any does, or the
// lock cannot be checked, the pool counts as open.
func (p *Producer) deviceReaders(reached map[uint32]uint64) (attached, progressed bool) {
	if mapped, err := ring.ByteLocked(p.seg.File, ring.LockDeviceMap); err != nil || mapped {
		attached = true
	}
	published := p.seg.Published()
	for _, r := range p.table.Readers() {
		if r.Placement != ring.PlacementDevice {
			continue
		}
		attached = true
		cur := min(r.Cursor, published)
		if last, seen := reached[r.Index]; !seen || cur > last {
			progressed = progressed || seen
			reached[r.Index] = cur
		}
	}
	return attached, progressed
}
