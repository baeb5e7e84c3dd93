package producer_test

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/internal/batchgen"
	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// publish publishes test batch i, waiting up to timeout for a slot.
func publish(p *producer.Producer, i uint64, timeout time.Duration) error {
	buf, err := p.Reserve(batchgen.PayloadBytes(i), timeout)
	if err != nil {
		return err
	}
	ts, meta := batchgen.Write(buf, i)
	return p.Publish(ts, meta)
}

func tensors(b *reader.Batch) []batchgen.Tensor {
	out := make([]batchgen.Tensor, len(b.Tensors))
	for k, t := range b.Tensors {
		out[k] = batchgen.Tensor(t)
	}
	return out
}

func TestCreateErrors(t *testing.T) {
	for _, n := range []string{"", ".", "..", "a/b", "../x", "a\x00b", strings.Repeat("n", 65), "sp ace"} {
		_, err := producer.Create(n, producer.Options{})
		assert.ErrorIs(t, err, producer.ErrName, "name %q", n)
		assert.Equal(t, ring.StatusName, ring.StatusOf(err))
	}
	name := testkit.Channel(t)
	bad := []producer.Options{
		{Slots: 3}, {Slots: 1}, {Slots: 1 << 17}, {MaxReaders: 1025}, {SlotBytes: ring.MaxSlotBytes + 1},
		{Mode: 0o1777}, {EvictAfter: -time.Second}, {Device: "gpu"}, {Device: "cuda:-1"}, {Device: "cuda:x"},
	}
	for _, o := range bad {
		_, err := producer.Create(name, o)
		assert.ErrorIs(t, err, producer.ErrInvalid, "%+v", o)
	}
	_, err := os.Stat(ring.ChannelPath(name))
	assert.ErrorIs(t, err, os.ErrNotExist, "a failed create leaves no file")
	tmps, _ := os.ReadDir(ring.ShmDir)
	for _, e := range tmps {
		assert.False(t, strings.HasPrefix(e.Name(), ".tsock-tmp."+strconv.Itoa(os.Getpid())+"."), "left %s", e.Name())
	}
}

// TestDeviceWithoutDriver: a device pool needs the CUDA driver; without one
// Create says so and leaves nothing behind. (The pool itself is tested
// against the fake driver in tests/c/test_device.c.)
func TestDeviceWithoutDriver(t *testing.T) {
	t.Setenv("TSOCK_LIBCUDA", t.TempDir()+"/no-libcuda.so.1")
	name := testkit.Channel(t)
	_, err := producer.Create(name, producer.Options{Device: "cuda:0"})
	require.Error(t, err)
	assert.ErrorIs(t, err, ring.Status(ring.StatusNoCUDA))
	assert.Equal(t, ring.StatusNoCUDA, ring.StatusOf(err))
	assert.Contains(t, err.Error(), "CUDA driver not available")
	_, err = os.Stat(ring.ChannelPath(name))
	assert.ErrorIs(t, err, os.ErrNotExist)
	for in, want := range map[string]int{"": -1, "cpu": -1, "cuda": 0, "cuda:3": 3} {
		got, err := producer.ParseDevice(in)
		require.NoError(t, err)
		assert.Equal(t, want, got, in)
	}
}

func TestCreateModeAndGeometry(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 8, SlotBytes: 5000, MaxReaders: 3, Mode: 0o640})
	st, err := os.Stat(ring.ChannelPath(name))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o640), st.Mode().Perm())
	assert.Equal(t, name, p.Name())
	assert.Equal(t, uint32(8), p.Slots())
	assert.Equal(t, uint64(8192), p.SlotBytes(), "slot bytes round up to pages")
	seg, err := ring.OpenSegment(name)
	require.NoError(t, err)
	defer seg.File.Close()
	defer seg.Unmap()
	info := seg.Info()
	assert.Equal(t, int32(os.Getpid()), info.ProducerPid)
	assert.Equal(t, uint32(3), info.Readers)
	assert.Equal(t, uint64(st.Size()), info.TotalBytes)
	locked, err := seg.ProducerLocked()
	require.NoError(t, err)
	assert.True(t, locked)

	// Defaults.
	name2 := testkit.Channel(t)
	p2 := testkit.Create(t, name2, producer.Options{})
	assert.Equal(t, uint32(producer.DefaultSlots), p2.Slots())
	assert.Equal(t, uint64(producer.DefaultSlotBytes), p2.SlotBytes())
	st, err = os.Stat(ring.ChannelPath(name2))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), st.Mode().Perm())
}

