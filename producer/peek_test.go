package producer_test

import (
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/ring"
)

func publishMeta(t *testing.T, p *producer.Producer, meta string) {
	t.Helper()
	_, err := p.Reserve(8, time.Second)
	require.NoError(t, err)
	require.NoError(t, p.Publish([]ring.Tensor{{Dtype: ring.DtypeUint8, Shape: []int64{8}}}, []byte(meta)))
}

// TestPeek: the newest batches of a live channel, counted back from the
// newest, with their metadata and epoch markers; what the ring no longer
// holds is StatusAgain, a missing channel StatusNoEnt.
func TestPeek(t *testing.T) {
	name := testkit.Channel(t)
	_, err := producer.Peek(name, 0)
	assert.Equal(t, ring.StatusNoEnt, ring.StatusOf(err), "%v", err)

	p := testkit.Create(t, name, producer.Options{Slots: 4, SlotBytes: 4096})
	_, err = producer.Peek(name, 0)
	assert.Equal(t, ring.StatusAgain, ring.StatusOf(err), "nothing published: %v", err)

	for i := 0; i < 6; i++ {
		publishMeta(t, p, fmt.Sprintf("batch %d", i))
	}
	require.NoError(t, p.EndEpoch(time.Second))

	got, err := producer.Peek(name, 0)
	require.NoError(t, err)
	assert.Equal(t, uint64(7), got.Published)
	assert.True(t, got.ProducerAlive)
	assert.Equal(t, uint64(6), got.Seq)
	assert.Equal(t, ring.FlagEpochEnd, got.Flags&ring.FlagEpochEnd, "newest is the epoch marker")
	assert.Equal(t, uint64(6), got.Index, "a marker's index is the epoch's batch count")
	for back := uint64(1); back < 4; back++ {
		got, err := producer.Peek(name, back)
		require.NoError(t, err)
		assert.Equal(t, 6-back, got.Seq)
		assert.Equal(t, uint64(0), got.Epoch)
		assert.Equal(t, 6-back, got.Index)
		assert.Equal(t, fmt.Sprintf("batch %d", 6-back), string(got.Meta))
	}
	_, err = producer.Peek(name, 4)
	assert.Equal(t, ring.StatusAgain, ring.StatusOf(err), "only 4 slots: %v", err)

	// A slot being rewritten (stamp 0) is not read.
	slot := producer.SlotForTest(p, 5)
	stamp := binary.LittleEndian.Uint64(slot[ring.SlotOffStamp:])
	binary.LittleEndian.PutUint64(slot[ring.SlotOffStamp:], 0)
	_, err = producer.Peek(name, 1)
	assert.Equal(t, ring.StatusAgain, ring.StatusOf(err), "torn: %v", err)
	binary.LittleEndian.PutUint64(slot[ring.SlotOffStamp:], stamp)

	// A metadata length no slot can have is refused, not copied past the slot.
	binary.LittleEndian.PutUint32(slot[ring.SlotOffMetaLen:], uint32(ring.MetaMax+1))
	_, err = producer.Peek(name, 1)
	assert.Equal(t, ring.StatusCorrupt, ring.StatusOf(err), "%v", err)

	require.NoError(t, p.Close())
	_, err = producer.Peek(name, 0)
	assert.Equal(t, ring.StatusNoEnt, ring.StatusOf(err), "a closed channel's name is gone: %v", err)
}
