package reader_test

import (
	"encoding/binary"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/internal/batchgen"
	"github.com/tsock/tsock/internal/readers"
	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

func publish(t *testing.T, p *producer.Producer, i uint64) {
	t.Helper()
	buf, err := p.Reserve(batchgen.PayloadBytes(i), time.Second)
	require.NoError(t, err)
	ts, meta := batchgen.Write(buf, i)
	require.NoError(t, p.Publish(ts, meta))
}

func tensors(b *reader.Batch) []batchgen.Tensor {
	out := make([]batchgen.Tensor, len(b.Tensors))
	for k, x := range b.Tensors {
		out[k] = batchgen.Tensor(x)
	}
	return out
}

func TestAttachErrors(t *testing.T) {
	for _, n := range []string{"", "..", "a/b", "x\x00"} {
		_, err := reader.Attach(n, reader.Options{})
		assert.Equal(t, ring.StatusName, ring.StatusOf(err), "name %q: %v", n, err)
	}
	name := testkit.Channel(t)
	start := time.Now()
	_, err := reader.Attach(name, reader.Options{})
	require.ErrorIs(t, err, reader.ErrNoChannel)
	assert.Less(t, time.Since(start), 5*time.Second, "no attach timeout: fails at once")

	start = time.Now()
	_, err = reader.Attach(name, reader.Options{AttachTimeout: 60 * time.Millisecond})
	require.ErrorIs(t, err, reader.ErrNoChannel)
	assert.GreaterOrEqual(t, time.Since(start), 60*time.Millisecond)

	testkit.Create(t, name, producer.Options{Slots: 2, SlotBytes: 4096})
	for _, o := range []reader.Options{{MaxHeld: 65}, {Start: 3}, {Start: -1}} {
		_, err = reader.Attach(name, o)
		assert.Equal(t, ring.StatusInval, ring.StatusOf(err), "%+v: %v", o, err)
	}
	r, err := reader.Attach(name, reader.Options{MaxHeld: 64, Spin: -1})
	require.NoError(t, err)
	require.NoError(t, r.Detach())
	assert.Equal(t, ring.StatusHandle, ring.StatusOf(r.Detach()), "second detach")
	_, err = r.Acquire(0)
	assert.Equal(t, ring.StatusHandle, ring.StatusOf(err), "acquire after detach")
}

// TestAttachWaitsForChannel: Attach with an AttachTimeout waits for a
// channel that does not exist yet. The producer is created 50 ms after the
// test starts to attach; a run in which the creation began before Attach
// was called (the test was descheduled that long) proves nothing, and is
// run again.
func TestAttachWaitsForChannel(t *testing.T) {
	for attempt := 1; !attachWaitsOnce(t); attempt++ {
		require.Less(t, attempt, 20, "the channel was created before Attach was called, every time")
		t.Logf("attempt %d: the channel was created before Attach was called; again", attempt)
	}
}

// attachWaitsOnce is one run of TestAttachWaitsForChannel; false when it
// proved nothing.
func attachWaitsOnce(t *testing.T) bool {
	name := testkit.Channel(t)
	creating := make(chan time.Time, 1)
	created := make(chan *producer.Producer, 1)
	go func() {
		time.Sleep(50 * time.Millisecond)
		creating <- time.Now()
		p, err := producer.Create(name, producer.Options{Slots: 4, SlotBytes: 64 << 10})
		if err != nil {
			created <- nil
			return
		}
		created <- p
		if err := p.WaitReaders(1, 5*time.Second); err != nil {
			return
		}
		buf, _ := p.Reserve(batchgen.PayloadBytes(0), time.Second)
		ts, meta := batchgen.Write(buf, 0)
		p.Publish(ts, meta)
	}()
	called := time.Now()
	r := testkit.Attach(t, name, reader.Options{AttachTimeout: 10 * time.Second})
	p := <-created
	require.NotNil(t, p)
	t.Cleanup(func() { p.Close() })
	if (<-creating).Before(called) {
		return false
	}
	b, err := r.Acquire(5 * time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	_, _, err = batchgen.Check(tensors(b), b.Meta)
	require.NoError(t, err)
	return true
}

func TestAcquireContents(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 8, SlotBytes: 64 << 10})
	r := testkit.Attach(t, name, reader.Options{})

	start := time.Now()
	b, err := r.Acquire(30 * time.Millisecond)
	require.NoError(t, err)
	require.Nil(t, b, "nothing published: no batch, no error")
	assert.GreaterOrEqual(t, time.Since(start), 30*time.Millisecond)
	b, err = r.Acquire(0)
	require.NoError(t, err)
	require.Nil(t, b)

	before := ring.MonotonicNs()
	publish(t, p, 5)
	// A strided, offset tensor of float32 next to the test batch's tensors.
	buf, err := p.Reserve(4096, 0)
	require.NoError(t, err)
	for k := 0; k < 1024; k++ {
		binary.LittleEndian.PutUint32(buf[4*k:], uint32(k))
	}
	require.NoError(t, p.Publish([]producer.Tensor{
		{Dtype: ring.DtypeUint32, Shape: []int64{3, 4}, Strides: []int64{10, 2}, Offset: 400},
		{Dtype: ring.DtypeFloat64, Offset: 4088},
		{Dtype: ring.DtypeInt16, Shape: []int64{0, 3}},
	}, []byte("meta")))
	require.NoError(t, p.EndEpoch(0))

	b, err = r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	assert.Equal(t, uint64(0), b.Seq)
	assert.Equal(t, uint64(0), b.Epoch)
	assert.Equal(t, uint64(0), b.Index)
	assert.False(t, b.EpochEnd())
	assert.GreaterOrEqual(t, b.PublishNs, before)
	assert.LessOrEqual(t, b.PublishNs, ring.MonotonicNs())
	i, _, err := batchgen.Check(tensors(b), b.Meta)
	require.NoError(t, err)
	assert.Equal(t, uint64(5), i)

	b2, err := r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b2)
	assert.Equal(t, uint64(1), b2.Seq)
	assert.Equal(t, uint64(1), b2.Index)
	assert.Equal(t, []byte("meta"), b2.Meta)
	require.Len(t, b2.Tensors, 3)
	st := b2.Tensors[0]
	assert.Equal(t, ring.DtypeUint32, st.Dtype)
	assert.Equal(t, []int64{3, 4}, st.Shape)
	assert.Equal(t, []int64{10, 2}, st.Strides)
	require.Len(t, st.Data, (2*10+3*2+1)*4, "a strided tensor spans its furthest element")
	for x := 0; x < 3; x++ {
		for y := 0; y < 4; y++ {
			off := 4 * (x*10 + y*2)
			assert.Equal(t, uint32(100+x*10+y*2), binary.LittleEndian.Uint32(st.Data[off:]))
		}
	}
	assert.Empty(t, b2.Tensors[1].Shape)
	assert.Len(t, b2.Tensors[1].Data, 8)
	assert.Equal(t, []int64{0, 3}, b2.Tensors[2].Shape)
	assert.Empty(t, b2.Tensors[2].Data)

	m, err := r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, m)
	assert.True(t, m.EpochEnd())
	assert.Equal(t, uint64(2), m.Index, "marker index: batches in the epoch")
	assert.Empty(t, m.Tensors)
	assert.Empty(t, m.Meta)
	require.NoError(t, r.Release(m))

	// Releasing a batch released already (with m) is out of order.
	assert.Equal(t, ring.StatusState, ring.StatusOf(r.Release(b)))
	assert.Equal(t, ring.StatusInval, ring.StatusOf(r.Release(nil)))
	assert.Equal(t, ring.StatusInval, ring.StatusOf(r.Release(&reader.Batch{})))

	publish(t, p, 6)
	b, err = r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	assert.Equal(t, uint64(1), b.Epoch)
	assert.Equal(t, uint64(0), b.Index)
	other := testkit.Attach(t, name, reader.Options{})
	assert.Equal(t, ring.StatusState, ring.StatusOf(other.Release(b)), "a batch of another reader")
}

