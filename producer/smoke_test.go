package producer_test

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

func TestPublishAcquireInProcess(t *testing.T) {
	name := testkit.Channel(t)
	p, err := producer.Create(name, producer.Options{Slots: 4, SlotBytes: 4096})
	require.NoError(t, err)
	defer p.Close()
	r, err := reader.Attach(name, reader.Options{})
	require.NoError(t, err)
	defer r.Detach()

	done := make(chan error, 1)
	go func() {
		for i := 0; i < 100; i++ {
			buf, err := p.Reserve(8*uint64(i+1), time.Second)
			if err != nil {
				done <- err
				return
			}
			for j := 0; j <= i; j++ {
				binary.LittleEndian.PutUint64(buf[8*j:], uint64(i*1000+j))
			}
			if err := p.Publish([]producer.Tensor{{Dtype: ring.DtypeUint64, Shape: []int64{int64(i + 1)}}}, []byte{byte(i)}); err != nil {
				done <- err
				return
			}
		}
		done <- p.EndEpoch(time.Second)
	}()
	for i := 0; i < 100; i++ {
		b, err := r.Acquire(2 * time.Second)
		require.NoError(t, err)
		require.NotNil(t, b, "batch %d", i)
		require.Equal(t, uint64(i), b.Index)
		require.Len(t, b.Tensors, 1)
		require.Equal(t, []int64{int64(i + 1)}, b.Tensors[0].Shape)
		for j := 0; j <= i; j++ {
			require.Equal(t, uint64(i*1000+j), binary.LittleEndian.Uint64(b.Tensors[0].Data[8*j:]))
		}
		require.Equal(t, []byte{byte(i)}, b.Meta)
		require.NoError(t, r.Release(b))
	}
	b, err := r.Acquire(2 * time.Second)
	require.NoError(t, err)
	require.True(t, b.EpochEnd())
	require.Equal(t, uint64(100), b.Index)
	require.NoError(t, r.Release(b))
	require.NoError(t, <-done)
}

// A late joiner waiting for the next epoch skips epoch-end markers, even the
// marker of an empty epoch (whose index is 0), and starts at real data.
func TestLateJoinSkipsEmptyEpochMarker(t *testing.T) {
	name := testkit.Channel(t)
	p, err := producer.Create(name, producer.Options{Slots: 8, SlotBytes: 4096})
	require.NoError(t, err)
	defer p.Close()
	publish := func() {
		_, err := p.Reserve(8, time.Second)
		require.NoError(t, err)
		require.NoError(t, p.Publish([]producer.Tensor{{Dtype: ring.DtypeUint64, Shape: []int64{1}}}, nil))
	}
	publish() // epoch 0, index 0
	r, err := reader.Attach(name, reader.Options{})
	require.NoError(t, err)
	defer r.Detach()
	require.NoError(t, p.EndEpoch(time.Second)) // marker of epoch 0
	require.NoError(t, p.EndEpoch(time.Second)) // epoch 1 is empty: its marker has index 0
	publish()                                   // epoch 2, index 0
	b, err := r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	require.False(t, b.EpochEnd())
	require.Equal(t, uint64(2), b.Epoch)
	require.Equal(t, uint64(0), b.Index)
}