func TestSecondProducerExists(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 2, SlotBytes: 64 << 10})
	_, err := producer.Create(name, producer.Options{Slots: 2, SlotBytes: 4096})
	require.ErrorIs(t, err, producer.ErrExist)
	// The live producer's channel is untouched.
	require.NoError(t, publish(p, 0, 0))
	r := testkit.Attach(t, name, reader.Options{Start: reader.StartNow})
	require.NoError(t, publish(p, 1, 0))
	b, err := r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	assert.Equal(t, uint64(1), b.Seq)

	require.NoError(t, p.Close())
	require.Error(t, p.Close(), "second close")
	p2 := testkit.Create(t, name, producer.Options{Slots: 2, SlotBytes: 4096})
	require.NoError(t, publish(p2, 0, 0)) // batch 0 is 24 bytes
}

// staleSegment writes a complete segment at the channel's path whose
// producer lock nobody holds: what a SIGKILLed producer leaves behind.
func staleSegment(t *testing.T, name string, published uint64) {
	t.Helper()
	g, ok := ring.ComputeGeometry(4, 2, 4096)
	require.True(t, ok)
	f, err := os.OpenFile(ring.ChannelPath(name), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(int64(g.TotalBytes)))
	seg, err := ring.MapSegment(f, g, 4, 2, true)
	require.NoError(t, err)
	seg.InitHeader(name, 1<<22+7, 1)
	seg.StorePublished(published)
	require.NoError(t, seg.Unmap())
}

func TestReclaimStaleSegment(t *testing.T) {
	name := testkit.Channel(t)
	staleSegment(t, name, 3)
	old, err := os.Stat(ring.ChannelPath(name))
	require.NoError(t, err)

	// A reader does not attach to a dead producer's channel.
	_, err = reader.Attach(name, reader.Options{})
	require.ErrorIs(t, err, reader.ErrProducerGone)

	p := testkit.Create(t, name, producer.Options{Slots: 8, SlotBytes: 8192})
	cur, err := os.Stat(ring.ChannelPath(name))
	require.NoError(t, err)
	assert.False(t, os.SameFile(old, cur), "the stale segment was replaced")
	seg, err := ring.OpenSegment(name)
	require.NoError(t, err)
	defer seg.File.Close()
	defer seg.Unmap()
	assert.Equal(t, int32(os.Getpid()), seg.Info().ProducerPid)
	assert.Equal(t, uint32(8), seg.Info().Slots)
	assert.Zero(t, seg.Published())

	r := testkit.Attach(t, name, reader.Options{})
	require.NoError(t, publish(p, 0, 0))
	b, err := r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	assert.Equal(t, uint64(0), b.Seq)
}

func TestStaleSegmentHeldLockIsLive(t *testing.T) {
	// A segment whose producer lock is held (by another open file
	// description, as a live producer would) is not reclaimed.
	name := testkit.Channel(t)
	staleSegment(t, name, 0)
	f, err := os.OpenFile(ring.ChannelPath(name), os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, ring.LockByte(f, ring.LockProducer))
	_, err = producer.Create(name, producer.Options{})
	require.ErrorIs(t, err, producer.ErrExist)
	require.NoError(t, ring.UnlockByte(f, ring.LockProducer))
	testkit.Create(t, name, producer.Options{Slots: 2, SlotBytes: 4096})
}

func TestForeignFileIsKept(t *testing.T) {
	name := testkit.Channel(t)
	junk := make([]byte, 8192)
	for i := range junk {
		junk[i] = byte(i)
	}
	require.NoError(t, os.WriteFile(ring.ChannelPath(name), junk, 0o600))
	_, err := producer.Create(name, producer.Options{})
	require.Error(t, err)
	assert.Equal(t, ring.StatusCorrupt, ring.StatusOf(err), "%v", err)
	got, err := os.ReadFile(ring.ChannelPath(name))
	require.NoError(t, err)
	assert.Equal(t, junk, got, "a file that is not a segment is never removed")
}