// A kept batch stays whole after its release, while the producer rewrites
// its slot (2 slots: batch 2 goes where batch 0 was).
func TestKeep(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 2, SlotBytes: 64 << 10})
	r := testkit.Attach(t, name, reader.Options{})
	publish(t, p, 7)
	b, err := r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	none, err := r.Keep(b, 0)
	require.NoError(t, err)
	assert.Nil(t, none, "nothing to keep")
	kept, err := r.Keep(b, 1<<uint(len(b.Tensors))-1)
	require.NoError(t, err)
	require.NotNil(t, kept)
	require.NoError(t, r.Release(b))
	_, err = r.Keep(b, 1)
	assert.Equal(t, ring.StatusState, ring.StatusOf(err), "released")
	for i := uint64(8); i < 10; i++ {
		publish(t, p, i)
		nb, err := r.Acquire(time.Second)
		require.NoError(t, err)
		require.NotNil(t, nb)
		require.NoError(t, r.Release(nb))
	}
	i, _, err := batchgen.Check(tensors(kept), kept.Meta)
	require.NoError(t, err)
	assert.Equal(t, uint64(7), i)
	require.NoError(t, kept.Free())
	assert.Equal(t, ring.StatusHandle, ring.StatusOf(kept.Free()))
	assert.Equal(t, ring.StatusHandle, ring.StatusOf(b.Free()), "not a kept batch")
}

