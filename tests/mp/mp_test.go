package mp

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/internal/batchgen"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

func create(t *testing.T, name string, o producer.Options) *producer.Producer {
	t.Helper()
	p, err := producer.Create(name, o)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// TestFourReadersAllBatches is the acceptance test: one Go producer, two C
// and two Go reader processes, 10,000 batches in 10 epochs through a 16-slot
// ring. Every reader must see every batch once, in order, intact, and all
// four must agree on the fold of the metadata hashes.
func TestFourReadersAllBatches(t *testing.T) {
	const epochs, perEpoch = 10, 1000
	name := channel(t)
	p := create(t, name, producer.Options{Slots: 16, SlotBytes: 64 << 10})
	var readers []*proc
	for k, lang := range []string{"c", "go", "c", "go"} {
		readers = append(readers, startReader(t, name, readerSpec{lang: lang}, fmt.Sprintf("%s reader %d", lang, k)))
	}
	require.NoError(t, p.WaitReaders(4, 30*time.Second))

	start := time.Now()
	fold := batchgen.FNVBasis
	i := uint64(0)
	for e := 0; e < epochs; e++ {
		for k := 0; k < perEpoch; k++ {
			h, err := publish(p, i, 30*time.Second)
			require.NoError(t, err, "batch %d", i)
			fold = batchgen.Fold(fold, h)
			i++
		}
		require.NoError(t, p.EndEpoch(30*time.Second))
	}
	published := time.Since(start)
	st := p.Stats()
	assert.Equal(t, uint64(epochs*perEpoch+epochs), st.Published)
	assert.Equal(t, uint64(epochs), st.Epoch)
	assert.Zero(t, st.ReadersReclaimed)
	assert.Zero(t, st.ReadersEvicted)
	require.NoError(t, p.Close())

	want := batchgen.Result{Batches: epochs * perEpoch, Markers: epochs, First: 0, Last: epochs*perEpoch - 1,
		Fold: fold, Status: "TSOCK_ECLOSED"}
	for _, r := range readers {
		code := r.wait(t, 60*time.Second)
		assert.Equal(t, 0, code, "%s exit code; output:\n%s", r.label, r.Output())
		assert.Equal(t, want, r.result(t), r.label)
	}
	t.Logf("%d batches to 4 readers in %v (back-pressure %v); check_reader built in %v",
		epochs*perEpoch, published.Round(time.Millisecond), time.Duration(st.BackpressureNs).Round(time.Millisecond),
		checkBuildMs.Round(time.Millisecond))
}

// TestReaderKilledWhileHolding kills a reader that holds a batch while the
// producer is back-pressured by it: the producer must go on within the
// liveness bound, the other readers must finish intact.
func TestReaderKilledWhileHolding(t *testing.T) {
	t.Run("c-reader/blocking-reserve", func(t *testing.T) { testReaderKill(t, "c", false) })
	t.Run("go-reader/polling-reserve", func(t *testing.T) { testReaderKill(t, "go", true) })
}

func testReaderKill(t *testing.T, slowLang string, polling bool) {
	const total, slots = 300, 16
	name := channel(t)
	p := create(t, name, producer.Options{Slots: slots, SlotBytes: 64 << 10})
	fast := []*proc{
		startReader(t, name, readerSpec{lang: "c"}, "fast c reader"),
		startReader(t, name, readerSpec{lang: "go"}, "fast go reader"),
	}
	slow := startReader(t, name, readerSpec{lang: slowLang, slowUs: 60e6}, "slow "+slowLang+" reader")
	require.NoError(t, p.WaitReaders(3, 30*time.Second))

	fold := batchgen.FNVBasis
	i := uint64(0)
	for ; ; i++ {
		h, err := publish(p, i, 0)
		if errors.Is(err, producer.ErrBackpressure) {
			break
		}
		require.NoError(t, err)
		fold = batchgen.Fold(fold, h)
		require.Less(t, i, uint64(10*slots), "the slow reader never held the producer back")
	}
	require.Equal(t, uint64(slots), i, "the slow reader holds batch 0, so batch %d waits", slots)

	// Wait until the fast readers have released everything: from then on the
	// slow reader alone holds the producer back.
	slowPid := int32(slow.cmd.Process.Pid)
	deadline := time.Now().Add(20 * time.Second)
	for {
		ok, seen := true, false
		for _, r := range p.Readers() {
			if r.Pid == slowPid {
				seen = true
				ok = ok && r.Cursor == 0 && r.Acquired == 1
			} else {
				ok = ok && r.Cursor == slots
			}
		}
		if ok && seen && len(p.Readers()) == 3 {
			break
		}
		require.True(t, time.Now().Before(deadline), "readers: %+v", p.Readers())
		time.Sleep(time.Millisecond)
	}
	_, err := publish(p, i, 0)
	require.ErrorIs(t, err, producer.ErrBackpressure)

	var stall time.Duration
	if !polling {
		type res struct {
			h   uint64
			err error
			at  time.Time
		}
		ch := make(chan res, 1)
		go func() {
			h, err := publish(p, i, 10*time.Second)
			ch <- res{h, err, time.Now()}
		}()
		time.Sleep(50 * time.Millisecond)
		select {
		case r := <-ch:
			t.Fatalf("Reserve did not wait for the slow reader: %v", r.err)
		default:
		}
		died := killAndReap(t, slow)
		r := <-ch
		require.NoError(t, r.err)
		stall = max(0, r.at.Sub(died))
		fold = batchgen.Fold(fold, r.h)
	} else {
		// A producer that never blocks (timeout 0) must also get past a dead
		// reader.
		died := killAndReap(t, slow)
		for {
			h, err := publish(p, i, 0)
			if err == nil {
				stall = time.Since(died)
				fold = batchgen.Fold(fold, h)
				break
			}
			require.ErrorIs(t, err, producer.ErrBackpressure)
			require.Less(t, time.Since(died), 5*time.Second, "a polling producer never got past the dead reader")
			time.Sleep(200 * time.Microsecond)
		}
	}
	t.Logf("stall after the death of the %s reader holding a batch: %v (%s reserve)", slowLang,
		stall.Round(10*time.Microsecond), map[bool]string{true: "polling", false: "blocking"}[polling])
	assert.Less(t, stall, 250*time.Millisecond, "the producer stalled too long after the reader died")
	assert.Equal(t, -1, slow.wait(t, 10*time.Second), "killed by a signal")

	for i++; i < total; i++ {
		h, err := publish(p, i, 10*time.Second)
		require.NoError(t, err, "batch %d", i)
		fold = batchgen.Fold(fold, h)
	}
	st := p.Stats()
	assert.Equal(t, uint64(1), st.ReadersReclaimed)
	assert.Equal(t, 2, st.Readers)
	require.NoError(t, p.Close())
	want := batchgen.Result{Batches: total, First: 0, Last: total - 1, Fold: fold, Status: "TSOCK_ECLOSED"}
	for _, r := range fast {
		assert.Equal(t, 0, r.wait(t, 30*time.Second), "%s exit code", r.label)
		assert.Equal(t, want, r.result(t), r.label)
	}
}

// killAndReap SIGKILLs a child and waits until it is reaped: it is dead
// then, and its locks are free (a process's files are closed before its
// parent can reap it). It returns when the test saw it reaped. A bound on
// what a peer does after a death is measured from there, not from the
// signal: on a loaded machine the victim itself may wait long for a CPU to
// run its exit.
func killAndReap(t *testing.T, p *proc) time.Time {
	t.Helper()
	require.NoError(t, p.cmd.Process.Kill())
	p.wait(t, 10*time.Second)
	return p.Ended()
}

// TestProducerKilled kills a producer process once its readers have read
// everything: every reader, C and Go, must report "producer gone" within a
// second of its death, having read every batch; a new producer then
// reclaims the name.
func TestProducerKilled(t *testing.T) {
	const n, every = 2500, 1000
	name := channel(t)
	prod := startProducer(t, name, producerSpec{readers: 4, batches: n, epochEvery: every, slots: 16})
	prod.waitLine(t, "producer created", 30*time.Second)
	var readers []*proc
	for k, lang := range []string{"c", "go", "c", "go"} {
		readers = append(readers, startReader(t, name, readerSpec{lang: lang}, fmt.Sprintf("%s reader %d", lang, k)))
	}
	line := prod.waitLine(t, "producer published", 60*time.Second)
	f := strings.TrimPrefix(line[strings.Index(line, "fold="):], "fold=")
	fold, err := strconv.ParseUint(f, 16, 64)
	require.NoError(t, err, line)
	require.Equal(t, batchgen.ExpectedFold(0, n), fold)

	died := killAndReap(t, prod)
	assert.Equal(t, -1, prod.wait(t, 10*time.Second))
	want := batchgen.Result{Batches: n, Markers: n / every, First: 0, Last: n - 1, Fold: fold,
		Status: "TSOCK_EPRODUCER_GONE"}
	var lat []string
	for _, r := range readers {
		code := r.wait(t, 10*time.Second)
		// When it said so, not when it had exited: a reader's own exit is
		// not part of noticing the death.
		gone := max(0, r.lineAt("check_reader status=").Sub(died))
		lat = append(lat, fmt.Sprintf("%s %v", r.label, gone.Round(100*time.Microsecond)))
		assert.Equal(t, 3, code, "%s exit code; output:\n%s", r.label, r.Output())
		assert.Less(t, gone, time.Second, "%s noticed the producer's death too late", r.label)
		assert.Equal(t, want, r.result(t), r.label)
	}
	t.Logf("producer death -> readers reported producer gone: %s", strings.Join(lat, ", "))

	// The dead producer's segment is still named: nobody attaches to it, and
	// a new producer replaces it.
	old, err := os.Stat(ring.ChannelPath(name))
	require.NoError(t, err)
	_, err = reader.Attach(name, reader.Options{})
	require.ErrorIs(t, err, reader.ErrProducerGone)
	p := create(t, name, producer.Options{Slots: 4, SlotBytes: 64 << 10})
	cur, err := os.Stat(ring.ChannelPath(name))
	require.NoError(t, err)
	assert.False(t, os.SameFile(old, cur), "the dead producer's segment was replaced")
	r, err := reader.Attach(name, reader.Options{})
	require.NoError(t, err)
	defer r.Detach()
	_, err = publish(p, 0, time.Second)
	require.NoError(t, err)
	b, err := r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	_, _, err = batchgen.Check(tensors(b), b.Meta)
	require.NoError(t, err)
}

// consumed is what an in-process reader goroutine saw.
type consumed struct {
	c                             *batchgen.Checker
	firstSeq, firstEpoch, firstIx uint64
	err                           error // nil when the stream ended with ErrClosed
}

// consume reads r in a goroutine until the channel is closed. The goroutine
// ends before r is detached: if the test ends early, the cleanup closes the
// producer (ending the goroutine's Acquire) and waits for it.
func consume(t *testing.T, p *producer.Producer, r *reader.Reader) <-chan consumed {
	ch := make(chan consumed, 1)
	exited := make(chan struct{})
	t.Cleanup(func() {
		p.Close()
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
		}
	})
	go func() {
		defer close(exited)
		res := consumed{c: batchgen.NewChecker()}
		defer func() { ch <- res }()
		for n := 0; ; n++ {
			b, err := r.Acquire(10 * time.Second)
			if errors.Is(err, reader.ErrClosed) {
				return
			}
			if err != nil || b == nil {
				res.err = fmt.Errorf("acquire after %d batches: %v (batch %v)", n, err, b)
				return
			}
			if n == 0 {
				res.firstSeq, res.firstEpoch, res.firstIx = b.Seq, b.Epoch, b.Index
			}
			if b.EpochEnd() {
				res.c.Marker()
			} else if err := res.c.Data(tensors(b), b.Meta); err != nil {
				res.err = err
				return
			}
			if err := r.Release(b); err != nil {
				res.err = err
				return
			}
		}
	}()
	return ch
}