func TestCallOrder(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 4, SlotBytes: 4096})

	_, err := p.Reserve(4097, 0)
	require.ErrorIs(t, err, producer.ErrTooBig)
	_, err = p.Reserve(1<<40, time.Second)
	require.ErrorIs(t, err, producer.ErrTooBig)

	require.ErrorIs(t, p.Publish(nil, nil), producer.ErrState, "publish without reserve")
	require.ErrorIs(t, p.Abort(), producer.ErrState, "abort without reserve")

	buf, err := p.Reserve(4096, 0)
	require.NoError(t, err)
	require.Len(t, buf, 4096)
	_, err = p.Reserve(16, 0)
	require.ErrorIs(t, err, producer.ErrState, "second reserve")
	require.ErrorIs(t, p.EndEpoch(0), producer.ErrState, "end epoch while reserved")

	// Bad publishes keep the reservation.
	many := make([]producer.Tensor, ring.MaxTensors+1)
	for i := range many {
		many[i] = producer.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{1}}
	}
	require.ErrorIs(t, p.Publish(many, nil), producer.ErrTooBig)
	require.ErrorIs(t, p.Publish(many[:1], make([]byte, ring.MetaMax+1)), producer.ErrTooBig)
	require.ErrorIs(t, p.Publish([]producer.Tensor{{Dtype: 77, Shape: []int64{1}}}, nil), producer.ErrDtype)
	require.ErrorIs(t, p.Publish([]producer.Tensor{{Dtype: ring.DtypeUint8, Shape: []int64{4097}}}, nil), producer.ErrTooBig)
	require.ErrorIs(t, p.Publish([]producer.Tensor{{Dtype: ring.DtypeInt32, Shape: []int64{1}, Offset: 2}}, nil), producer.ErrDtype)
	require.ErrorIs(t, p.Publish([]producer.Tensor{{Dtype: ring.DtypeUint8, Shape: []int64{-1}}}, nil), producer.ErrDtype)

	// A tensor must lie within the reserved bytes, not just the slot.
	require.NoError(t, p.Abort())
	_, err = p.Reserve(100, 0)
	require.NoError(t, err)
	require.ErrorIs(t, p.Publish([]producer.Tensor{{Dtype: ring.DtypeUint8, Shape: []int64{101}}}, nil), producer.ErrTooBig)
	require.NoError(t, p.Publish(many[:ring.MaxTensors], make([]byte, ring.MetaMax)))
	require.NoError(t, p.EndEpoch(0))
	st := p.Stats()
	assert.Equal(t, uint64(2), st.Published, "one batch and one marker")
	assert.Equal(t, uint64(1), st.Epoch)

	// An aborted reservation publishes nothing.
	_, err = p.Reserve(8, 0)
	require.NoError(t, err)
	require.NoError(t, p.Abort())
	assert.Equal(t, uint64(2), p.Stats().Published)

	require.NoError(t, p.Close())
	_, err = p.Reserve(8, 0)
	require.Error(t, err)
	assert.Equal(t, ring.StatusHandle, ring.StatusOf(err))
	require.Error(t, p.EndEpoch(0))
	require.Error(t, p.Publish(nil, nil))
	require.Error(t, p.WaitReaders(0, 0))
	_, err = os.Stat(ring.ChannelPath(name))
	assert.ErrorIs(t, err, os.ErrNotExist, "close removes the name")
}

