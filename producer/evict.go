package producer

import (
	"time"
)

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
