package producer

import (
	"time"

	"github.com/tsock/tsock/ring"
)

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