func TestBackpressure(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 4, SlotBytes: 64 << 10})
	r := testkit.Attach(t, name, reader.Options{})
	require.NoError(t, p.WaitReaders(1, time.Second))

	require.NoError(t, publish(p, 0, 0))
	held, err := r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, held)
	for i := uint64(1); i < 4; i++ {
		require.NoError(t, publish(p, i, 0))
	}
	// The ring is full: the reader holds batch 0 and releases nothing.
	_, err = p.Reserve(16, 0)
	require.ErrorIs(t, err, producer.ErrBackpressure)
	start := time.Now()
	_, err = p.Reserve(16, 20*time.Millisecond)
	waited := time.Since(start)
	require.ErrorIs(t, err, producer.ErrTimedOut)
	assert.GreaterOrEqual(t, waited, 20*time.Millisecond)
	assert.Less(t, waited, 2*time.Second)
	assert.NotZero(t, p.Stats().BackpressureNs)
	require.ErrorIs(t, p.EndEpoch(0), producer.ErrBackpressure)

	// The reader's data is intact while it holds it.
	_, _, err = batchgen.Check(tensors(held), held.Meta)
	require.NoError(t, err)

	// A release in another goroutine wakes a blocked Reserve: the ring is
	// full until the release begins, so the publish cannot return before,
	// however the goroutines are scheduled. (The reader is used by one
	// goroutine at a time: wait for Release to return before using it
	// again.)
	var releasing atomic.Bool
	released := make(chan error, 1)
	go func() {
		time.Sleep(30 * time.Millisecond) // most often, the Reserve below is asleep by then
		releasing.Store(true)
		released <- r.Release(held)
	}()
	require.NoError(t, publish(p, 4, 5*time.Second))
	assert.True(t, releasing.Load(), "Reserve returned a slot of a full ring before the reader released one")
	require.NoError(t, <-released)

	// Acquiring without releasing never gives more than max_held.
	c := batchgen.NewChecker()
	var last *reader.Batch
	for i := 1; i <= 4; i++ {
		last, err = r.Acquire(time.Second)
		require.NoError(t, err)
		require.NotNil(t, last)
		require.NoError(t, c.Data(tensors(last), last.Meta))
	}
	_, err = r.Acquire(0)
	require.Equal(t, ring.StatusState, ring.StatusOf(err), "max_held reached: %v", err)
	require.NoError(t, r.Release(last), "releases every batch up to last")
	assert.Equal(t, uint64(4), c.Batches)
	for i := uint64(5); i < 8; i++ {
		require.NoError(t, publish(p, i, 0))
	}
}

func TestNoReadersNeverBlocks(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 2, SlotBytes: batchgen.MaxPayload})
	for i := uint64(0); i < 500; i++ {
		require.NoError(t, publish(p, i, 0), "batch %d", i)
		if i%100 == 99 {
			require.NoError(t, p.EndEpoch(0))
		}
	}
	st := p.Stats()
	assert.Equal(t, uint64(505), st.Published)
	assert.Equal(t, uint64(5), st.Epoch)
	assert.Zero(t, st.BackpressureNs)
	assert.Zero(t, st.Readers)

	// A reader that detached stops gating at once.
	r, err := reader.Attach(name, reader.Options{Start: reader.StartNow})
	require.NoError(t, err)
	require.NoError(t, publish(p, 500, 0))
	require.NoError(t, publish(p, 501, 0))
	_, err = p.Reserve(8, 0)
	require.ErrorIs(t, err, producer.ErrBackpressure)
	require.NoError(t, r.Detach())
	require.NoError(t, publish(p, 502, 0))
	require.NoError(t, publish(p, 503, 0))
}

