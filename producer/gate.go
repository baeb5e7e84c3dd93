package producer

import (
	"time"

	"github.com/tsock/tsock/ring"
)

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
