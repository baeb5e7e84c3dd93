// Package producer is tsock's writer side: it creates a channel in
// /dev/shm, publishes batches of tensors into its ring, gates on the
// slowest live reader, and frees the records of readers that die.
//
// A Producer is used by one goroutine at a time (Stats, Readers and
// WaitReaders may be called from any goroutine).
//
// One mechanism a file: producer.go the options, the Producer and its
// life (Create, Close); create.go building and naming the segment;
// reclaim.go taking over a dead producer's name and removing dead
// channels; forkguard.go the descriptors kept from forked children;
// publish.go reserve, publish and epoch ends; gate.go waiting for the
// slowest reader; evict.go the eviction policy; readers.go the readers
// and counters as callers see them; pooldrain.go releasing the device
// pool at Close; gpu.go the device pool; peek.go reading a channel
// without attaching.
package producer

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tsock/tsock/internal/readers"
	"github.com/tsock/tsock/ring"
)

// Options choose a channel's geometry, permissions and reader policy. The
// zero value of each field means its default (Default*, defaults.go).
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