// TestEviction: a reader that holds a batch is evicted once it has gated
// the producer for EvictAfter; a reader that keeps reading is not, and
// reads every batch.
//
// The policy evicts every reader at the gating cursor, so the fine reader
// would be evicted too if its goroutine were kept off the CPU for
// EvictAfter while it gates. EvictAfter is 500 ms, not tens of ms, so that
// only a far longer stall than a loaded machine gives a runnable goroutine
// could do that; and the fine reader has read past the stuck one's batch
// before the producer meets the stuck one.
func TestEviction(t *testing.T) {
	const evictAfter = 500 * time.Millisecond
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 4, SlotBytes: 64 << 10, EvictAfter: evictAfter})
	stuck := testkit.Attach(t, name, reader.Options{})
	fine := testkit.Attach(t, name, reader.Options{})
	require.NoError(t, p.WaitReaders(2, 10*time.Second))

	done := make(chan error, 1)
	exited := make(chan struct{})
	// Cleanups run last-in first-out: this one ends the goroutine (the
	// producer's close ends its Acquire) before the readers are detached.
	t.Cleanup(func() {
		p.Close()
		<-exited
	})
	fineCheck := batchgen.NewChecker()
	var fineRead atomic.Uint64 // batches the fine reader released
	go func() {
		defer close(exited)
		for {
			b, err := fine.Acquire(5 * time.Second)
			if err != nil {
				done <- err
				return
			}
			if b == nil {
				done <- errors.New("no batch in 5 s")
				return
			}
			if err := fineCheck.Data(tensors(b), b.Meta); err != nil {
				done <- err
				return
			}
			if err := fine.Release(b); err != nil {
				done <- err
				return
			}
			fineRead.Add(1)
			if fineCheck.Batches == 12 {
				done <- nil
				return
			}
		}
	}()

	require.NoError(t, publish(p, 0, 0))
	held, err := stuck.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, held)
	for i := uint64(1); i < 4; i++ {
		require.NoError(t, publish(p, i, time.Second))
	}
	// The fine reader is past batch 0 (else it shares the gating cursor
	// with the stuck reader, and is evicted with it).
	for deadline := time.Now().Add(20 * time.Second); fineRead.Load() < 4; time.Sleep(time.Millisecond) {
		require.True(t, time.Now().Before(deadline), "the fine reader did not read batches 0-3 in 20 s")
	}
	start := time.Now()
	require.NoError(t, publish(p, 4, 30*time.Second), "the stuck reader is evicted")
	waited := time.Since(start)
	t.Logf("evicted after %v", waited)
	// Not before EvictAfter: the policy's clock starts inside this
	// Reserve. Soon after it: the gate looks at least every EvictAfter;
	// 5 s tells that from a policy whose clock never runs out (the
	// Reserve's 30 s timeout), and leaves a loaded machine seconds.
	assert.GreaterOrEqual(t, waited, evictAfter)
	assert.Less(t, waited, 5*time.Second)
	st := p.Stats()
	assert.Equal(t, uint64(1), st.ReadersEvicted)
	assert.Zero(t, st.ReadersReclaimed)
	for i := uint64(5); i < 12; i++ {
		require.NoError(t, publish(p, i, 5*time.Second))
	}
	require.NoError(t, <-done)
	assert.Equal(t, uint64(12), fineCheck.Batches)
	assert.Equal(t, batchgen.ExpectedFold(0, 12), fineCheck.Fold)

	infos := p.Readers()
	require.Len(t, infos, 2)
	evicted := 0
	for _, in := range infos {
		if in.Evicted {
			evicted++
		}
	}
	assert.Equal(t, 1, evicted)

	// The evicted reader learns it at its next call; it gets no more data.
	_, err = stuck.Acquire(time.Second)
	require.ErrorIs(t, err, reader.ErrEvicted)
	require.ErrorIs(t, stuck.Release(held), reader.ErrEvicted)
	_, err = stuck.Acquire(0)
	require.ErrorIs(t, err, reader.ErrEvicted)
	// Its record is freed by detach and can be claimed again.
	require.NoError(t, stuck.Detach())
	again := testkit.Attach(t, name, reader.Options{Start: reader.StartNow})
	require.NoError(t, publish(p, 12, time.Second))
	b, err := again.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	assert.Equal(t, uint64(12), b.Seq)
}

// TestEvictedReaderGetsNoMoreData: once evicted, a reader gets ErrEvicted
// on its next Acquire even where the producer has not lapped it yet: the
// producer no longer protects its slots, so any batch handed out could be
// overwritten while in use.
func TestEvictedReaderGetsNoMoreData(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 4, SlotBytes: 64 << 10, EvictAfter: 30 * time.Millisecond})
	stuck := testkit.Attach(t, name, reader.Options{})
	require.NoError(t, p.WaitReaders(1, time.Second))
	for i := uint64(0); i < 4; i++ {
		require.NoError(t, publish(p, i, 0))
	}
	held, err := stuck.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, held)
	require.NoError(t, publish(p, 4, 5*time.Second)) // evicts, overwrites slot 0 only
	require.Equal(t, uint64(1), p.Stats().ReadersEvicted)
	b, err := stuck.Acquire(time.Second)
	if b != nil {
		t.Errorf("evicted reader got batch seq %d", b.Seq)
	}
	require.ErrorIs(t, err, reader.ErrEvicted)
}

// TestEvictionAfterLap: an evicted reader that kept acquiring until the
// producer lapped it gets ErrEvicted, never stale data.
func TestEvictionAfterLap(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 2, SlotBytes: 64 << 10, EvictAfter: 20 * time.Millisecond})
	stuck := testkit.Attach(t, name, reader.Options{MaxHeld: 1})
	require.NoError(t, p.WaitReaders(1, time.Second))
	require.NoError(t, publish(p, 0, 0))
	held, err := stuck.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, held)
	for i := uint64(1); i < 10; i++ {
		require.NoError(t, publish(p, i, 5*time.Second))
	}
	require.ErrorIs(t, stuck.Release(held), reader.ErrEvicted)
	_, err = stuck.Acquire(time.Second)
	require.ErrorIs(t, err, reader.ErrEvicted)
}

