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