// A reader that attaches while no more than JoinWindow batches of the
// current epoch are published gets the whole epoch; later, the next epoch.
func TestLateJoinWindow(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 8, SlotBytes: 4096, JoinWindow: 3})
	publish := func() {
		_, err := p.Reserve(8, 0) // never blocks: the window is smaller than the ring
		require.NoError(t, err)
		require.NoError(t, p.Publish([]producer.Tensor{{Dtype: ring.DtypeUint64, Shape: []int64{1}}}, nil))
	}
	first := func(r *reader.Reader) *reader.Batch {
		b, err := r.Acquire(time.Second)
		require.NoError(t, err)
		require.NotNil(t, b)
		require.NoError(t, r.Release(b))
		return b
	}
	for i := 0; i < 3; i++ {
		publish()
	}
	inside := testkit.Attach(t, name, reader.Options{}) // 3 of the epoch out: inside the window
	publish()                                           // 4: outside
	late := testkit.Attach(t, name, reader.Options{})
	now := testkit.Attach(t, name, reader.Options{Start: reader.StartNow})
	publish()
	require.NoError(t, p.EndEpoch(0))
	publish() // epoch 1, index 0

	b := first(inside)
	require.Equal(t, [2]uint64{0, 0}, [2]uint64{b.Epoch, b.Index}, "inside the window: the whole epoch")
	b = first(late)
	require.Equal(t, [2]uint64{1, 0}, [2]uint64{b.Epoch, b.Index}, "outside the window: next epoch")
	b = first(now)
	require.Equal(t, [2]uint64{0, 4}, [2]uint64{b.Epoch, b.Index}, "StartNow ignores the window")

	// The window never blocks the producer with no reader behind.
	for _, r := range []*reader.Reader{inside, late, now} {
		require.NoError(t, r.Detach())
	}
	for i := 0; i < 20; i++ {
		publish()
	}
	_, err := producer.Create(name+"x", producer.Options{Slots: 4, JoinWindow: 4})
	require.ErrorIs(t, err, producer.ErrInvalid)
}

// A StartOldest reader begins at the oldest batch an attached reader has
// not released (the slowest one's next), and reads on from there; with no
// reader attached it starts as StartNow. Its start gates the producer at
// once: the batches it starts with are never overwritten under it.
func TestStartOldest(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 8, SlotBytes: 4096})
	publish := func() {
		_, err := p.Reserve(8, 0)
		require.NoError(t, err)
		require.NoError(t, p.Publish([]producer.Tensor{{Dtype: ring.DtypeUint64, Shape: []int64{1}}}, nil))
	}
	take := func(r *reader.Reader) uint64 {
		b, err := r.Acquire(time.Second)
		require.NoError(t, err)
		require.NotNil(t, b)
		require.NoError(t, r.Release(b))
		return b.Index
	}
	publish() // 0, with nobody attached
	alone := testkit.Attach(t, name, reader.Options{Start: reader.StartOldest})
	for i := 0; i < 7; i++ {
		publish() // 1..7
	}
	require.Equal(t, uint64(1), take(alone), "with no reader: the next batch published")
	for want := uint64(2); want <= 3; want++ {
		require.Equal(t, want, take(alone))
	}
	oldest := testkit.Attach(t, name, reader.Options{Start: reader.StartOldest})
	now := testkit.Attach(t, name, reader.Options{Start: reader.StartNow})
	for i := 0; i < 4; i++ {
		publish() // 8..11: the ring (8 slots) is full behind batch 4
	}
	_, err := p.Reserve(8, 0)
	require.ErrorIs(t, err, producer.ErrBackpressure)
	require.Equal(t, uint64(4), take(oldest), "the slowest reader's next batch")
	require.Equal(t, uint64(8), take(now))
	_, err = p.Reserve(8, 0)
	require.ErrorIs(t, err, producer.ErrBackpressure, "the first reader still holds batch 4")
	for want := uint64(4); want <= 11; want++ {
		require.Equal(t, want, take(alone))
	}
	publish() // 12
	_, err = p.Reserve(8, 0)
	require.ErrorIs(t, err, producer.ErrBackpressure, "the oldest reader, at 5, holds the producer back now")
	for want := uint64(5); want <= 12; want++ {
		require.Equal(t, want, take(oldest))
	}
	for want := uint64(9); want <= 12; want++ {
		require.Equal(t, want, take(now))
	}
	require.Equal(t, uint64(12), take(alone))
	for _, r := range []*reader.Reader{alone, oldest, now} {
		require.NoError(t, r.Detach())
	}
}