func attach(t *testing.T, name string, o reader.Options) *reader.Reader {
	t.Helper()
	r, err := reader.Attach(name, o)
	require.NoError(t, err)
	t.Cleanup(func() { r.Detach() })
	return r
}

// TestLateJoin: readers that attach mid-epoch start at the first batch of
// the next epoch by default, at the next batch with StartNow.
func TestLateJoin(t *testing.T) {
	const per = 100
	name := channel(t)
	p := create(t, name, producer.Options{Slots: 16, SlotBytes: 64 << 10})
	pub := func(from, to uint64) {
		for i := from; i < to; i++ {
			_, err := publish(p, i, 10*time.Second)
			require.NoError(t, err, "batch %d", i)
		}
	}
	pub(0, per/2) // nobody reads these

	cNext := startReader(t, name, readerSpec{lang: "c", start: "next"}, "c reader next")
	cNow := startReader(t, name, readerSpec{lang: "c", start: "now"}, "c reader now")
	goNext := consume(t, p, attach(t, name, reader.Options{}))
	goNow := consume(t, p, attach(t, name, reader.Options{Start: reader.StartNow}))
	require.NoError(t, p.WaitReaders(4, 30*time.Second))

	pub(per/2, per)
	require.NoError(t, p.EndEpoch(10*time.Second))
	// Joining exactly at the epoch boundary gives the next batch (index 0).
	goBoundary := consume(t, p, attach(t, name, reader.Options{}))
	pub(per, 2*per)
	require.NoError(t, p.EndEpoch(10*time.Second))
	require.NoError(t, p.Close())

	check := func(label string, ch <-chan consumed, first, batches, markers, epoch, index uint64) {
		var res consumed
		select {
		case res = <-ch:
		case <-time.After(30 * time.Second):
			t.Fatalf("%s did not finish", label)
		}
		require.NoError(t, res.err, label)
		assert.Equal(t, first, res.c.First, "%s first batch", label)
		assert.Equal(t, batches, res.c.Batches, label)
		assert.Equal(t, markers, res.c.Markers, label)
		assert.Equal(t, batchgen.ExpectedFold(first, batches), res.c.Fold, label)
		assert.Equal(t, epoch, res.firstEpoch, "%s first epoch", label)
		assert.Equal(t, index, res.firstIx, "%s first index", label)
	}
	check("go next", goNext, per, per, 1, 1, 0)
	check("go boundary", goBoundary, per, per, 1, 1, 0)
	check("go now", goNow, per/2, per*3/2, 2, 0, per/2)

	for _, c := range []struct {
		p              *proc
		first, batches uint64
		markers        uint64
	}{{cNext, per, per, 1}, {cNow, per / 2, per * 3 / 2, 2}} {
		assert.Equal(t, 0, c.p.wait(t, 30*time.Second), c.p.label)
		assert.Equal(t, batchgen.Result{Batches: c.batches, Markers: c.markers, First: c.first,
			Last: 2*per - 1, Fold: batchgen.ExpectedFold(c.first, c.batches), Status: "TSOCK_ECLOSED"},
			c.p.result(t), c.p.label)
	}
}