func TestMaxHeld(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 16, SlotBytes: 64 << 10})
	r := testkit.Attach(t, name, reader.Options{MaxHeld: 3})
	for i := uint64(0); i < 8; i++ {
		publish(t, p, i)
	}
	var held []*reader.Batch
	for k := 0; k < 3; k++ {
		b, err := r.Acquire(time.Second)
		require.NoError(t, err)
		require.NotNil(t, b)
		held = append(held, b)
	}
	_, err := r.Acquire(time.Second)
	require.Equal(t, ring.StatusState, ring.StatusOf(err), "%v", err)
	// Held batches stay valid while more are held.
	for k, b := range held {
		i, _, err := batchgen.Check(tensors(b), b.Meta)
		require.NoError(t, err)
		assert.Equal(t, uint64(k), i)
	}
	// Releasing the second releases the first too.
	require.NoError(t, r.Release(held[1]))
	assert.Equal(t, ring.StatusState, ring.StatusOf(r.Release(held[0])))
	for k := 0; k < 2; k++ {
		b, err := r.Acquire(time.Second)
		require.NoError(t, err)
		require.NotNil(t, b)
		assert.Equal(t, uint64(3+k), b.Seq)
	}
	_, err = r.Acquire(0)
	require.Equal(t, ring.StatusState, ring.StatusOf(err))
	var cursor uint64
	for _, in := range p.Readers() {
		cursor = in.Cursor
		assert.Equal(t, uint64(5), in.Acquired)
		assert.Equal(t, uint64(5), in.Batches)
	}
	assert.Equal(t, uint64(2), cursor)
}

func TestReaderRecordsFull(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 2, SlotBytes: 4096, MaxReaders: 2})
	a := testkit.Attach(t, name, reader.Options{})
	testkit.Attach(t, name, reader.Options{})
	_, err := reader.Attach(name, reader.Options{})
	require.Equal(t, ring.StatusFull, ring.StatusOf(err))
	require.NoError(t, a.Detach())
	testkit.Attach(t, name, reader.Options{})
	assert.Len(t, p.Readers(), 2)
}

// fakeSegment builds a channel segment by hand, holds its producer lock
// through f and lets readers join through a reader table, standing in for
// a producer the test controls completely.
type fakeSegment struct {
	seg   *ring.Segment
	f     *os.File
	table *readers.Table
	next  uint64
}

