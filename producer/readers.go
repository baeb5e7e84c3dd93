package producer

import (
	"time"

	"github.com/tsock/tsock/ring"
)

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
