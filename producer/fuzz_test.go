package producer_test

// FuzzBuggyReaderRecord: a "buggy reader" joins the channel as any
// reader process can (the join protocol spoken by hand, testkit.Rogue) and
// then writes fuzzed values into its own record (cursor, acquired,
// sleeping flag, placement, ...), sends fuzzed bytes on its connection and
// tries to resize its record's file, while the producer publishes with
// short timeouts and good readers consume. A reader writes nothing else:
// the segment is read-only to it, and no other reader's record is in its
// reach. So this is everything a buggy or hostile reader can do to the
// producer. Checked:
//   - the producer never panics (nor faults: the record cannot be shrunk);
//   - Reserve and EndEpoch return within their timeout (plus scheduling
//     slack), with nil or ErrTimedOut; with timeout 0, nil or
//     ErrBackpressure at once; Publish of a reserved batch never fails;
//   - the good readers get every batch in order, intact, and end with
//     ErrClosed (with the opt-in eviction policy they may be evicted as
//     slow, but then what they got is still an in-order prefix, and a batch
//     they held when evicted, which the producer may overwrite while it is
//     read, is reported by its release: ErrEvicted);
//   - once the buggy reader is gone, whatever it left in its record never
//     stalls the producer again.
//
// The seed corpus runs in every `go test`; to fuzz:
//
//	go test -run '^$' -fuzz FuzzBuggyReaderRecord -fuzztime 120s ./producer

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tsock/tsock/internal/batchgen"
	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// slack is how much later than its timeout a wait may return on a loaded
// machine (other builds and tests share two cores).
const slack = 2 * time.Second

var fuzzN atomic.Int64

type script struct {
	b []byte
	i int
}

func (s *script) more() bool { return s.i < len(s.b) }

func (s *script) u8() byte {
	if s.i >= len(s.b) {
		return 0
	}
	v := s.b[s.i]
	s.i++
	return v
}

func (s *script) u64() uint64 {
	var v uint64
	for k := 0; k < 8; k++ {
		v |= uint64(s.u8()) << (8 * k)
	}
	return v
}

// goodReader consumes a channel and checks every batch.
type goodReader struct {
	r       *reader.Reader
	c       *batchgen.Checker
	err     error // nil: ended with ErrClosed
	evicted bool
	done    chan struct{}
}

func startGood(r *reader.Reader) *goodReader {
	g := &goodReader{r: r, c: batchgen.NewChecker(), done: make(chan struct{})}
	go func() {
		defer close(g.done)
		for {
			b, err := r.Acquire(30 * time.Second)
			if errors.Is(err, reader.ErrClosed) {
				return
			}
			if errors.Is(err, reader.ErrEvicted) {
				g.evicted = true
				return
			}
			if err != nil || b == nil {
				g.err = fmt.Errorf("acquire after %d batches: %v", g.c.Batches, err)
				return
			}
			if b.EpochEnd() {
				g.c.Marker()
			} else if err := g.c.Data(tensors(b), b.Meta); err != nil {
				// With the eviction policy a batch held when its reader is
				// evicted may be overwritten while in use; the release
				// says so (ErrEvicted), and then the content does not count.
				if errors.Is(r.Release(b), reader.ErrEvicted) {
					g.evicted = true
					return
				}
				g.err = err
				return
			}
			if err := r.Release(b); err != nil {
				if errors.Is(err, reader.ErrEvicted) {
					g.evicted = true
					return
				}
				g.err = err
				return
			}
		}
	}()
	return g
}

// interesting turns fuzz bytes into a value for a record word: raw bits,
// or values near the ring's positions, or claim words of each state.
func interesting(s *script, published, slots uint64) uint64 {
	switch s.u8() % 8 {
	case 0:
		return s.u64()
	case 1:
		return published + uint64(s.u8())
	case 2:
		return published - uint64(s.u8())
	case 3:
		return published - slots - uint64(s.u8()%4)
	case 4:
		return ring.MakeClaim(uint64(s.u8()), uint32(s.u8()%5))
	case 5:
		return ^uint64(0) - uint64(s.u8())
	case 6:
		return 0
	default:
		return uint64(s.u8())
	}
}