func newFake(t *testing.T, name string, slots uint32) *fakeSegment {
	t.Helper()
	g, ok := ring.ComputeGeometry(slots, 4, 4096)
	require.True(t, ok)
	f, err := os.OpenFile(ring.ChannelPath(name), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	require.NoError(t, err)
	require.NoError(t, f.Truncate(int64(g.TotalBytes)))
	seg, err := ring.MapSegment(f, g, slots, 4, true)
	require.NoError(t, err)
	table, err := readers.Listen(seg, nil)
	require.NoError(t, err)
	seg.InitHeader(name, os.Getpid(), 1)
	require.NoError(t, ring.LockByte(f, ring.LockProducer))
	table.Serve()
	fs := &fakeSegment{seg: seg, f: f, table: table}
	t.Cleanup(fs.die)
	return fs
}

// publish writes a slot as the producer does, with the given descriptor
// checked against checkBytes but the slot claiming payloadBytes.
func (fs *fakeSegment) publish(t *testing.T, tn ring.Tensor, checkBytes, payloadBytes uint64) {
	t.Helper()
	var d [1]ring.ShmTensor
	st, err := tn.Fill(&d[0], checkBytes)
	require.Equal(t, ring.StatusOK, st, "%v", err)
	fs.seg.BeginSlot(fs.next)
	fs.seg.WriteSlot(fs.next, &ring.SlotContents{Index: fs.next, Tensors: []ring.Tensor{tn},
		PayloadBytes: payloadBytes, PublishNs: ring.MonotonicNs()}, d[:])
	fs.next++
	fs.seg.StorePublished(fs.next)
	ring.FutexWakeAll(fs.seg.PublishedWord())
}

// cursor is the cursor in the record of the reader of entry i, now.
func (fs *fakeSegment) cursor(t *testing.T, i uint32) uint64 {
	t.Helper()
	for _, r := range fs.table.Readers() {
		if r.Index == i {
			return r.Cursor
		}
	}
	t.Fatalf("no reader in entry %d", i)
	return 0
}

// die drops the producer lock and the join socket as a dying process
// would.
func (fs *fakeSegment) die() {
	if fs.f != nil {
		fs.table.Close()
		fs.seg.Unmap()
		fs.f.Close()
		fs.f = nil
	}
}

func TestCorruptDescriptorRejected(t *testing.T) {
	name := testkit.Channel(t)
	fs := newFake(t, name, 4)
	r := testkit.Attach(t, name, reader.Options{})
	fs.publish(t, ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{100}}, 4096, 100)
	b, err := r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	require.Len(t, b.Tensors[0].Data, 100)
	require.NoError(t, r.Release(b))

	// The descriptor says 200 bytes, the slot only 100 in use.
	fs.publish(t, ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{200}}, 4096, 100)
	_, err = r.Acquire(time.Second)
	require.ErrorIs(t, err, reader.ErrCorrupt)
	// The slot claims more payload than the channel has.
	fs.publish(t, ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{10}}, 1<<20, 1<<20)
	_, err = r.Acquire(time.Second)
	require.ErrorIs(t, err, reader.ErrCorrupt)
	// The reader goes on with the next valid batch.
	fs.publish(t, ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{7}}, 4096, 7)
	b, err = r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	assert.Equal(t, uint64(3), b.Seq)
}

func TestProducerGone(t *testing.T) {
	name := testkit.Channel(t)
	fs := newFake(t, name, 4)
	r := testkit.Attach(t, name, reader.Options{})
	for k := 0; k < 3; k++ {
		fs.publish(t, ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{int64(k + 1)}}, 4096, 4096)
	}
	type res struct {
		n   int
		err error
		at  time.Time
	}
	ch := make(chan res, 1)
	go func() {
		n := 0
		for {
			b, err := r.Acquire(10 * time.Second)
			if err == nil && b == nil {
				err = fmt.Errorf("no batch and no error in 10 s")
			}
			if err != nil {
				ch <- res{n, err, time.Now()}
				return
			}
			n++
			r.Release(b)
		}
	}()
	time.Sleep(100 * time.Millisecond)
	died := time.Now()
	fs.die()
	select {
	case x := <-ch:
		require.ErrorIs(t, x.err, reader.ErrProducerGone)
		assert.Equal(t, 3, x.n, "everything published before the death is read")
		t.Logf("producer gone noticed after %v", x.at.Sub(died))
		// Death is seen by a 50 ms liveness poll, but the time measured
		// also holds this goroutine's own scheduling (draining the three
		// batches, cgo returns, getting a P back), seconds on a loaded
		// machine. 5 s still tells "noticed" from the Acquire's 10 s
		// timeout, which is how a missed death ends.
		assert.Less(t, x.at.Sub(died), 5*time.Second)
	case <-time.After(30 * time.Second):
		t.Fatal("a reader waiting without limit never noticed the producer's death")
	}
	_, err := r.Acquire(200 * time.Millisecond)
	require.ErrorIs(t, err, reader.ErrProducerGone)
	// "Gone" is sticky: even a call that does not wait says so at once.
	for k := 0; k < 3; k++ {
		_, err = r.Acquire(0)
		require.ErrorIs(t, err, reader.ErrProducerGone)
	}
	// No new reader attaches to a dead producer's channel.
	_, err = reader.Attach(name, reader.Options{})
	require.ErrorIs(t, err, reader.ErrProducerGone)
	start := time.Now()
	_, err = reader.Attach(name, reader.Options{AttachTimeout: 50 * time.Millisecond})
	require.ErrorIs(t, err, reader.ErrProducerGone)
	assert.GreaterOrEqual(t, time.Since(start), 50*time.Millisecond, "waits for a new producer")
}