// TestCleanClose: after Close, readers drain everything that was published,
// then get ErrClosed (again and again); waiting readers and a waiting
// producer are woken.
func TestCleanClose(t *testing.T) {
	name := channel(t)
	p, err := producer.Create(name, producer.Options{Slots: 16, SlotBytes: 64 << 10})
	require.NoError(t, err)
	r := attach(t, name, reader.Options{})
	child := startReader(t, name, readerSpec{lang: "c"}, "c reader")
	require.NoError(t, p.WaitReaders(2, 30*time.Second))
	fold := batchgen.FNVBasis
	for i := uint64(0); i < 13; i++ {
		h, err := publish(p, i, 0) // 13 batches and a marker fit the ring
		require.NoError(t, err)
		fold = batchgen.Fold(fold, h)
		if i == 9 {
			require.NoError(t, p.EndEpoch(0))
		}
	}
	require.NoError(t, p.Close())
	_, err = os.Stat(ring.ChannelPath(name))
	require.ErrorIs(t, err, os.ErrNotExist)
	_, err = reader.Attach(name, reader.Options{})
	require.ErrorIs(t, err, reader.ErrNoChannel)

	c := batchgen.NewChecker()
	for k := 0; k < 14; k++ {
		b, err := r.Acquire(time.Second)
		require.NoError(t, err, "batch %d was published before the close", k)
		require.NotNil(t, b)
		if b.EpochEnd() {
			assert.Equal(t, 10, k)
			assert.Equal(t, uint64(10), b.Index)
			c.Marker()
		} else {
			require.NoError(t, c.Data(tensors(b), b.Meta))
		}
		require.NoError(t, r.Release(b))
	}
	assert.Equal(t, batchgen.Result{Batches: 13, Markers: 1, First: 0, Last: 12, Fold: fold},
		batchgen.Result{Batches: c.Batches, Markers: c.Markers, First: c.First, Last: c.Last, Fold: c.Fold})
	for _, timeout := range []time.Duration{0, time.Millisecond, -1} {
		_, err = r.Acquire(timeout)
		require.ErrorIs(t, err, reader.ErrClosed, "timeout %v", timeout)
		// In words, with no count that mixes batches and epoch-end markers.
		assert.Contains(t, err.Error(), "closed by the producer; this reader has read every batch published since it attached")
	}
	assert.Equal(t, 0, child.wait(t, 30*time.Second))
	assert.Equal(t, batchgen.Result{Batches: 13, Markers: 1, First: 0, Last: 12, Fold: fold, Status: "TSOCK_ECLOSED"},
		child.result(t))

	t.Run("wakes a waiting reader", func(t *testing.T) {
		name := channel(t)
		p, err := producer.Create(name, producer.Options{Slots: 4, SlotBytes: 4096})
		require.NoError(t, err)
		r := attach(t, name, reader.Options{})
		type res struct {
			err error
			at  time.Time
		}
		ch := make(chan res, 1)
		go func() {
			_, err := r.Acquire(-1)
			ch <- res{err, time.Now()}
		}()
		time.Sleep(80 * time.Millisecond) // past the spin, asleep on the futex
		closed := time.Now()
		require.NoError(t, p.Close())
		select {
		case x := <-ch:
			require.ErrorIs(t, x.err, reader.ErrClosed)
			t.Logf("waiting reader woke %v after Close", x.at.Sub(closed))
			assert.Less(t, x.at.Sub(closed), time.Second)
		case <-time.After(5 * time.Second):
			t.Fatal("a reader waiting without limit was not woken by Close")
		}
	})

	t.Run("wakes a waiting producer", func(t *testing.T) {
		name := channel(t)
		p, err := producer.Create(name, producer.Options{Slots: 2, SlotBytes: 64 << 10})
		require.NoError(t, err)
		r := attach(t, name, reader.Options{})
		for i := uint64(0); i < 2; i++ {
			_, err := publish(p, i, 0)
			require.NoError(t, err)
		}
		ch := make(chan error, 1)
		go func() {
			_, err := publish(p, 2, -1)
			ch <- err
		}()
		time.Sleep(50 * time.Millisecond)
		closed := time.Now()
		require.NoError(t, p.Close())
		select {
		case err := <-ch:
			require.Error(t, err)
			assert.Equal(t, ring.StatusHandle, ring.StatusOf(err), "%v", err)
			assert.Less(t, time.Since(closed), 10*time.Second)
		case <-time.After(30 * time.Second):
			t.Fatal("a Reserve waiting without limit was not ended by Close")
		}
		// The reader still drains the two batches, then sees the close.
		for i := 0; i < 2; i++ {
			b, err := r.Acquire(time.Second)
			require.NoError(t, err)
			require.NotNil(t, b)
			require.NoError(t, r.Release(b))
		}
		_, err = r.Acquire(time.Second)
		require.ErrorIs(t, err, reader.ErrClosed)
	})
}