func FuzzBuggyReaderRecord(f *testing.F) {
	f.Add(uint16(0), []byte{0, 0, 0})
	f.Add(uint16(1), []byte{4, 3, 2, 0, 0, 0, 0, 0, 0, 0})            // cursor far behind: the producer times out
	f.Add(uint16(2), []byte{4, 3, 1, 9, 0, 0, 0, 0, 0})               // cursor ahead
	f.Add(uint16(3), []byte{4, 7, 4, 3, 2, 0, 1, 0, 3, 0})            // sleeping for ever
	f.Add(uint16(2), []byte{5, 1, 'w', 63, 0, 0, 5, 0, 'l', 0, 0, 0}) // wake spam, then a leave
	f.Add(uint16(1), []byte{8, 0, 8, 200, 0, 0, 0})                   // shrink, grow
	f.Add(uint16(1<<7), []byte{4, 3, 3, 0, 0, 0, 0, 0, 0})            // with eviction
	f.Add(uint16(5), []byte{5, 1, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 7, 0, 6, 3, 0})
	f.Add(uint16(6), []byte{4, 0, 4, 0, 2, 6, 0, 0, 0, 3})
	f.Fuzz(func(t *testing.T, cfg uint16, ops []byte) {
		if len(ops) > 96 {
			return
		}
		hung := time.AfterFunc(2*time.Minute, func() {
			panic(fmt.Sprintf("FuzzBuggyReaderRecord: iteration hung (cfg %#x ops %x)", cfg, ops))
		})
		defer hung.Stop()
		runBuggyReader(t, cfg, ops)
	})
}