func TestBadSegments(t *testing.T) {
	g, ok := ring.ComputeGeometry(4, 4, 4096)
	require.True(t, ok)
	cases := []struct {
		name   string
		mutate func(h []byte) []byte
		status int
	}{
		{"garbage", func(h []byte) []byte {
			for i := range h {
				h[i] = 0xa5
			}
			return h
		}, ring.StatusCorrupt},
		{"empty", func([]byte) []byte { return nil }, ring.StatusCorrupt},
		{"truncated", func(h []byte) []byte { return h[:4096+100] }, ring.StatusCorrupt},
		{"version", func(h []byte) []byte { binary.LittleEndian.PutUint32(h[8:], 99); return h }, ring.StatusVersion},
		{"geometry", func(h []byte) []byte { binary.LittleEndian.PutUint32(h[24:], 8); return h }, ring.StatusCorrupt},
		{"being built", func(h []byte) []byte { binary.LittleEndian.PutUint32(h[8:], 0); return h }, ring.StatusTimedOut},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			name := testkit.Channel(t)
			fs := newFake(t, name, 4)
			img := make([]byte, g.TotalBytes)
			n, err := fs.f.ReadAt(img, 0)
			require.NoError(t, err)
			require.Equal(t, len(img), n)
			img = c.mutate(img)
			require.NoError(t, fs.f.Truncate(int64(len(img))))
			_, err = fs.f.WriteAt(img, 0)
			require.NoError(t, err)
			_, err = reader.Attach(name, reader.Options{})
			assert.Equal(t, c.status, ring.StatusOf(err), "%v", err)
		})
	}
}

// TestDevicePathRefusedWithoutPool: a channel without a device pool has no
// device path (no driver needed to say so), its batches no device copy;
// RegisterHost needs a driver. The device path itself is tested against
// the fake driver in tests/c/test_device.c (same C code).
func TestDevicePathRefusedWithoutPool(t *testing.T) {
	name := testkit.Channel(t)
	p, err := producer.Create(name, producer.Options{Slots: 4, SlotBytes: 1 << 16})
	require.NoError(t, err)
	defer p.Close()
	r, err := reader.Attach(name, reader.Options{Start: reader.StartNow})
	require.NoError(t, err)
	defer r.Detach()
	ordinal, err := r.OpenDevice()
	assert.ErrorIs(t, err, reader.ErrNoDevice)
	assert.Equal(t, -1, ordinal)
	assert.Contains(t, err.Error(), "no device pool")
	publish(t, p, 0)
	b, err := r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	assert.ErrorIs(t, b.CUDAUse(0, false), reader.ErrNoDevice)
	_, err = b.CUDAPtr(0)
	assert.ErrorIs(t, err, reader.ErrNoDevice)
	require.NoError(t, r.Release(b))

	if _, err := os.Stat("/proc/driver/nvidia"); err == nil {
		return // a real driver would answer RegisterHost
	}
	t.Setenv("TSOCK_LIBCUDA", t.TempDir()+"/no-libcuda.so.1")
	err = r.RegisterHost()
	assert.ErrorIs(t, err, reader.ErrNoCUDA)
	assert.Contains(t, err.Error(), "CUDA driver not available")
}

// TestAttachToClosingChannel: a producer that is closing its channel no
// longer accepts readers; a reader that found the file first is told the
// channel is closed, not that its producer died.
func TestAttachToClosingChannel(t *testing.T) {
	name := testkit.Channel(t)
	fs := newFake(t, name, 4)
	fs.seg.SetState(ring.StateClosed)
	fs.table.StopJoins()
	_, err := reader.Attach(name, reader.Options{})
	require.ErrorIs(t, err, reader.ErrClosed)
	assert.Contains(t, err.Error(), "closed by the producer")
}