func TestSlowReaderNotEvictedByDefault(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 4, SlotBytes: 64 << 10})
	slow := testkit.Attach(t, name, reader.Options{})
	require.NoError(t, p.WaitReaders(1, time.Second))
	for i := uint64(0); i < 4; i++ {
		require.NoError(t, publish(p, i, 0))
	}
	held, err := slow.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, held)
	start := time.Now()
	_, err = p.Reserve(16, 300*time.Millisecond)
	require.ErrorIs(t, err, producer.ErrTimedOut)
	assert.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond)
	st := p.Stats()
	assert.Zero(t, st.ReadersEvicted)
	assert.Equal(t, 1, st.Readers)

	// The slow reader goes on, in order, with intact data.
	c := batchgen.NewChecker()
	require.NoError(t, c.Data(tensors(held), held.Meta))
	require.NoError(t, slow.Release(held))
	for i := uint64(4); i < 20; i++ {
		require.NoError(t, publish(p, i, 0))
		b, err := slow.Acquire(time.Second)
		require.NoError(t, err)
		require.NotNil(t, b)
		require.NoError(t, c.Data(tensors(b), b.Meta))
		require.NoError(t, slow.Release(b))
	}
	for k := 0; k < 3; k++ {
		b, err := slow.Acquire(time.Second)
		require.NoError(t, err)
		require.NotNil(t, b)
		require.NoError(t, c.Data(tensors(b), b.Meta))
		require.NoError(t, slow.Release(b))
	}
	assert.Equal(t, uint64(20), c.Batches)
	assert.Equal(t, batchgen.ExpectedFold(0, 20), c.Fold)
	assert.Zero(t, p.Stats().ReadersEvicted)
}

func TestWaitReadersAndStats(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 4, SlotBytes: 4096, MaxReaders: 2})
	start := time.Now()
	require.ErrorIs(t, p.WaitReaders(1, 30*time.Millisecond), producer.ErrTimedOut)
	assert.GreaterOrEqual(t, time.Since(start), 30*time.Millisecond)
	require.NoError(t, p.WaitReaders(0, 0))

	late := make(chan *reader.Reader, 1)
	go func() {
		time.Sleep(20 * time.Millisecond)
		r, _ := reader.Attach(name, reader.Options{})
		late <- r
	}()
	require.NoError(t, p.WaitReaders(1, 5*time.Second))
	if r := <-late; r != nil {
		t.Cleanup(func() { r.Detach() })
	}
	r2 := testkit.Attach(t, name, reader.Options{})
	_, err := reader.Attach(name, reader.Options{})
	assert.Equal(t, ring.StatusFull, ring.StatusOf(err), "only 2 records: %v", err)

	infos := p.Readers()
	require.Len(t, infos, 2)
	for _, in := range infos {
		assert.Equal(t, int32(os.Getpid()), in.Pid)
		assert.False(t, in.Evicted)
	}
	assert.Equal(t, 2, p.Stats().Readers)

	require.NoError(t, r2.Detach())
	assert.Len(t, p.Readers(), 1)
	r3 := testkit.Attach(t, name, reader.Options{})
	_ = r3
	assert.Len(t, p.Readers(), 2)
}

// TestCloseUnderReservation (review 1, item 1): Close while a batch is
// reserved leaves its payload writable (another thread of a C host may be
// writing it: before the fix it died of SIGSEGV); Publish then reports the
// close and drops the batch, and the channel is gone.
func TestCloseUnderReservation(t *testing.T) {
	name := testkit.Channel(t)
	p, err := producer.Create(name, producer.Options{Slots: 2, SlotBytes: 1 << 20})
	require.NoError(t, err)
	buf, err := p.Reserve(1<<20, 0)
	require.NoError(t, err)
	buf[0] = 1
	require.NoError(t, p.Close())
	for i := range buf {
		buf[i] = byte(i) // would fault on an unmapped payload
	}
	assert.True(t, p.HoldsReservation())
	err = p.Publish(nil, nil)
	require.Error(t, err)
	assert.ErrorIs(t, err, ring.Status(ring.StatusHandle))
	assert.False(t, p.HoldsReservation(), "the reservation ends with the close reported")
	assert.Error(t, p.Abort(), "nothing reserved any more, and closed")
	_, err = os.Stat(ring.ChannelPath(name))
	assert.True(t, os.IsNotExist(err), "the channel is removed")
}