func runBuggyReader(t *testing.T, cfg uint16, ops []byte) {
	slots := uint32(2) << (cfg & 3)
	timeout := time.Duration(1+(cfg>>2)&3) * time.Millisecond
	nGood := 1 + int(cfg>>4)&1
	evict := cfg&(1<<7) != 0
	const maxReaders = 4

	name := fmt.Sprintf("fuzzprod-%d-%d", os.Getpid(), fuzzN.Add(1))
	o := producer.Options{Slots: slots, SlotBytes: batchgen.MaxPayload, MaxReaders: maxReaders}
	if evict {
		o.EvictAfter = 30 * time.Millisecond
	}
	p, err := producer.Create(name, o)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			p.Close()
		}
	}()
	buggy, err := testkit.JoinRogue(name, uint32(reader.StartNow))
	if err != nil {
		t.Fatal(err)
	}
	defer buggy.Close()
	var goods []*goodReader
	var wg sync.WaitGroup
	for k := 0; k < nGood; k++ {
		r, err := reader.Attach(name, reader.Options{Start: reader.StartNow})
		if err != nil {
			t.Fatal(err)
		}
		g := startGood(r)
		goods = append(goods, g)
		wg.Add(1)
		go func() { defer wg.Done(); <-g.done; r.Detach() }()
	}
	defer func() { // on any failure: end the readers before returning
		if !closed {
			p.Close()
			closed = true
		}
		wg.Wait()
	}()

	// The buggy reader attached first: roster entry 0, as the producer says.
	seg, err := ring.OpenSegment(name)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	if snap := seg.Snapshot(0); snap.Pid != int32(os.Getpid()) || snap.Claim != buggy.Reply.Claim ||
		ring.ClaimState(snap.Claim) != ring.ReaderActive {
		t.Fatalf("entry 0 is not the buggy reader's: %+v", snap)
	}
	recordWords := []uintptr{ring.RecordOffCursor, ring.RecordOffAcquired, ring.RecordOffHeartbeatNs,
		ring.RecordOffWaitNs, ring.RecordOffBatches, ring.RecordOffPlacement, ring.RecordOffGPUUUID,
		ring.RecordOffSleeping}

	var i, markers uint64 // next data batch, epoch markers published
	wait := func(what string, tmo time.Duration, err error, took time.Duration) bool {
		switch {
		case err == nil:
			return true
		case tmo == 0 && errors.Is(err, producer.ErrBackpressure):
		case tmo != 0 && errors.Is(err, producer.ErrTimedOut):
		default:
			t.Fatalf("%s (timeout %v): unexpected error %v", what, tmo, err)
		}
		if took > tmo+slack {
			t.Fatalf("%s with timeout %v returned after %v", what, tmo, took)
		}
		return false
	}
	publish := func(tmo time.Duration) {
		start := time.Now()
		buf, err := p.Reserve(batchgen.PayloadBytes(i), tmo)
		if !wait("reserve", tmo, err, time.Since(start)) {
			return
		}
		ts, meta := batchgen.Write(buf, i)
		if err := p.Publish(ts, meta); err != nil {
			t.Fatalf("publish batch %d: %v", i, err)
		}
		i++
	}
	s := &script{b: ops}
	for s.more() {
		switch op := s.u8(); op % 9 {
		case 0, 1, 2:
			publish(timeout)
		case 3:
			publish(0)
		case 4: // the buggy reader writes a word of its record
			off := recordWords[int(s.u8())%len(recordWords)]
			buggy.Set(off, interesting(s, seg.Published(), uint64(slots)))
		case 5: // ... or sends bytes on its connection (a leave, a wake, garbage)
			msg := make([]byte, 1+int(s.u8()%8))
			for k := range msg {
				msg[k] = s.u8()
			}
			for k := 0; k < 1+int(s.u8()%64); k++ {
				_ = buggy.Send(msg) // a full buffer refuses some: that is fine
			}
		case 6: // ... or releases everything, like a real reader
			buggy.Set(ring.RecordOffCursor, seg.Published())
		case 7:
			start := time.Now()
			if wait("end epoch", timeout, p.EndEpoch(timeout), time.Since(start)) {
				markers++
			}
		case 8: // ... or tries to shrink or grow its record's file: the seals refuse
			if err := buggy.Truncate(int64(s.u8()) * 64); err == nil {
				t.Fatalf("the buggy reader resized its record's file")
			}
		}
	}

	// The buggy reader goes away: whatever it left in its record, the
	// producer must not be held back by it any more.
	buggy.Close()
	for k := 0; k < 2*int(slots); k++ {
		start := time.Now()
		buf, err := p.Reserve(batchgen.PayloadBytes(i), 10*time.Second)
		if err != nil {
			t.Fatalf("after the buggy reader left: reserve batch %d: %v after %v (entry: %+v)", i, err,
				time.Since(start), seg.Snapshot(0))
		}
		ts, meta := batchgen.Write(buf, i)
		if err := p.Publish(ts, meta); err != nil {
			t.Fatal(err)
		}
		i++
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	closed = true
	wg.Wait()
	for k, g := range goods {
		if g.err != nil {
			t.Fatalf("good reader %d: %v", k, g.err)
		}
		if g.evicted {
			if !evict {
				t.Fatalf("good reader %d evicted without an eviction policy", k)
			}
			if g.c.Batches > 0 && g.c.First != 0 {
				t.Fatalf("good reader %d (evicted) started at batch %d", k, g.c.First)
			}
			continue
		}
		if g.c.Batches != i || (i > 0 && (g.c.First != 0 || g.c.Last != i-1)) || g.c.Markers != markers {
			t.Fatalf("good reader %d got %d batches (%d..%d) and %d markers; published %d and %d", k,
				g.c.Batches, g.c.First, g.c.Last, g.c.Markers, i, markers)
		}
		if g.c.Fold != batchgen.ExpectedFold(0, i) {
			t.Fatalf("good reader %d: fold differs", k)
		}
	}
	os.Remove(ring.ChannelPath(name))
}
